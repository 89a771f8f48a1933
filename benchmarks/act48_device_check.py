"""Session 48 (brief act48): the clamp after the activation (``ActivationSpec.limit_after_act``, the kernels'
LIMIT_AFTER constexpr: Step-3.7, Bailing-Hybrid) on the GPU. It only has to show the flag is right and costs nothing.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/act48_device_check.py --out $OUT/act48 --deadline 72    # GPU
    PYTHONPATH=$PWD python3 benchmarks/act48_device_check.py --smoke    # CPU, interpreted: the Triton picks at M = 4
    ... act48_device_check.py --out $OUT/act48b --deadline 72 --phases gain    # the pick against grouped_mm

A Step-3.7-like layer: 64 local experts (an EP slice of Step-3.7-Flash's 288), top-8, hidden 4096, expert width 1280;
silu clamped at LIMIT = 1.0 (it bites on unit-variance gate-up sums; at Step-3.7's larger limits silu(L) ~ L and the
two places hardly differ, so no check could tell them apart). Every check runs both places, the clamp before the
activation (gpt-oss's, ``limit_after_act=False``) and after it, and first checks that the two twins differ (> 10 TOL).
First the Gluon kernels, which run nowhere else (the interpreter cannot run Gluon):
  gluon_fp8   ``experts_gluon_fp8`` (its gate-up's ``_variant_h``) at M = 1024 against ``experts_gluon_fp8_twin``
  words       ``run_experts_wo(decode="gluon_words")`` (``words_glu.store_h``) on int4 at M = 1 and 64 against
              ``fused_experts_wo_torch``
then the backend's pick (``experts_triton``: bf16 weights, ``fp8_block``, ``int4_w4a16``; whatever path the route
takes at that M) at M = 1, 64, 1024, called before, after, before, after (the plans, kept sequences and compiled
kernels of the two places must stay apart), each call against its twin (bf16: ``experts_reference``, float32). Then
CUDA graphs of the pick, after against before, each cell's two graphs in shuffled rounds (median µs a call, the
rounds the after-act one took >= 3% longer). Last, where time is left (``--phases gain`` runs it alone), what the
change gives such a layer: the pick against ``grouped_mm`` (``backend="auto"``'s choice for it on CUDA before session
48), the clamp after the activation, both checked against the twin, eager wall µs a call. Table last; JSON
<out>/act48.json.
"""

from __future__ import annotations

import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import eager_us, graph_of, medians, settled, shuffled, wins  # noqa: E402
from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases  # noqa: E402
from wo_device_check import quantized  # noqa: E402

from moekit.activations import ActivationSpec  # noqa: E402

E, K, N, TOP_K = (8, 256, 256, 2) if SMOKE else (64, 4096, 1280, 8)
LIMIT = 1.0
SPECS = {"before": ActivationSpec("silu", limit=LIMIT), "after": ActivationSpec("silu", limit=LIMIT,
                                                                                limit_after_act=True)}
BATCHES = (4,) if SMOKE else (1, 64, 1024)
SCHEMES = ("bf16", "fp8_block", "int4_w4a16")
TOL, SETS, ROUNDS, REPLAYS = 2e-2, 2, 7, 3
RUN = RunLog("act48: graph µs a call of the pick, the clamp after the activation vs before (Step-3.7-like layer)")


def weights(scheme: str, dev):
    """(w13, w2) as ``experts_triton`` takes them (bf16 tensors or ``moekit.quant`` objects) and as the twin does
    (bf16 tensors, fp8's (q, scale) pairs, int4's ``WoWeight``s)."""
    if scheme == "int4_w4a16":
        from moekit.quant.int4 import Int4Weight

        w13, w2 = quantized(scheme, E, 2 * N, K, dev, seed=1), quantized(scheme, E, K, N, dev, seed=2)
        return (Int4Weight(q=w13.q, scale=w13.scale, zero=w13.zero, group_size=w13.group_size, cols=K),
                Int4Weight(q=w2.q, scale=w2.scale, zero=w2.zero, group_size=w2.group_size, cols=N)), (w13, w2)
    g = torch.Generator(device=dev).manual_seed(1)
    w13 = (torch.randn(E, 2 * N, K, generator=g, device=dev) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g, device=dev) * N**-0.5).bfloat16()
    if scheme == "bf16":
        return (w13, w2), (w13, w2)
    from moekit.quant import quantize

    q13, q2 = (quantize(w, scheme, block_shape=(128, 128)) for w in (w13, w2))
    return (q13, q2), ((q13.q, q13.scale), (q2.q, q2.scale))


def routing(m: int, dev, seed: int):
    """(x [M, K] bf16 ~ N(0, 1), ids [M, k]: k distinct experts a token, weights [M, k] softmax)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(m, K, generator=g, device=dev).bfloat16()
    ids = torch.rand(m, E, generator=g, device=dev).argsort(dim=1)[:, :TOP_K].int()
    return x, ids, torch.softmax(torch.rand(m, TOP_K, generator=g, device=dev), dim=1)


def twin(scheme: str, ref, x, ids, w, spec) -> torch.Tensor:
    """The scheme's torch twin of the call."""
    if scheme == "bf16":
        from moekit.experts.reference import experts_reference

        return experts_reference(x, *ref, ids, w, activation=spec)
    if scheme == "fp8_block":
        from moekit.experts.triton_fp8 import fused_experts_fp8_torch

        return fused_experts_fp8_torch(x, *ref[0], *ref[1], ids, w, activation=spec)
    from moekit.experts.triton_wo import fused_experts_wo_torch

    return fused_experts_wo_torch(x, *ref, ids, w, activation=spec)


def checked(label: str, call, want: dict, order=("before", "after", "before", "after")) -> bool:
    """``call(spec)`` for the places in ``order``, each against its twin; the twins first checked apart."""
    apart = rel_l2(want["after"].float(), want["before"].float())
    ok = RUN.check(f"{label} twins apart", apart > 10 * TOL, f"rel-L2 after vs before {apart:.2e}")
    for place in order:
        err = rel_l2(call(SPECS[place]).float(), want[place].float())
        ok = RUN.check(f"{label} {place}", err <= TOL, f"rel-L2 {err:.2e}") and ok
    return ok


def gluon_checks(dev) -> None:
    """The Gluon kernels first: the fp8 GEMMs' ``_variant_h`` (M = 1024) and the words decode (int4, M = 1, 64)."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, experts_gluon_fp8_twin, gluon_fp8_supported
    from moekit.experts.triton_wo import run_experts_wo
    from moekit.experts.triton_wo_plan import weight_args

    if gluon_fp8_supported(dev):
        _, ((q13, s13), (q2, s2)) = weights("fp8_block", dev)
        x, ids, w = routing(1024, dev, 5)
        want = {p: experts_gluon_fp8_twin(x, q13, s13, q2, s2, ids, w, activation=s) for p, s in SPECS.items()}
        checked("gluon_fp8 M=1024", lambda s: experts_gluon_fp8(x, q13, s13, q2, s2, ids, w, activation=s), want)
    else:
        RUN.summary.append("gluon_fp8: not run (no Hopper GPU with Gluon)")
    _, (w13, w2) = weights("int4_w4a16", dev)
    a13, a2 = (weight_args(v.q, v.scale, v.zero, v.group_size) for v in (w13, w2))
    for m in (1, 64):
        x, ids, w = routing(m, dev, 6 + m)
        want = {p: twin("int4_w4a16", (w13, w2), x, ids, w, s) for p, s in SPECS.items()}
        checked(f"words int4 M={m}", lambda s: run_experts_wo(x, a13, a2, ids, w, None, "int4_w4a16", s,
                                                             decode="gluon_words"), want)


_WEIGHTS: dict = {}  # scheme -> its weights: the checks' and, after them, the graphs'


def pick_cell(scheme: str, m: int, dev, timed: dict) -> None:
    """The pick's checks at M; where they pass (on the GPU), the cell's calls for the graphs into ``timed``."""
    from moekit.experts.triton import experts_triton

    if scheme not in _WEIGHTS:
        _WEIGHTS[scheme] = weights(scheme, dev)
    (w13, w2), ref = _WEIGHTS[scheme]
    sets = [routing(m, dev, 100 * m + i) for i in range(SETS)]
    x, ids, w = sets[0]
    want = {p: twin(scheme, ref, x, ids, w, s) for p, s in SPECS.items()}
    label = f"pick {scheme} M={m}"
    if checked(label, lambda s: experts_triton(x, w13, w2, ids, w, activation=s), want) and dev.type == "cuda":
        timed[label] = {p: [lambda c=c, s=s: experts_triton(c[0], w13, w2, c[1], c[2], activation=s) for c in sets]
                        for p, s in SPECS.items()}


def time_cell(label: str, calls: dict, dev, stop: float, results: list) -> None:
    """The cell's two graphs (before, after) in shuffled rounds until ``stop``: medians, the rounds after lost."""
    if time.time() > stop:
        RUN.summary.append(f"{label}: checked, not timed (deadline)")
        return
    graphs = {place: graph_of(fns, dev) for place, fns in calls.items()}
    rounds = settled({p: (g, None) for p, g in graphs.items()}, SETS, dev, ROUNDS, REPLAYS, stop, order=shuffled)
    times = medians(rounds)
    slower = wins(rounds["before"], rounds["after"])  # rounds the after-act graph took >= 3% longer
    RUN.summary.append(f"{label}: before {times['before']:.1f} µs, after {times['after']:.1f} µs, after / before "
                       f"x{times['after'] / times['before']:.3f} (>= 3% slower in {slower}/{len(rounds['after'])})")
    results.append({"cell": label, "graph_us": times, "rounds": rounds})


def gain_cell(scheme: str, m: int, dev, results: list) -> None:
    """What the change gives a Step-3.7 layer: its pick (the Triton kernels, clamp after the activation) against
    ``grouped_mm`` (what ``backend="auto"`` ran for it on CUDA before session 48: torch GEMMs, quantized weights
    dequantized per call), both checked against the twin, then eager wall µs a call (``bench_rounds.eager_us``)."""
    from moekit.experts import backend_fn
    from moekit.experts.triton import experts_triton

    if scheme not in _WEIGHTS:
        _WEIGHTS[scheme] = weights(scheme, dev)
    (w13, w2), ref = _WEIGHTS[scheme]
    sets, spec, label = [routing(m, dev, 100 * m + i) for i in range(SETS)], SPECS["after"], f"gain {scheme} M={m}"
    runs = {"triton": lambda c: experts_triton(c[0], w13, w2, c[1], c[2], activation=spec),
            "grouped_mm": lambda c: backend_fn("grouped_mm", dev)(c[0], w13, w2, c[1], c[2], activation=spec)}
    want = twin(scheme, ref, *sets[0], spec).float()
    errs = {name: rel_l2(run(sets[0]).float(), want) for name, run in runs.items()}
    if not all([RUN.check(f"{label} {n}", e <= TOL, f"rel-L2 {e:.2e}") for n, e in errs.items()]) or dev.type != "cuda":
        return
    us = eager_us({name: [lambda c=c, run=run: run(c) for c in sets] for name, run in runs.items()}, 3, 4)
    wall = {name: pair[1] for name, pair in us.items()}
    RUN.summary.append(f"{label}: eager wall µs triton {wall['triton']:.1f}, grouped_mm {wall['grouped_mm']:.1f} "
                       f"(x{wall['grouped_mm'] / wall['triton']:.2f})")
    results.append({"cell": label, "eager_host_wall_us": us})


def main() -> int:
    dev, result, timed = torch.device("cpu" if SMOKE else "cuda"), {"cells": []}, {}
    phases = {"gluon": lambda: gluon_checks(dev),
              "picks": lambda: RUN.each_cell([(scheme, m) for m in BATCHES for scheme in SCHEMES],
                                             lambda cell: pick_cell(*cell, dev, timed), args.deadline - 8),
              "graphs": lambda: RUN.each_cell(list(timed), lambda label: time_cell(label, timed[label], dev, stop_at,
                                                                                   result["cells"]), args.deadline),
              "gain": lambda: RUN.each_cell([(scheme, m) for m in BATCHES for scheme in SCHEMES],
                                            lambda cell: gain_cell(*cell, dev, result["cells"]), args.deadline - 4)}
    args = phase_args(__doc__, phases, "act48.json")
    stop_at = time.time() + args.deadline - 6 - RUN.elapsed()  # the graphs' rounds stop by it
    result.update(run_info(), limit=LIMIT, shape=dict(E=E, K=K, N=N, top_k=TOP_K))
    RUN.log(f"E={E} K={K} N={N} top-{TOP_K}, limit {LIMIT}; {run_info()}")
    names = [name for name in args.phases if not (SMOKE and name == "gluon")]  # Gluon: CUDA only
    with torch.no_grad():
        return run_phases(RUN, phases, names, args.deadline, {"gluon": 8, "picks": 8, "graphs": 6, "gain": 6},
                          args.path, result)


if __name__ == "__main__":
    sys.exit(main())
