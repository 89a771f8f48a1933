"""The cells, weights and variants of ``wolean_device_check.py`` (its module docstring describes them): the
weight-only Gluon path through the lean launch (``moekit/experts/triton_gluon_wo_lean.py``) against its plain launch
and today's default decode, all three as the ``triton`` backend (or the path's own entry) is called.
``SMOKE`` (set by the check before importing this): tiny shapes."""

from __future__ import annotations

import os
import sys

import torch

import moekit.experts.triton_gluon_wo as tgw
from moekit.bench.cells import Shape
from moekit.experts.triton import experts_triton_unchecked
from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS, run_experts_wo_gluon
from moekit.experts.triton_wo import weight_args
from moekit.experts.triton_wo_plan import choose_decode
from moekit.quant.int4 import Int4Weight
from moekit.quant.int8 import Int8Weight
from moekit.quant.mxfp4 import Mxfp4Weight
from wo_device_check import quantized

SMOKE = "--smoke" in sys.argv
# (preset, M, schemes), in the order they run (a cell past the deadline is skipped): int4 groups of 128 with zero
# points (moekit bench's)
ALL_CELLS = (("qwen3-30b-a3b", 1024, ("int8_w8a16", "int4_w4a16", "mxfp4")),
             ("qwen3-30b-a3b", 2048, ("int8_w8a16", "int4_w4a16", "mxfp4")),
             ("qwen3-30b-a3b", 4096, ("int8_w8a16", "int4_w4a16", "mxfp4")),
             ("mixtral-8x7b", 1024, ("int4_w4a16", "mxfp4")),
             ("deepseek-v3", 1024, ("int8_w8a16",)),
             ("deepseek-v3", 2048, ("int8_w8a16",)),
             ("mixtral-8x7b", 4096, ("int4_w4a16", "mxfp4")))
# the cells checkpoint 1 took into GLUON_WO_CELLS (``--taken``: the merged run re-times them against "prev")
TAKEN_CELLS = (("qwen3-30b-a3b", 1024, ("int8_w8a16", "mxfp4")),
               ("qwen3-30b-a3b", 2048, ("int8_w8a16", "int4_w4a16", "mxfp4")),
               ("qwen3-30b-a3b", 4096, ("int8_w8a16",)),
               ("deepseek-v3", 2048, ("int8_w8a16",)))
CELLS = TAKEN_CELLS if os.environ.get("WOLEAN_CELLS") == "taken" else ALL_CELLS  # (the compile workers inherit it)


def shape_of(preset: str) -> Shape:
    return Shape(f"{preset}/smoke", 8, 128, 256, 2) if SMOKE else Shape.from_preset(preset)


def quantized_weight(w):
    """The ``moekit.quant`` object over a WoWeight's tensors (shared, not copied): what the backend takes."""
    cols = w.q.shape[2] * (1 if w.scheme == "int8_w8a16" else 2)
    if w.scheme == "int8_w8a16":
        return Int8Weight(q=w.q, scale=w.scale)
    if w.scheme == "int4_w4a16":
        return Int4Weight(q=w.q, scale=w.scale, zero=w.zero, group_size=w.group_size, cols=cols)
    return Mxfp4Weight(q=w.q, scale=w.scale, cols=cols)


class Weights:
    """One preset's weights per scheme, built on first use: the WoWeights (random, ``seed``; None: uninitialised,
    for compiling) and two QuantizedWeight pairs over the same tensors, one for the default's calls and one for the
    lean Gluon calls (the backend's fast-path entries are per weight object: each variant keeps its own)."""

    def __init__(self, s: Shape, dev, seed: int | None):
        self.s, self.dev, self.seed, self.held = s, dev, seed, {}

    def wo(self, scheme: str) -> tuple:
        if scheme not in self.held:
            s, seed = self.s, self.seed
            wo = (quantized(scheme, s.num_experts, 2 * s.n, s.k, self.dev, seed=seed),
                  quantized(scheme, s.num_experts, s.k, s.n, self.dev, seed=None if seed is None else seed + 1))
            self.held[scheme] = (wo, tuple(weight_args(w.q, w.scale, w.zero, w.group_size) for w in wo),
                                 tuple(map(quantized_weight, wo)), tuple(map(quantized_weight, wo)))
        return self.held[scheme]


def default_decode(scheme: str, s: Shape, m: int) -> str:
    """Today's default at this cell: "gluon" where ``GLUON_WO_CELLS`` takes it, else the chooser's decode."""
    lo, hi = GLUON_WO_CELLS.get((scheme, s.num_experts, s.n, s.k), (0, 0))
    return "gluon" if lo <= m < hi else choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)


def _backend(cells: dict):
    """A backend call (``experts_triton_unchecked``, the bench's) with ``cells`` as GLUON_WO_CELLS during it."""
    def call(c, w13, w2):
        saved, tgw.GLUON_WO_CELLS = tgw.GLUON_WO_CELLS, cells
        try:
            return experts_triton_unchecked(c.x, w13, w2, c.topk_ids, c.topk_weights)
        finally:
            tgw.GLUON_WO_CELLS = saved

    return call


def variant_names(scheme: str, s: Shape, m: int) -> tuple:
    """The variants of a cell in the order they run: "plain" first (the Gluon variants' outputs must equal its);
    "prev" where today's default is the Gluon path, else "lean"."""
    return ("plain", "default", "prev") if default_decode(scheme, s, m) == "gluon" else ("plain", "default", "lean")


def variants(scheme: str, s: Shape, m: int, w: Weights) -> dict:
    """name -> fn(inputs) -> out (``variant_names``): "plain" (the Gluon path's plain launches,
    ``run_experts_wo_gluon(lean=False)``), "default" (the backend with today's GLUON_WO_CELLS), "lean" (the backend
    with this cell in GLUON_WO_CELLS: the Gluon path's lean launch, repeated calls from the backend's fast-path entry)
    or, where the default is already that, "prev" (the backend with this shape out of GLUON_WO_CELLS: the chooser's
    decode it replaced)."""
    key = (scheme, s.num_experts, s.n, s.k)
    today = _backend(dict(GLUON_WO_CELLS))
    taken = _backend({**GLUON_WO_CELLS, key: (m, m + 1)})
    before = _backend({k: v for k, v in GLUON_WO_CELLS.items() if k != key})
    fns = {"plain": lambda c: run_experts_wo_gluon(c.x, *w.wo(scheme)[1], c.topk_ids, c.topk_weights, None, scheme,
                                                   lean=False),
           "default": lambda c: today(c, *w.wo(scheme)[2]),
           "lean": lambda c: taken(c, *w.wo(scheme)[3]),
           "prev": lambda c: before(c, *w.wo(scheme)[3])}
    return {name: fns[name] for name in variant_names(scheme, s, m)}
