"""The cells, weights and variants of ``wol7_device_check.py`` (its module docstring describes them): the weight-only
Gluon GEMMs (``moekit/experts/triton_gluon_wo.py``) against the default, the decode it replaced and bf16.
``SMOKE`` (set by the check before importing this): tiny shapes."""

from __future__ import annotations

import sys

import torch

from moekit.bench.cells import Shape
from moekit.experts.triton import experts_triton
from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS, run_experts_wo_gluon
from moekit.experts.triton_wo import run_experts_wo, weight_args
from moekit.experts.triton_wo_plan import choose_decode
from wo_device_check import quantized

SMOKE = "--smoke" in sys.argv
SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")  # int4: group 128 with zero points (moekit bench's)
CELLS = (("mixtral-8x7b", 1024), ("qwen3-30b-a3b", 1024), ("deepseek-v3", 4096), ("mixtral-8x7b", 4096),
         ("qwen3-30b-a3b", 4096), ("deepseek-v3", 1024))

def shape_of(preset: str) -> Shape:
    return Shape(f"{preset}/smoke", 8, 128, 256, 2) if SMOKE else Shape.from_preset(preset)


class Weights:
    """One preset's weights, each built on first use: the int8, int4 and mxfp4 WoWeights (random, ``seed``; None:
    uninitialised, for compiling) and the bf16 weights the int8 ones dequantize to (uninitialised when compiling)."""

    def __init__(self, s: Shape, dev, seed: int | None):
        self.s, self.dev, self.seed, self.held = s, dev, seed, {}

    def wo(self, scheme: str) -> tuple:
        if scheme not in self.held:
            s, seed = self.s, self.seed
            seed2 = None if seed is None else seed + 1
            self.held[scheme] = (quantized(scheme, s.num_experts, 2 * s.n, s.k, self.dev, seed=seed),
                                 quantized(scheme, s.num_experts, s.k, s.n, self.dev, seed=seed2))
        return self.held[scheme]

    def args(self, scheme: str) -> tuple:
        return tuple(weight_args(w.q, w.scale, w.zero, w.group_size) for w in self.wo(scheme))

    def bf16(self) -> tuple:
        if "bf16" not in self.held:
            if self.seed is None:
                s = self.s
                self.held["bf16"] = (torch.empty(s.num_experts, 2 * s.n, s.k, device=self.dev, dtype=torch.bfloat16),
                                     torch.empty(s.num_experts, s.k, s.n, device=self.dev, dtype=torch.bfloat16))
            else:
                self.held["bf16"] = tuple((w.q.to(torch.bfloat16) * w.scale[:, :, None]).to(torch.bfloat16)
                                          for w in self.wo("int8_w8a16"))
        return self.held["bf16"]


def gluon_cell(scheme: str, s: Shape, m: int) -> bool:
    """Whether the default takes the weight-only Gluon path at this cell (``GLUON_WO_CELLS``; the H200 fits it)."""
    lo, hi = GLUON_WO_CELLS.get((scheme, s.num_experts, s.n, s.k), (0, 0))
    return lo <= m < hi


def variants(s: Shape, m: int, w: Weights) -> dict:
    """name -> (scheme or None for bf16, fn(inputs) -> out): bf16, then per scheme the default ("pick"), where the
    default is the Gluon path the decode the chooser picked before it ("prev", ``choose_decode``), else the Gluon
    path ("gluon")."""
    out = {"bf16": (None, lambda c: experts_triton(c.x, *w.bf16(), c.topk_ids, c.topk_weights))}
    for scheme in SCHEMES:
        tag = scheme.split("_")[0]
        out[f"pick_{tag}"] = (scheme, lambda c, sc=scheme: run_experts_wo(c.x, *w.args(sc), c.topk_ids,
                                                                             c.topk_weights, None, sc))
        if gluon_cell(scheme, s, m):
            prev = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
            out[f"prev_{tag}"] = (scheme, lambda c, sc=scheme, d=prev: run_experts_wo(
                c.x, *w.args(sc), c.topk_ids, c.topk_weights, None, sc, decode=d))
        else:
            out[f"gluon_{tag}"] = (scheme, lambda c, sc=scheme: run_experts_wo_gluon(
                c.x, *w.args(sc), c.topk_ids, c.topk_weights, None, sc))
    return out
