"""Issue #16, session 39 (brief scr39): gpt-oss's weight-only experts at prefill on the scratch decode, which now takes
expert biases and the activation variant (``triton_wo_scratch``: each chunk dequantized once, then the bf16 GEMMs with
the chunk's bias rows and the spec), against the fused decode main's route ran for such a call (gpt39's "tile" at these
M) and the bf16 Triton path. The route's rule: a variant call takes scratch where a plain call of its shape and M would
(gpt-oss-20b: from SCRATCH_MIN_TOKENS = 4096); this check says whether that holds at 512 / 1024 / 4096.

    PYTHONPATH=$PWD timeout 70 python3 benchmarks/scr39_device_check.py --out $OUT/scr39 --deadline 50   # H100/H200
    PYTHONPATH=$PWD timeout 70 python3 benchmarks/scr39_device_check.py --schemes mxfp4 --ms 1024,4096 ...
    PYTHONPATH=$PWD python3 benchmarks/scr39_device_check.py --smoke     # CPU: interpreter, tiny shapes

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4, b13 / b2
bf16, silu interleaved alpha 1.702 limit 7 up_shift 1; the smoke: E 8, K 128, N 64, top-2). Schemes mxfp4 then int4
g128 (``--schemes``), M = 512, 1024, 4096 (``--ms``; the smoke: 5, 9, the scratch threshold lowered to 9). Per
(scheme, M), none started past the deadline:
  correct  against the torch twin ``fused_experts_wo_torch`` (float32, dequantized weights; rel-L2 < TOL): the scratch
           decode by name, the fused decode main's route took (``triton_wo_plan._usable_decode`` of a variant call),
           the route (``run_experts`` on the triton backend: which decode it takes is logged) and the bf16 path.
  timing   CUDA graphs (eager where capture fails, marked) of scratch, fused and bf16, ROUNDS settled rounds.
The table last: per (scheme, M) the route's decode, scratch / fused / bf16 µs, fused / scratch with the rounds scratch
was >= 3% faster, scratch / bf16. Then the real client's command (prefill 4 x 1024 tokens: M = 4096 per layer call).
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt39_device_check as gpt39  # noqa: E402
from bench_rounds import faster_rounds  # noqa: E402
from bench_run import RunLog  # noqa: E402

SCHEMES = ("mxfp4", "int4_w4a16")
MS = (5, 9) if SMOKE else (512, 1024, 4096)
ROUNDS, REPLAYS, TOL = (1, 1, 1e-2) if SMOKE else (5, 3, 1e-2)
CLIENT = ("PYTHONPATH=$PWD timeout 300 python3 -m moekit bench --hf --hf-model gpt-oss-20b --hf-quant mxfp4 "
          "--hf-impls moekit_blocks,no_experts --repeats 3 --out $OUT/hf")
RUN = RunLog("scr39: gpt-oss experts at prefill, scratch vs fused decode vs bf16, graph µs, median of settled rounds",
             stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"run": {}, "failed": RUN.failed}


def calls(w: dict, x, ids, weights) -> tuple[dict, str, str]:
    """(name -> the call: "scratch", "fused", "route", "bf16"; the fused decode's name; the route's decode)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import _runs_scratch, run_experts_wo, weight_args
    from moekit.experts.triton_wo_plan import _usable_decode
    from moekit.layouts.block_aligned import use_naive

    a13, a2 = (weight_args(v.q, v.scale, v.zero, v.group_size) for v in (_wo(w["q13"]), _wo(w["q2"])))
    biases, scheme = dict(b13=w["b13"], b2=w["b2"]), w["q13"].scheme
    e, k, n, top_k = gpt39.shape()
    fused = _usable_decode(None, a13, a2, scheme, x.shape[0], e, n, k, top_k, use_naive(ids.numel(), e, None), True)
    route = "scratch" if _runs_scratch(x, a13, ids, scheme, None, None, None, True) else fused

    def decode(name: str):
        return lambda: run_experts_wo(x, a13, a2, ids, weights, None, scheme, gpt39.SPEC, decode=name, **biases)

    fns = {"scratch": decode("scratch"), "fused": decode(fused),
           "route": lambda: run_experts(x, w["q13"], w["q2"], ids, weights, activation=gpt39.SPEC, backend="triton",
                                        **biases),
           "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=gpt39.SPEC, backend="triton",
                                       **biases)}
    return fns, fused, route


def run_scheme(scheme: str, ms: tuple, dev, deadline: float) -> None:
    res = RESULT["run"][scheme] = {}
    for w, m, (x, ids, weights) in gpt39.cells(scheme, ms, dev, deadline, 5):
        fns, fused, route = calls(w, x, ids, weights)
        errs = gpt39.checked(f"{scheme} M={m}", fns, gpt39.twin(w, x, ids, weights), TOL, fused)[0]
        RUN.log(f"{scheme} M={m}: checked; the route takes {route}")
        timed = {name: fns[name] for name in ("scratch", "fused", "bf16")}
        us, eager = gpt39.graph_rounds(timed, dev, deadline, ROUNDS, REPLAYS)
        res[m] = {"rel_l2": errs, "us": us, "fused_decode": fused, "route": route, "eager_timed": eager}
        med, mark = gpt39.medians(f"{scheme} M={m}", us, eager)
        RUN.summary.append(
            f"| {scheme} | {m} | {route} | {med['scratch']:.1f}{mark['scratch']} | {med['fused']:.1f}{mark['fused']} "
            f"({fused}) | {med['bf16']:.1f}{mark['bf16']} | x{med['fused'] / med['scratch']:.2f} "
            f"({faster_rounds(us['scratch'], us['fused'])}/{len(us['scratch'])}) "
            f"| {med['scratch'] / med['bf16']:.2f} |")
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # each graph's pool holds a scratch of up to 1 GB at gpt-oss's width


def main() -> int:
    args = gpt39.parser(__doc__.split("\n")[0], 50.0, SCHEMES, MS).parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:  # the route's scratch branch at the smoke's M = 9 (the threshold lowered for this process only)
        from moekit.experts import triton_wo, triton_wo_plan

        triton_wo.SCRATCH_MIN_TOKENS = triton_wo_plan.SCRATCH_MIN_TOKENS = MS[-1]
    gpt39.run_checks(args, dev, "| scheme | M | route takes | scratch µs | fused µs (decode) | bf16 µs "
                     "| fused / scratch (rounds scratch >= 3% faster) | scratch / bf16 |", "scr39", RESULT,
                     lambda s: run_scheme(s, args.ms, dev, args.deadline))
    print(f"\nthe real client (prefill 4 x 1024 tokens, M = 4096 a layer call; not part of this check):\n    {CLIENT}")
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
