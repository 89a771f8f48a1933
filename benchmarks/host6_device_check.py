"""Host check of issue 13 (<= 40 µs host per experts call), session 24 helper host6: where each µs of a call goes,
per launch, and a sequence's launches issued in one call into C (``batch_launch``) against launch by launch.

    PYTHONPATH=$PWD timeout 170 python3 benchmarks/host6_device_check.py --out $OUT/host6 [--deadline-s 140]
        [--parts anatomy calls]

Parts (a line per cell as it goes, JSON rewritten after each, a table last):
0. probe (always first, in a child process: a wrong parameter layout could fault the GPU and end the process): one
   call per ``calls`` cell launch by launch, then batched, synchronized, outputs compared bit for bit. Where the
   child fails, this process runs only launch by launch (``batch`` variants skipped, said so).
1. anatomy: Qwen3 bf16 M = 1024 / 4096 (fast path, kept sequence), launch by launch: µs per call of each launch
   entry (named by kernel), of ``empty_like``, the whole call, the rest (the path's Python), and ``noop`` (the call
   with every launch a no-op); from an idle GPU and behind a 2 ms sleep; then the same call with the batch
   (``batch_total``, ``batch_noop``: the batch call a no-op).
2. calls: whole eager calls ``step`` (``triton_lean.BATCHED`` off: launch by launch) vs ``batch`` (on) at Qwen3 bf16
   M = 1 / 1024 / 4096 / 16384 (Gluon), fp8_block 4096 (Gluon fp8), DeepSeek-V3 bf16 4096; 3 interleaved rounds:
   ``batch``'s output bit-equal to ``step``'s, ``step``'s near ``experts_reference``; eager / host_rest µs
   (``time_eager``), events µs, ``batched`` (kept sequences with a batch / kept sequences).
Look for: PASS everywhere; calls: batch host_rest below step by ~2-4 µs a launch, events equal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import moekit.batch_launch as bl
import moekit.experts.triton as tri
import moekit.experts.triton_fast as fast
import moekit.experts.triton_lean as lean
from host_big3_device_check import (DEEPSEEK, QWEN3, TOL, Deadline, _kept_sequence, _med, _rel, _weights, host_rest,
                                    noop_host, step_times)
from moekit.bench.cells import Shape, make_sets
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import get_backend
from moekit.experts.reference import experts_reference

CALL_CELLS = [(QWEN3, "bfloat16", 4096), (QWEN3, "bfloat16", 1024), (QWEN3, "bfloat16", 16384),
              (QWEN3, "bfloat16", 1), (QWEN3, "fp8_block", 4096), (DEEPSEEK, "bfloat16", 4096)]  # as far as time goes
VARIANTS = {"step": False, "batch": True}  # triton_lean.BATCHED
_OUT = [None]
_SKIP_BATCH = [False]  # the probe failed: no batched call in this process


def use(batched: bool) -> None:
    """``triton_lean.BATCHED``, the caches dropped: it is read when a sequence is recorded."""
    lean.BATCHED = batched
    tri.clear_launch_caches()


def save(results: dict) -> None:
    if _OUT[0] is not None:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=1, default=str)


def kept_sequences() -> list:
    """Every kept sequence (bf16 fast path, Gluon and quantized entries alike), once each."""
    seqs = {}
    for store in _stores():
        for value in list(store.values()):
            seq = getattr(value, "sequence", value)
            if isinstance(seq, lean.LaunchSequence):
                seqs[id(seq)] = seq
    return list(seqs.values())


def _stores() -> list:
    import moekit.experts.triton_gluon_lean as tgl
    import moekit.experts.triton_quant_fast as tqf

    stores = [fast._MEMO, lean._SEQUENCES, tgl._SEQUENCES]
    stores += [v for v in vars(tqf).values() if isinstance(v, dict) and v is not fast._MEMO]
    return stores


def batch_noop(calls: list, busy: bool) -> float:
    """host_rest with every kept batch a no-op (the call's Python, its address reads and ``empty_like``)."""
    seqs = [s for s in kept_sequences() if s.batch is not None]
    real = [s.batch for s in seqs]
    for s in seqs:
        s.batch = bl.Batch(s.batch.blob, lambda *a: None, s.batch.names)
    try:
        return host_rest(calls, busy)
    finally:
        for s, b in zip(seqs, real):
            s.batch = b


def why_not() -> str:
    """Why no kept sequence has a batch: ``batch_launch.refusal`` of each."""
    return "; ".join(sorted({str(bl.refusal(q.steps)) for q in kept_sequences()}))


def probe_child() -> None:
    """In the child: one call per cell launch by launch, then batched; a line per cell."""
    fn = get_backend("triton")
    for preset, dtype, m in CALL_CELLS:
        shape = Shape.from_preset(preset)
        w13, w2 = _weights(shape, dtype)
        s = make_sets(shape, m, 1, torch.bfloat16, torch.device("cuda"))[0]
        use(False)
        for _ in range(3):
            want = fn(s.x, w13, w2, s.topk_ids, s.topk_weights)
        use(True)
        got = [fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for _ in range(3)]  # recorded, then the fast path's
        torch.cuda.synchronize()
        batched = [q for q in kept_sequences() if q.batch is not None]
        equal = all(torch.equal(g, want) for g in got)
        same = equal and bool(batched)
        print(("PASS" if same else "FAIL") + f" probe {preset} {dtype} M={m}: equal {equal} "
              f"batched {len(batched)} {batched[0].batch.names if batched else why_not()}", flush=True)
        use(False)
        del w13, w2
        torch.cuda.empty_cache()


def part_probe(results: dict, deadline: Deadline) -> None:
    """The child's run; on any failure, no batched call here."""
    command = [sys.executable, os.path.abspath(__file__), "--child"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=max(20.0, 0.4 * deadline.left()))
        text, rc = done.stdout + done.stderr[-1500:], done.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    lines = [line for line in text.splitlines() if " probe " in line]
    ok = rc == 0 and len(lines) == len(CALL_CELLS) and all(line.startswith("PASS") for line in lines)
    _SKIP_BATCH[0] = not ok
    results["probe"] = dict(rc=rc, ok=ok, lines=lines, tail=None if ok else text[-1500:])
    print(("PASS" if ok else "FAIL") + f" probe (child rc {rc}):\n  " + "\n  ".join(lines), flush=True)
    if not ok:
        print("probe failed: batched variants skipped; child output tail:\n" + text[-1500:], flush=True)
    save(results)


def part_anatomy(results: dict, deadline: Deadline) -> None:
    fn, out = get_backend("triton"), results.setdefault("anatomy", {})
    shape = Shape.from_preset(QWEN3)
    w13, w2 = _weights(shape, "bfloat16")
    for m in (1024, 4096):
        if deadline.left() < deadline.stops["anatomy"]:
            print(f"deadline: anatomy stops before M={m}", flush=True)
            return
        sets = make_sets(shape, m, 4, torch.bfloat16, torch.device("cuda"))
        calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
        use(False)
        for c in calls * 3:
            c()
        s0 = sets[0]
        want = calls[0]()
        row = dict(ref_err=_rel(want, experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights)))
        sequence = _kept_sequence(w13, m)
        row["kept"] = sequence is not None
        if sequence is not None:
            for busy in (False, True):
                tag = "busy" if busy else "idle"
                row[f"steps_{tag}"] = step_times(calls, sequence, busy)
                row[f"noop_{tag}"] = noop_host(calls, sequence, busy)
            if not _SKIP_BATCH[0]:
                use(True)
                for c in calls * 2:
                    c()
                batched = _kept_sequence(w13, m)
                row["kernels"] = (None if batched is None else list(batched.batch.names) if batched.batch is not None
                                  else bl.refusal(batched.steps))
                for busy in (False, True):
                    tag = "busy" if busy else "idle"
                    row[f"batch_total_{tag}"] = host_rest(calls, busy)
                    row[f"batch_noop_{tag}"] = batch_noop(calls, busy)
                row["batch_equal"] = bool(torch.equal(calls[0](), want))
                use(False)
        ok = row["ref_err"] < TOL and row["kept"] and row.get("batch_equal", _SKIP_BATCH[0])
        key = f"{QWEN3} bfloat16 M={m}"
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" anatomy {key}: " + json.dumps(row), flush=True)
        save(results)


def _round(row: dict, calls: list, variant: str, want, check_ref):
    use(VARIANTS[variant])
    for c in calls * 2:
        c()
    got = calls[0]()
    if want is None:
        want = got
        if check_ref is not None:
            row["ref_err"] = _rel(got, check_ref())
    row.setdefault(f"{variant}_equal", []).append(bool(torch.equal(got, want)))
    seqs = kept_sequences()
    row.setdefault(f"{variant}_batched", []).append(f"{sum(s.batch is not None for s in seqs)}/{len(seqs)}")
    e = time_eager(calls, torch.device("cuda"))
    row.setdefault(f"{variant}_eager", []).append(round(e.eager_us, 1))
    row.setdefault(f"{variant}_rest", []).append(round(e.host_rest_us, 1))
    row.setdefault(f"{variant}_events", []).append(round(time_stats(calls, torch.device("cuda"), budget_s=0.03).us, 1))
    return want


def part_calls(results: dict, deadline: Deadline) -> None:
    fn, out, held = get_backend("triton"), results.setdefault("calls", {}), {}
    for preset, dtype, m in CALL_CELLS:
        if deadline.left() < deadline.stops["calls"]:
            print(f"deadline: calls stop before {preset} {dtype} M={m}", flush=True)
            break
        shape = Shape.from_preset(preset)
        if (preset, dtype) not in held:
            held.clear()
            torch.cuda.empty_cache()
            held[(preset, dtype)] = _weights(shape, dtype)
        w13, w2 = held[(preset, dtype)]
        sets = make_sets(shape, m, 2, torch.bfloat16, torch.device("cuda"))
        calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
        s0 = sets[0]
        ref = lambda: experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights)  # noqa: E731
        row, want = {}, None
        for rnd in range(3):
            for variant in VARIANTS:
                if VARIANTS[variant] and _SKIP_BATCH[0]:
                    continue
                try:
                    want = _round(row, calls, variant, want, ref if rnd == 0 else None)
                except RuntimeError as e:  # a refused launch: say so, go on
                    row[f"{variant}_error"] = str(e)[:200]
                    print(f"FAIL calls {variant}: {str(e)[:200]}", flush=True)
        use(False)
        ok = (all(all(v) for k, v in row.items() if k.endswith("_equal")) and row.get("ref_err", 1.0) < TOL
              and not any(k.endswith("_error") for k in row))
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" calls {key}: " + json.dumps(row), flush=True)
        save(results)


def table(results: dict) -> None:
    print("\n== anatomy (µs per call; idle GPU / behind a sleep) ==")
    for key, r in results.get("anatomy", {}).items():
        print(f"{key}  kernels {r.get('kernels')}")
        for tag in ("idle", "busy"):
            s = r.get(f"steps_{tag}", {})
            print(f"  {tag}: total {s.get('total')} launches {s.get('launches')} empty_like {s.get('empty_like')} "
                  f"rest {s.get('rest')} noop {r.get(f'noop_{tag}')} | batch total {r.get(f'batch_total_{tag}')} "
                  f"batch noop {r.get(f'batch_noop_{tag}')}")
    print("\n== calls: eager / host_rest / events µs (medians of 3 rounds), step -> batch ==")
    for key, r in results.get("calls", {}).items():
        cols = "  ".join(f"{v} {_med(r.get(v + '_eager', [])):8.1f} {_med(r.get(v + '_rest', [])):5.1f} "
                         f"{_med(r.get(v + '_events', [])):8.1f}" for v in VARIANTS)
        print(f"{key:28} {cols}  batched {r.get('batch_batched', ['?'])[-1]}  err {r.get('ref_err', float('nan')):.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host6_out"))
    parser.add_argument("--deadline-s", type=float, default=140.0)
    parser.add_argument("--parts", nargs="+", default=["probe", "anatomy", "calls"],
                        choices=["probe", "anatomy", "calls"])
    parser.add_argument("--child", action="store_true", help="the probe's child process (part 0)")
    args = parser.parse_args()
    if args.child:
        with torch.no_grad():
            probe_child()
        return
    os.makedirs(args.out, exist_ok=True)
    _OUT[0] = os.path.join(args.out, "host6.json")
    deadline = Deadline(args.deadline_s)
    deadline.stops = dict(anatomy=0.5 * args.deadline_s if "calls" in args.parts else 10.0, calls=10.0)
    import triton

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    t0 = time.perf_counter()
    parts = dict(probe=part_probe, anatomy=part_anatomy, calls=part_calls)
    with torch.no_grad():
        for part in args.parts:
            try:
                parts[part](results, deadline)
            except Exception as e:  # noqa: BLE001 (out of memory, a refused launch: report, go on with the next part)
                print(f"FAIL {part}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                torch.cuda.empty_cache()
            use(False)
            save(results)
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    table(results)


if __name__ == "__main__":
    main()
