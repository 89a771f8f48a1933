"""Third host check (issue 13: <= 40 µs host per experts call): the alignment in one launch, the M = 64 host gap.

    PYTHONPATH=$PWD timeout 185 python3 benchmarks/host_big3_device_check.py --out $OUT/launch3 [--deadline-s 150]
        [--parts align calls phases] [--from 0 32768]   (default: all three parts in this order, each cut by the
        deadline; --from: the calls part's align_one_pass_from values, the first one's output the reference)

Parts (a line per cell as it goes, JSON rewritten after each, a table last):
1. align: the alignment alone (Qwen3 E = 128 and DeepSeek-V3 E = 256, top-8, uniform routing) at ALIGN_CELLS: ``two``
   (without the one-pass launch: the fused hist + scan and the scatter) against ``one`` (``align_one_pass_kernel`` as
   the plans build it, at any A: at most two programs per SM, cooperative). Each layout equal to ``two``'s (counts,
   num_padded, sorted_ids, expert_ids, the padding; sync slots back at 0) and ``two``'s to the torch twin at M = 1024;
   GPU µs (events around 20 alignments behind a sleep) and host µs per alignment, variants interleaved over 3 rounds.
2. calls: whole eager calls under each ``align_one_pass_from`` of --from (default: 0, off, and this tree's
   default), interleaved over 3 rounds at CALL_CELLS (Qwen3 bf16 M = 16384 and fp8 4096: the Gluon routes; int8
   4096: the weight-only scratch path): output bit-equal to the first's, eager / host_rest µs (``time_eager``),
   events µs (plain passes), and in round 1 each kernel of one call with its GPU µs.
3. phases: Qwen3-30B-A3B bf16, DeepSeek-V3 bf16, Qwen3 fp8_block at M = 1 and 64 (session 22: host_rest 27.5 vs
   53.1 at Qwen3 bf16 with one launch more), each checked against ``experts_reference``. host_rest µs of 16
   back-to-back calls started on an idle GPU (``idle``) and queued behind a 2 ms ``torch.cuda._sleep`` (``busy``:
   every launch waits in the queue), 3 rounds; for the bf16 fast path also each step of the kept sequence (each
   launch's entry, ``empty_like``, the rest) and the call with every launch replaced by a no-op (its Python alone),
   idle and busy. If M = 1 busy reads what M = 64 idle does, the gap is the launches behind a running queue.
Look for: align: ``one`` GPU µs <= ``two``'s from M = 4096 and host one launch lower; calls: host_rest lower by a
launch (~5-9 µs) and eager (GPU-bound) not higher; phases: busy vs idle at M = 1 against M = 64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import fields

import torch

from host_big3_align import align_variants
from host_big_probe import kernel_times
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import get_backend
from moekit.experts.reference import experts_reference
import moekit.experts.triton as tri
import moekit.experts.triton_fast as fast
import moekit.experts.triton_gluon_lean as tgl
from moekit.experts.triton_align import align_launches
from moekit.experts.triton_launch import LaunchOptions
from moekit.layouts.block_aligned import align_block
from moekit.quant import quantize

QWEN3, DEEPSEEK = "qwen3-30b-a3b", "deepseek-v3"
BUSY_CYCLES = 4_000_000  # torch.cuda._sleep: ~2 ms at 1.98 GHz, longer than 16 calls' issue
# (M, block): the fused route's 64-row blocks, the Gluon route's 128 at 16384 (run 1: 64 or 128 changed nothing)
ALIGN_CELLS = [(1024, 64), (2048, 64), (4096, 64), (16384, 128)]
TOL = 2e-2  # relative L2 against the reference: bf16 ~1e-3, fp8 (activations quantized) ~3e-3
DEFAULT_FROM = LaunchOptions().align_one_pass_from  # this tree's default: put back after each cell
FROM = [0, DEFAULT_FROM]  # the calls part's align_one_pass_from values (--from); the first is the reference output
_OUT = [None]


class Deadline:
    """The run's end; ``stops[part]``: seconds left at which that part starts no new cell (``main`` sets them)."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds
        self.stops = {}

    def left(self) -> float:
        return self.end - time.perf_counter()


def save(results: dict) -> None:
    if _OUT[0] is not None:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=1, default=str)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(shape: Shape, dtype: str):
    base = make_weights(shape, torch.bfloat16, torch.device("cuda"))
    if dtype == "bfloat16":
        return base.w13, base.w2
    return quantize(base.w13, dtype), quantize(base.w2, dtype)


def host_rest(calls: list, busy: bool, n: int = 16, repeats: int = 5, hooks=None) -> float:
    """Median over ``repeats`` of the issue µs a call of calls 2..n (back to back), from idle or behind a sleep;
    ``hooks``: (called after each loop's first call, called at each loop's end), both untimed."""
    seq = [calls[i % len(calls)] for i in range(n)]
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        seq[0]()
        if hooks is not None:
            hooks[0]()
        t0 = time.perf_counter()
        for c in seq[1:]:
            c()
        samples.append((time.perf_counter() - t0) / (n - 1) * 1e6)
        if hooks is not None:
            hooks[1]()
    torch.cuda.synchronize()
    return round(statistics.median(samples), 1)


def _kept_sequence(w13, m: int):
    """The bf16 fast path's kept sequence of the default-options calls on ``w13`` with M = ``m``."""
    for key, entry in list(fast._MEMO.items()):
        if key[0] == id(w13) and key[2][0] == m and key[12] == tri._DEFAULT_OPTIONS:
            return entry.sequence
    return None


def step_times(calls: list, sequence, busy: bool, n: int = 16, repeats: int = 5) -> dict:
    """µs a call (calls 2..n of each loop) of each launch entry of the kept ``sequence``, of ``empty_like`` and of
    the whole call (its median loop; the steps' mean: ``rest`` is only roughly the Python around them)."""
    real = sequence.steps
    acc, kept = [0.0] * (len(real) + 1), [0.0] * (len(real) + 1)  # this loop's, the loops' after their first calls

    def drop():  # after a loop's first call (not timed)
        acc[:] = [0.0] * len(acc)

    def keep():  # at a loop's end: its calls 2..n
        for i, a in enumerate(acc):
            kept[i] += a

    def timed(entry, i):
        def run(*args):
            t = time.perf_counter()
            entry(*args)
            acc[i] += time.perf_counter() - t
        return run

    sequence.steps = [(timed(e, i), t, s, r) for i, (e, t, s, r) in enumerate(real)]
    real_empty = torch.empty_like

    def empty_like(*a, **k):
        t = time.perf_counter()
        out = real_empty(*a, **k)
        acc[-1] += time.perf_counter() - t
        return out

    torch.empty_like = empty_like
    try:
        total = host_rest(calls, busy, n, repeats, hooks=(drop, keep))
    finally:
        sequence.steps, torch.empty_like = real, real_empty
    per = [round(a / ((n - 1) * repeats) * 1e6, 2) for a in kept]
    return dict(total=total, launches=per[:-1], empty_like=per[-1], rest=round(total - sum(per), 1))


def noop_host(calls: list, sequence, busy: bool) -> float:
    real = sequence.steps
    sequence.steps = [((lambda *a: None), t, s, r) for (e, t, s, r) in real]
    try:
        return host_rest(calls, busy)
    finally:
        sequence.steps = real


def part_phases(results: dict, deadline: Deadline) -> None:
    fn, out = get_backend("triton"), results.setdefault("phases", {})
    for preset, dtype in ((QWEN3, "bfloat16"), (DEEPSEEK, "bfloat16"), (QWEN3, "fp8_block")):
        if deadline.left() < 15:
            print(f"deadline: phases stop before {preset} {dtype}", flush=True)
            return
        shape = Shape.from_preset(preset)
        w13, w2 = _weights(shape, dtype)
        for m in (1, 64):
            if deadline.left() < 8:
                break
            sets = make_sets(shape, m, 4, torch.bfloat16, torch.device("cuda"))
            calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
            for c in calls * 3:
                c()
            s0 = sets[0]
            err = _rel(calls[0](), experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights))
            same = err < TOL
            row = dict(ref_err=err)
            for rnd in range(3):
                for busy in (False, True):
                    row.setdefault("busy" if busy else "idle", []).append(host_rest(calls, busy))
            sequence = _kept_sequence(w13, m) if dtype == "bfloat16" else None
            if sequence is not None:
                for busy in (False, True):
                    row[f"steps_{'busy' if busy else 'idle'}"] = step_times(calls, sequence, busy)
                    row[f"noop_{'busy' if busy else 'idle'}"] = noop_host(calls, sequence, busy)
            key = f"{preset} {dtype} M={m}"
            out[key] = row
            print(("PASS" if same else "FAIL") + f" phases {key}: " + json.dumps(row), flush=True)
            save(results)
        del w13, w2
        torch.cuda.empty_cache()


def part_align(results: dict, deadline: Deadline) -> None:
    out, device = results.setdefault("align", {}), torch.device("cuda")
    for preset in (QWEN3, DEEPSEEK):
        shape = Shape.from_preset(preset)
        for m, block in ALIGN_CELLS:
            if deadline.left() < deadline.stops["align"]:
                print(f"deadline: align stops before {preset} M={m}", flush=True)
                return
            ids = make_sets(shape, m, 1, torch.bfloat16, device)[0].topk_ids.contiguous()
            plans = align_variants(ids.numel(), shape.num_experts, block)
            bufs, sync, launches = {}, {}, {}
            for name, plan in plans.items():
                bufs[name] = {n: torch.full(s, -5, dtype=d, device=device) for n, d, s in plan.regions}
                sync[name] = torch.zeros(8, dtype=torch.int32, device=device)
                launches[name] = align_launches(plan, ids, ids, bufs[name], sync[name])
            row, ref = {"grid": {n: p.one.grid[0] for n, p in plans.items() if p.one is not None}}, None
            for name in plans:
                try:
                    for launch, ptrs in launches[name]:
                        launch(*ptrs)
                    torch.cuda.synchronize()
                except RuntimeError as e:
                    row[f"{name}_error"] = str(e)[:200]
                    launches[name] = None
                    print(f"FAIL align {name}: {str(e)[:200]}", flush=True)
                    torch.cuda.synchronize()
            b2 = bufs["two"]
            used = int(b2["num_padded"].item())
            nb = -(-used // block)
            if m == 1024:
                twin = align_block(ids, shape.num_experts, block, None, allow_naive=False)
                ref = (torch.equal(twin.sorted_ids[:used], b2["sorted_ids"][:used])
                       and torch.equal(twin.expert_ids[:nb], b2["expert_ids"][:nb]))
            row["two_vs_twin"] = ref
            for name in plans:
                if name == "two" or launches[name] is None:
                    continue
                b = bufs[name]
                row[f"{name}_equal"] = bool(  # every row and block written, as ``two`` writes them
                    torch.equal(b["counts"], b2["counts"]) and torch.equal(b["num_padded"], b2["num_padded"])
                    and torch.equal(b["sorted_ids"], b2["sorted_ids"])
                    and torch.equal(b["expert_ids"], b2["expert_ids"])
                    and bool((b["sorted_ids"][used:] == ids.numel()).all()) and int(sync[name].abs().sum()) == 0)
            for rnd in range(3):
                for name in plans:
                    if launches[name] is None:
                        continue
                    one = [lambda ls=launches[name]: [launch(*p) for launch, p in ls]]
                    row.setdefault(f"{name}_gpu", []).append(_align_gpu_us(one[0]))
                    row.setdefault(f"{name}_host", []).append(host_rest(one, False, 21, 5))
            ok = (ref is not False and all(v for k, v in row.items() if k.endswith("_equal"))
                  and not any(k.endswith("_error") for k in row))
            key = f"{preset} M={m} B={block}"
            out[key] = row
            print(("PASS" if ok else "FAIL") + f" align {key}: " + json.dumps(row), flush=True)
            save(results)


def _align_gpu_us(run, reps: int = 20, repeats: int = 5) -> float:
    """GPU µs per alignment: events around ``reps`` alignments queued behind a 2 ms sleep (so no host gap between
    them; no graph: the one-pass launch is cooperative), median of ``repeats``."""
    start, end, samples = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    return round(statistics.median(samples), 2)


def use_one_pass(start: int) -> None:
    """``align_one_pass_from`` = ``start`` for every call: the default options object (the one the default routes are
    keyed on) and the class default (the options the quantized and Gluon paths build themselves); caches dropped."""
    for o in (tri._DEFAULT_OPTIONS, tri.FUSED_OPTIONS):
        object.__setattr__(o, "align_one_pass_from", start)
        object.__setattr__(o, "_args", o.as_op_args())
        object.__setattr__(o, "_hash", hash(o._args))
    names = [f.name for f in fields(LaunchOptions)]
    defaults = list(LaunchOptions.__init__.__defaults__)
    defaults[len(defaults) - len(names) + names.index("align_one_pass_from")] = start
    LaunchOptions.__init__.__defaults__ = tuple(defaults)
    tri.clear_launch_caches()


CALL_CELLS = [(QWEN3, "bfloat16", 4096), (QWEN3, "bfloat16", 16384), (QWEN3, "fp8_block", 4096),
              (QWEN3, "int8_w8a16", 4096), (DEEPSEEK, "bfloat16", 4096), (QWEN3, "bfloat16", 1024)]


def _call_variant(row: dict, calls: list, start: int, want, kernels: bool):
    """One round of variant ``start`` (``align_one_pass_from``): warm, equal to the first variant's output, eager /
    host_rest / events µs, and (``kernels``) the kernels of one call with their GPU µs. Returns the first's output."""
    use_one_pass(start)
    for c in calls * 2:
        c()
    got = calls[0]()
    want = got if start == FROM[0] else want
    row.setdefault(f"f{start}_equal", []).append(bool(torch.equal(got, want)))
    e = time_eager(calls, torch.device("cuda"))
    row.setdefault(f"f{start}_eager", []).append(round(e.eager_us, 1))
    row.setdefault(f"f{start}_rest", []).append(round(e.host_rest_us, 1))
    row.setdefault(f"f{start}_events", []).append(round(time_stats(calls, torch.device("cuda"), budget_s=0.03).us, 1))
    if kernels:
        row[f"f{start}_kernels"] = kernel_times(calls[0], 2)
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
        row, want = {}, None
        for rnd in range(3):
            for start in FROM:
                try:
                    want = _call_variant(row, calls, start, want, rnd == 0 and deadline.left() > 60)
                except RuntimeError as e:  # a refused launch: say so, go on
                    row[f"f{start}_error"] = str(e)[:200]
                    print(f"FAIL calls f{start}: {str(e)[:200]}", flush=True)
        use_one_pass(DEFAULT_FROM)
        ok = (all(all(v) for k, v in row.items() if k.endswith("_equal"))
              and not any(k.endswith("_error") for k in row))
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" calls {key}: " + json.dumps(row), flush=True)
        save(results)


def _med(v) -> float:
    return statistics.median(v) if v else float("nan")  # nan: a variant that never ran


def table(results: dict) -> None:
    print("\n== host_big3: phases, host_rest µs (idle / busy), medians of 3 rounds ==")
    for key, r in results.get("phases", {}).items():
        s = r.get("steps_idle")
        print(f"{key:28} {_med(r['idle']):6.1f} / {_med(r['busy']):6.1f}" + (
            f"  noop {r['noop_idle']} / {r['noop_busy']}  empty_like {s['empty_like']} / "
            f"{r['steps_busy']['empty_like']}  launches idle {s['launches']} busy {r['steps_busy']['launches']}" if s
            else ""))
    print("\n== align alone: GPU µs / host µs per alignment (medians of 3 rounds) ==")
    for key, r in results.get("align", {}).items():
        cols = "  ".join(f"{n} {_med(r.get(n + '_gpu', [])):7.2f}/{_med(r.get(n + '_host', [])):5.1f}"
                         for n in ("two", "one"))
        print(f"{key:24} {cols}  equal {[k for k, v in r.items() if k.endswith('_equal') and v]}")
    print(f"\n== calls: eager / host_rest / events µs (medians of 3 rounds), align_one_pass_from {FROM} ==")
    for key, r in results.get("calls", {}).items():
        cols = "  ".join(f"f{v} {_med(r[f'f{v}_eager']):8.1f} {_med(r[f'f{v}_rest']):5.1f} "
                         f"{_med(r[f'f{v}_events']):8.1f}" for v in FROM if f"f{v}_eager" in r)
        print(f"{key:28} {cols}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host_big3_out"))
    parser.add_argument("--deadline-s", type=float, default=150.0)
    parser.add_argument("--parts", nargs="+", default=["align", "calls", "phases"],
                        choices=["phases", "align", "calls"])
    parser.add_argument("--from", dest="starts", type=int, nargs="+", default=FROM,
                        help="align_one_pass_from values of the calls part (the first: the reference output)")
    args = parser.parse_args()
    FROM[:] = args.starts
    os.makedirs(args.out, exist_ok=True)
    _OUT[0] = os.path.join(args.out, "host_big3.json")
    deadline = Deadline(args.deadline_s)
    # the parts share the time: align to 70% of it left, calls to 23% (with phases after it; else to 10 s)
    deadline.stops = dict(align=0.7 * args.deadline_s if len(args.parts) > 1 else 10.0,
                          calls=0.23 * args.deadline_s if "phases" in args.parts else 10.0)
    import triton
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    parts = dict(phases=part_phases, align=part_align, calls=part_calls)
    with torch.no_grad():
        for part in args.parts:
            try:
                parts[part](results, deadline)
            except Exception as e:  # noqa: BLE001 (out of memory, a refused launch: report, go on with the next part)
                print(f"FAIL {part}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                use_one_pass(DEFAULT_FROM)
                torch.cuda.empty_cache()
            save(results)
    table(results)


if __name__ == "__main__":
    main()
