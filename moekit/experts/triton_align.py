"""Block alignment on the device: the launchers of ``_kernels/align.py`` and the op
``torch.ops.moekit.align_block_triton`` (no autograd layer: ``op_library``). No host sync: every size comes from
shapes.

Torch twin: ``moekit.layouts.block_aligned.align_block``; the layouts are equal element for element.

Shapes: A = M*k assignments, E local experts, EP = next_pow2(E + 1) histogram bins, B = block size,
R = rows of sorted_ids, R/B blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import torch

from moekit.experts.op_library import define_inference_op
from moekit.experts.triton_launch import (
    ALIGN_CHUNK, LaunchOptions, cdiv, kernels, next_pow2, resolve_launch_options,
)
from moekit.triton_bind import BoundLaunch, interpreting
from moekit.layouts.block_aligned import BlockAlignedLayout, check_align_args, use_naive
from moekit.layouts.grouping import max_padded_rows


@dataclass(frozen=True)
class AlignPlan:
    """The launches that build one block-aligned layout, decided once per (A, E, B, map, options): the
    single-program one (A <= one chunk, few bins), the naive shortcut's, the one-launch ``place`` (its
    programs histogram all ids themselves), hist then ``place``, or hist, scan and scatter (a launch
    with an empty grid is None); or none at all when ``folded`` into the gate-up GEMM (its programs
    write sorted_ids, expert_ids and num_padded). ``regions`` are the buffers they fill, for a
    workspace. ``launches`` is how many run per call."""

    # (name, dtype, shape): sorted_ids [R], expert_ids [R/B], num_padded [1], counts [E], + hist, chunk_base or
    # chunk_start [chunks, EP], offsets [EP]
    regions: tuple
    small: BoundLaunch | None = None
    naive: BoundLaunch | None = None
    hist: BoundLaunch | None = None
    scan: BoundLaunch | None = None
    scatter: BoundLaunch | None = None
    place: BoundLaunch | None = None  # scan + scatter (after hist), or all three alone (no hist)
    # hist + scan in one launch (``LaunchOptions.align_scan_fold``), taken instead of hist and scan where the
    # caller passes the pool's kept counters (its arrival slot); None: hist and scan always
    hist_scan: BoundLaunch | None = None
    # hist, scan and scatter in one launch of a persistent grid (``_kernels/align_one_pass.py``,
    # ``LaunchOptions.align_one_pass_from``), taken instead of the chunked launches where the caller passes its kept
    # counters
    one: BoundLaunch | None = None
    one_slot: int = 0  # the one-pass launch's first counter (it uses three)
    folded: bool = False  # no launch: the gate-up GEMM's prologue (``_kernels/gemm.py``, FOLD); no counts

    @property
    def launches(self) -> int:
        """Launches per call (with the kept counters: hist and scan as one where folded)."""
        if self.one is not None:
            return 1
        launches = (self.small, self.naive, self.hist, self.scan, self.scatter, self.place)
        return sum(x is not None for x in launches) - (self.hist_scan is not None)

    @property
    def kept_counters(self) -> int:
        """The kept int32 counters (0 between calls) the plan's launches with counters use from its arrival
        slot on: 3 for the one-pass launch (arrivals, scanned, exits), 1 for the fused hist + scan, else 0."""
        return 3 if self.one is not None else int(self.hist_scan is not None)


@dataclass(frozen=True)
class BlockRows:
    """How the GEMMs of one call walk their rows: the tiny-batch shortcut (block a = assignment a, one
    16-row block each, no alignment) or the block-aligned layout of ``align``."""

    block_m: int  # the GEMMs' BLOCK_M: 16 in the shortcut
    num_pid_m: int  # M-blocks of the GEMM grids: A in the shortcut, else ceil(R / B)
    align: AlignPlan | None  # None in the shortcut


def shortcut_allowed(num_tokens: int, options: LaunchOptions) -> bool:
    """Whether the tiny-batch shortcut may serve a call of ``num_tokens`` tokens (where ``use_naive`` holds too):
    up to ``options.shortcut_max_tokens``."""
    return num_tokens <= options.shortcut_max_tokens


def plan_block_rows(num_assignments: int, num_experts: int, block_m: int, expert_map: torch.Tensor | None,
                    options: LaunchOptions, shortcut: bool = True, fold: bool = False,
                    arrival_slot: int | None = None, one_pass: int = 0) -> BlockRows:
    """The shortcut where ``use_naive`` allows it (and ``shortcut``), else the alignment into blocks of
    ``block_m`` rows, its row count bounded from shapes alone (``max_padded_rows``): folded into the
    caller's gate-up GEMM where it can take it (``fold``) and A <= ``options.align_fold_max``.
    ``arrival_slot``: where the caller keeps counters, the slot a fused hist + scan may count in; ``one_pass``:
    the programs a one-pass alignment may run (``one_pass_programs``; 0: none)."""
    if shortcut and use_naive(num_assignments, num_experts, expert_map):
        return BlockRows(16, num_assignments, None)
    num_pid_m = cdiv(max_padded_rows(num_assignments, num_experts, block_m), block_m)
    if fold and 0 < num_assignments <= options.align_fold_max:
        return BlockRows(block_m, num_pid_m, AlignPlan(_layout_regions(num_pid_m * block_m, num_pid_m), folded=True))
    num_global = None if expert_map is None else expert_map.numel()
    return BlockRows(block_m, num_pid_m, plan_align(num_assignments, num_experts, block_m, num_global,
                                                    num_pid_m * block_m, options, arrival_slot=arrival_slot,
                                                    one_pass=one_pass))


def plan_align(num_assignments: int, num_experts: int, block_size: int, num_global: int | None, num_rows: int,
               options: LaunchOptions, naive: bool = False, arrival_slot: int | None = None,
               one_pass: int = 0) -> AlignPlan:
    """The launches for A assignments into ``num_rows`` rows of sorted_ids (>= R; the rest padding).
    ``num_global``: the expert map's length, None without one. ``options``: resolved for the device.
    ``one_pass``: with an ``arrival_slot``, past align_two_launch_max and from ``options.align_one_pass_from``
    assignments, the programs at most of the one-pass launch (``one_pass_programs``), taken instead of the fused
    hist + scan and the scatter where the caller passes its counters."""
    e_pad, num_blocks = next_pow2(num_experts + 1), cdiv(num_rows, block_size)
    regions = _layout_regions(num_rows, num_blocks) + (("counts", torch.int32, (num_experts,)),)
    launch = dict(cached=options.cached_launcher, raw=options.raw_launcher, **options.pdl_kwargs())
    common = (num_assignments, num_experts, 0 if num_global is None else num_global, block_size, num_rows, num_blocks)
    if naive:
        return AlignPlan(regions, naive=BoundLaunch(
            kernels("align").align_naive_kernel, (1,), 5, (num_assignments, num_experts, block_size),
            A_PAD=next_pow2(max(num_assignments, 1)), E_PAD=e_pad, BLOCK_PAD=next_pow2(block_size), **launch))
    if 0 < num_assignments <= options.align_small_max and e_pad <= options.align_small_max_bins:
        return AlignPlan(regions, small=BoundLaunch(
            kernels("align").align_small_kernel, (1,), 6, common,
            CHUNK=ALIGN_CHUNK, E_PAD=e_pad, BLOCKS_PER_ITER=max(1, min(next_pow2(num_blocks), 4096 // e_pad)),
            BLOCK_PAD=next_pow2(block_size), HAS_MAP=num_global is not None, **launch))
    has_map = num_global is not None
    if 0 < num_assignments <= max(options.align_one_launch_max, options.align_two_launch_max):
        return _plan_place(regions, common, e_pad, has_map, launch,
                           own_hist=num_assignments <= options.align_one_launch_max)
    plan = _plan_chunked(regions, common, e_pad, has_map, launch, arrival_slot if options.align_scan_fold else None)
    start = options.align_one_pass_from
    if one_pass and arrival_slot is not None and start and num_assignments >= start:
        one = _one_pass(common, e_pad, has_map, launch, one_pass, arrival_slot)
        return replace(plan, one=one, one_slot=arrival_slot)
    return plan


# The one-pass grid at one program per SM (not two) while its chunk programs fit in one per SM (``_one_pass``): H200,
# the alignment alone at M = 4096 (host_pyhost_device_check, raw/NVIDIA_H200-2026-12-03-26f5379-pyhost.*): DeepSeek-V3
# 22.56 µs in 132 programs against 26.31 in 224, Qwen3 20.56 against 21.64 in 168; layouts equal. False: at most two
# per SM always (that script's A/B only).
ONE_PASS_ONE_PER_SM = True


def one_pass_programs(options: LaunchOptions, device: torch.device) -> int:
    """The programs the one-pass alignment may run on ``device`` (0: none, ``options.align_one_pass_from`` 0): two
    per SM (all resident: the launch is cooperative); one under the interpreter, whose programs run one after
    another (a barrier would wait forever)."""
    if not options.align_one_pass_from:
        return 0
    if interpreting() or device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _layout_regions(num_rows: int, num_blocks: int) -> tuple:
    """The layout the GEMMs read: sorted_ids [R], expert_ids [R/B], num_padded [1] (int32)."""
    i32 = torch.int32
    return (("sorted_ids", i32, (num_rows,)), ("expert_ids", i32, (num_blocks,)), ("num_padded", i32, (1,)))


def _plan_place(regions: tuple, common: tuple, e_pad: int, has_map: bool, launch: dict, own_hist: bool) -> AlignPlan:
    """``align_place_kernel`` alone (``own_hist``: its programs histogram all A ids themselves) or after
    the histogram launch (its programs sum the [chunks, EP] histogram themselves)."""
    k = kernels("align")
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks = common
    num_chunks = cdiv(num_assignments, ALIGN_CHUNK)
    regions += (("hist", torch.int32, (num_chunks, e_pad)),  # [chunks, EP]; unused with own_hist
                ("chunk_start", torch.int32, (num_chunks, e_pad)))  # [chunks, EP] each chunk's first row per expert
    hist = None if own_hist else BoundLaunch(
        k.align_hist_kernel, (num_chunks,), 3, (num_assignments, num_experts, num_global),
        CHUNK=ALIGN_CHUNK, E_PAD=e_pad, HAS_MAP=has_map, **launch)
    blocks_per_program = _blocks_per_program(num_blocks, e_pad)
    place = BoundLaunch(
        k.align_place_kernel, (num_chunks + cdiv(num_blocks, blocks_per_program),), 8, (*common, num_chunks),
        CHUNK=ALIGN_CHUNK, E_PAD=e_pad, A_PAD=next_pow2(num_assignments) if own_hist else 1,
        CHUNK_ROWS=max(1, min(next_pow2(num_chunks), 4096 // e_pad)), BLOCKS_PER_PROGRAM=blocks_per_program,
        BLOCK_PAD=next_pow2(block_size), OWN_HIST=own_hist, HAS_MAP=has_map, **launch)
    return AlignPlan(regions, hist=hist, place=place)


def _plan_chunked(regions: tuple, common: tuple, e_pad: int, has_map: bool, launch: dict,
                  arrival_slot: int | None = None) -> AlignPlan:
    """Histogram per chunk, one scan, then the scatter (``_kernels/align.py`` explains the three); with an
    ``arrival_slot`` also the fused hist + scan (taken where the caller passes its kept counters)."""
    k = kernels("align")
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks = common
    num_chunks = cdiv(num_assignments, ALIGN_CHUNK)
    chunk_rows = (max(num_chunks, 1), e_pad)
    regions += (("hist", torch.int32, chunk_rows), ("chunk_base", torch.int32, chunk_rows),  # [chunks, EP]
                ("offsets", torch.int32, (e_pad,)))  # [EP]; offsets[E] = rows used
    hist = BoundLaunch(k.align_hist_kernel, (num_chunks,), 3, (num_assignments, num_experts, num_global),
                       CHUNK=ALIGN_CHUNK, E_PAD=e_pad, HAS_MAP=has_map, **launch) if num_chunks else None
    chunk_rows = _scan_rows(num_chunks, e_pad)
    scan = BoundLaunch(k.align_scan_kernel, (1,), 5, (num_chunks, num_experts, block_size),
                       CHUNK_ROWS=chunk_rows, E_PAD=e_pad, **launch)
    hist_scan = None
    if arrival_slot is not None and num_chunks:
        hist_scan = BoundLaunch(k.align_hist_scan_kernel, (num_chunks,), 8,
                                (num_assignments, num_experts, num_global, num_chunks, block_size, arrival_slot),
                                CHUNK=ALIGN_CHUNK, E_PAD=e_pad, CHUNK_ROWS=chunk_rows, HAS_MAP=has_map, **launch)
    blocks_per_program = _blocks_per_program(num_blocks, e_pad)
    grid = num_chunks + cdiv(num_blocks, blocks_per_program)
    scatter = BoundLaunch(k.align_scatter_kernel, (grid,), 8, (*common, num_chunks), CHUNK=ALIGN_CHUNK, E_PAD=e_pad,
                          BLOCKS_PER_PROGRAM=blocks_per_program, BLOCK_PAD=next_pow2(block_size), HAS_MAP=has_map,
                          **launch) if grid else None
    return AlignPlan(regions, hist=hist, scan=scan, scatter=scatter, hist_scan=hist_scan)


def _scan_rows(num_chunks: int, e_pad: int) -> int:
    """Rows of hist [chunks, EP] the scan sums at a time ([rows, EP] <= 8192 lanes)."""
    return max(1, min(next_pow2(max(num_chunks, 1)), 8192 // e_pad))


def _blocks_per_program(num_blocks: int, e_pad: int) -> int:
    """Blocks one scatter item writes ([blocks, EP] <= 4096 lanes)."""
    return max(1, min(next_pow2(max(num_blocks, 1)), 4096 // e_pad))


def _one_pass(common: tuple, e_pad: int, has_map: bool, launch: dict, programs: int, slot: int) -> BoundLaunch | None:
    """The one-pass launch (hist, scan and scatter: ``_kernels/align_one_pass.py``) on at most ``programs``
    programs: chunk programs of at least two consecutive chunks each (fewer hist rows for the one-program scan),
    as few as fit in ``programs``, then one more per block item while there is room; counting in the kept counters
    from ``slot`` on. None without assignments. It reads and writes the chunked plan's regions (hist, chunk_base
    [chunks, EP]: a row per chunk program; offsets [EP]) and the layout. H200, Qwen3-30B-A3B
    (f6f35e93:benchmarks/host_big3_device_check.py): A = 32768 (256 chunks), 128 chunk programs of 2 in a grid of 132
    20.6 µs against 23.1 for 256 of 1 (run 2), in a grid of 168 21.9 (merged main; DeepSeek-V3 26.6 in 224 against 22.6
    in 132: hence ``ONE_PASS_ONE_PER_SM``, 20.56 / 22.56 in 132 on one run); A = 131072, 256 of 4 chunks 39.0-39.2
    against 45.4 for 128 of 8."""
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks = common
    num_chunks = cdiv(num_assignments, ALIGN_CHUNK)
    if not num_chunks:
        return None
    per = max(2, cdiv(num_chunks, programs))  # chunks a chunk program
    chunk_programs = cdiv(num_chunks, per)
    blocks_per_program = _blocks_per_program(num_blocks, e_pad)
    block_items = cdiv(num_blocks, blocks_per_program)
    if ONE_PASS_ONE_PER_SM and chunk_programs <= programs // 2:  # the chunk programs fit in one per SM: no more
        programs //= 2
    return BoundLaunch(kernels("align_one_pass").align_one_pass_kernel, (min(programs, chunk_programs + block_items),),
                       10, (*common, num_chunks, block_items, slot, per, chunk_programs), CHUNK=ALIGN_CHUNK,
                       E_PAD=e_pad, CHUNK_ROWS=_scan_rows(chunk_programs, e_pad), BLOCKS_PER_PROGRAM=blocks_per_program,
                       BLOCK_PAD=next_pow2(block_size), HAS_MAP=has_map, launch_cooperative_grid=True, **launch)


def run_align(plan: AlignPlan, ids: torch.Tensor, expert_map: torch.Tensor | None, b: dict) -> None:
    """Launch ``plan`` on ids [M, k] (contiguous) into the buffers ``b`` (named as ``plan.regions``); a
    folded plan launches nothing (the gate-up GEMM fills them)."""
    for launch, pointers in align_launches(plan, ids, expert_map if expert_map is not None else ids, b):
        launch(*pointers)


def align_launches(plan: AlignPlan, ids, map_arg, b: dict, counters=None) -> list:
    """``plan``'s launches in order, each (BoundLaunch, its pointers): on ids (contiguous [M, k]) and
    ``map_arg`` (the expert map, or ids without one: never read then), into the buffers ``b``; with the
    caller's kept ``counters`` (int32, 0) hist and scan as one launch where the plan has it, or the whole
    alignment as one where the plan has that and the counters reach its three slots. The arguments may be
    stand-ins (``triton_lean`` records where each goes)."""
    if plan.folded:
        return []
    if plan.small is not None:
        return [(plan.small, (ids, map_arg, b["sorted_ids"], b["expert_ids"], b["counts"], b["num_padded"]))]
    if plan.naive is not None:
        return [(plan.naive, (ids, b["sorted_ids"], b["expert_ids"], b["counts"], b["num_padded"]))]
    if plan.one is not None and counters is not None and counters.numel() >= plan.one_slot + 3:
        return [(plan.one, (ids, map_arg, b["hist"], b["chunk_base"], b["counts"], b["offsets"], b["num_padded"],
                            b["sorted_ids"], b["expert_ids"], counters))]
    launches = [] if plan.hist is None else [(plan.hist, (ids, map_arg, b["hist"]))]
    if plan.place is not None:
        launches.append((plan.place, (ids, map_arg, b["hist"], b["chunk_start"], b["sorted_ids"], b["expert_ids"],
                                      b["counts"], b["num_padded"])))
        return launches
    if plan.hist_scan is not None and counters is not None:
        launches = [(plan.hist_scan, (ids, map_arg, b["hist"], b["chunk_base"], b["counts"], b["offsets"],
                                      b["num_padded"], counters))]
    else:
        launches.append((plan.scan, (b["hist"], b["chunk_base"], b["counts"], b["offsets"], b["num_padded"])))
    if plan.scatter is not None:
        launches.append((plan.scatter, (ids, map_arg, b["chunk_base"], b["offsets"], b["counts"], b["num_padded"],
                                        b["sorted_ids"], b["expert_ids"])))
    return launches


# The op takes the alignment's launch options as primitive arguments (an op's schema has no dataclasses): a compiled
# caller picks them like an eager one, and they are resolved inside the op.
def _align_kernel(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: Optional[torch.Tensor], allow_naive: bool,
    dependent_launch: bool, align_small_max: int, align_small_max_bins: int,
    align_one_launch_max: int = LaunchOptions.align_one_launch_max,
    align_two_launch_max: int = LaunchOptions.align_two_launch_max,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body: topk_ids [M, k] (int), the layout's sizes, expert_map [E_global] or None, the options'
    fields -> (sorted_ids [R], expert_ids [R/B], num_padded [1], counts [E]), int32."""
    topk_ids = topk_ids.contiguous()
    num_assignments = topk_ids.numel()
    naive = allow_naive and use_naive(num_assignments, num_experts, expert_map)
    plan = _op_plan(num_assignments, num_experts, block_size, None if expert_map is None else expert_map.numel(),
                    naive, dependent_launch, align_small_max, align_small_max_bins, align_one_launch_max,
                    align_two_launch_max, topk_ids.device)
    buffers = {name: torch.empty(shape, dtype=dtype, device=topk_ids.device) for name, dtype, shape in plan.regions}
    # A = 0 too: counts, num_padded
    run_align(plan, topk_ids, None if expert_map is None else expert_map.contiguous(), buffers)
    return buffers["sorted_ids"], buffers["expert_ids"], buffers["num_padded"], buffers["counts"]


@functools.lru_cache(maxsize=256)
def _op_plan(num_assignments: int, num_experts: int, block_size: int, num_global: int | None, naive: bool,
             dependent_launch: bool, small_max: int, small_max_bins: int, one_launch_max: int, two_launch_max: int,
             device: torch.device) -> AlignPlan:
    """The op's plan, its options resolved for ``device``, built once per kind of call: a compiled graph passes the
    same sizes and constants every call. Its launches go through ``kernel[grid]`` (no cached launcher): they keep
    no state, so one plan serves every call of its kind, the same launches as one built per call."""
    options = resolve_launch_options(
        LaunchOptions(dependent_launch=dependent_launch, align_small_max=small_max, align_small_max_bins=small_max_bins,
                      cached_launcher=False, align_one_launch_max=one_launch_max, align_two_launch_max=two_launch_max),
        device)
    num_rows = num_assignments * block_size if naive else max_padded_rows(num_assignments, num_experts, block_size)
    return plan_align(num_assignments, num_experts, block_size, num_global, num_rows, options, naive)


def clear_op_plans() -> None:
    """Drop the op's kept plans (they hold the kernels they were built with: a test's interpreted ones, say)."""
    _op_plan.cache_clear()


def _align_fake(topk_ids, num_experts, block_size, expert_map, allow_naive, *options):
    num_assignments = topk_ids.numel()
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        rows, blocks = num_assignments * block_size, num_assignments
    else:
        rows = max_padded_rows(num_assignments, num_experts, block_size)
        blocks = cdiv(rows, block_size)
    new = dict(dtype=torch.int32, device=topk_ids.device)
    return (torch.empty(rows, **new), torch.empty(blocks, **new), torch.empty(1, **new),
            torch.empty(num_experts, **new))


# No autograd layer (``op_library``): its inputs are integer tensors, which never need a gradient.
define_inference_op("align_block_triton", _align_kernel, _align_fake)


def align_block_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: torch.Tensor | None = None,
    allow_naive: bool = True,
    *,
    options: LaunchOptions = LaunchOptions(),
) -> BlockAlignedLayout:
    """``align_block`` on the device (Triton kernels, no host sync); equal to it element for element.
    ``options``: its dependent_launch and align_* fields apply."""
    check_align_args(topk_ids, num_experts, block_size, expert_map)
    sorted_ids, expert_ids, num_padded, counts = torch.ops.moekit.align_block_triton(
        topk_ids, num_experts, block_size, expert_map, allow_naive,
        options.dependent_launch, options.align_small_max, options.align_small_max_bins,
        options.align_one_launch_max, options.align_two_launch_max,
    )
    num_assignments = topk_ids.numel()
    return BlockAlignedLayout(
        sorted_ids=sorted_ids, expert_ids=expert_ids, num_padded=num_padded, counts=counts,
        block_size=block_size, top_k=topk_ids.shape[1], num_assignments=num_assignments,
        naive=allow_naive and use_naive(num_assignments, num_experts, expert_map),
    )
