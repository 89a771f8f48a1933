"""Issue #15, session 42 (brief gfp42): gpt-oss's fp8 experts on the fp8 Gluon path at prefill (b13 / b2, interleaved
gate/up rows, silu alpha 1.702 / limit 7 / up + 1, N = K = 2880 past a multiple of 128) against main's route (the fused
Triton fp8 kernels, interleaved rows by TMA) and bf16.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gfp42_device_check.py --out $OUT/gfp42 --deadline 55   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/gfp42_device_check.py --smoke     # CPU: interpreter, the GEMMs' torch stand-ins

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4; the smoke:
E 8, K 128, N 64, top-2), quantized to fp8_block. The arms, each with the biases and the spec:
  main     ``run_experts(backend="triton")`` as main routes it (``Fp8GluonChoice.variants`` off: the fused Triton fp8
           kernels)
  gluon    the fp8 Gluon path (``experts_gluon_fp8``, its lean launch: what the route launches with the switch on)
  bf16     the bf16 route on the dequantized weights
  correct  at M = 1024, 4096 (``--check-ms``; the smoke: 9, 33): main and gluon against the reference backend's fp8
           recipe, gluon against its torch twin (``experts_gluon_fp8_twin``: the same roundings), bf16 against the
           reference on the dequantized weights (rel-L2 < TOL each); the route with the switch on (PASS where it took
           the Gluon path exactly where ``Fp8GluonChoice.wants`` the call, and is right)
  timing   CUDA graphs at M = 2048, 4096, 8192 (``--ms``) in ROUNDS settled rounds, median µs; none started past the
           deadline; then at M = 4096 the route eagerly (switch off / on: the lean launch's host time counted), host
           and wall µs a call (``bench_run.host_and_wall_us``)
Then plain fp8 Mixtral-8x7B and Qwen3-30B-A3B at M = 4096 (no biases, plain silu: the fp8 Gluon path, its kernels main's
SASS on Triton 3.6 and 3.9; their µs read against earlier runs of the card).
The table last, then ``Fp8GluonChoice.variants by the defaults rule``: True where every check PASSed and gluon was >= 3%
faster than main in every round at every timed M (the route takes the path from 3e11 FLOPs: gpt-oss M >= 2048).
"""

from __future__ import annotations

import dataclasses
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
from bench_run import RunLog, host_and_wall_us, rel_l2  # noqa: E402

MS = (9, 33) if SMOKE else (2048, 4096, 8192)
CHECK_MS = (9, 33) if SMOKE else (1024, 4096)
EAGER_M = 33 if SMOKE else 4096
ROUNDS, REPLAYS = (1, 1) if SMOKE else (5, 3)
TOL, TWIN_TOL = 2e-2, 1e-2  # bf16 out, an e4m3 midpoint flip now and then; the twin rounds as the kernels do
EAGER_CALLS = 2 if SMOKE else 20
PLAIN_M = 9 if SMOKE else 4096
PLAIN_CELLS = ("mixtral-8x7b", "qwen3-30b-a3b")
ARMS = ("main", "gluon", "bf16")
RUN = RunLog("gfp42: gpt-oss experts in fp8_block on the fp8 Gluon path at prefill, graph µs, median of settled "
             "rounds", stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"run": {}, "checks": {}, "eager": {}, "plain": {}, "failed": RUN.failed}


_CHOICES: dict = {}  # on -> the choice: one object each (the fused path's kept entries check the choice by identity)


def switched(on: bool):
    """The route's choice with ``variants`` on or off (the smoke: from any size, its shapes are tiny); the module's
    own where it is that one."""
    import moekit.experts.triton_gluon_fp8 as tgf

    if on not in _CHOICES:
        base = tgf.Fp8GluonChoice(min_flops=1, min_rows_per_expert=0) if SMOKE else tgf.DEFAULT_FP8_CHOICE
        choice = dataclasses.replace(base, variants=on)
        _CHOICES[on] = tgf.DEFAULT_FP8_CHOICE if choice == tgf.DEFAULT_FP8_CHOICE else choice
    return _CHOICES[on]


def route(w: dict, x, ids, weights, on: bool):
    """``run_experts`` on the triton backend with the switch ``on`` (the module's choice restored after)."""
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts import run_experts

    kept, tgf.DEFAULT_FP8_CHOICE = tgf.DEFAULT_FP8_CHOICE, switched(on)
    try:
        return run_experts(x, w["q13"], w["q2"], ids, weights, activation=gpt39.SPEC, b13=w["b13"], b2=w["b2"],
                           backend="triton")
    finally:
        tgf.DEFAULT_FP8_CHOICE = kept


def arms(w: dict, x, ids, weights) -> dict:
    """name -> the call (``ARMS``)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    q13, q2, biases = w["q13"], w["q2"], dict(b13=w["b13"], b2=w["b2"])
    return {"main": lambda: route(w, x, ids, weights, False),
            "gluon": lambda: experts_gluon_fp8(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights,
                                               activation=gpt39.SPEC, **biases),
            "bf16": lambda: run_experts(x, w["d13"], w["d2"], ids, weights, activation=gpt39.SPEC, backend="triton",
                                        **biases)}


def check(w: dict, m: int, dev) -> None:
    """Each arm against its reference, gluon against the twin, the route with the switch on: a PASS / FAIL line each."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin, gluon_fp8_takes

    x, ids, weights = gpt39.inputs(m, dev)
    q13, q2 = w["q13"], w["q2"]
    with torch.no_grad():
        want = fpb40.references(w, x, ids, weights)
        outs = {name: fn() for name, fn in arms(w, x, ids, weights).items()}
        errs = {name: rel_l2(out, want["bf16" if name == "bf16" else "new"]) for name, out in outs.items()}
        twin = experts_gluon_fp8_twin(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, activation=gpt39.SPEC,
                                      b13=w["b13"], b2=w["b2"])
        errs["gluon vs twin"] = rel_l2(outs["gluon"], twin)
        errs["route (switch on)"] = rel_l2(route(w, x, ids, weights, True), want["new"])
    on, off = switched(True), switched(False)
    wants = on.wants(m, ids.shape[1], q2.shape[2], x.shape[1], q2.shape[0])
    takes = gluon_fp8_takes(x, q13, q2, weights, gpt39.SPEC, w["b13"], w["b2"], on)
    RUN.check(f"gpt-oss fp8 M={m} route (switch on) takes the Gluon path where the choice wants the call "
              f"({wants})", takes == wants and not gluon_fp8_takes(x, q13, q2, weights, gpt39.SPEC, w["b13"], w["b2"],
                                                                    off))
    for name, err in errs.items():
        tol = TWIN_TOL if name == "gluon vs twin" else TOL
        RUN.check(f"gpt-oss fp8 M={m} {name}", err < tol, f"rel_l2={err:.2e}")
    RESULT["checks"][m] = errs


def eager_row(w: dict, dev) -> None:
    """The route eagerly at EAGER_M, switch off / on: host and wall µs a call, median of the rounds."""
    x, ids, weights = gpt39.inputs(EAGER_M, dev)
    with torch.no_grad():
        fns = {"main": lambda: route(w, x, ids, weights, False), "gluon": lambda: route(w, x, ids, weights, True)}
        for fn in fns.values():  # compiled, plans kept
            fn()
        got = host_and_wall_us(fns, dev, EAGER_CALLS, ROUNDS)
    RESULT["eager"] = {name: {"host_us": h, "wall_us": wall} for name, (h, wall) in got.items()}
    med = {name: (statistics.median(h), statistics.median(wall)) for name, (h, wall) in got.items()}
    RUN.log("eager M=%d: " % EAGER_M + ", ".join(f"{n} host {h:.1f} / wall {wl:.1f} µs" for n, (h, wl) in med.items()))
    (host_main, wall_main), (host_gluon, wall_gluon) = med["main"], med["gluon"]
    RUN.summary.append(f"| eager {EAGER_M} (host / wall) | {host_main:.1f} / {wall_main:.1f} | {host_gluon:.1f} / "
                       f"{wall_gluon:.1f} | - | wall x{wall_main / wall_gluon:.3f} "
                       f"({faster_rounds(got['gluon'][1], got['main'][1])}/{ROUNDS}) | - | - |")


def run_gpt_oss(ms: tuple, check_ms: tuple, dev, deadline: float) -> None:
    w = gpt39.layer("fp8_block", dev)
    RUN.log("gpt-oss: weights quantized to fp8_block")
    for m in check_ms:
        check(w, m, dev)
    RUN.log("checked")
    for m in gpt39.reached("fp8_block", ms, deadline, len(ARMS) + 2):
        x, ids, weights = gpt39.inputs(m, dev)
        us, eager = gpt39.graph_rounds(arms(w, x, ids, weights), dev, deadline, ROUNDS, REPLAYS)
        RESULT["run"][m] = {"us": us, "eager_timed": eager}
        med, mark = gpt39.medians(f"gpt-oss fp8 M={m}", us, eager)
        RUN.summary.append(
            f"| {m} | " + " | ".join(f"{med[a]:.1f}{mark[a]}" for a in ARMS)
            + f" | x{med['main'] / med['gluon']:.3f} ({faster_rounds(us['gluon'], us['main'])}/{len(us['gluon'])})"
            + f" | {med['gluon'] / med['bf16']:.2f} | {med['main'] / med['bf16']:.2f} |")
    if RUN.elapsed() < deadline:
        eager_row(w, dev)


HEADER = "| M | main µs | gluon µs | bf16 µs | main / gluon (rounds >= 3%) | gluon / bf16 | main / bf16 |"


def variants_by_rule() -> bool:
    """``Fp8GluonChoice.variants`` by the defaults rule: every check PASS, every M of ``MS`` timed, gluon >= 3% faster
    than main in every round at each."""
    runs = RESULT["run"]
    return (not RUN.failed and len(runs) == len(MS)
            and all(faster_rounds(r["us"]["gluon"], r["us"]["main"]) == ROUNDS for r in runs.values()))


def main() -> int:
    p = gpt39.parser(__doc__.split("\n")[0], 55.0, ("fp8_block",), MS)
    p.add_argument("--check-ms", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=CHECK_MS)
    args = p.parse_args()
    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:  # the Gluon GEMMs do not run in the interpreter: the tests' torch stand-ins take their launches
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from _gluon_fakes import install_fakes

        install_fakes()
    gpt39.begin(RESULT, args.ms, HEADER)
    path = os.path.join(args.out, "gfp42.json") if args.out else ""
    RUN.each_cell(["gpt-oss"], lambda _: run_gpt_oss(args.ms, args.check_ms, dev, args.deadline), args.deadline)
    RESULT["variants_by_rule"] = variants_by_rule()
    RUN.summary.append(f"\nFp8GluonChoice.variants by the defaults rule: {RESULT['variants_by_rule']}\n")
    blanks = len(HEADER.split("|")) - 5
    return fpb40.plain_cells_and_table(PLAIN_CELLS, lambda preset: fpb40.run_plain(
        preset, dev, PLAIN_M, None, RUN, RESULT, blanks), dev, path, args.deadline + 15, RUN, RESULT)


if __name__ == "__main__":
    sys.exit(main())
