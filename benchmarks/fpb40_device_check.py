"""Issue #15, session 40 (brief fpb40): gpt-oss's experts quantized to fp8_block (expert biases, interleaved gate/up
rows, its clamped SwiGLU) on the fused fp8 Triton kernels, where main sent every such call to grouped_mm's dequantizing
path (``moekit.quant``'s per-expert fp8 recipe in torch, with its host syncs).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/fpb40_device_check.py --out $OUT/fpb40 --deadline 55   # H100/H200
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/fpb40_device_check.py --ms 1,64 ...
    PYTHONPATH=$PWD python3 benchmarks/fpb40_device_check.py --smoke     # CPU: interpreter, tiny shapes

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4, b13 / b2
bf16, silu interleaved alpha 1.702 limit 7 up_shift 1; the smoke: E 8, K 128, N 64, top-2), the weights quantized to
fp8_block (128 x 128 blocks). M = 1, 8, 64, 512, 1024, 4096 (``--ms``; the smoke: 1, 9), none started past the
deadline:
  correct  against the reference backend's fp8 recipe (``experts_fp8_block_reference``: x and h through e4m3 per 128
           columns, the dequantized weights, float32; rel-L2 < TOL): the fused kernels by name (``fused_experts_fp8``
           with the biases and the spec), the route (``run_experts`` on the triton backend, and no "dequantizing path"
           warning), main's route (``experts_grouped_mm`` on the quantized weights); the bf16 Triton path on the
           dequantized weights against the reference backend on them.
  timing   CUDA graphs (eager where capture fails, marked) of the route ("new"), main's route ("old") and bf16, ROUNDS
           settled rounds (``bench_rounds.settled``), median µs.
Then one plain cell per family, Qwen3-30B-A3B and DeepSeek-V3's experts (E 256 there: its weights are 7 GB in fp8 at
full width, so E 32 of them) in fp8_block at M = 64, no biases, the plain silu: the route against the reference (PASS)
and its graph µs (the kernels of those calls are main's: sm_90 SASS identical, ``wo_sass_diff_cpu.py``; compare
with ``fp8_device_check``'s figures). The table last: per M new / old / bf16 µs, old / new with the rounds new was
>= 3% faster, new / bf16; then the plain cells.
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt39_device_check as gpt39  # noqa: E402
from bench_rounds import faster_rounds, settled  # noqa: E402
from bench_run import RunLog, rel_l2, write_json  # noqa: E402

MS = (1, 9) if SMOKE else (1, 8, 64, 512, 1024, 4096)
ROUNDS, REPLAYS, TOL = (1, 1, 2e-2) if SMOKE else (5, 3, 2e-2)  # bf16 out; now and then an e4m3 midpoint flip
PLAIN_M = 9 if SMOKE else 64
PLAIN_CELLS = {"qwen3-30b-a3b": None, "deepseek-v3": 32}  # preset -> experts kept (None: all)
RUN = RunLog("fpb40: gpt-oss experts in fp8_block (biases + clamped SwiGLU), graph µs, median of settled rounds",
             stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"run": {}, "plain": {}, "failed": RUN.failed}


def calls(w: dict, x, ids, weights) -> dict:
    """name -> the call: "fused" (the kernels by name), "new" (the route), "old" (main's route), "bf16"."""
    from moekit.experts import run_experts
    from moekit.experts.grouped_mm import experts_grouped_mm
    from moekit.experts.triton_fp8 import fused_experts_fp8

    q13, q2, spec = w["q13"], w["q2"], gpt39.SPEC
    biases = dict(b13=w["b13"], b2=w["b2"])
    return {"fused": lambda: fused_experts_fp8(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, activation=spec,
                                               block_shape=tuple(q13.block_shape), **biases),
            "new": lambda: run_experts(x, q13, q2, ids, weights, activation=spec, backend="triton", **biases),
            "old": lambda: experts_grouped_mm(x, q13, q2, ids, weights, activation=spec, **biases),
            "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=spec, backend="triton",
                                        **biases)}


def references(w: dict, x, ids, weights) -> dict:
    """name -> what the call of ``calls`` is held to: the reference backend's fp8 recipe, or on the dequantized
    weights for bf16."""
    from moekit.experts import run_experts

    fp8 = run_experts(x, w["q13"], w["q2"], ids, weights, activation=gpt39.SPEC, b13=w["b13"], b2=w["b2"],
                      backend="reference")
    bf16 = run_experts(x, w["d13"], w["d2"], ids, weights, activation=gpt39.SPEC, b13=w["b13"], b2=w["b2"],
                       backend="reference")
    return {"fused": fp8, "new": fp8, "old": fp8, "bf16": bf16}


def run_gpt_oss(ms: tuple, dev, deadline: float) -> None:
    from moekit.experts.triton_quant import _warn_once

    w = gpt39.layer("fp8_block", dev)
    RUN.log("gpt-oss: weights quantized to fp8_block")
    res = RESULT["run"]
    for m in gpt39.reached("fp8_block", ms, deadline, 4):
        x, ids, weights = gpt39.inputs(m, dev)
        fns = calls(w, x, ids, weights)
        _warn_once.cache_clear()
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            want = references(w, x, ids, weights)
            errs = {name: rel_l2(fn(), want[name]) for name, fn in fns.items()}
        for name, err in errs.items():
            RUN.check(f"gpt-oss fp8 M={m} {name}", err < TOL, f"rel_l2={err:.2e}")
        fell_back = [str(c.message) for c in caught if "dequantizing path" in str(c.message)]
        RUN.check(f"gpt-oss fp8 M={m} the route stays on the fused kernels", not fell_back, "; ".join(fell_back))
        timed = {name: fns[name] for name in ("new", "old", "bf16")}
        us, eager = gpt39.graph_rounds(timed, dev, deadline, ROUNDS, REPLAYS)
        res[m] = {"rel_l2": errs, "us": us, "eager_timed": eager}
        med, mark = gpt39.medians(f"gpt-oss fp8 M={m}", us, eager)
        RUN.summary.append(
            f"| fp8_block | {m} | {med['new']:.1f}{mark['new']} | {med['old']:.1f}{mark['old']} | "
            f"{med['bf16']:.1f}{mark['bf16']} | x{med['old'] / med['new']:.2f} "
            f"({faster_rounds(us['new'], us['old'])}/{len(us['new'])}) | {med['new'] / med['bf16']:.2f} |")


def run_plain(preset: str, dev, m: int = PLAIN_M, kept: int | None = None, run: RunLog = RUN,
              result: dict = RESULT, blanks: int = 4) -> None:
    """One plain fp8 call of ``preset``'s experts at M = ``m`` (E: ``kept`` of them, else ``PLAIN_CELLS``' count or all;
    the smoke: gpt39's tiny shape): the route against the reference, then its graph µs, logged into ``run`` (a
    table row with ``blanks`` empty cells after the µs) and ``result["plain"]`` (gof41's check ran it with its own)."""
    import moekit.quant as Q
    from moekit.bench.cells import Shape
    from moekit.experts import run_experts

    if SMOKE:
        e, k, n, top_k = gpt39.shape()
    else:
        shape = Shape.from_preset(preset)
        e, k, n, top_k = kept or PLAIN_CELLS.get(preset) or shape.num_experts, shape.k, shape.n, shape.top_k
    g = torch.Generator(device=dev).manual_seed(40)
    q13 = Q.quantize((torch.randn(e, 2 * n, k, generator=g, device=dev) * k**-0.5).bfloat16(), "fp8_block")
    q2 = Q.quantize((torch.randn(e, k, n, generator=g, device=dev) * n**-0.5).bfloat16(), "fp8_block")
    x = torch.randn(m, k, generator=g, device=dev).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g, device=dev)[:top_k] for _ in range(m)]).int()
    weights = torch.softmax(torch.randn(m, top_k, generator=g, device=dev), dim=1)

    def route():
        return run_experts(x, q13, q2, ids, weights, backend="triton")

    with torch.no_grad():
        err = rel_l2(route(), run_experts(x, q13, q2, ids, weights, backend="reference"))
        run.check(f"{preset} fp8 plain M={m} (E {e}, K {k}, N {n}, top-{top_k})", err < TOL, f"rel_l2={err:.2e}")
        graph = gpt39.captured("plain", route, dev)
        us = settled({"plain": (graph, None)}, 1, dev, ROUNDS, REPLAYS)["plain"]
    result["plain"][preset] = {"rel_l2": err, "us": us, "shape": (e, k, n, top_k), "m": m}
    run.log(f"{preset} plain M={m}: {statistics.median(us):.1f} µs")
    run.summary.append(f"| {preset} plain (E {e}) | {m} | {statistics.median(us):.1f} |" + " |" * blanks)


def main() -> int:
    args = gpt39.parser(__doc__.split("\n")[0], 55.0, ("fp8_block",), MS).parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    gpt39.begin(RESULT, args.ms, "| scheme | M | new (fused fp8) µs | old (grouped_mm) µs | bf16 µs "
                "| old / new (rounds >= 3%) | new / bf16 |")
    path = os.path.join(args.out, "fpb40.json") if args.out else ""
    RUN.each_cell(["gpt-oss"], lambda _: run_gpt_oss(args.ms, dev, args.deadline), args.deadline)
    return plain_cells_and_table(PLAIN_CELLS, lambda preset: run_plain(preset, dev), dev, path, args.deadline + 7)


def plain_cells_and_table(cells, run_one, dev, path: str, deadline: float, run: RunLog = RUN,
                          result: dict = RESULT) -> int:
    """The end of a gpt-oss fp8 check (this one's; gof41's ran it too): ``result`` written to ``path`` (if any), the
    GPU's cache emptied (gpt-oss's weights and graphs), ``run_one(preset)`` for each of ``cells`` that starts before
    ``deadline``, ``result`` written again, the table; 1 where a check failed, else 0."""
    if path:
        write_json(path, result)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    run.each_cell(list(cells), run_one, deadline)
    if path:
        write_json(path, result)
    run.print_table()
    return 1 if run.failed else 0


if __name__ == "__main__":
    sys.exit(main())
