"""The lean eager launch of the weight-only Gluon path (``triton_gluon_wo``): what its plain launch builds on every
call (the alignment through its custom op, dst filled, fresh x_perm / h / y, five TMA descriptors, every launch
through Triton's binder: ~1 ms of host a call on the H200) built once and reused, with the bf16 / fp8 Gluon paths'
machinery and state (``triton_gluon_lean``: its plans dict, workspace pool, weight descriptors and sequences).

    per kind of call (WoLeanPlan, dropped on a retune): the alignment (``plan_align``), the gather into x_perm, the
      two weight-only GEMMs (``_kernels/gluon_gemm_wo.py``) and the combine as ``BoundLaunch``es; the workspace's
      regions (the alignment's, dst, x_perm, h, y)
    per stored weight pair (q13, q2; the key names the device, scheme and block shapes): their TMA descriptors
      (int4: over the int32 words), built once (``triton_cache.WeightDescriptors``; gone when q13 is freed)
    per (plan, thread, q13, the scales' and zeros' addresses): the launches recorded once over the pooled workspace
      and its activation descriptors (``triton_lean.record_launches``)
    per call: out, then the recorded launches with the call's x, ids, weights (and map)

The ``triton`` backend's repeated calls on QuantizedWeight pairs skip even the lookups: ``triton_quant_fast`` keeps an
entry recorded from ``wo_gluon_lean_inputs`` (its checks, then one C call). Outputs equal the plain launch's
(``run_experts_wo_gluon(lean=False)``) bit for bit: the same kernels, grids and arguments; the combine reads dst only
for the slots routed here (``FROM_IDS``), so dst is not filled. While a CUDA graph captures and above the pool's
size: the plan's bound launches on fresh regions, their descriptors built for them.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, R rows of the permuted buffer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.experts.triton_align import AlignPlan, align_launches, one_pass_programs, plan_align
from moekit.experts.triton_cache import DescriptorPair, WorkspaceSpec
from moekit.experts.triton_gluon_launch import (
    BLOCK_M, MAX_REGISTERS, UP_TILE, GluonTile, down_tile, gluon_descriptor, num_sms,
)
from moekit.experts.triton_gluon_lean import (
    _DESCRIPTORS, _PLANS, _SEQUENCES, _WORKSPACES, MAX_PLANS, _lock, combine_launch, gather_launch, workspace_regions,
)
from moekit.experts.triton_gluon_wo import (
    GLUON_WO_SCHEMES, GluonWoGemms, WoGemmLaunch, scale_strides, wo_gemm_launch, wo_options,
)
from moekit.experts.triton_launch import LaunchOptions, cdiv, resolve_launch_options
from moekit.experts.triton_lean import IDS, MAP, OUT, WEIGHTS, X, _Slot, keep_sequence, record_launches
from moekit.triton_bind import BoundLaunch

_WO = "gluon_wo"  # the first field of this path's plan and descriptor keys (the other Gluon paths' never have it)


@dataclass(frozen=True, eq=False)
class WoLeanPlan:
    """Everything the launches of one kind of weight-only Gluon call share. Holds no tensor."""

    workspace: WorkspaceSpec  # the alignment's regions, dst [A] int32, x_perm [R, K], h [R, N], y [R, K] (x's dtype)
    align: AlignPlan  # never folded, never the naive shortcut: the GEMMs read 128-row expert segments
    weight_key: tuple  # (_WO, device, scheme, q13 block, q2 block, q13 words, q2 words): the weights' descriptors
    blocks: tuple  # the activation descriptors' blocks: up A (x_perm), up C (h), down A (h), down C (y)
    gather: BoundLaunch  # pointers: x, sorted_ids, x_perm, dst
    up: BoundLaunch  # pointers: A, Q, C descriptors, expert_ids, num_padded, w13's scale, its zero (else the scale)
    down: BoundLaunch  # the same on w2
    combine: BoundLaunch  # pointers: y, dst, weights, out, ids, map (ids without one)


def _zero(w) -> torch.Tensor:
    """The zero-point pointer the GEMM gets: the zeros, or the scale where the scheme has none (never read)."""
    return w.scale if w.zero is None else w.zero


def _scale_key(w) -> tuple:
    """What the kernel specialises on in a weight's scale and zero pointers and strides, and its GROUP (int8: 1
    whether the weight says 0, a ``WoWeight``, or 1, ``WeightArgs``: the route's call and the named one share a
    plan)."""
    zero = _zero(w)
    return (w.scale.dtype, zero.dtype, scale_strides(w), w.scale.data_ptr() & 15, zero.data_ptr() & 15,
            max(w.group_size, 1))


def wo_plan_for(x, w13, w2, ids, weights, expert_map, scheme: str, up: GluonTile, down: GluonTile,
                options: GluonWoGemms = GluonWoGemms()) -> WoLeanPlan:
    """The cached plan of this call's kind: shapes, dtypes, device, x's row stride, the scales' layouts, every pointer's
    16-byte alignment (Triton specialises on it), the map's length, the tiles, the GEMMs' variants. ``w13`` / ``w2``:
    ``WeightArgs`` or ``WoWeight``; ``ids``, ``weights``, ``expert_map``: contiguous."""
    key = (_WO, scheme, x.shape, x.dtype, x.device, x.stride(0), w13.q.shape, w2.q.shape, w13.q.dtype, ids.shape[1],
           ids.dtype, weights.dtype, x.data_ptr() & 15, ids.data_ptr() & 15, weights.data_ptr() & 15,
           None if expert_map is None else (expert_map.numel(), expert_map.dtype, expert_map.data_ptr() & 15),
           _scale_key(w13), _scale_key(w2), up, down, options)
    plan = _PLANS.get(key)
    if plan is None:
        plan = build_wo_plan(x, w13, w2, ids, expert_map, scheme, up, down, options)
        put_bounded(_PLANS, key, plan, MAX_PLANS)
    return plan


def build_wo_plan(x, w13, w2, ids, expert_map, scheme: str, up: GluonTile, down: GluonTile,
                  variants: GluonWoGemms = GluonWoGemms()) -> WoLeanPlan:
    """The launches of one kind of call: ``triton_gluon_wo.launch_gemm_wo``'s grids, scalars and constexprs."""
    from moekit.layouts.grouping import max_padded_rows

    options = resolve_launch_options(LaunchOptions(), x.device)
    launch = dict(cached=options.cached_launcher, raw=options.raw_launcher)
    (num_tokens, hidden), top_k = x.shape, ids.shape[1]
    num_experts, inter = w13.q.shape[0], w13.q.shape[1] // 2
    num_assignments = num_tokens * top_k
    rows = max_padded_rows(num_assignments, num_experts, BLOCK_M)
    align = plan_align(num_assignments, num_experts, BLOCK_M, None if expert_map is None else expert_map.numel(),
                       rows, options, arrival_slot=0, one_pass=one_pass_programs(options, x.device))
    sms = num_sms(x.device)

    def gemm(w, tile: GluonTile, reduce_dim: int, cols: int, gated: bool, how: WoGemmLaunch, opt) -> BoundLaunch:
        col_blocks = cols // tile.block_n
        return BoundLaunch(how.kernel(), (max(1, min(sms, cdiv(rows, BLOCK_M) * col_blocks)),), 7,
                           (*scale_strides(w), reduce_dim, col_blocks), W_ROWS=w.q.shape[1],
                           GATE_OFFSET=inter if gated else 0, GATED=gated, STAGES=how.stages, GROUP_M=tile.group_m,
                           SCHEME=GLUON_WO_SCHEMES[scheme], GROUP=max(w.group_size, 1), num_warps=how.num_warps,
                           maxnreg=MAX_REGISTERS, **how.variant(opt), **launch)

    regions = [*align.regions, ("dst", torch.int32, (num_assignments,)), ("x_perm", x.dtype, (rows, hidden)),
               ("h", x.dtype, (rows, inter)), ("y", x.dtype, (rows, hidden))]
    how_up, how_down = wo_gemm_launch(scheme, up, True, variants.up), wo_gemm_launch(scheme, down, False, variants.down)
    weight_key = (_WO, x.device, scheme, how_up.q_block, how_down.q_block, how_up.words, how_down.words)
    blocks = ((BLOCK_M, up.block_k), (BLOCK_M, how_up.c_block_n), (BLOCK_M, down.block_k),
              (BLOCK_M, how_down.c_block_n))  # (a split GEMM's output blocks: a partition's half)
    return WoLeanPlan(WorkspaceSpec.of(regions, counters=align.kept_counters), align, weight_key, blocks,
                      gather_launch(x, rows, num_assignments, top_k, launch),
                      gemm(w13, up, hidden, inter, True, how_up, variants.up),
                      gemm(w2, down, inter, hidden, False, how_down, variants.down),
                      combine_launch(num_tokens, hidden, num_experts, top_k, expert_map, launch))


def wo_weight_pair(q13: torch.Tensor, q2: torch.Tensor, key: tuple) -> DescriptorPair:
    """The stored weights' descriptors of a plan's ``weight_key``: q13 [E, 2N, K / PACK] as [E*2N, K / PACK], q2
    [E, K, N / PACK] as [E*K, N / PACK]; as int32 words where the key says (int4; mxfp4 with FAST)
    (``WeightDescriptors.get``'s builder)."""
    def rows(q: torch.Tensor, words: bool) -> torch.Tensor:
        view = q.detach().view(-1, q.shape[2])
        return view.view(torch.int32) if words else view

    return DescriptorPair(gluon_descriptor(rows(q13, key[5]), key[3]), None, gluon_descriptor(rows(q2, key[6]), key[4]))


def activation_descriptors(plan: WoLeanPlan, b: dict) -> tuple:
    """The descriptors over the workspace's regions ``b``: (up A over x_perm, up C over h, down A over h, down C
    over y)."""
    return tuple(gluon_descriptor(b[name], block) for name, block in zip(("x_perm", "h", "h", "y"), plan.blocks))


def wo_launches(plan: WoLeanPlan, b: dict, acts: tuple, pair: DescriptorPair, x, ids, weights, expert_map, out,
                w13, w2) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment, the gather, gate-up, down, the
    combine. ``b``: the workspace's regions; ``acts``: their descriptors; x, ids, weights, map, out may be stand-ins."""
    map_or_ids = expert_map if expert_map is not None else ids  # read only with a map
    launches = align_launches(plan.align, ids, map_or_ids, b, b.get("counters"))
    rows = (b["expert_ids"], b["num_padded"])
    return launches + [(plan.gather, (x, b["sorted_ids"], b["x_perm"], b["dst"])),
                       (plan.up, (acts[0], pair.w13, acts[1], *rows, w13.scale, _zero(w13))),
                       (plan.down, (acts[2], pair.w2, acts[3], *rows, w2.scale, _zero(w2))),
                       (plan.combine, (b["y"], b["dst"], weights, out, ids, map_or_ids))]


def run_wo_lean(x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, expert_map: torch.Tensor | None,
                scheme: str, up: GluonTile = UP_TILE, down: GluonTile | None = None,
                options: GluonWoGemms = GluonWoGemms()) -> torch.Tensor:
    """out [M, K] of a call on the weight-only Gluon path, checked by the caller (``run_experts_wo_gluon``): w13 / w2
    ``WeightArgs`` or ``WoWeight``; ``ids``, ``weights``, ``expert_map`` contiguous; ``up`` / ``down``: the tiles
    (None: ``down_tile`` for N); ``options``: the GEMMs' variants."""
    down = down_tile(w13.q.shape[1] // 2) if down is None else down
    plan = wo_plan_for(x, w13, w2, ids, weights, expert_map, scheme, up, down, options)
    out = torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)  # [M, K]
    pair = _DESCRIPTORS.get(w13.q, w2.q, plan.weight_key, wo_weight_pair)
    b, pooled = workspace_regions(plan.workspace, x.device)
    if pooled:
        sequence = _sequence(plan, b, pair, w13, w2, expert_map is not None)
        if sequence is not None:
            sequence.launch((x, ids, weights, out, expert_map))
            return out
    for launch, pointers in wo_launches(plan, b, activation_descriptors(plan, b), pair, x, ids, weights, expert_map,
                                        out, w13, w2):
        launch(*pointers)
    return out


def _sequence(plan: WoLeanPlan, b: dict, pair: DescriptorPair, w13, w2, has_map: bool):
    """The recorded launches of ``plan`` for these weights and pooled regions on this thread (recorded now if stale),
    or None where they cannot be used yet (a launch not compiled, a Triton launch hook). The scales and zeros are
    recorded by address (in the key: an in-place update keeps them, a new tensor records again)."""
    key = (plan, threading.get_ident(), id(w13.q), w13.scale.data_ptr(), _zero(w13).data_ptr(), w2.scale.data_ptr(),
           _zero(w2).data_ptr())
    sequence = _SEQUENCES.get(key)
    if sequence is None or not sequence.current(b, pair):
        launches = wo_launches(plan, b, activation_descriptors(plan, b), pair, _Slot(X), _Slot(IDS), _Slot(WEIGHTS),
                               _Slot(MAP) if has_map else None, _Slot(OUT), w13, w2)
        sequence = record_launches(launches, b, pair)
        if sequence is None:
            return None
        keep_sequence(_SEQUENCES, _lock, key, sequence, MAX_PLANS, w13.q)  # it holds q13's descriptors: goes with it
    if sequence.raw and not sequence.hooks.idle():
        return None
    return sequence


def wo_gluon_lean_inputs(x, w13, w2, ids, weights, scheme: str):
    """What ``triton_quant_fast`` records a backend call (no map, the default tiles) from: (plan, the pool, its
    launches as a function of (b, x, ids, weights, out), the weights bound), or None above the pool's size (the
    regions are then per call, and descriptors cannot be recorded over them)."""
    plan = wo_plan_for(x, w13, w2, ids, weights, None, scheme, UP_TILE, down_tile(w13.q.shape[1] // 2),
                       wo_options(w13, w2, scheme, x.shape[0]))
    if plan.workspace.nbytes > _WORKSPACES.max_bytes:
        return None
    pair = _DESCRIPTORS.get(w13.q, w2.q, plan.weight_key, wo_weight_pair)

    def launches(b: dict, x_arg, ids_arg, weights_arg, out_arg) -> list:
        return wo_launches(plan, b, activation_descriptors(plan, b), pair, x_arg, ids_arg, weights_arg, None, out_arg,
                           w13, w2)

    return plan, _WORKSPACES, launches
