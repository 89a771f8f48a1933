"""The lean eager launch of the Gluon paths (bf16 ``triton_gluon``, fp8 ``triton_gluon_fp8``; the weight-only one,
``triton_gluon_wo_lean``, shares this module's plans, pool, descriptors and sequences): what their plain
launch decides on every call (the alignment through its custom op and ``kernel[grid](...)``, fresh buffers, six
TMA descriptors, every launch through Triton's binder) decided once and reused, with the Triton path's machinery.

    per kind of call (GluonLeanPlan; dropped on a retune): the alignment's bound launches (``plan_align``, the
      Triton path's: hist + scan as one launch on kept counters above 4096 assignments, then the scatter), the
      gather, the two GEMMs and the combine as ``BoundLaunch``es (grids, scalars, constexprs fixed), the
      workspace's regions (the alignment's, dst, x_perm or x_q + x_s, h or h_q + h_s, y); bf16 with the gather in
      the gate-up GEMM's loader (``in_loader``, experts at most ``LOADER_GATHER_MAX_INTER`` wide): no gather
      launch, no x_perm
    per weight tensor (version, storage, dtype; the key names the device, dtype and block shapes): the weights'
      TMA descriptors, in the Triton path's ``WeightDescriptors`` cache (gone when w13 is freed)
    per (plan, thread, weights): the launches recorded once (``triton_lean.record_launches``) with the pooled
      workspace's regions and their TMA descriptors; recorded again when the pool hands out another buffer or
      the weights' descriptors are rebuilt
    per call: out, the recorded launches with the call's x, ids, weights, map (fp8: scales); dst is not filled with
      -1 (the plain path's ``torch.full``): the combine reads it only for the slots routed here (``FROM_IDS``)

The workspace is one reused buffer per (device, stream, thread; at most two kept) up to ``GLUON_REUSE_MAX_BYTES``
(a prefill call's x_perm, h and y: 1.4 GB for Qwen3-30B-A3B at M = 16384, 5.4 GB for DeepSeek-V3), grown to the
largest plan seen, not to a power of two; ``clear_gluon_caches`` frees it. Above it, while a CUDA graph captures, and on
a plan's first call (its launches compile) the same plan's bound launches run with the regions of one fresh buffer and
activation descriptors built for them. Either way the kernels, grids and arguments are the plain path's: the outputs are
equal bit for bit.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import on_config_cache_clear
from moekit.experts.triton_align import AlignPlan, align_launches, one_pass_programs, plan_align
from moekit.experts.triton_cache import DescriptorPair, WeightDescriptors, WorkspacePool, WorkspaceSpec
from moekit.experts.triton_fast import fast_stamp, remember, run_fast
from moekit.experts.triton_gluon_blk256 import CONSUMER_REGS, CONSUMER_WARPS, SUB_M, out_cols, search_steps
from moekit.experts.triton_gluon_blk256 import MAX_REGISTERS as BLK256_REGISTERS
from moekit.experts.triton_gluon_launch import (
    BLOCK_M, LOADER_REGS, LOADER_WARPS, MAX_REGISTERS, NUM_WARPS, SUM_TILE, gluon_descriptor, loader_gather_fits,
    num_sms, wants_loader_gather,
)
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, resolve_launch_options
from moekit.experts.triton_lean import IDS, MAP, OUT, WEIGHTS, X, _Slot, keep_sequence, record_launches
from moekit.triton_bind import BoundLaunch

GLUON_REUSE_MAX_BYTES = 8 << 30  # the largest workspace kept (DeepSeek-V3 bf16 at M = 16384: 5.4 GB)
MAX_PLANS = 1024  # kinds of call kept; the oldest goes first
GATHER_ROWS, GATHER_COLS = 16, 512  # the bf16 gather's program tile (``launch_gather_rows``'s defaults)
_KERNELS = "moekit.experts._kernels"
_FAST_OPTIONS = LaunchOptions()  # the fast path's entries of this module: the default options (their fast_ready)

# at most two streams' workspaces (a benchmark's side stream besides the main one), each its size exactly
_WORKSPACES = WorkspacePool(max_bytes=GLUON_REUSE_MAX_BYTES, max_entries=2, pow2=False)
_DESCRIPTORS = WeightDescriptors()
_PLANS: dict[tuple, "GluonLeanPlan"] = {}
_SEQUENCES: dict[tuple, object] = {}  # (plan, thread, id(w13)) -> triton_lean.LaunchSequence
_lock = threading.Lock()
on_config_cache_clear(_PLANS.clear)  # a retune: the plans go, their sequences with them
on_config_cache_clear(_SEQUENCES.clear)


def clear_gluon_caches() -> None:
    """Drop the plans, sequences, weight descriptors and the kept workspaces (``triton.clear_launch_caches``)."""
    _PLANS.clear()
    _SEQUENCES.clear()
    _DESCRIPTORS.clear()
    _WORKSPACES.clear()


@dataclass(frozen=True, eq=False)
class GluonLeanPlan:
    """Everything the launches of one kind of call share. Holds no tensor."""

    fp8: bool
    # the alignment's regions, dst [A], then (bf16) x_perm, h, y or (fp8) x_q, x_s, h_q, h_s, y
    workspace: WorkspaceSpec
    align: AlignPlan  # never folded, never the naive shortcut: the GEMMs read 128-row expert segments
    weight_key: tuple  # (path, device, weight dtype, E, 2N, K, up block, down block): the weights' descriptors
    blocks: tuple  # the activation descriptors' blocks: (up A, up C, down A, down C); bf16 then (down T, down CT), the
    # down tile's tail's (None without one: ``GluonTile.tail``)
    # pointers: x, sorted_ids, x_perm (bf16) or x_q, x_s (fp8), dst; None: the gate-up GEMM's loader gathers (bf16)
    gather: BoundLaunch | None
    # pointers: A, W, C descriptors, then (fp8) x_s, w13 scale, h_s, then expert_ids, num_padded (fp8: then b13 or None;
    # bf16 on 256-row tiles: then sorted_ids); with the gather in its loader: x, sorted_ids, dst, W, C descriptors,
    # expert_ids, num_padded
    up: BoundLaunch
    # pointers: A, W, C descriptors, then (fp8) h_s, w2 scale, h_s (never written), then the same (fp8: then b2 or
    # None); with a tail (bf16): A, T, W, C, CT descriptors, expert_ids, sorted_ids, num_padded
    down: BoundLaunch
    combine: BoundLaunch  # pointers: y, dst, weights, out, ids, map (ids without one); FROM_IDS: dst never filled
    blk256: bool = False  # the gate-up GEMM on 256-row tiles: a sixth pointer, sorted_ids


def plan_key(x, w13, w2, ids, weights, expert_map, up, down, s13=None, s2=None, in_loader: bool = False,
             gather_groups: int = 1, variant=None, b13=None, b2=None) -> tuple:
    """The kind of a call: shapes, dtypes, device, x's row stride, every pointer's 16-byte alignment (Triton
    specialises on it), the map's length, the tiles, the fp8 gather's groups a program, the fp8 variant (its
    activation constexprs and which biases it has: a gpt-oss call never reuses a silu plan) and its biases' dtypes.
    ``ids``, ``weights``, ``expert_map``: contiguous."""
    return (s13 is not None, x.shape[0], x.shape[1], x.dtype, x.device, x.stride(0), w13.shape, w13.dtype, ids.shape[1],
            ids.dtype, weights.dtype, x.data_ptr() & 15, ids.data_ptr() & 15, weights.data_ptr() & 15,
            None if expert_map is None else (expert_map.numel(), expert_map.dtype, expert_map.data_ptr() & 15),
            None if s13 is None else (s13.stride(), s2.stride(), s13.data_ptr() & 15, s2.data_ptr() & 15), up, down,
            in_loader, gather_groups, variant,
            *(None if b is None else (b.dtype, b.data_ptr() & 15) for b in (b13, b2)))


def plan_for(x, w13, w2, ids, weights, expert_map, up, down, s13=None, s2=None,
             in_loader: bool = False, gather_groups: int = 1, variant=None, b13=None, b2=None) -> GluonLeanPlan:
    """The cached plan of this call's kind (fp8 when the weight scales ``s13``, ``s2`` are given, its gather
    taking ``gather_groups`` 128-column groups a program, ``variant`` its ``Fp8GluonVariant``, b13 / b2 its biases or
    None; ``in_loader``: bf16 with the gather in the gate-up GEMM's loader)."""
    key = plan_key(x, w13, w2, ids, weights, expert_map, up, down, s13, s2, in_loader, gather_groups, variant, b13, b2)
    plan = _PLANS.get(key)
    if plan is None:
        plan = build_plan(x, w13, w2, ids, expert_map, up, down, fp8=s13 is not None, s13=s13, s2=s2,
                          in_loader=in_loader, gather_groups=gather_groups, variant=variant)
        put_bounded(_PLANS, key, plan, MAX_PLANS)
    return plan


def build_plan(x, w13, w2, ids, expert_map, up, down, fp8: bool, s13=None, s2=None,
               in_loader: bool = False, gather_groups: int = 1, variant=None) -> GluonLeanPlan:
    """The launches of one kind of call (``up`` / ``down``: ``GluonTile`` or ``Fp8GluonTile``; ``in_loader``: bf16,
    no gather launch, no x_perm: the gate-up GEMM's loader copies x's rows,
    ``triton_gluon_launch.loader_gather_fits``; ``variant``: fp8's ``Fp8GluonVariant``)."""
    if in_loader and (fp8 or not loader_gather_fits(x)):
        raise ValueError(f"the in-loader gather needs bf16/fp16 x with 16-byte aligned rows (fp8={fp8}, x stride "
                         f"{x.stride()}, address % 16 = {x.data_ptr() % 16})")
    if not fp8 and (up.tail or (in_loader and up.blk256) or down.blk256):
        raise ValueError(f"up={up}, down={down}: a tail is for the down GEMM only; 256-row tiles for the gate-up GEMM, "
                         f"reading x_perm (in_loader={in_loader})")
    from moekit.layouts.grouping import max_padded_rows

    options = resolve_launch_options(LaunchOptions(), x.device)
    launch = dict(cached=options.cached_launcher, raw=options.raw_launcher)
    (num_tokens, hidden), (num_experts, _, inter), top_k = x.shape, w2.shape, ids.shape[1]
    num_assignments = num_tokens * top_k
    rows = max_padded_rows(num_assignments, num_experts, BLOCK_M)
    align = plan_align(num_assignments, num_experts, BLOCK_M, None if expert_map is None else expert_map.numel(),
                       rows, options, arrival_slot=0, one_pass=one_pass_programs(options, x.device))
    sms = num_sms(x.device)

    def grid(cols: int, block_n: int) -> tuple:
        return (max(1, min(sms, cdiv(rows, BLOCK_M) * cdiv(cols, block_n))),)

    sizes = (rows, num_assignments, top_k, hidden, inter)
    part = (_fp8_part(x, sizes, up, down, s13, s2, grid, launch, gather_groups, variant) if fp8
            else _bf16_part(x, sizes, up, down, grid, launch, in_loader))
    combine = combine_launch(num_tokens, hidden, num_experts, top_k, expert_map, launch)
    regions = list(align.regions) + [("dst", torch.int32, (num_assignments,))] + part.regions
    weight_key = ("gluon_fp8" if fp8 else "gluon", x.device, w13.dtype, *w13.shape, *part.weight_blocks)
    return GluonLeanPlan(fp8, WorkspaceSpec.of(regions, counters=align.kept_counters), align,
                         weight_key, part.blocks, part.gather, part.up, part.down, combine,
                         not fp8 and up.blk256)


def gather_launch(x, rows: int, num_assignments: int, top_k: int, launch: dict) -> BoundLaunch:
    """The gather of x's rows into the permuted buffer [R, K] (``launch_gather_rows``'s kernel and tile); pointers: x,
    sorted_ids, x_perm, dst (the bf16 route without the in-loader gather, the weight-only Gluon path)."""
    hidden = x.shape[1]
    return BoundLaunch(importlib.import_module(f"{_KERNELS}.contiguous").gather_rows_kernel,
                       (cdiv(rows, GATHER_ROWS), cdiv(hidden, GATHER_COLS)), 4,
                       (rows, num_assignments, hidden, x.stride(0), hidden),
                       TOP_K=top_k, BLOCK_R=GATHER_ROWS, BLOCK_K=GATHER_COLS, num_warps=4, **launch)


def combine_launch(num_tokens: int, hidden: int, num_experts: int, top_k: int, expert_map, launch: dict) -> BoundLaunch:
    """The weighted sum over the k slots (``SUM_TILE``), reading dst only for the slots routed here (``FROM_IDS``);
    pointers: y, dst, weights, out, ids, map (ids without one)."""
    num_global = 0 if expert_map is None else expert_map.numel()
    return BoundLaunch(importlib.import_module(f"{_KERNELS}.contiguous").contiguous_sum_kernel,
                       (cdiv(num_tokens, SUM_TILE.block_t), cdiv(hidden, SUM_TILE.block_k)), 6,
                       (num_tokens, hidden, hidden, hidden, num_experts, num_global), TOP_K=top_k,
                       BLOCK_T=SUM_TILE.block_t, BLOCK_K=SUM_TILE.block_k, FROM_IDS=True,
                       HAS_MAP=expert_map is not None, num_warps=SUM_TILE.num_warps, **launch)


@dataclass(frozen=True)
class _Part:
    """What the bf16 and fp8 plans do differently: their regions, gather, GEMMs and descriptor blocks."""

    regions: list  # (name, dtype, shape) after the alignment's and dst
    gather: BoundLaunch | None
    up: BoundLaunch
    down: BoundLaunch
    blocks: tuple  # the activation descriptors' blocks: up A, up C, down A, down C
    weight_blocks: tuple  # w13's and w2's


def _bf16_part(x, sizes: tuple, up, down, grid, launch: dict, in_loader: bool) -> _Part:
    rows, num_assignments, top_k, hidden, inter = sizes
    gemm = importlib.import_module(f"{_KERNELS}.gluon_gemm").grouped_gemm_kernel

    def tail_blocks(tile) -> tuple:
        return ((tile.tail, tile.block_k), (tile.tail, tile.block_n)) if tile.tail else (None, None)

    up_m, up_c = (SUB_M, out_cols(up)) if up.blk256 else (BLOCK_M, up.block_n)  # rows of A and C, C's columns
    blocks = ((up_m, up.block_k), (up_m, up_c), (BLOCK_M, down.block_k), (BLOCK_M, down.block_n), *tail_blocks(down))
    weight_blocks = ((up_c, up.block_k), (down.block_n, down.block_k))  # (256-row tiles: 64 gate, 64 up rows)

    def bf16_gemm(tile, reduce_dim: int, cols: int, w_rows: int, gate_offset: int, gated: bool):
        if tile.blk256:  # the gate-up GEMM on 256-row tiles (``triton_gluon_blk256``): A, W, C, expert_ids,
            # num_padded, sorted_ids
            blk = importlib.import_module(f"{_KERNELS}.gluon_gemm_blk256").blk256_gemm_kernel
            step = out_cols(tile)
            return BoundLaunch(blk, grid(cols, step), 6, (num_assignments, reduce_dim, cols // step), W_ROWS=w_rows,
                               GATE_OFFSET=gate_offset, STAGES=tile.stages, GROUP_M=tile.group_m,
                               SEARCH_STEPS=search_steps(cdiv(rows, BLOCK_M)), CONSUMER_REGS=CONSUMER_REGS,
                               num_warps=CONSUMER_WARPS, maxnreg=BLK256_REGISTERS, **launch)
        if tile.tail:  # the down GEMM folding tails (``triton_gluon_tail``): 8 pointers, then A
            tail_down = importlib.import_module(f"{_KERNELS}.gluon_gemm_tail").tail_down_kernel
            return BoundLaunch(tail_down, grid(cols, tile.block_n), 8, (num_assignments, reduce_dim,
                               cols // tile.block_n), W_ROWS=w_rows, STAGES=tile.stages, GROUP_M=tile.group_m,
                               num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **launch)
        return BoundLaunch(gemm, grid(cols, tile.block_n), 5, (reduce_dim, cols // tile.block_n),
                           W_ROWS=w_rows, GATE_OFFSET=gate_offset, GATED=gated, STAGES=tile.stages,
                           GROUP_M=tile.group_m, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **launch)

    down_gemm = bf16_gemm(down, inter, hidden, hidden, 0, False)
    if in_loader:
        gather_gemm = importlib.import_module(f"{_KERNELS}.gluon_gemm_gather").gather_gate_up_kernel
        up_gemm = BoundLaunch(gather_gemm, grid(inter, up.block_n), 7,
                              (num_assignments, x.stride(0), hidden, inter // up.block_n), TOP_K=top_k,
                              W_ROWS=2 * inter, GATE_OFFSET=inter, STAGES=up.stages, GROUP_M=up.group_m,
                              LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=NUM_WARPS,
                              maxnreg=MAX_REGISTERS, **launch)
        return _Part([("h", x.dtype, (rows, inter)), ("y", x.dtype, (rows, hidden))], None, up_gemm, down_gemm,
                     blocks, weight_blocks)
    gather = gather_launch(x, rows, num_assignments, top_k, launch)
    return _Part([("x_perm", x.dtype, (rows, hidden)), ("h", x.dtype, (rows, inter)), ("y", x.dtype, (rows, hidden))],
                 gather, bf16_gemm(up, hidden, inter, 2 * inter, inter, True), down_gemm, blocks, weight_blocks)


def _fp8_part(x, sizes: tuple, up, down, s13, s2, grid, launch: dict, gather_groups: int, variant) -> _Part:
    from moekit.experts.triton_gluon_fp8_launch import CONSUMER_WARPS, GATHER_ROWS as QROWS, GROUP, HALF_M, check_wide

    rows, num_assignments, top_k, hidden, inter = sizes
    groups, inter_groups = cdiv(hidden, GROUP), cdiv(inter, GROUP)  # x's and h's scale columns
    gemm = importlib.import_module(f"{_KERNELS}.gluon_gemm_fp8").grouped_gemm_fp8_kernel
    gather = BoundLaunch(importlib.import_module(f"{_KERNELS}.gather_fp8").gather_quant_rows_kernel,
                         (cdiv(rows, QROWS), cdiv(groups, gather_groups)), 5,
                         (rows, num_assignments, hidden, x.stride(0), hidden, groups, groups),
                         TOP_K=top_k, BLOCK_R=QROWS, GROUP=GROUP, EMULATE=interpreting(), GROUPS=gather_groups,
                         num_warps=4, **launch)

    def fp8_gemm(tile, reduce_dim: int, cols: int, w_rows: int, gate_offset: int, a_groups: int, scale,
                 out_groups: int, gated: bool, bias: bool):
        check_wide(tile, gated, cols, bias)
        gate_offset = GROUP if tile.wide else gate_offset  # WIDE: the second weight tile is the next column block
        return BoundLaunch(gemm, grid(cols, tile.block_n), 9,  # the ninth pointer: the bias (or None)
                           (reduce_dim, cdiv(cols, tile.block_n), w_rows, gate_offset, a_groups, *scale.stride()[:2],
                            out_groups),
                           GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                           WIDE=tile.wide, PIPE=tile.pipelined, num_warps=CONSUMER_WARPS, maxnreg=tile.max_registers,
                           **(variant.gate_up_constexprs() if gated else {}), **launch)  # down: the defaults

    regions = [("x_q", torch.float32 if interpreting() else torch.float8_e4m3fn, (rows, hidden)),
               ("x_s", torch.float32, (rows, groups)), ("h_q", torch.float8_e4m3fn, (rows, inter)),
               ("h_s", torch.float32, (rows, inter_groups)), ("y", x.dtype, (rows, hidden))]
    return _Part(regions, gather, fp8_gemm(up, hidden, inter, 2 * inter, variant.gate_offset(inter), groups, s13,
                                           inter_groups, True, variant.b13),
                 fp8_gemm(down, inter, hidden, hidden, 0, inter_groups, s2, inter_groups, False, variant.b2),
                 ((HALF_M, GROUP),) * 4, ((GROUP, GROUP), (GROUP, GROUP)))


def weight_pair(w13: torch.Tensor, w2: torch.Tensor, key: tuple) -> DescriptorPair:
    """The weights' descriptors of a plan's ``weight_key``: w13 [E, 2N, K] as [E*2N, K], w2 [E, K, N] as [E*K, N]
    (``WeightDescriptors.get``'s builder: once per weight tensor, version and key)."""
    up_block, down_block = key[-2], key[-1]
    return DescriptorPair(gluon_descriptor(w13.detach().view(-1, w13.shape[2]), up_block), None,
                          gluon_descriptor(w2.detach().view(-1, w2.shape[2]), down_block))


def activation_descriptors(plan: GluonLeanPlan, b: dict) -> tuple:
    """The descriptors over the workspace's regions: (up A, up C, down A, down C); fp8's up C and down A are one;
    up A is None with the gather in the gate-up GEMM's loader (no x_perm); bf16 then the down tail's (T over h, CT
    over y; None without a tail)."""
    if plan.fp8:
        a_up, h = gluon_descriptor(b["x_q"], plan.blocks[0]), gluon_descriptor(b["h_q"], plan.blocks[1])
        return a_up, h, h, gluon_descriptor(b["y"], plan.blocks[3])
    a_up = gluon_descriptor(b["x_perm"], plan.blocks[0]) if plan.gather is not None else None
    tails = tuple(None if block is None else gluon_descriptor(region, block)
                  for region, block in zip((b["h"], b["y"]), plan.blocks[4:]))
    return (a_up, gluon_descriptor(b["h"], plan.blocks[1]),
            gluon_descriptor(b["h"], plan.blocks[2]), gluon_descriptor(b["y"], plan.blocks[3]), *tails)


def plan_launches(plan: GluonLeanPlan, b: dict, acts: tuple, pair: DescriptorPair, x, ids, weights, expert_map, out,
                  s13, s2, counters, b13=None, b2=None) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment, the gather, gate-up, down, the
    combine. ``b``: the workspace's regions; ``acts``: their descriptors; any argument may be a stand-in; fp8's
    biases b13 / b2 (None: none) the GEMMs' last pointers."""
    map_or_ids = expert_map if expert_map is not None else ids  # read only with a map
    launches = align_launches(plan.align, ids, map_or_ids, b, counters)
    a_up, c_up, a_down, c_down = acts[:4]
    rows = (b["expert_ids"], b["num_padded"])
    if plan.fp8:
        launches += [(plan.gather, (x, b["sorted_ids"], b["x_q"], b["x_s"], b["dst"])),
                     (plan.up, (a_up, pair.w13, c_up, b["x_s"], s13, b["h_s"], *rows, b13)),
                     (plan.down, (a_down, pair.w2, c_down, b["h_s"], s2, b["h_s"], *rows, b2))]
    else:
        t_down, ct_down = acts[4:]
        up_rows = rows + (b["sorted_ids"],) if plan.blk256 else rows  # 256-row tiles: sorted_ids, a sixth pointer
        down = ((a_down, t_down, pair.w2, c_down, ct_down, b["expert_ids"], b["sorted_ids"], b["num_padded"])
                if t_down is not None else (a_down, pair.w2, c_down, *rows))
        if plan.gather is None:  # the gate-up GEMM's loader reads x by sorted_ids and writes dst
            launches.append((plan.up, (x, b["sorted_ids"], b["dst"], pair.w13, c_up, *rows)))
        else:
            launches += [(plan.gather, (x, b["sorted_ids"], b["x_perm"], b["dst"])),
                         (plan.up, (a_up, pair.w13, c_up, *up_rows))]
        launches.append((plan.down, down))
    # the combine reads dst only for the slots routed here (FROM_IDS), each written by this call's gather (or the
    # gate-up GEMM's loader): no fill
    launches.append((plan.combine, (b["y"], b["dst"], weights, out, ids, map_or_ids)))
    return launches


def run_fast_gluon(x, w13, w2, topk_ids, topk_weights, fast_key: tuple, b13=None, b2=None) -> torch.Tensor | None:
    """A repeated call with the same weights launched from what its first lean call kept, or None: the Triton
    path's fast path (``triton_fast.run_fast``: its checks, its invalidation) on this module's pool. w13, w2: bf16
    weights, or fp8's e4m3 ``q`` tensors. ``fast_key``: what else decided the path (the backend's activation and
    choice; fp8: the block shape and the scales' addresses, ``triton_gluon_fp8.fp8_fast_key``); a Triton path
    entry never has it. fp8's ``b13`` / ``b2``: the entry's, unchanged, or a miss (``kept_biases``)."""
    return run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, fast_key, _FAST_OPTIONS, False, b13, b2)


def run_lean(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             expert_map: torch.Tensor | None, up, down, s13: torch.Tensor | None = None,
             s2: torch.Tensor | None = None, fast_key: tuple | None = None,
             in_loader: bool | None = None, gather_groups: int = 1, variant=None, b13: torch.Tensor | None = None,
             b2: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, K] of a call on the Gluon path, its arguments checked by the caller: bf16 with w13 [E, 2N, K], w2
    [E, K, N]; fp8 with their e4m3 ``q`` tensors and float32 scales ``s13``, ``s2``. ``up`` / ``down``: the tiles.
    ``fast_key`` (no map): a call that launches from its sequence is kept for ``run_fast_gluon`` (with its biases).
    ``in_loader`` (bf16): the gather in the gate-up GEMM's loader; None: ``wants_loader_gather`` (where x fits it).
    ``gather_groups`` (fp8): the gather's 128-column groups a program (``triton_gluon_fp8_launch.plan_gluon_fp8``);
    ``variant`` (fp8): the call's ``Fp8GluonVariant`` (``variant_of``), ``b13`` / ``b2`` its biases (contiguous; the
    recorded launches hold their addresses, in the sequence's key as the scales' are)."""
    stamp = fast_stamp(_WORKSPACES)  # before the pool lookup: a new buffer from here on makes a kept entry stale
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    if expert_map is not None:
        expert_map = expert_map.contiguous()
    if in_loader is None:  # (256-row gate-up tiles read x_perm by TMA: the gather kernel)
        in_loader = s13 is None and not up.blk256 and wants_loader_gather(x, w2.shape[-1])
    plan = plan_for(x, w13, w2, ids, weights, expert_map, up, down, s13, s2, in_loader, gather_groups, variant, b13, b2)
    out = torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)  # [M, K]
    pair = _DESCRIPTORS.get(w13, w2, plan.weight_key, weight_pair)
    b, pooled = workspace_regions(plan.workspace, x.device)
    if pooled:
        sequence = _sequence(plan, b, pair, w13, expert_map is not None, s13, s2, b13, b2)
        if sequence is not None:
            if fast_key is not None and expert_map is None and ids is topk_ids and weights is topk_weights:
                remember(stamp, x, w13, w2, ids, weights, fast_key, _FAST_OPTIONS, plan, sequence, False, b13, b2)
            sequence.launch((x, ids, weights, out, expert_map, None, None, None, None, None, None))
            return out
    for launch, pointers in plan_launches(plan, b, activation_descriptors(plan, b), pair, x, ids, weights, expert_map,
                                          out, s13, s2, b.get("counters"), b13, b2):
        launch(*pointers)
    return out


def workspace_regions(spec, device: torch.device) -> tuple[dict, bool]:
    """A call's regions of workspace ``spec`` and whether they are the pool's (reused, so a recorded sequence may
    launch on them): fresh while a CUDA graph captures or past the pool's size (the alignment's pooled unless
    capturing)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing or spec.nbytes > _WORKSPACES.max_bytes:
        return _WORKSPACES.buffers(spec, device), False
    return _WORKSPACES.pooled(spec, device), True


def _sequence(plan: GluonLeanPlan, b: dict, pair: DescriptorPair, w13: torch.Tensor, has_map: bool, s13=None, s2=None,
              b13=None, b2=None):
    """The recorded launches of ``plan`` for these weights and pooled regions on this thread (recorded now if
    stale), or None where they cannot be used yet (a launch not compiled, a Triton launch hook). fp8: the scales
    ``s13``, ``s2`` and the biases ``b13``, ``b2`` are recorded in it by address (the key has their addresses; an
    in-place update keeps them), so a call launches it with the call's tensors alone (``triton_lean.launch_lean``, the
    fast path's)."""
    key = (plan, threading.get_ident(), id(w13)) if s13 is None else (
        plan, threading.get_ident(), id(w13), s13.data_ptr(), s2.data_ptr(),
        *(None if t is None else t.data_ptr() for t in (b13, b2)))
    sequence = _SEQUENCES.get(key)
    if sequence is None or not sequence.current(b, pair):
        launches = plan_launches(plan, b, activation_descriptors(plan, b), pair, _Slot(X), _Slot(IDS),
                                 _Slot(WEIGHTS), _Slot(MAP) if has_map else None, _Slot(OUT), s13, s2,
                                 b.get("counters"), b13, b2)
        sequence = record_launches(launches, b, pair)
        if sequence is None:
            return None
        keep_sequence(_SEQUENCES, _lock, key, sequence, MAX_PLANS, w13)  # it holds w13's descriptors: goes with w13
    if sequence.raw and not sequence.hooks.idle():
        return None
    return sequence
