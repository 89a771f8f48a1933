"""What every call of one kind through the weight-only scratch decode (``triton_wo_scratch``) launches
besides the bf16 plans, decided once and cached; and the lean eager form of such a call, recorded once
(``triton_quant_fast`` keeps and serves it like the fused decodes' entries).

    scratch_plan_for(call) --_SCRATCH_PLANS--> ScratchPlan: experts per chunk, per chunk its dequant
    launches (w13, w2) and its expert map (kept, no caller map), the ordered k-sum launch
    scratch_lean_inputs(call) -> (ScratchPlan, SCRATCH_WORKSPACES, launches(b, x, ids, weights, out)): per
    chunk [dequant w13] [align] [gate-up] [dequant w2] [down], then [k-sum], on the kept scratch

Before this each call bound the dequant and k-sum launches anew (``kernel[grid](...)``: Triton's binder
and its specialisation key every time, a new C launcher entry for the k-sum), built its chunk maps with
seven small torch kernels per chunk (DeepSeek-V3: 8 chunks, 113 launches a call, enough to fill the
device's launch queue in 9 back-to-back calls), allocated a scratch of up to 2 GiB and encoded the scratch's
TMA descriptors. The kept form reuses all of it (h and y up to a size).

What the lean form keeps (``SCRATCH_WORKSPACES``, one buffer per (device, stream, thread), at most
``MAX_ENTRIES`` of them): the scratch of one chunk (at most ``triton_wo_scratch.SCRATCH_MAX_BYTES``: 2 GiB
by default; Qwen3-30B-A3B 0.81 GB, Mixtral-8x7B 1.88 GB, DeepSeek-V3 1.97 GB), the alignment's buffers
and its counters, grown to the largest kind seen; h [A, N] and y [A, K] too where they take at most
``triton_cache.REUSE_MAX_BYTES`` (256 MiB), else per call (one fresh byte buffer, freed in stream order).
``release_scratch()`` frees the kept buffers (the entries that use them go stale and record again on their
next call); ``triton.clear_launch_caches`` and ``triton_wo.clear_launch_caches`` do too. A plain call
(CUDA-graph capture, torch.compile, an expert map, the overlapped pipeline) keeps nothing: its scratch is
fresh per call as before.

Every launch is the plain path's own: the same kernels, grids, scalars and constexprs, so the outputs are
bit-equal (the fused hist + scan of the alignment, as in every lean call, writes the same layout).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, c experts per chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import on_config_cache_clear
from moekit.experts.triton_align import align_launches
from moekit.experts.triton_cache import REUSE_MAX_BYTES, WorkspacePool, WorkspaceSpec, descriptor_pair
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels, resolve_launch_options
from moekit.experts.triton_plan import plan_for, sum_launch
from moekit.triton_bind import BoundLaunch

DEQUANT_TILE = (32, 128)  # BLOCK_R, BLOCK_C of the dequant kernel (one 4-warp program: 4096 weights)
MAX_PLANS = 256  # kinds of scratch call kept (a few launches each); the oldest goes first
MAX_ENTRIES = 2  # kept scratch buffers, one per (device, stream, thread); the oldest is freed first
SCRATCH = "scratch"  # the kept region the chunks' matrices are dequantized into

# the kept buffers of lean scratch calls: max_bytes 0, so every spec splits into its kept regions (the scratch,
# the alignment's, the counters; h and y up to REUSE_MAX_BYTES) and the rest, fresh per call; sized to the
# largest kind seen, no power of two
SCRATCH_WORKSPACES = WorkspacePool(max_bytes=0, max_entries=MAX_ENTRIES, pow2=False)


@dataclass(frozen=True, eq=False)
class ScratchChunk:
    """One chunk of experts, [expert0, expert0 + count)."""

    expert0: int
    count: int
    dequant13: BoundLaunch  # pointers: q13, s13, z13, scratch as [c, 2N, K]
    dequant2: BoundLaunch  # pointers: q2, s2, z2, scratch as [c, K, N]
    # the chunk's expert map (global id -> index in the chunk, else -1) where there is no caller map and
    # several chunks, built once (never while a graph captures: then per call); None: the caller's / none
    chunk_map: torch.Tensor | None


@dataclass(eq=False)
class ScratchPlan:
    """What a scratch call of one kind launches besides its chunks' bf16 plans (``triton_plan.plan_for``)."""

    num_experts: int  # E
    per: int  # experts per chunk (all of them in one chunk where they fit)
    chunks: tuple[ScratchChunk, ...]
    ksum: BoundLaunch  # pointers: y, ids, expert_map (ids without one), out; ordered (the folded k-sum's order)
    work_dtype: torch.dtype  # the scratch's, h's and y's: x's (float32 under the interpreter)
    # the lean form's buffers (``lean_spec``): set by the plain path from its chunks' bf16 plans
    workspace: WorkspaceSpec | None = field(default=None)


_SCRATCH_PLANS: dict[tuple, ScratchPlan] = {}
_CHUNK_MAPS: dict[tuple, torch.Tensor] = {}  # (device, E, expert0, c) -> int32 [E]; a few per shape, never dropped
on_config_cache_clear(_SCRATCH_PLANS.clear)


def clear_scratch_plans() -> None:
    """Drop the scratch plans (their launches hold the kernels of the moment) and the kept buffers."""
    _SCRATCH_PLANS.clear()
    release_scratch()


def release_scratch() -> None:
    """Free the lean scratch calls' kept buffers (``SCRATCH_WORKSPACES``); their entries record again."""
    SCRATCH_WORKSPACES.clear()


def held_scratch() -> dict[tuple, torch.Tensor]:
    """(device, stream, thread) -> the byte buffer kept for lean scratch calls (memory accounting)."""
    return SCRATCH_WORKSPACES.held()


def dequant_launch(w, scheme_id: int, rows: int, cols: int, count: int, expert0: int, out_strides: tuple,
                   options: LaunchOptions = LaunchOptions(), tile: tuple[int, int] = DEQUANT_TILE) -> BoundLaunch:
    """The dequant kernel's launch over experts [expert0, expert0 + count) of the packed weight ``w`` (a
    ``triton_wo_plan.WeightArgs``) into out [count, rows, cols] of strides ``out_strides`` (rows contiguous);
    pointers: q, scale, zero, out. ``tile``: (BLOCK_R, BLOCK_C), powers of 2, BLOCK_C >= 32."""
    block_r, block_c = tile
    stored = cols if scheme_id == 0 else w.q.shape[2]  # int8: one byte a weight, else two weights a byte
    span = block_c if scheme_id == 0 else min(block_c, w.group_size)
    return BoundLaunch(
        kernels("dequant_wo").dequant_wo_kernel, (cdiv(rows, block_r), cdiv(cols, block_c), count), 4,
        (rows, cols, stored, expert0, *w.strides, *out_strides),
        SCHEME=scheme_id, GROUP=w.group_size, SPAN=span, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
        cached=options.cached_launcher, raw=options.raw_launcher,
    )


def chunk_map(expert_map: torch.Tensor | None, num_experts: int, expert0: int, chunk: int,
              device: torch.device) -> torch.Tensor:
    """The expert map of one chunk: global id -> its index in [expert0, expert0 + chunk), -1 for every
    other expert (through ``expert_map`` where there is one; without one, global ids are local ids)."""
    local = torch.arange(num_experts, dtype=torch.int32, device=device) if expert_map is None else expert_map
    inside = (local >= expert0) & (local < expert0 + chunk)
    return torch.where(inside, local - expert0, torch.full_like(local, -1))


def _kept_chunk_map(num_experts: int, expert0: int, count: int, device: torch.device) -> torch.Tensor | None:
    """The chunk's map without a caller map, built once (from the host: complete when returned); None where
    none is kept yet while a CUDA graph captures (a tensor built then would be the graph's, written on replay)."""
    key = (device, num_experts, expert0, count)
    kept = _CHUNK_MAPS.get(key)
    if kept is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        values = [e - expert0 if expert0 <= e < expert0 + count else -1 for e in range(num_experts)]
        kept = _CHUNK_MAPS[key] = torch.tensor(values, dtype=torch.int32, device=device)
    return kept


def scratch_key(x, w13, w2, ids, weights, expert_map, scheme_id: int, activation, options: LaunchOptions,
                per: int, overlap: bool, b13=None, b2=None) -> tuple:
    """The kind of a scratch call: what its launches depend on but the tensors' contents and addresses
    (``activation``: a name or an ``ActivationSpec``; b13 / b2: whether each is there, its dtype, strides and
    alignment: the chunks' bf16 plans are keyed by them too, and their values are each call's pointers)."""

    def tensor(t):
        return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & 15)

    return (tensor(x), x.device, *(tensor(t) for w in (w13, w2) for t in (w.q, w.scale, w.zero)), w13.group_size,
            w2.group_size, tensor(ids), tensor(weights), tensor(expert_map), scheme_id, activation, options, per,
            overlap, tensor(b13), tensor(b2))


def scratch_plan_for(key: tuple, x: torch.Tensor, w13, w2, top_k: int, expert_map, scheme_id: int, per: int,
                     options: LaunchOptions) -> ScratchPlan:
    """The cached scratch plan of this call's ``key`` (``scratch_key``), else a new one; ``w13`` / ``w2``:
    ``WeightArgs``; ``per``: experts per chunk. Not kept where a chunk map had to wait (a graph captures)."""
    plan = _SCRATCH_PLANS.get(key) if options.cache_plans else None
    if plan is None:
        num_experts = w13.q.shape[0]
        plan = _build(x, w13, w2, top_k, expert_map, scheme_id, per, options)
        waited = expert_map is None and any(c.count != num_experts and c.chunk_map is None for c in plan.chunks)
        if options.cache_plans and not waited:
            put_bounded(_SCRATCH_PLANS, key, plan, MAX_PLANS)
    return plan


def chunk_map_of(plan: ScratchPlan, chunk: ScratchChunk, expert_map, device: torch.device) -> torch.Tensor | None:
    """The expert map the chunk's launches take: the caller's (or None) for one chunk of all experts, the kept
    one, else built now (``chunk_map``)."""
    if chunk.count == plan.num_experts:
        return expert_map
    if expert_map is None and chunk.chunk_map is not None:
        return chunk.chunk_map
    return chunk_map(expert_map, plan.num_experts, chunk.expert0, chunk.count, device)


def _build(x, w13, w2, top_k: int, expert_map, scheme_id: int, per: int, options: LaunchOptions) -> ScratchPlan:
    (num_experts, two_n), (num_tokens, hidden) = w13.q.shape[:2], x.shape
    n = two_n // 2
    resolved = resolve_launch_options(options, x.device)  # what the chunks' bf16 plans resolve
    chunks = []
    for expert0 in range(0, num_experts, per):
        count = min(per, num_experts - expert0)
        kept = None
        if expert_map is None and count != num_experts:
            kept = _kept_chunk_map(num_experts, expert0, count, x.device)
        chunks.append(ScratchChunk(
            expert0, count,
            dequant_launch(w13, scheme_id, two_n, hidden, count, expert0, (two_n * hidden, hidden), resolved),
            dequant_launch(w2, scheme_id, hidden, n, count, expert0, (hidden * n, n), resolved), kept))
    ksum = sum_launch(num_tokens, hidden, top_k, num_experts, expert_map, resolved, ordered=True)
    return ScratchPlan(num_experts, per, tuple(chunks), ksum, torch.float32 if interpreting() else x.dtype)


def scratch_weights(bf16, w13_view: torch.Tensor, w2_view: torch.Tensor) -> tuple:
    """What a chunk's bf16 GEMMs take for its scratch views: the views, or their TMA descriptors (built
    now: the scratch is the call's, or the pool's for a record, never the per-weight cache's)."""
    if bf16.descriptor_key is None:
        return w13_view, None, w2_view
    pair = descriptor_pair(w13_view, w2_view, bf16.descriptor_key)
    return pair.w13, pair.w13_up, pair.w2


def lean_spec(plan: ScratchPlan, bf16_plans: list, num_assignments: int, n: int, hidden: int) -> WorkspaceSpec:
    """The lean form's buffers: the scratch of one chunk and the union of the chunks' alignment regions (the
    chunks run in stream order, so one set serves them all) kept; h [A, N] and y [A, K] kept too while they
    take at most ``REUSE_MAX_BYTES`` together (the pools' rule for a whole workspace: Mixtral-8x7B M=1024 75 MB,
    Qwen3-30B-A3B M=4096 184 MB), else per call; the counters the most any chunk's plan asks (the fused
    hist + scan's arrival slot)."""
    align: dict[str, tuple] = {}
    for bf16 in bf16_plans:
        for name, dtype, shape in (bf16.align.regions if bf16.align is not None else ()):
            size = math.prod(shape)
            if name not in align or align[name][1][0] < size:
                align[name] = (dtype, (size,))
    work = plan.work_dtype
    regions = [(SCRATCH, work, (plan.per * 2 * n * hidden,)), *((name, d, s) for name, (d, s) in align.items()),
               ("h", work, (num_assignments, n)), ("y", work, (num_assignments, hidden))]
    small = num_assignments * (n + hidden) * work.itemsize <= REUSE_MAX_BYTES
    return WorkspaceSpec.of(regions, counters=max(bf16.workspace.counters for bf16 in bf16_plans),
                            kept=(SCRATCH, *align, *(("h", "y") if small else ())))


def scratch_lean_inputs(x, w13, w2, ids, weights, scheme_id: int, activation: str, options: LaunchOptions,
                        per: int, overlap: bool):
    """(plan, SCRATCH_WORKSPACES, launches(b, x, ids, weights, out)) for ``triton_quant_fast`` to record a plain
    scratch call without a map or biases (``triton_quant_fast`` keeps none with them; ``activation``: a name or a
    spec) that just ran (``w13`` / ``w2``: ``WeightArgs``; ``options``: the custom op's),
    or None: the overlapped pipeline, a kind the plain path did not keep. The launches not compiled yet (the
    fused hist + scan) run once here on the kept buffers (the output dropped)."""
    key = scratch_key(x, w13, w2, ids, weights, None, scheme_id, activation, options, per, overlap)
    plan = _SCRATCH_PLANS.get(key)
    if overlap or plan is None or plan.workspace is None:
        return None
    two_n, hidden = w13.q.shape[1], x.shape[1]
    n = two_n // 2

    def launches(b: dict, x_arg, ids_arg, weights_arg, out_arg) -> list:
        scratch, counters, steps = b[SCRATCH], b.get("counters"), []
        for chunk in plan.chunks:
            w13_view = scratch[:chunk.count * two_n * hidden].view(chunk.count, two_n, hidden)  # [c, 2N, K]
            w2_view = scratch[:chunk.count * hidden * n].view(chunk.count, hidden, n)  # [c, K, N]
            cmap = chunk_map_of(plan, chunk, None, x.device)
            bf16 = plan_for(x, w13_view, w2_view, ids, weights, cmap, activation, None, options)
            w13_arg, up_arg, w2_arg = scratch_weights(bf16, w13_view, w2_view)
            rows = (None, None, None) if bf16.align is None else (b["sorted_ids"], b["expert_ids"], b["num_padded"])
            steps.append((chunk.dequant13, (w13.q, w13.scale, w13.zero, w13_view)))
            if bf16.align is not None:
                steps += align_launches(bf16.align, ids_arg, ids_arg if cmap is None else cmap, b, counters)
            steps.append((bf16.gate_up, (x_arg, w13_arg, up_arg, None, b["h"], ids_arg, *rows, cmap)))
            steps.append((chunk.dequant2, (w2.q, w2.scale, w2.zero, w2_view)))
            steps.append((bf16.down, (b["h"], w2_arg, None, b["y"], weights_arg, ids_arg, *rows, None, None, None)))
        steps.append((plan.ksum, (b["y"], ids_arg, ids_arg, out_arg)))
        return steps

    parts = plan.workspace.parts()
    b = dict(SCRATCH_WORKSPACES.pooled(parts.pooled, x.device))
    b.update(parts.fresh.allocate(x.device))
    warm = launches(b, x, ids, weights, torch.empty_like(x))
    if any(launch._launcher is None and launch._raw is None for launch, _ in warm):
        for launch, pointers in warm:
            launch(*pointers)
    return plan, SCRATCH_WORKSPACES, launches
