"""Host check of issue 13 (``host_us`` <= 40 µs in every triton cell of ``moekit bench``), session 25 helper host7:
per cell, which route a repeated call takes and where its host µs go, the first call after a sync against the rest,
and what the host does right after a long GPU wait.

    PYTHONPATH=$PWD timeout 170 python3 benchmarks/host7_device_check.py --out $OUT/host7 [--deadline-s 140]
        [--parts wake cells] [--cells over quant | --cell PRESET:DTYPE:M ...]

Parts (a line per cell as it goes, JSON rewritten after each, a table last):
1. wake: what the host does right after a sync (``host7_wake``).
2. cells: the bench's cells over 40 µs (final bench of session 24) and the quantized dtypes' cells. Per cell, the
   bench's weights (``make_weights``, ``quantize``) and rotated input sets; the call checked against
   ``experts_reference`` (M <= 64, else against the first output of the full path); then
   - ``route``: which kept path served a repeated call (``run_fast``, the Gluon ones, the quantized one) or the
     full path (``_unchecked``: a miss), the kept sequences it launched (kernels, batched or why not, per-call
     regions);
   - ``bench``: ``time_paired`` as the bench times it (graph replay passes up to M = 1024): host_us, host_rest_us;
   - ``parts``: 5 loops of 16 calls, each after the bench's pass over the sets (graph replay to M = 1024): per call
     index, µs of the whole call, of the C launch (``launch_all`` or the step launches), of ``empty_like`` and of
     any ``torch.empty`` (a per-call buffer); first call vs calls 2..16 (medians);
   - ``split``: the same loops with a batched sequence issued as one C call a launch: each launch's µs by kernel
     (bit-equal to the first output);
   - ``nopdl``: the same loops with the batches' launches without the PDL attribute (host µs; bit-equal);
   - ``noop``: the same loops with every kept launch a no-op (the call's Python and allocations alone);
     ``noop_busy``: the same behind a ~20 ms GPU sleep (is the Python slower while the GPU runs?);
   - ``profile``: cProfile of 15 back-to-back calls, the 10 functions with the most own time (µs per call).
Look for: PASS everywhere; which part makes a cell's rest > 40 and how much the first call adds.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import struct
import statistics
import time

import torch

from host6_device_check import kept_sequences
from host7_wake import part_wake
from host_big3_device_check import DEEPSEEK, QWEN3, TOL, Deadline, _rel, _weights
import moekit.batch_launch as bl
import moekit.experts.triton as tri
import moekit.experts.triton_fast as fast
from moekit.bench.cells import Shape, make_sets
from moekit.bench.timing import _cuda_pass, time_paired
from moekit.experts import get_backend
from moekit.experts.reference import experts_reference

# the final bench of session 24 over 40 (host_us / host_rest_us), grouped by weights (made once), worst first
OVER = [(DEEPSEEK, "bfloat16", 1024), (DEEPSEEK, "bfloat16", 4096), (DEEPSEEK, "bfloat16", 64),
        (DEEPSEEK, "bfloat16", 16384), (DEEPSEEK, "fp8_block", 1024), (DEEPSEEK, "fp8_block", 16384),
        (DEEPSEEK, "fp8_block", 1), (QWEN3, "fp8_block", 16384), (QWEN3, "fp8_block", 64),
        (QWEN3, "bfloat16", 64), (QWEN3, "bfloat16", 1024)]
QUANT = [(p, d, m) for p in (QWEN3, DEEPSEEK) for d in ("int8_w8a16", "int4_w4a16", "mxfp4") for m in (1, 64, 1024)]
LOOPS, CALLS = 5, 16
ROTATION_BYTES = 256 << 20  # moekit.bench.sweep's
_OUT = [None]


def save(results: dict) -> None:
    with open(_OUT[0], "w") as f:
        json.dump(results, f, indent=1, default=str)


class Parts:
    """Per call index: µs of the whole call and of the wrapped pieces (launches, empty_like, empty)."""

    def __init__(self):
        self.acc = {}
        self.touched = {}

    def wrap(self, name: str, f, seq=None):
        def run(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            acc = self.acc  # the current call's (``_loops`` starts a new one per call)
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            if seq is not None:
                self.touched[id(seq)] = seq
            return r
        return run


def _split(parts: Parts, q):
    """A batched sequence's launches as one C call each, in order (the same launches), each timed as "L<i> name"."""
    subs = [bl.Batch.of([step]) for step in q.steps]
    if any(sub is None for sub in subs):
        return q.batch.launch_all
    names = [f"L{i} {name}" for i, name in enumerate(q.batch.names)]

    def run(blob, stream, *values):
        acc = parts.acc
        for name, sub in zip(names, subs):
            t = time.perf_counter()
            sub.launch_all(sub.blob, stream, *values)
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
        parts.touched[id(q)] = q
    return run


def _flags(blob: bytearray) -> list:
    """Byte offsets of each launch's flags word in a batch's blob (``batch_launch._blob``'s layout)."""
    n_launches, n_patches = struct.unpack_from("<2Q", blob)
    at, out = 24 + 16 * n_patches, []
    for _ in range(n_launches):
        out.append(at + 8 + 4 * 5)
        at += 40 + 8 * struct.unpack_from("<I", blob, at + 8 + 4 * 6)[0]
    return out


def _patch(parts: Parts | None, noop: bool = False, split: bool = False, nopdl: bool = False):
    """Wrap (or no-op, or ``split`` into one C call a launch) every kept sequence's launches, and torch.empty_like /
    torch.empty (``nopdl``: a batch's launches without the PDL attribute, in place); returns the undo."""
    seqs, saved, flags = kept_sequences(), [], []
    for q in seqs:
        saved.append((q, q.batch, q.steps))
        if q.batch is not None and nopdl:
            for at in _flags(q.batch.blob):
                flags.append((q.batch.blob, at, struct.unpack_from("<I", q.batch.blob, at)[0]))
                struct.pack_into("<I", q.batch.blob, at, flags[-1][2] & ~1)
        if q.batch is not None and split:
            q.batch = bl.Batch(q.batch.blob, _split(parts, q), q.batch.names)
        elif q.batch is not None:
            f = (lambda *a: None) if noop else q.batch.launch_all
            q.batch = bl.Batch(q.batch.blob, parts.wrap("launch", f, q) if parts else f, q.batch.names)
        q.steps = [((lambda *a: None) if noop else (parts.wrap("launch", e, q) if parts else e), t, s, r)
                   for e, t, s, r in q.steps]
    real = torch.empty_like, torch.empty
    if parts is not None:
        torch.empty_like, torch.empty = parts.wrap("empty_like", real[0]), parts.wrap("empty", real[1])

    def undo():
        torch.empty_like, torch.empty = real
        for blob, at, value in flags:
            struct.pack_into("<I", blob, at, value)
        for q, batch, steps in saved:
            q.batch, q.steps = batch, steps
    return undo


def _loops(calls: list, before, noop: bool, busy: bool = False, split: bool = False, nopdl: bool = False) -> dict:
    """LOOPS loops of CALLS calls, each after one pass over the sets and a sync (``busy``: then a ~20 ms GPU sleep
    queued, so every call is issued behind a running GPU; ``split``: a batched sequence as one C call a launch);
    per-part µs, first vs rest; ``out``: the last loop's first output."""
    parts = Parts()
    undo = _patch(parts, noop, split, nopdl)
    got = None
    per = []  # [loop][call index] -> dict
    seq = [calls[i % len(calls)] for i in range(CALLS)]
    try:
        for _ in range(LOOPS):
            before()  # the bench's pass (it ends synchronized)
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(40_000_000)
            rows = []
            for c in seq:
                parts.acc = {}
                t = time.perf_counter()
                r = c()
                if not rows:
                    got = r
                rows.append(dict(total=(time.perf_counter() - t) * 1e6, **{k: v * 1e6 for k, v in parts.acc.items()}))
            per.append(rows)
            torch.cuda.synchronize()
    finally:
        undo()
    names = sorted({k for loop in per for r in loop for k in r})

    med = lambda rows, k: round(statistics.median(r.get(k, 0.0) for r in rows), 2)  # noqa: E731
    first = {k: med([loop[0] for loop in per], k) for k in names}
    rest = {k: med([r for loop in per for r in loop[1:]], k) for k in names}
    for d in (first, rest):
        d["other"] = round(d["total"] - sum(v for k, v in d.items() if k != "total"), 2)
    return dict(first=first, rest=rest, touched=list(parts.touched.values()), out=got)


def _route(calls: list) -> dict:
    """Which of the kept paths served one repeated call (a spy on each), or the full path."""
    import moekit.experts.triton_gluon as tg
    import moekit.experts.triton_gluon_fp8 as tgf

    hits = []
    spots = [(tri, "run_fast"), (tg, "run_fast_default_gluon"), (tgf, "run_fast_fp8"), (fast, "run_quant_fast"),
             (tri, "_unchecked")]
    saved = [(m, n, getattr(m, n)) for m, n in spots]

    def spy(name, f):
        def run(*a, **k):
            r = f(*a, **k)
            hits.append(name if r is not None else name + ":miss")
            return r
        return run
    [setattr(m, n, spy(n, f)) for m, n, f in saved]
    try:
        calls[0]()
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    return dict(route=hits)


def _describe(seqs: list) -> list:
    return [dict(kernels=list(q.batch.names) if q.batch is not None else len(q.steps), batched=q.batch is not None,
                 why=None if q.batch is not None else bl.refusal(q.steps), large=q.large is not None) for q in seqs]


def _profile(calls: list) -> list:
    seq = [calls[i % len(calls)] for i in range(CALLS)]
    seq[0]()
    prof = cProfile.Profile()
    prof.enable()
    for c in seq[1:]:
        c()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:10]
    return [f"{os.path.basename(k[0])}:{k[1]}:{k[2]} n{v[1] // (CALLS - 1)} {v[2] / (CALLS - 1) * 1e6:.1f}"
            for k, v in rows]


def _num_sets(shape: Shape, m: int, w13, w2) -> int:
    per_expert = (w13.nbytes + w2.nbytes) / shape.num_experts
    touched = max(1, min(shape.num_experts, m * shape.top_k)) * per_expert
    return max(2, min(8, math.ceil(ROTATION_BYTES / touched)))


def part_cells(results: dict, deadline: Deadline, cells: list) -> None:
    fn, out, held = get_backend("triton"), results.setdefault("cells", {}), {}
    for preset, dtype, m in cells:
        if deadline.left() < deadline.stops["cells"]:
            print(f"deadline: cells stop before {preset} {dtype} M={m}", flush=True)
            break
        key, sets, calls = f"{preset} {dtype} M={m}", None, None
        try:
            shape = Shape.from_preset(preset)
            if (preset, dtype) not in held:
                held.clear()
                torch.cuda.empty_cache()
                held[(preset, dtype)] = _weights(shape, dtype)
            w13, w2 = held[(preset, dtype)]
            sets = make_sets(shape, m, _num_sets(shape, m, w13, w2), torch.bfloat16, torch.device("cuda"))
            calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
            first = calls[0]().clone()
            for c in calls * 3:
                c()
            s0 = sets[0]
            row = dict(sets=len(sets), equal=bool(torch.equal(calls[0](), first)))
            if m <= 64:
                row["ref_err"] = _rel(first, experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights))
            row.update(_route(calls))
            paired = time_paired(calls, torch.device("cuda"), graph=m <= 1024, budget_s=0.3)
            row["bench"] = dict(us=round(paired.timing.us, 1), eager=round(paired.eager.eager_us, 1),
                                host=round(paired.eager.host_us, 1), rest=round(paired.eager.host_rest_us, 1))
            before = _cuda_pass(calls, m <= 1024)  # its warm-up runs on a side stream (a new pool buffer there)
            for c in calls * 2:
                c()
            real = _loops(calls, before, noop=False)
            row["seqs"] = _describe(real.pop("touched"))
            row["loops_equal"] = bool(torch.equal(real.pop("out"), first))
            row["parts"] = real
            split = _loops(calls, before, noop=False, split=True)
            split.pop("touched")
            row["split_equal"] = bool(torch.equal(split.pop("out"), first))
            row["split"] = split
            nopdl = _loops(calls, before, noop=False, nopdl=True)
            nopdl.pop("touched")
            row["nopdl_equal"] = bool(torch.equal(nopdl.pop("out"), first))
            row["nopdl"] = nopdl
            for name, busy in (("noop", False), ("noop_busy", True)):
                row[name] = _loops(calls, before, noop=True, busy=busy)
                row[name].pop("touched")
                row[name].pop("out")
            row["profile"] = _profile(calls)
            ok = (row["equal"] and row["loops_equal"] and row["split_equal"] and row["nopdl_equal"]
                  and row.get("ref_err", 0.0) < TOL
                  and "_unchecked" not in row["route"])
        except Exception as e:  # noqa: BLE001 (out of memory, a refused launch: report, go on)
            row, ok = dict(error=f"{type(e).__name__}: {str(e)[:300]}"), False
            torch.cuda.synchronize()
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" cell {key}: " + json.dumps(row, default=str), flush=True)
        save(results)
        del sets, calls
    held.clear()
    torch.cuda.empty_cache()


def table(results: dict) -> None:
    print("\n== wake: µs after waiting (pure-Python workload, its largest step, then an experts call, a second) ==")
    for how, r in results.get("wake", {}).items():
        print(f"{how:10} " + " ".join(f"{k} {v}" for k, v in r.items()))
    print("\n== cells: bench host/rest; loops first/rest total (launch, empty_like, empty, other); noop rest ==")
    for key, r in results.get("cells", {}).items():
        if "error" in r:
            print(f"{key:34} ERROR {r['error'][:80]}")
            continue
        b, f, s, n = r["bench"], r["parts"]["first"], r["parts"]["rest"], r["noop"]["rest"]
        nb = r["noop_busy"]["rest"]
        pieces = lambda d: "/".join(f"{d.get(k, 0.0):.1f}" for k in ("launch", "empty_like", "empty", "other"))  # noqa
        route = ",".join(sorted(set(r["route"])))
        batched = "".join("B" if q["batched"] else ("L" if q["large"] else "s") for q in r["seqs"])
        print(f"{key:34} bench {b['host']:5.1f}/{b['rest']:5.1f} first {f['total']:6.1f} ({pieces(f)}) rest "
              f"{s['total']:5.1f} ({pieces(s)}) noop {n['total']:5.1f} busy {nb['total']:5.1f} [{route} {batched}]")
        print(f"{'':34} nopdl rest {r['nopdl']['rest']['total']:5.1f} first {r['nopdl']['first']['total']:6.1f}")
        launches = {k: v for k, v in r["split"]["rest"].items() if k.startswith("L")}
        if launches:
            print(f"{'':34} split rest {r['split']['rest']['total']:5.1f}: " + ", ".join(
                f"{k} {v:.1f}" for k, v in launches.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host7_out"))
    parser.add_argument("--deadline-s", type=float, default=140.0)
    parser.add_argument("--parts", nargs="+", default=["wake", "cells"], choices=["wake", "cells"])
    parser.add_argument("--cells", nargs="+", default=["over", "quant"], choices=["over", "quant"])
    parser.add_argument("--cell", nargs="+", default=[], metavar="PRESET:DTYPE:M",
                        help="these cells instead of --cells (e.g. qwen3-30b-a3b:int4_w4a16:16384)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    _OUT[0] = os.path.join(args.out, "host7.json")
    deadline = Deadline(args.deadline_s)
    deadline.stops = dict(cells=12.0)
    import triton

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    cells = (OVER if "over" in args.cells else []) + (QUANT if "quant" in args.cells else [])
    if args.cell:
        cells = [(p, d, int(m)) for p, d, m in (c.split(":") for c in args.cell)]
    t0 = time.perf_counter()
    with torch.no_grad():
        for part in args.parts:
            try:
                part_wake(results, save) if part == "wake" else part_cells(results, deadline, cells)
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {part}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                torch.cuda.empty_cache()
            tri.clear_launch_caches()
            save(results)
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    table(results)


if __name__ == "__main__":
    main()
