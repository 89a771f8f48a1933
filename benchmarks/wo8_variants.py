"""The cells, weights and timed calls of ``wo8_device_check.py`` (its docstring describes them): the weight-only
Gluon GEMMs' session-28 variants (``GluonWoOptions``: split, fast) against the session-27 kernel ("base") and
the bf16 Gluon GEMMs at the same layout. ``SMOKE`` (set by the check before importing this): tiny shapes."""

from __future__ import annotations

import os
import sys

import torch

from moekit.bench.cells import Shape
from moekit.experts.triton import experts_triton
from moekit.experts.triton_gluon import gluon_layout
from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, launch_gemm
from moekit.experts.triton_gluon_wo import GluonWoGemms, GluonWoOptions, launch_gemm_wo, run_experts_wo_gluon
from moekit.experts.triton_wo import WoWeight, run_experts_wo, weight_args
from moekit.experts.triton_wo_plan import choose_decode
from wo_device_check import quantized

SMOKE = "--smoke" in sys.argv
if "--winners" in sys.argv:  # (the compile workers, started without it, inherit the environment)
    os.environ["WO8_WINNERS"] = "1"
WINNERS = os.environ.get("WO8_WINNERS") == "1"
# (preset, M, schemes): issue #16 target 3's cells the brief names (int4: group 128 with zero points)
CELLS = (("mixtral-8x7b", 1024, ("int8_w8a16", "int4_w4a16", "mxfp4")),
         ("deepseek-v3", 4096, ("int8_w8a16", "int4_w4a16", "mxfp4")),
         ("mixtral-8x7b", 4096, ("int8_w8a16", "int4_w4a16", "mxfp4")),
         ("qwen3-30b-a3b", 4096, ("int8_w8a16", "int4_w4a16")))
# --winners (CK2): the variants checkpoint 1c took as defaults, their whole calls only, against the base, the call
# that names no decode (now the default) and the decode the chooser took before ("prev")
WINNING = {("mixtral-8x7b", 1024): {"int4_w4a16": "split+fast", "mxfp4": "split+fast"},
           ("deepseek-v3", 4096): {"int8_w8a16": "base|slots3", "int4_w4a16": "fast", "mxfp4": "fast"}}
if WINNERS:
    CELLS = tuple((p, m, tuple(WINNING[(p, m)])) for p, m, _ in CELLS if (p, m) in WINNING)
_V = GluonWoOptions
# name -> each GEMM's variant; "UP|DOWN": the gate-up GEMM's and the down GEMM's differ (whole calls only)
OPTIONS = {name: GluonWoGemms(o, o) for name, o in (
    ("base", _V()), ("split", _V(split=True)), ("slots3", _V(slots=3)), ("fast", _V(fast=True)),
    ("split+fast", _V(split=True, fast=True)), ("fast+slots3", _V(fast=True, slots=3)))}
OPTIONS.update({"base|slots3": GluonWoGemms(_V(), _V(slots=3)),
                "split|slots3": GluonWoGemms(_V(split=True), _V(slots=3)),
                "split+fast|fast+slots3": GluonWoGemms(_V(split=True, fast=True), _V(fast=True, slots=3)),
                "fast|fast+slots3": GluonWoGemms(_V(fast=True), _V(fast=True, slots=3))})
INT8 = ("base", "split", "slots3", "base|slots3", "split|slots3")  # int8's decode has no FAST form
PACKED = ("base", "split", "fast", "split+fast", "fast+slots3", "fast|fast+slots3", "split+fast|fast+slots3")
PARTS = ("up", "down", "call")  # each GEMM alone (the layout of the cell's first input set), the whole call


def shape_of(preset: str) -> Shape:
    return Shape(f"{preset}/smoke", 8, 128, 256, 2) if SMOKE else Shape.from_preset(preset)


def options_of(scheme: str) -> dict:
    """The variants a scheme runs: int8's decode has no FAST form (its conversion is already 2 instructions a weight:
    ``benchmarks/wo8_compile_cpu.py``); the 4-bit schemes' third slot only with FAST. --winners: the base and the
    variants WINNING names for the scheme."""
    if WINNERS:
        return {k: OPTIONS[k] for k in dict.fromkeys(["base"] + [w[scheme] for w in WINNING.values() if scheme in w])}
    return {k: OPTIONS[k] for k in (INT8 if scheme == "int8_w8a16" else PACKED)}


def parts_of(name: str) -> tuple:
    """A variant's timed parts: each GEMM alone and the call; a mixed one ("UP|DOWN") and every one with --winners
    the call (a mixed one's GEMMs are timed as the plain variants')."""
    return ("call",) if "|" in name or WINNERS else PARTS


class Weights:
    """One preset's weights, each built on first use: per scheme the (w13, w2) WoWeights (random, ``seed``; None:
    uninitialised, for compiling) and random bf16 weights of the same shapes (uninitialised when compiling)."""

    def __init__(self, s: Shape, dev, seed: int | None):
        self.s, self.dev, self.seed, self.held = s, dev, seed, {}

    def wo(self, scheme: str) -> tuple[WoWeight, WoWeight]:
        if scheme not in self.held:
            s, seed = self.s, self.seed
            self.held[scheme] = (quantized(scheme, s.num_experts, 2 * s.n, s.k, self.dev, seed=seed),
                                 quantized(scheme, s.num_experts, s.k, s.n, self.dev, seed=None if seed is None
                                           else seed + 1))
        return self.held[scheme]

    def bf16(self) -> tuple[torch.Tensor, torch.Tensor]:
        if "bf16" not in self.held:
            s = self.s
            shapes = ((s.num_experts, 2 * s.n, s.k), (s.num_experts, s.k, s.n))
            if self.seed is None:
                self.held["bf16"] = tuple(torch.empty(sh, device=self.dev, dtype=torch.bfloat16) for sh in shapes)
            else:
                g = torch.Generator(device=self.dev).manual_seed(self.seed)
                self.held["bf16"] = tuple(torch.randn(sh, generator=g, device=self.dev, dtype=torch.bfloat16)
                                          .mul_(sh[2] ** -0.5) for sh in shapes)
        return self.held["bf16"]


class Gemms:
    """The cell's GEMMs alone on one input set's layout (built once): the gate-up GEMM [R, K] -> h [R, N] and the
    down GEMM h -> y [R, K], bf16 (``launch_gemm``, the route's tiles without a tail) or weight-only
    (``launch_gemm_wo``, the tiles ``run_experts_wo_gluon`` takes)."""

    def __init__(self, s: Shape, c0):
        self.s = s
        self.layout = gluon_layout(c0.x, c0.topk_ids, s.num_experts)
        rows = self.layout.sorted_ids.numel()
        self.h = c0.x.new_empty(rows, s.n)
        self.y = c0.x.new_empty(rows, s.k)
        self.assignments = c0.topk_ids.numel()

    def bf16(self, part: str, w13: torch.Tensor, w2: torch.Tensor) -> None:
        s, lay = self.s, self.layout
        if part == "up":
            launch_gemm(lay.x_perm, w13.view(-1, s.k), self.h, lay.block_experts, lay.rows_used, UP_TILE, gated=True,
                        w_rows=2 * s.n, gate_offset=s.n, sorted_ids=lay.sorted_ids,
                        num_assignments=self.assignments)
        else:
            launch_gemm(self.h, w2.view(-1, s.n), self.y, lay.block_experts, lay.rows_used, down_tile(s.n),
                        gated=False, w_rows=s.k, sorted_ids=lay.sorted_ids, num_assignments=self.assignments)

    def wo(self, part: str, w13: WoWeight, w2: WoWeight, scheme: str, options: GluonWoGemms) -> None:
        s, lay = self.s, self.layout
        if part == "up":
            launch_gemm_wo(lay.x_perm, w13, self.h, lay.block_experts, lay.rows_used, UP_TILE, True, scheme, s.n,
                           options.up)
        else:
            launch_gemm_wo(self.h, w2, self.y, lay.block_experts, lay.rows_used, down_tile(s.n), False, scheme,
                           options=options.down)


def timed_calls(s: Shape, w: Weights, gemms: Gemms | None) -> dict:
    """name -> (scheme or None, part, fn(inputs)): bf16 (moekit's default bf16 call; its Gluon GEMMs alone), then
    per scheme each variant's GEMMs alone and whole call. ``gemms`` None: the whole calls only (compiling)."""
    out = {}
    for part in parts_of("bf16"):
        if part == "call":
            out["bf16 call"] = (None, part, lambda c: experts_triton(c.x, *w.bf16(), c.topk_ids, c.topk_weights))
        elif gemms is not None:
            out[f"bf16 {part}"] = (None, part, lambda c, p=part: gemms.bf16(p, *w.bf16()))
    return out


def pick_call(w: Weights, scheme: str, m: int) -> dict:
    """"<scheme> pick call": the call that names no decode (the chooser's pick, or this path where GLUON_WO_CELLS
    takes it), on the weights as ``run_experts_wo`` takes them; --winners also "<scheme> prev call", the decode the
    chooser names (``choose_decode``, without this path)."""
    s, tag = w.s, scheme.split("_")[0]
    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in w.wo(scheme))
    out = {f"{tag} pick call": (scheme, "call", lambda c: run_experts_wo(c.x, *args, c.topk_ids, c.topk_weights, None,
                                                                        scheme))}
    if WINNERS:
        prev = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
        out[f"{tag} prev call"] = (scheme, "call", lambda c: run_experts_wo(
            c.x, *args, c.topk_ids, c.topk_weights, None, scheme, decode=prev))
    return out


def wo_calls(s: Shape, w: Weights, gemms: Gemms | None, scheme: str) -> dict:
    """``timed_calls``' entries of one scheme: "<scheme> <variant> <part>"."""
    out = {}
    tag = scheme.split("_")[0]
    for name, opt in options_of(scheme).items():
        for part in parts_of(name):
            key = f"{tag} {name} {part}"
            if part == "call":
                out[key] = (scheme, part, lambda c, sc=scheme, o=opt: run_experts_wo_gluon(
                    c.x, *w.wo(sc), c.topk_ids, c.topk_weights, None, sc, options=o))
            elif gemms is not None:
                out[key] = (scheme, part, lambda c, p=part, sc=scheme, o=opt: gemms.wo(p, *w.wo(sc), sc, o))
    return out
