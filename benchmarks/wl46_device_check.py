"""Issue #16 target 1, session 46 (brief wl46): the words decode's lean eager launch against the route's pick's
(``moekit/experts/triton_wo_words_lean.py``), and mxfp4 on the words loop (``_kernels/words_mx.py``) against the pick.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wl46_device_check.py --out $OUT/wl46 --deadline 72     # GPU
    PYTHONPATH=$PWD python3 benchmarks/wl46_device_check.py --smoke     # CPU, interpreted: the pick and twin only
    ... wl46_device_check.py --out $OUT/wl46b --deadline 72 --presets gpt-oss-20b    # its cells alone (CK2)

Cells: DeepSeek-V3 M = 1, Mixtral M = 8, DeepSeek-V3 M = 8, Mixtral M = 1, each in int4_w4a16 then mxfp4 (random
codes; int4 random scales and zero points, groups of 128; mxfp4 e8m0 scales around the unit-variance one), then
gpt-oss-20b mxfp4 M = 1 and 8 as it ships (b13, b2, the clamped SwiGLU on interleaved rows; its K = N = 2880 is no
multiple of 256: the route's words run a kept copy padded to 3072, ``triton_wo_words_pad``; w4u45's form refuses it).
First, per cell, PASS / FAIL against ``fused_experts_wo_torch`` (rel-L2 <= TOL) of:
  words        ``run_experts_wo(decode="gluon_words")``: the plan; from its third call the recorded sequence
  words_before w4u45's form (``experts_words`` with ``words_layout``: the layout, x_words, h, y and out allocated
               and four cached launches a call)
  pick         ``experts_triton`` on the ``moekit.quant`` weights: the route's choice, its lean path from the third
               call (``triton_quant_fast``)
and that the words lean call equals its first (plan) call bit for bit. Then per cell: eager wall and host µs a call
(EAGER_CALLS calls from an idle GPU, median of EAGER_ROUNDS rounds, the variants interleaved), then CUDA graphs of
words and pick over SETS input sets (ROUNDS rounds shuffled, median µs a call), % of the packed floor (touched w13 +
w2 bytes at the copy rate measured first). Table last; JSON <out>/wl46.json. Cells past the deadline: "not reached".
"""

from __future__ import annotations

import math
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import graph_of, medians, settled, shuffled, wins  # noqa: E402
from bench_run import RunLog, check_parser, run_info, write_json  # noqa: E402
from decode_q3_device_check import measure_copy, rel_l2  # noqa: E402
from wo_device_check import quantized  # noqa: E402

from moekit.activations import ActivationSpec  # noqa: E402
from moekit.bench.cells import Shape, make_sets  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402
from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_plan import weight_args  # noqa: E402
from moekit.experts.triton_wo_words import check_words, down_split, experts_words, words_layout  # noqa: E402
from moekit.quant.int4 import Int4Weight  # noqa: E402
from moekit.quant.mxfp4 import Mxfp4Weight  # noqa: E402

# both schemes early (mxfp4's words run on a GPU for the first time here), then the other M, then gpt-oss
CELLS = [(p, s, m) for p, m in (("deepseek-v3", 1), ("mixtral-8x7b", 8), ("deepseek-v3", 8), ("mixtral-8x7b", 1))
         for s in ("int4_w4a16", "mxfp4")]
CELLS += [("gpt-oss-20b", "mxfp4", 1), ("gpt-oss-20b", "mxfp4", 8)]
SETS, ROUNDS, REPLAYS, TOL = 2, 3, 3, 1e-2
EAGER_CALLS, EAGER_ROUNDS = 24, 3
RUN = RunLog("wl46: whole calls, eager wall / host µs a call and graph µs; % of the w13 + w2 byte floor")


_KEPT: dict = {}  # the last cell's weights (its preset and scheme): the next M reuses them


def weights(s: Shape, scheme: str, dev, seed: int = 1):
    """(WoWeight w13, w2) of random codes: int4 scales x0.5-1.5 and zero points 0-15; mxfp4 scales -2..+1 around
    the unit-variance exponent (``quantized``'s). Kept for the next cell of the same shape and scheme."""
    if (s, scheme) in _KEPT:
        return _KEPT[(s, scheme)]
    _KEPT.clear()
    out = []
    for i, (rows, cols) in enumerate(((2 * s.n, s.k), (s.k, s.n))):
        w = quantized(scheme, s.num_experts, rows, cols, dev, seed=seed + i)
        g = torch.Generator(device=dev).manual_seed(seed + 7 + i)
        if scheme == "int4_w4a16":
            w.scale.mul_(torch.rand(w.scale.shape, generator=g, device=dev) + 0.5)
            w.zero.copy_(torch.randint(0, 16, w.zero.shape, generator=g, device=dev, dtype=torch.uint8))
        else:
            w.scale.add_(torch.randint(0, 4, w.scale.shape, generator=g, device=dev, dtype=torch.uint8)).sub_(2)
        out.append(w)
    _KEPT[(s, scheme)] = out
    return out


def as_quant(w, cols: int):
    """The ``moekit.quant`` object of a WoWeight (what a model's layer holds: the backend's pick takes it)."""
    if w.scheme == "int4_w4a16":
        return Int4Weight(q=w.q, scale=w.scale, zero=w.zero, group_size=w.group_size, cols=cols)
    return Mxfp4Weight(q=w.q, scale=w.scale, cols=cols)


def floor_us(s: Shape, scheme: str, ids: torch.Tensor, copy_tbps: float) -> float:
    """The touched experts' w13 + w2 bytes (codes, scales, zero points) at the copy rate."""
    per_col = 0.5 + (1 / 32 if scheme == "mxfp4" else 5 / 128)  # bytes a weight
    return ids.unique().numel() * 3 * s.n * s.k * per_col / (copy_tbps * 1e12) * 1e6


def eager_walls(fns: dict, dev) -> dict:
    """name -> (wall µs a call, host µs a call): each variant's calls from an idle GPU, the variants interleaved a
    round, the median of EAGER_ROUNDS."""
    got = {name: ([], []) for name in fns}
    for _ in range(EAGER_ROUNDS):
        for name, calls in fns.items():
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            for i in range(EAGER_CALLS):
                calls[i % len(calls)]()
            t1 = time.perf_counter()
            torch.cuda.synchronize(dev)
            got[name][0].append((time.perf_counter() - t0) / EAGER_CALLS * 1e6)
            got[name][1].append((t1 - t0) / EAGER_CALLS * 1e6)
    return {name: tuple(sorted(v)[len(v) // 2] for v in pair) for name, pair in got.items()}


def gpt_oss_call(s: Shape, dev) -> dict:
    """gpt-oss's experts as they ship beside the weights: b13 / b2 (random, ~unit) and its clamped SwiGLU on
    interleaved rows; other presets: plain SiLU."""
    if not s.name.startswith("gpt-oss"):
        return {}
    g = torch.Generator(device=dev).manual_seed(3)
    return dict(activation=ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0),
                b13=torch.randn(s.num_experts, 2 * s.n, generator=g, device=dev).bfloat16(),
                b2=torch.randn(s.num_experts, s.k, generator=g, device=dev).bfloat16())


def checked_calls(label: str, s: Shape, scheme: str, sets: list, w13, w2) -> dict:
    """The PASS / FAIL lines on set 0; name -> [a call per set] of the variants that passed."""
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    q13, q2 = as_quant(w13, s.k), as_quant(w2, s.n)
    extra = gpt_oss_call(s, sets[0].x.device)
    spec = extra.get("activation", "silu")
    makers = {"pick": lambda c: experts_triton(c.x, q13, q2, c.topk_ids, c.topk_weights, **extra),
              "words": lambda c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, spec,
                                                decode="gluon_words", b13=extra.get("b13"), b2=extra.get("b2"))}
    try:
        check_words(sets[0].x, a13, s.top_k)
        if extra:
            raise ValueError("no biases or activation variant in w4u45's form")
    except ValueError as e:  # gpt-oss's 2880: the route's words run a padded copy, w4u45's form none
        RUN.summary.append(f"{label}: words on the padded copy; words_before refused ({str(e)[:70]})")
    else:
        def before(c):
            layout = words_layout(c.topk_ids, s.num_experts)
            blocks = c.topk_ids.numel() if layout is None else layout.expert_ids.numel()
            return experts_words(c.x, a13, a2, c.topk_ids, c.topk_weights, layout, down_split(s.n, s.k, blocks))

        makers["words_before"] = before
    c0 = sets[0]
    twin = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights, **extra).float()
    fns = {}
    for name, make in makers.items():
        if SMOKE and name != "pick":
            continue
        outs = [make(c0) for _ in range(3)]  # plan (compiles), records, lean
        err = rel_l2(outs[0].float(), twin)
        same = all(torch.equal(o, outs[0]) for o in outs)
        if RUN.check(f"{label} {name}", err <= TOL and (same or name == "words_before"),
                     f"rel-L2 {err:.2e}, lean calls equal the first: {same}"):
            fns[name] = [lambda c=c, make=make: make(c) for c in sets]
    return fns


def preset_shape(preset: str) -> Shape:
    """Any published preset's shape (``Shape.from_preset`` knows the bench's three; gpt-oss is not one)."""
    c = MoEConfig.preset(preset)
    return Shape(preset, c.num_experts, c.moe_intermediate_size, c.hidden_size, c.top_k)


def run_cell(preset: str, scheme: str, m: int, dev, copy_tbps: float, stop: float, results: list) -> None:
    s = Shape(f"{preset}/smoke", 8, 256, 512, 2) if SMOKE else preset_shape(preset)
    label = f"{preset} {scheme} M={m}"
    w13, w2 = weights(s, scheme, dev)
    sets = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    fns = checked_calls(label, s, scheme, sets, w13, w2)
    if dev.type != "cuda" or not fns:
        return
    walls = eager_walls(fns, dev)
    timed = {n: f for n, f in fns.items() if n != "words_before"}
    graphs = {name: graph_of(f, dev) for name, f in timed.items()}
    rounds = settled({n: (g, None) for n, g in graphs.items()}, len(sets), dev, ROUNDS, REPLAYS, stop, order=shuffled)
    del graphs
    times = medians(rounds)
    floor = sum(floor_us(s, scheme, c.topk_ids, copy_tbps) for c in sets) / len(sets)
    results.append({"cell": label, "floor_us": floor, "graph_us": times, "rounds": rounds,
                    "eager_wall_host_us": walls})
    line = f"{label} (floor {floor:.1f}): graph " + ", ".join(f"{n} {t:.1f} ({100 * floor / t:.0f}%)"
                                                             for n, t in times.items())
    if "words" in times and "pick" in times and not math.isnan(times["words"]):
        line += f", x{times['pick'] / times['words']:.2f} {wins(rounds['words'], rounds['pick'])}/{len(rounds['pick'])}"
    line += "; eager wall/host " + ", ".join(f"{n} {w:.1f}/{h:.1f}" for n, (w, h) in walls.items())
    RUN.summary.append(line)


def main(args) -> int:
    dev, results = torch.device("cpu" if SMOKE else "cuda"), []
    copy_tbps = 0.0 if SMOKE else measure_copy(dev)
    stop_at = time.time() + args.deadline - RUN.elapsed()  # the graphs' rounds stop by it
    RUN.log(f"copy {copy_tbps:.2f} TB/s; {run_info()}")

    def one(cell: tuple) -> None:
        with torch.no_grad():
            run_cell(*cell, dev, copy_tbps, stop_at, results)

    def after() -> None:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            write_json(os.path.join(args.out, "wl46.json"), {**run_info(), "copy_tbps": copy_tbps, "cells": results})

    cells = [c for c in CELLS if not args.presets or c[0] in args.presets]
    RUN.each_cell(cells[:1] if SMOKE else cells, one, args.deadline - 8, after)
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    p = check_parser(deadline=72.0)
    p.add_argument("--presets", nargs="+", default=[], help="these presets' cells only (a second call: gpt-oss-20b)")
    sys.exit(main(p.parse_args()))
