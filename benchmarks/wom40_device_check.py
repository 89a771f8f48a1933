"""Issue #16, session 40 (brief wom40): gpt-oss's weight-only experts at M = 8..724 on the word MMA decode and (M <= 8)
the gemv word decode, which now take expert biases and the activation variant (``_kernels/gemm_wo_mma.py``,
``gemm_wo_gemv.py``), against the decode the route runs for such a call today (the tile decode; int4 to M = 127 the
register decode: gpt-oss-20b's shape has no measured mma or gemv row, so a plain call never takes them there either)
and the bf16 Triton path. Whether a variant call should take them (``triton_wo_variant.VARIANT_DECODE_MEASURED``) is
this check's question.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wom40_device_check.py --out $OUT/wom40 --deadline 58   # H100/H200
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wom40_device_check.py --ms 1,8 --out $OUT/wom40b ...  # the gemv's M
    PYTHONPATH=$PWD python3 benchmarks/wom40_device_check.py --smoke     # CPU: interpreter, tiny shapes

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4, b13 / b2
bf16, silu interleaved alpha 1.702 limit 7 up_shift 1; the smoke: E 8, K 128, N 64, top-2). Schemes mxfp4, int4 g128,
int8 (``--schemes``), M = 8, 64, 256, 512, 724 (``--ms``; the smoke: 5, 9). Per (scheme, M), none started past the
deadline:
  correct  against the torch twin ``fused_experts_wo_torch`` (float32, dequantized weights; rel-L2 < TOL): the mma
           decode in the route's mma config ("mma16": 16-row blocks, 32 x 128 one-warp tiles), from MMA32_FROM also in
           32-row blocks ("mma32": the mid-M winner at Mixtral / DeepSeek-V3 / Qwen3), up to GEMV_TO the gemv decode
           in its looked-up config ("gemv"), the fused decode the route takes today (``triton_wo_plan._usable_decode``
           of a variant call), the route (``run_experts`` on the triton backend) and the bf16 path.
  timing   CUDA graphs (eager where capture fails, marked) of the new arms, the route's decode and bf16, ROUNDS
           settled rounds (``bench_rounds.settled``), median µs.
The table last: per (scheme, M) the route's decode, each arm's µs, route / best new arm with the rounds it was >= 3%
faster, best new / bf16. Then the VARIANT_DECODE_MEASURED / MMA_CONFIGS rows the rule would take (every check PASS,
>= 3% faster in every round), ready to paste.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import replace

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt39_device_check as gpt39  # noqa: E402
from bench_rounds import faster_rounds, settled  # noqa: E402
from bench_run import RunLog  # noqa: E402

SCHEMES = ("mxfp4", "int4_w4a16", "int8_w8a16")
MS = (5, 9) if SMOKE else (8, 64, 256, 512, 724)
MMA32_FROM = 9 if SMOKE else 256  # 32-row blocks from 8 rows an expert (M*k/E) up
GEMV_TO = 5 if SMOKE else 8  # the gemv decode (no tensor cores) up to 1 row an expert
ROUNDS, REPLAYS, TOL = (1, 1, 1e-2) if SMOKE else (5, 3, 1e-2)
RUN = RunLog("wom40: gpt-oss experts, the mma / gemv decodes with biases + spec vs the route's decode vs bf16, "
             "graph µs, median of settled rounds", stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"run": {}, "failed": RUN.failed, "rows": []}


def calls(w: dict, x, ids, weights) -> tuple[dict, str, str]:
    """(name -> the call: "mma16", "mma32" (from MMA32_FROM), "gemv" (to GEMV_TO), "fused", "route", "bf16"; the fused
    decode's name; the mma16 config's text)."""
    from moekit.experts import run_experts
    from moekit.experts.configs import device_key
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import run_experts_wo, weight_args
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_plan import _usable_decode
    from moekit.layouts.block_aligned import use_naive

    a13, a2 = (weight_args(v.q, v.scale, v.zero, v.group_size) for v in (_wo(w["q13"]), _wo(w["q2"])))
    biases, scheme = dict(b13=w["b13"], b2=w["b2"]), w["q13"].scheme
    e, k, n, top_k = gpt39.shape()
    m = x.shape[0]
    fused = _usable_decode(None, a13, a2, scheme, m, e, n, k, top_k, use_naive(ids.numel(), e, None), True)
    mma16 = wo_config(m, e, n, k, top_k, scheme, device_key(x.device), "mma")

    def decode(name: str, config=None):
        return lambda: run_experts_wo(x, a13, a2, ids, weights, None, scheme, gpt39.SPEC, config=config, decode=name,
                                      **biases)

    fns = {"mma16": decode("mma", mma16)}
    if m >= MMA32_FROM:
        fns["mma32"] = decode("mma", replace(mma16, BLOCK_M=32))
    if m <= GEMV_TO:  # its looked-up config (``triton_wo_plan._config_for``: never folded for the variant)
        fns["gemv"] = decode("gemv")
    fns |= {"fused": decode(fused),
            "route": lambda: run_experts(x, w["q13"], w["q2"], ids, weights, activation=gpt39.SPEC, backend="triton",
                                         **biases),
            "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=gpt39.SPEC, backend="triton",
                                        **biases)}
    return fns, fused, str(mma16)


def run_scheme(scheme: str, ms: tuple, dev, deadline: float) -> None:
    res = RESULT["run"][scheme] = {}
    for w, m, (x, ids, weights) in gpt39.cells(scheme, ms, dev, deadline, 7):
        fns, fused, mma_config = calls(w, x, ids, weights)
        errs, passed = gpt39.checked(f"{scheme} M={m}", fns, gpt39.twin(w, x, ids, weights), TOL, fused)
        RUN.log(f"{scheme} M={m}: checked; the route takes {fused}; mma16 config {mma_config}")
        timed = {name: fn for name, fn in fns.items() if name != "route"}
        with torch.no_grad():
            graphs = {name: gpt39.captured(name, fn, dev) for name, fn in timed.items()}
            us = settled({name: (g, None) for name, g in graphs.items()}, 1, dev, ROUNDS, REPLAYS,
                         until=time.time() + max(1.0, deadline - RUN.elapsed()))
        eager = [name for name, g in graphs.items() if isinstance(g, gpt39.EagerCall)]
        med = {name: statistics.median(v) for name, v in us.items()}
        best = min((n for n in med if n.startswith(("mma", "gemv"))), key=med.get)
        won = faster_rounds(us[best], us["fused"])
        res[m] = {"rel_l2": errs, "us": us, "fused_decode": fused, "mma16_config": mma_config, "eager_timed": eager,
                  "best_mma": best, "best_rounds_3pct": won}
        RUN.log(f"{scheme} M={m}: " + ", ".join(f"{n} {v:.1f} µs" for n, v in med.items()))
        mark = {n: " (eager)" if n in eager else "" for n in med}
        cell = {n: f"{med[n]:.1f}{mark[n]}" if n in med else "-" for n in ("mma16", "mma32", "gemv", "fused", "bf16")}
        RUN.summary.append(
            f"| {scheme} | {m} | {fused} | {cell['mma16']} | {cell['mma32']} | {cell['gemv']} | {cell['fused']} "
            f"| {cell['bf16']} "
            f"| x{med['fused'] / med[best]:.2f} {best} ({won}/{len(us[best])}) | {med[best] / med['bf16']:.2f} |")
        if passed and won == len(us[best]) == ROUNDS:
            RESULT["rows"].append((scheme, m, best, f"{med[best]:.1f}", f"{med['fused']:.1f}", fused))
        del graphs


def print_rows(shape: tuple) -> None:
    """The table rows the rule takes: a VARIANT_DECODE_MEASURED entry per won (scheme, M), an MMA_CONFIGS row where the
    32-row blocks won (the mma decode's config of that M for every call of the shape: only variant calls take it)."""
    e, k, n, _ = shape
    print("\nrows by the rule (every check PASS, the new arm >= 3% faster than the route's decode in every round):")
    for scheme, m, best, new, old, fused in RESULT["rows"]:
        decode = "gemv" if best == "gemv" else "mma"
        print(f"    VARIANT_DECODE_MEASURED[({scheme!r}, {e}, {n}, {k})][{m}] = {decode!r}  # {best} {new} µs "
              f"against {fused} {old}")
        if best == "mma32":
            print(f"    MMA_CONFIGS[({scheme!r}, {e}, {n}, {k}, {m})] = KernelConfig(32, _T128, _T128)")
    if not RESULT["rows"]:
        print("    none")


def main() -> int:
    args = gpt39.parser(__doc__.split("\n")[0], 70.0, SCHEMES, MS).parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    gpt39.run_checks(args, dev, "| scheme | M | route takes | mma16 µs | mma32 µs | gemv µs | route's decode µs "
                     "| bf16 µs | route / best new (rounds new >= 3% faster) | best new / bf16 |", "wom40", RESULT,
                     lambda s: run_scheme(s, args.ms, dev, args.deadline))
    print_rows(gpt39.shape())
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())
