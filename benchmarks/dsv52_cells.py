"""The cells and candidates of ``dsv52_device_check.py`` (session 52, issues 19 and 15: the near-miss cells): what each
variant calls, the weights it reads, the float64 / torch twin it is checked against.

Variants (``Variant.kind``):
- ``route``: the ``triton`` backend's call, as ``moekit bench`` times it (today's pick: path, entry, switches);
- ``aligned``: today's entry with the tiny-batch shortcut off (A*4 <= E: block a = assignment a, so an expert that two
  slots pick is streamed twice; here its slots share a block, the alignment folded into gate-up where A <= 64):
  ``triton_plan`` / ``triton_fp8_plan`` build the plan under ``shortcut(False)`` with options no other call has;
- ``shortcut``: the opposite, the tiny-batch shortcut wherever ``use_naive`` allows it (vLLM's rule alone, the plans'
  rule before session 52), built under ``shortcut(True)`` with ``SHORTCUT_OPTIONS``;
- ``entry``: the packaged file's entry at another M (``entry_m``), its switches with it;
- ``tiles``: today's entry with ``up`` / ``down`` fields replaced;
- ``options``: today's entry with ``LaunchOptions`` fields replaced (``opts``; the alignment in fewer launches:
  ``align_one_launch_max`` / ``align_two_launch_max``; lean off, as ``ALIGNED_OPTIONS``);
- ``gluon``: the Gluon GEMMs (bf16 ``experts_gluon``, fp8 ``experts_gluon_fp8``) whatever the route's choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

import moekit.experts.configs as configs_pkg
from moekit.bench import tuning, tuning_switches
from moekit.bench.cells import Shape
from moekit.experts import get_backend, triton_fp8_plan, triton_plan
from moekit.experts.configs import device_key, read_configs
from moekit.experts.reference import experts_reference
from moekit.experts.triton import fused_experts
from moekit.experts.triton_fp8 import fused_experts_fp8_launch, fused_experts_fp8_torch
from moekit.experts.triton_fp8_plan import read_entries
from moekit.experts.triton_launch import LaunchOptions

# Options no other call of the run has (a plan key of its own, built under ``shortcut``); lean off so that no eager
# warm-up call leaves a fast-path entry the route's calls could meet. Neither changes a kernel or its arguments.
ALIGNED_OPTIONS = LaunchOptions(lean_launch=False)
SHORTCUT_OPTIONS = LaunchOptions(lean_launch=False, fast_path=False)  # the same, another key


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "route", "aligned", "entry", "tiles", "gluon"
    entry_m: int = 0  # kind "entry": the packaged entry of this M
    up: dict = field(default_factory=dict)  # kind "tiles": GemmTile fields replaced in today's entry
    down: dict = field(default_factory=dict)
    opts: dict = field(default_factory=dict)  # kind "options": LaunchOptions fields


@dataclass(frozen=True)
class Cell:
    preset: str
    dtype: str  # "bfloat16" or "fp8_block"
    m: int
    variants: tuple[Variant, ...]  # the first is the route: every x is against it
    sets: int = 2  # input sets rotated in a graph (the bytes of one call dwarf the L2 at every cell here)
    breakdown: tuple[str, ...] = ("route",)  # the variants whose graph replay is broken down by launch

    @property
    def name(self) -> str:
        return f"{self.preset} {self.dtype} M={self.m}"

    @property
    def label(self) -> str:
        """The cell and its candidates (a cell may be listed twice: the Gluon GEMMs last)."""
        return f"{self.name} [{', '.join(v.name for v in self.variants[1:])}]"


ROUTE, ALIGNED, GLUON = Variant("route", "route"), Variant("aligned", "aligned"), Variant("gluon", "gluon")
SHORTCUT = Variant("shortcut", "shortcut")
CELLS = (
    Cell("deepseek-v3", "bfloat16", 8, (ROUTE, ALIGNED, Variant("up-k256-s3", "tiles", up=dict(BLOCK_K=256,
         num_stages=3)), Variant("down-n64-k128-s4", "tiles", down=dict(BLOCK_N=64, BLOCK_K=128, num_stages=4))),
         breakdown=("route", "aligned")),
    Cell("deepseek-v3", "bfloat16", 4, (ROUTE, ALIGNED)),
    Cell("deepseek-v3", "bfloat16", 2, (ROUTE, ALIGNED)),
    Cell("deepseek-v3", "fp8_block", 512, (ROUTE, Variant("entry-1024", "entry", 1024), Variant(
         "align-1-launch", "options", opts=dict(align_one_launch_max=4096)))),
    Cell("deepseek-v3", "fp8_block", 1024, (ROUTE, Variant("entry-512", "entry", 512), Variant(
         "align-1-launch", "options", opts=dict(align_one_launch_max=8192)), Variant(
         "align-2-launches", "options", opts=dict(align_two_launch_max=8192)))),
    Cell("deepseek-v3", "fp8_block", 8, (ROUTE, ALIGNED)),
    Cell("qwen3-30b-a3b", "bfloat16", 512, (ROUTE, Variant("entry-256", "entry", 256),
                                             Variant("entry-1024", "entry", 1024), Variant(
         "align-1-launch", "options", opts=dict(align_one_launch_max=4096)))),
    Cell("qwen3-30b-a3b", "bfloat16", 4, (ROUTE, ALIGNED), sets=4),
    Cell("deepseek-v3", "fp8_block", 512, (ROUTE, GLUON), breakdown=("gluon",)),
    Cell("qwen3-30b-a3b", "bfloat16", 512, (ROUTE, GLUON), breakdown=("gluon",)),
)
SMOKE_SHAPE = Shape("tiny", num_experts=32, n=128, k=256, top_k=2)  # M = 4: A*4 = 32 <= E, the shortcut
SMOKE_CELLS = (
    Cell("tiny", "bfloat16", 4, (ROUTE, ALIGNED, SHORTCUT, Variant("up-k128", "tiles", up=dict(BLOCK_K=128))),
         breakdown=("route", "aligned")),
    Cell("tiny", "fp8_block", 80, (ROUTE, Variant("align-1-launch", "options", opts=dict(align_one_launch_max=0)))),
)
TOL = {"fp8_block": 2e-2, "bfloat16": 1e-2}


def shape_of(cell: Cell) -> Shape:
    return SMOKE_SHAPE if cell.preset == "tiny" else Shape.from_preset(cell.preset)


@contextlib.contextmanager
def shortcut(on: bool):
    """Inside, the bf16 and fp8 plans built take the tiny-batch shortcut where ``use_naive`` allows it (``on``) or
    align every call, whatever the plan's own rule asks (``plan_block_rows(shortcut=on)``): a plan's layout is fixed
    when it is built, so only calls whose plan is new here (``ALIGNED_OPTIONS``) take it."""
    saved = triton_plan.plan_block_rows, triton_fp8_plan.plan_block_rows

    def forced(*args, **kwargs):
        return saved[0](*args, **{**kwargs, "shortcut": on})

    triton_plan.plan_block_rows = triton_fp8_plan.plan_block_rows = forced
    try:
        yield
    finally:
        triton_plan.plan_block_rows, triton_fp8_plan.plan_block_rows = saved


def packaged_file(cell: Cell, shape: Shape, dev) -> Path:
    scheme = tuning.scheme_for(cell.dtype)
    return Path(configs_pkg.__file__).parent / scheme.file_name(shape.num_experts, shape.n, shape.k, device_key(dev))


def entry_config(cell: Cell, variant: Variant, shape: Shape, dev):
    """The candidate config of an ``entry`` or ``tiles`` variant (None: the packaged file has no such entry)."""
    scheme = tuning.scheme_for(cell.dtype)
    if variant.kind == "tiles":
        cfg = scheme.current(cell.m, shape, device_key(dev))
        return replace(cfg, up=replace(cfg.up, **variant.up), down=replace(cfg.down, **variant.down))
    path = packaged_file(cell, shape, dev)
    if not path.is_file():
        return None
    if cell.dtype == "fp8_block":
        entries = read_entries(path)
        return tuning_switches.candidate_of(entries[variant.entry_m], cell.m, shape) if variant.entry_m in entries \
            else None
    return read_configs(path).get(variant.entry_m)


def variant_call(cell: Cell, variant: Variant, shape: Shape, w, dev):
    """``call(s)``: one experts call of ``variant`` on input set ``s``; None where it cannot run here (why: logged by
    the caller)."""
    fp8 = cell.dtype == "fp8_block"
    if variant.kind == "route":
        backend = get_backend("triton")
        return lambda s: backend(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights)
    if variant.kind in ("aligned", "shortcut", "options"):
        options = SHORTCUT_OPTIONS if variant.kind == "shortcut" else replace(ALIGNED_OPTIONS, **variant.opts)

        def with_options(s):
            with contextlib.nullcontext() if variant.kind == "options" else shortcut(variant.kind == "shortcut"):
                if fp8:
                    return fused_experts_fp8_launch(s.x, w.w13.q, w.w13.scale, w.w2.q, w.w2.scale, s.topk_ids,
                                                    s.topk_weights, block_shape=tuple(w.w13.block_shape),
                                                    options=options)
                return fused_experts(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights, options=options)
        return with_options
    if variant.kind == "gluon":
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            return None
        if fp8:
            from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

            return lambda s: experts_gluon_fp8(s.x, w.w13.q, w.w13.scale, w.w2.q, w.w2.scale, s.topk_ids,
                                               s.topk_weights)
        from moekit.experts.triton_gluon import experts_gluon

        return lambda s: experts_gluon(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights)
    cfg = entry_config(cell, variant, shape, dev)
    if cfg is None:
        return None
    scheme = tuning.scheme_for(cell.dtype)
    return lambda s: scheme.call(w, s, cfg)


def touched(ids: torch.Tensor) -> torch.Tensor:
    """The distinct experts ``ids`` [M, k] picks, ascending (skipped slots, -1, left out)."""
    u = ids.reshape(-1).unique()
    return u[u >= 0]


def twin(cell: Cell, w, s) -> torch.Tensor:
    """bf16: ``experts_reference`` in float64 (x in float64: each routed expert's weights upcast in its turn); fp8:
    ``fused_experts_fp8_torch`` on the same quantized weights, of the touched experts only (ids renumbered)."""
    if cell.dtype != "fp8_block":
        return experts_reference(s.x.double(), w.w13, w.w2, s.topk_ids, s.topk_weights)
    sub = touched(s.topk_ids).long()
    ids = torch.searchsorted(sub, s.topk_ids.long()).to(s.topk_ids.dtype)  # [M, k]: positions in sub
    q13, q2 = w.w13, w.w2
    return fused_experts_fp8_torch(s.x, q13.q[sub], q13.scale[sub], q2.q[sub], q2.scale[sub], ids, s.topk_weights,
                                   block_shape=tuple(q13.block_shape))


def weight_parts(cell: Cell, w) -> list[torch.Tensor]:
    """The tensors whose touched experts' slices a call streams: w13 and w2 (fp8: each with its block scales)."""
    if cell.dtype == "fp8_block":
        return [w.w13.q, w.w13.scale, w.w2.q, w.w2.scale]
    return [w.w13, w.w2]


def read_parts(cell: Cell, w) -> list[torch.Tensor]:
    """``weight_parts`` that the pure read can stream: an expert's slice a whole number of 16-byte units (every part
    at the real shapes; the smoke's tiny fp8 scales, 8 bytes an expert, are left out)."""
    return [t for t in weight_parts(cell, w) if t[0].numel() * t.element_size() % 16 == 0]


def plans_with(options: LaunchOptions) -> list:
    """The bf16 and fp8 plans built with ``options`` (the options are part of each plan's key)."""
    return [p for k, p in (*triton_plan._PLANS.items(), *triton_fp8_plan._PLANS.items()) if options in k]


def aligned_layouts(options: LaunchOptions = ALIGNED_OPTIONS) -> list[bool]:
    """For each plan built with ``options`` (bf16 and fp8): whether it aligns (its ``align`` is set)."""
    return [p.align is not None for p in plans_with(options)]


def alignment_launches(variant: Variant) -> list:
    """The alignment launches of each plan an ``options`` variant built (None: the shortcut)."""
    return [None if p.align is None else p.align.launches for p in plans_with(replace(ALIGNED_OPTIONS,
                                                                                        **variant.opts))]
