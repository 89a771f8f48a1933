"""Issue #15, session 41 (brief gof41): gpt-oss's experts in fp8_block at prefill, its interleaved gate/up rows through
TMA (``gemm_fp8``'s W_DESC with INTERLEAVED: the plain calls' descriptor over w13, each tile's rows in place as two row
tiles, a scale a row tile) against main's pointer loads (a scale a column), and against bf16.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gof41_device_check.py --out $OUT/gof41 --deadline 60   # H100/H200
    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gof41_device_check.py --ms 1024,4096 --extra m128,persist ...
    PYTHONPATH=$PWD python3 benchmarks/gof41_device_check.py --smoke     # CPU: interpreter, tiny shapes

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4, b13 / b2
bf16, silu interleaved alpha 1.702 limit 7 up_shift 1; the smoke: E 8, K 128, N 64, top-2), the weights quantized to
fp8_block (128 x 128 blocks). The arms, each ``fused_experts_fp8_launch`` with fresh workspaces (as the op: a graph's
own), the biases and the spec:
  main      pointer weights, the heuristic tiles: what main's route (and this branch's with ``triton_fp8_plan.
            INTERLEAVED_TMA_FROM_M`` None) launches at every M
  tma       TMA weights, the same tiles: what the route launches from ``INTERLEAVED_TMA_FROM_M`` on
  bf16      the bf16 Triton route on the dequantized weights (biases + spec)
  --extra m128: tma_m128 / ptr_m128, TMA or pointer weights with 128-row tiles (Mixtral's tuned prefill entries: gate-up
            128 x 128 on 8 warps, 3 stages; down 8 warps), what a tuned file for E32_N2880_K2880 could name. Not by
            default: that gate-up spills (sm_90, Triton 3.9: 928 B of stack a thread; the 64-row TMA tile none)
  --extra persist: tma_persist, tma with the persistent GEMMs (``PERSISTENT``; session 41 gave them biases and the
            spec, taken only where asked), where the layout is aligned (M >= 64 here). Not by default: that gate-up
            spills (sm_90: 1150 / 1184 LDL / STL lines on Triton 3.9, 1024 / 1144 on 3.6)
  correct  at M = 64, 1024, 4096 (``--check-ms``; the smoke: 9, 33): each fp8 arm and the route (``run_experts``, the
           switch off, then on from M = 1) against the reference backend's fp8 recipe, bf16 against the reference
           backend on the dequantized weights (rel-L2 < TOL)
  timing   at M = 1, 8, 64, 512, 1024, 2048, 4096 (``--ms``; the smoke: 9, 33): CUDA graphs of the arms in ROUNDS
           settled rounds (``bench_rounds.settled``), median µs; none started past the deadline
Then plain fp8 Mixtral-8x7B and Qwen3-30B-A3B at M = 4096 (no biases, the plain silu; ``fpb40_device_check.run_plain``:
the route against the reference, PASS, and its graph µs): their kernels are main's (sm_90 SASS identical on Triton 3.6
and 3.9, ``wo_sass_diff_cpu.py``), so the figures read against earlier runs of the same card.
The table last: per M each arm's median, main / each other fp8 arm with the rounds it was >= 3% faster, best fp8 /
bf16; then the switch the defaults rule gives (``INTERLEAVED_TMA_FROM_M``: the smallest timed M
from which tma was >= 3% faster than main in every round at every timed M, every check PASS), then the plain cells.
"""

from __future__ import annotations

import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fpb40_device_check as fpb40  # noqa: E402
import gpt39_device_check as gpt39  # noqa: E402
from bench_rounds import faster_rounds  # noqa: E402
from bench_run import RunLog, rel_l2  # noqa: E402

from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_persistent import Persistent  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

MS = (9, 33) if SMOKE else (1, 8, 64, 512, 1024, 2048, 4096)
CHECK_MS = (9, 33) if SMOKE else (64, 1024, 4096)
ROUNDS, REPLAYS, TOL = (1, 1, 2e-2) if SMOKE else (5, 3, 2e-2)  # bf16 out; now and then an e4m3 midpoint flip
PLAIN_M = 9 if SMOKE else 4096
PLAIN_CELLS = ("mixtral-8x7b", "qwen3-30b-a3b")
M128 = KernelConfig(128, GemmTile(128, 128, 8, 8, 3), GemmTile(128, 128, 8, 8, 4))
FRESH = LaunchOptions(reuse_workspace=False)  # each call (and graph) its own workspace, as through the op
EXTRA = {"m128": ("tma_m128", "ptr_m128"), "persist": ("tma_persist",)}  # --extra: arms beyond main, tma, bf16
PERSISTENT = Persistent(1, 2)  # tma_persist's GEMMs: 1 gate-up and 2 down programs an SM (Qwen3's M = 512 entry)
RUN = RunLog("gof41: gpt-oss experts in fp8_block at prefill, interleaved rows by TMA, graph µs, median of settled "
             "rounds", stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"run": {}, "checks": {}, "plain": {}, "failed": RUN.failed}


def names(extra: tuple) -> tuple:
    """The arms timed: main, tma, the ``extra`` groups' (``EXTRA``), bf16."""
    return ("main", "tma") + sum((EXTRA[e] for e in extra), ()) + ("bf16",)


def arms(w: dict, x, ids, weights, extra: tuple) -> dict:
    """name -> the call (``names(extra)``; tma_persist only past the folded alignment's assignments: the persistent
    GEMMs read the aligned layout's launch)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    q13, q2, spec, biases = w["q13"], w["q2"], gpt39.SPEC, dict(b13=w["b13"], b2=w["b2"])

    def fp8(weight_tma: bool, config=None, persistent=None):
        return lambda: fused_experts_fp8_launch(
            x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, None, tuple(q13.block_shape), config, FRESH,
            weight_tma=weight_tma, persistent=persistent, activation=spec, **biases)

    calls = {"main": fp8(False), "tma": fp8(True), "tma_m128": fp8(True, M128), "ptr_m128": fp8(False, M128),
             "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=spec, backend="triton",
                                         **biases)}
    if ids.numel() > FRESH.align_fold_max:
        calls["tma_persist"] = fp8(True, None, PERSISTENT)
    return {name: calls[name] for name in names(extra) if name in calls}


def route(w: dict, x, ids, weights, from_m: int | None):
    """The route (``run_experts`` on the triton backend) with ``INTERLEAVED_TMA_FROM_M`` = ``from_m`` (plans rebuilt
    for it, the module's value restored after), and whether its plan took TMA weights."""
    from moekit.experts import run_experts, triton_fp8_plan
    from moekit.experts.triton_fp8 import clear_launch_caches

    kept, build, seen = triton_fp8_plan.INTERLEAVED_TMA_FROM_M, triton_fp8_plan.build_plan, []

    def build_and_keep(*args, **kwargs):
        seen.append(build(*args, **kwargs))
        return seen[-1]

    triton_fp8_plan.INTERLEAVED_TMA_FROM_M, triton_fp8_plan.build_plan = from_m, build_and_keep
    try:
        clear_launch_caches()
        out = run_experts(x, w["q13"], w["q2"], ids, weights, activation=gpt39.SPEC, b13=w["b13"], b2=w["b2"],
                          backend="triton")
    finally:
        triton_fp8_plan.INTERLEAVED_TMA_FROM_M, triton_fp8_plan.build_plan = kept, build
        clear_launch_caches()
    return out, any(p.descriptor_key is not None for p in seen)


def check(w: dict, m: int, dev, extra: tuple) -> None:
    """Each arm and the route (switch off, then on) against its reference: a PASS / FAIL line each."""
    x, ids, weights = gpt39.inputs(m, dev)
    with torch.no_grad():
        want = fpb40.references(w, x, ids, weights)
        errs = {name: rel_l2(fn(), want["bf16" if name == "bf16" else "new"]) for name, fn in
                arms(w, x, ids, weights, extra).items()}
        for name, from_m, tma in (("route (switch off)", None, False), ("route (switch on from M = 1)", 1, True)):
            out, took = route(w, x, ids, weights, from_m)
            errs[name] = rel_l2(out, want["new"])
            RUN.check(f"gpt-oss fp8 M={m} {name} took {'TMA' if tma else 'pointer'} weights", took == tma)
    for name, err in errs.items():
        RUN.check(f"gpt-oss fp8 M={m} {name}", err < TOL, f"rel_l2={err:.2e}")
    RESULT["checks"][m] = errs


def run_gpt_oss(ms: tuple, check_ms: tuple, dev, deadline: float, extra: tuple) -> None:
    w = gpt39.layer("fp8_block", dev)
    RUN.log("gpt-oss: weights quantized to fp8_block")
    for m in check_ms:
        check(w, m, dev, extra)
    RUN.log("checked")
    timed = names(extra)
    fp8 = [a for a in timed if a != "bf16"]
    for m in gpt39.reached("fp8_block", ms, deadline, 2 * len(timed)):
        x, ids, weights = gpt39.inputs(m, dev)
        us, eager = gpt39.graph_rounds(arms(w, x, ids, weights, extra), dev, deadline, ROUNDS, REPLAYS)
        RESULT["run"][m] = {"us": us, "eager_timed": eager}
        med, mark = gpt39.medians(f"gpt-oss fp8 M={m}", us, eager)
        RUN.summary.append(
            f"| {m} | " + " | ".join(f"{med[a]:.1f}{mark[a]}" if a in med else "-" for a in timed) + " | " + " | ".join(
                f"x{med['main'] / med[a]:.3f} ({faster_rounds(us[a], us['main'])}/{len(us[a])})" if a in med else "-"
                for a in fp8[1:]) + f" | {min(med[a] for a in fp8 if a in med) / med['bf16']:.2f} |")


def header(extra: tuple) -> str:
    """The table's head row: M, each arm's µs, main / each other fp8 arm, best fp8 / bf16."""
    timed = names(extra)
    ratios = [f"main / {a}" + (" (rounds >= 3%)" if a == "tma" else "") for a in timed if a not in ("main", "bf16")]
    return "| M | " + " | ".join(f"{a} µs" for a in timed) + " | " + " | ".join(ratios) + " | best fp8 / bf16 |"


def switch_from_m() -> int | None:
    """``INTERLEAVED_TMA_FROM_M`` by the defaults rule: the smallest timed M from which tma was >= 3% faster than
    main in every round at every timed M after it (and every check PASS); None where none is."""
    if RUN.failed:
        return None
    timed = sorted(RESULT["run"])
    wins = {m: faster_rounds(RESULT["run"][m]["us"]["tma"], RESULT["run"][m]["us"]["main"]) == ROUNDS for m in timed}
    from_m = None
    for m in reversed(timed):
        if not wins[m]:
            break
        from_m = m
    return from_m


def main() -> int:
    p = gpt39.parser(__doc__.split("\n")[0], 60.0, ("fp8_block",), MS)
    p.add_argument("--check-ms", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=CHECK_MS)
    p.add_argument("--extra", type=lambda v: tuple(x for x in v.split(",") if x), default=(),
                   help="comma-separated groups of arms beyond main / tma / bf16: m128, persist (docstring)")
    args = p.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    gpt39.begin(RESULT, args.ms, header(args.extra))
    path = os.path.join(args.out, "gof41.json") if args.out else ""
    RUN.each_cell(["gpt-oss"], lambda _: run_gpt_oss(args.ms, args.check_ms, dev, args.deadline, args.extra),
                  args.deadline)
    RESULT["switch_from_m"] = switch_from_m()
    RUN.summary.append(f"\nINTERLEAVED_TMA_FROM_M by the defaults rule: {RESULT['switch_from_m']}\n")
    return fpb40.plain_cells_and_table(PLAIN_CELLS, lambda preset: fpb40.run_plain(
        preset, dev, PLAIN_M, None, RUN, RESULT, len(header(args.extra).split("|")) - 5), dev, path, args.deadline + 15,
        RUN, RESULT)


if __name__ == "__main__":
    sys.exit(main())
