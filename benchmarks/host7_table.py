"""Issue 13's host table (``host_us`` <= 40 µs in every triton cell): host_us / host_rest_us of the cells ``moekit
bench`` times on the GPU (Qwen3-30B-A3B and DeepSeek-V3; bf16, fp8_block, int8_w8a16, int4_w4a16, mxfp4; M = 1 / 64 /
1024 / 4096 / 16384), timed as the bench times them (``time_paired``: graph replay passes up to M = 1024, eager passes
above, five 16-call eager loops spread between them), per variant of ``VARIANTS`` (this tree's defaults first),
interleaved over ``--rounds`` rounds; every variant's output bit-equal to the first variant's, the first near
``experts_reference`` at M <= 64. Cells go by shape, then dtype (each quantized copy made once), then M. Per cell and
round a control (unless ``--no-control``): the same loops with each call a bare torch op pair (``empty_like`` and a
tiny ``add_``), each after the cell's own pass: what any host work pays as the first call after that GPU wait. The
table marks host_us over 40 and eager_us over issue 13's bound, max(1.15 x graph, graph + 15 µs).

    PYTHONPATH=$PWD timeout 200 python3 benchmarks/host7_table.py --out $OUT/host7 [--deadline-s 170]
        [--variants default ...] [--dtypes D ...] [--presets P ...] [--batches M ...] [--rounds R] [--no-control]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import time

import torch

from host7_device_check import _flags
from host_big3_device_check import DEEPSEEK, QWEN3, TOL, Deadline, _rel
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import EAGER_CALLS, MIN_REPEATS, _cuda_pass, _EagerLoop, time_paired
from moekit.experts import get_backend
from moekit.experts.reference import experts_reference
import moekit.batch_launch as bl
import moekit.experts.triton as tri
from moekit.quant import quantize

BATCHES = (1, 64, 1024, 4096, 16384)
DTYPES = ("bfloat16", "fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4")
ROUNDS, BUDGET_S, TARGET_US = 3, 0.1, 40.0
ROTATION_BYTES = 256 << 20  # moekit.bench.sweep's


def _default(on: bool) -> None:
    """This tree's defaults (nothing to switch)."""


_BATCH_OF = bl.Batch.__dict__["of"]


def _nopdl(on: bool) -> None:
    """Not a default: every batch recorded without the PDL launch attribute (host µs of the attribute; GPU µs in
    ``us`` / ``eager``), the kernels and parameters unchanged (bit-equal)."""
    if not on:
        bl.Batch.of = _BATCH_OF
        return

    def of(cls, steps, mod=None):
        made = _BATCH_OF.__func__(cls, steps, mod)
        if made is not None:
            for at in _flags(made.blob):
                struct.pack_into("<I", made.blob, at, struct.unpack_from("<I", made.blob, at)[0] & ~1)
        return made
    bl.Batch.of = classmethod(of)


VARIANTS = {"default": _default, "nopdl": _nopdl}  # name -> switch(on): its module switches set (on) or put back


def _cells(presets: list, dtypes: list, batches: list) -> list:
    """(preset, dtype, M) grouped by weights, the bench's order within a shape."""
    return [(p, d, m) for p in presets for d in dtypes for m in batches]


def _num_sets(shape: Shape, m: int, w13, w2) -> int:
    per_expert = (w13.nbytes + w2.nbytes) / shape.num_experts
    touched = max(1, min(shape.num_experts, m * shape.top_k)) * per_expert
    return max(2, min(8, math.ceil(ROTATION_BYTES / touched)))


class Held:
    """The bf16 weights of one shape and one quantized copy at a time (the bench quantizes once per shape)."""

    def __init__(self):
        self.key, self.base, self.dtype, self.pair = None, None, None, None

    def get(self, preset: str, dtype: str):
        if self.key != preset:
            self.base = self.pair = self.dtype = None
            torch.cuda.empty_cache()
            self.key, self.base = preset, make_weights(Shape.from_preset(preset), torch.bfloat16, torch.device("cuda"))
        if dtype == "bfloat16":
            return self.base.w13, self.base.w2
        if self.dtype != dtype:
            self.pair = None
            torch.cuda.empty_cache()
            self.dtype, self.pair = dtype, (quantize(self.base.w13, dtype), quantize(self.base.w2, dtype))
        return self.pair


def _use(name: str | None) -> None:
    """Switch to variant ``name`` (None: every variant off), the launch caches dropped."""
    for other, switch in VARIANTS.items():
        if other != name:
            switch(False)
    if name is not None:
        VARIANTS[name](True)
    tri.clear_launch_caches()


def _control(calls: list, graph: bool, x: torch.Tensor, scratch: torch.Tensor) -> tuple:
    """(host, rest) µs of the bench's eager loop with each call a bare torch op pair (``torch.empty_like(x)``, one
    tiny CUDA ``add_``; no moekit), each loop after the cell's own pass (graph replay or eager), as ``time_paired``
    places its loops: what any host work pays as the first call after that wait."""
    one_pass, loop = _cuda_pass(calls, graph), _EagerLoop([lambda: (torch.empty_like(x), scratch.add_(1.0))],
                                                          torch.device("cuda"), EAGER_CALLS)
    for _ in range(MIN_REPEATS):
        one_pass()
        loop.run()
    t = loop.timing()
    return t.host_us, t.host_rest_us


def run_table(results: dict, deadline: Deadline, variants: list, cells: list, rounds: int, control: bool,
              save) -> None:
    fn, out, held = get_backend("triton"), results.setdefault("table", {}), Held()
    scratch = torch.zeros(64, device="cuda")  # the control's add_ target
    for preset, dtype, m in cells:
        if deadline.left() < deadline.stops["table"]:
            print(f"deadline: table stops before {preset} {dtype} M={m}", flush=True)
            break
        key, row = f"{preset} {dtype} M={m}", {}
        try:
            shape = Shape.from_preset(preset)
            w13, w2 = held.get(preset, dtype)
            sets = make_sets(shape, m, _num_sets(shape, m, w13, w2), torch.bfloat16, torch.device("cuda"))
            calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
            want = None
            for rnd in range(rounds):
                for name in variants:
                    _use(name)
                    for c in calls * 2:
                        c()
                    got = calls[0]()
                    if want is None:
                        want, s0 = got, sets[0]
                        if m <= 64:
                            row["ref_err"] = _rel(got, experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights))
                    row.setdefault(f"{name}_equal", []).append(bool(torch.equal(got, want)))
                    p = time_paired(calls, torch.device("cuda"), graph=m <= 1024, budget_s=BUDGET_S)
                    for field, value in (("us", p.timing.us), ("eager", p.eager.eager_us), ("host", p.eager.host_us),
                                         ("rest", p.eager.host_rest_us)):
                        row.setdefault(f"{name}_{field}", []).append(round(value, 1))
                if control:
                    for field, value in zip(("host", "rest"), _control(calls, m <= 1024, sets[0].x, scratch)):
                        row.setdefault(f"control_{field}", []).append(round(value, 1))
            ok = all(all(v) for k, v in row.items() if k.endswith("_equal")) and row.get("ref_err", 0.0) < TOL
        except Exception as e:  # noqa: BLE001 (out of memory, a refused launch: report, go on)
            row, ok = dict(error=f"{type(e).__name__}: {str(e)[:300]}"), False
            torch.cuda.synchronize()
        _use(None)
        out[key] = row
        print(("PASS" if ok else "FAIL") + f" table {key}: " + json.dumps(row), flush=True)
        save(results)


def _first(host: float, rest: float) -> float:
    """The first call of a 16-call loop from its host and rest µs (medians over separate loops: a rough figure)."""
    return EAGER_CALLS * host - (EAGER_CALLS - 1) * rest


def print_table(results: dict, variants: list, rounds: int) -> None:
    print(f"\n== host table: host_us / host_rest_us (medians of {rounds} interleaved rounds), * over {TARGET_US}; "
          "first: the loop's first call (16 host - 15 rest); eager against max(1.15 graph, graph + 15), ! over; "
          "control: a bare torch op pair per call after the same pass, host / rest / first ==")
    med = lambda r, k: statistics.median(r[k]) if r.get(k) else float("nan")  # noqa: E731
    over = {v: 0 for v in variants}
    for key, r in results.get("table", {}).items():
        if "error" in r:
            print(f"{key:34} ERROR {r['error'][:90]}")
            continue
        cols = []
        for v in [v for v in variants if f"{v}_host" in r]:
            host, rest, us, eager = (med(r, f"{v}_{k}") for k in ("host", "rest", "us", "eager"))
            over[v] += host > TARGET_US
            bound = max(1.15 * us, us + 15.0)
            cols.append(f"{v} {host:5.1f}{'*' if host > TARGET_US else ' '}/{rest:5.1f} first {_first(host, rest):6.1f}"
                        f" (us {us:8.1f} eager {eager:8.1f}{'!' if eager > bound else ' '})")
        if "control_host" in r:
            host, rest = med(r, "control_host"), med(r, "control_rest")
            cols.append(f"control {host:5.1f}/{rest:5.1f} first {_first(host, rest):6.1f}")
        print(f"{key:34} " + "  ".join(cols))
    print("cells over: " + ", ".join(f"{v} {n}" for v, n in over.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host7_out"))
    parser.add_argument("--deadline-s", type=float, default=170.0)
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--presets", nargs="+", default=[QWEN3, DEEPSEEK], choices=[QWEN3, DEEPSEEK])
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--no-control", action="store_true", help="no bare-torch control loop per cell and round")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host7_table.json")

    def save(results: dict) -> None:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    deadline = Deadline(args.deadline_s)
    deadline.stops = dict(table=15.0)
    import triton

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   variants=args.variants, rounds=args.rounds)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        run_table(results, deadline, args.variants, _cells(args.presets, args.dtypes, args.batches), args.rounds,
                  not args.no_control, save)
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    print_table(results, args.variants, args.rounds)


if __name__ == "__main__":
    main()
