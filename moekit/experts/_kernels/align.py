"""Block alignment on the device: topk_ids [M, k] -> the block-aligned layout, with no host sync.

Torch twin: ``moekit.layouts.block_aligned.align_block``; the results are equal element for element.

Shapes: A = M*k assignments (a = t*k + j), E local experts, EP = next_pow2(E + 1) histogram bins
(bin E = "not routed here"), C = assignments per chunk, num_chunks = ceil(A / C), B = block size,
R = rows of sorted_ids, R/B blocks.

Three launches, each parallel over chunks except the short scan:
  1. hist:    hist[c, e]      = assignments of chunk c routed to expert e          [num_chunks, EP]
  2. scan:    chunk_base[c, e] = sum of hist[c' < c, e] (exclusive, per expert)   [num_chunks, EP]
              counts[e], offsets[e] = padded start row of expert e (offsets[E] = rows used), num_padded
  3. scatter: chunk programs write sorted_ids[offsets[e] + chunk_base[c, e] + rank] = a, where rank
              counts earlier same-expert lanes of the chunk, so each expert's rows stay in a-order
              (the twin's stable sort); block programs write expert_ids and the padding sentinel A.
Unlike vLLM's atomicAdd scatter this order is deterministic, which is what lets the tests demand
exact equality with the twin.

Each launch costs the host 5.5-7 µs (H200), so smaller batches fold them (``triton_align`` picks):
  small: all three in one program (one chunk, few bins: [C, EP] one-hot tiles stay small)
  place: the scan and the scatter in one launch after hist, each program summing the [chunks, EP]
         histogram itself; or all three in one launch (OWN_HIST), each program histogramming all A ids.
         No program waits for another, so nothing depends on which programs are resident.
  folded: no launch of its own (A <= ``LaunchOptions.align_fold_max``): each gate-up GEMM program derives
         its own block from all A ids (``fold_block_rows``, the one-launch ``place``'s histogram), and
         the programs of the first N tile write the layout for the down GEMM.
  one pass: hist, scan and scatter in one launch of a persistent grid whose programs meet at a barrier
         (``align_one_pass.py``), where the caller keeps counters (eager calls with a pooled workspace).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def align_hist_kernel(
    ids_ptr, map_ptr, hist_ptr,  # ids [A] int, map [G] int, hist [num_chunks, EP] int32
    num_assignments, num_experts, num_global,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    chunk_hist_row(ids_ptr, map_ptr, hist_ptr, tl.program_id(0), num_assignments, num_experts, num_global,
                   CHUNK, E_PAD, HAS_MAP)


@triton.jit
def chunk_hist_row(ids_ptr, map_ptr, hist_ptr, chunk, num_assignments, num_experts, num_global,
                   CHUNK: tl.constexpr, E_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """hist[chunk, :] = how many of the chunk's CHUNK assignments each local expert has (column
    num_experts: skipped ones and the tail past num_assignments)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_assignments
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int64)
    local = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP)
    local = tl.where(valid, local, num_experts).to(tl.int32)
    tl.store(hist_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.histogram(local, E_PAD))  # [EP]


@triton.jit
def align_scan_kernel(
    hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr,
    num_chunks, num_experts, block_size,
    CHUNK_ROWS: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """One program: column-wise exclusive scan of hist, then the padded expert offsets."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    scan_hist(hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, num_chunks, num_experts, block_size,
              CHUNK_ROWS, E_PAD)


@triton.jit
def align_hist_scan_kernel(
    ids_ptr, map_ptr, hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, arrivals_ptr,
    num_assignments, num_experts, num_global, num_chunks, block_size, arrival_slot,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr, HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    """hist and scan in one launch: each chunk program writes its histogram row, then counts its arrival
    (arrivals[arrival_slot] int32, 0 on entry: a slot of the pool's kept counters); the last to arrive (every row
    written: acq_rel atomics at GPU scope, the release publishes the row, the last's acquire sees them all) runs the
    scan and sets arrivals back to 0 for the next call. The same rows and the same scan as the two launches, so the same
    layout."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    chunk_hist_row(ids_ptr, map_ptr, hist_ptr, tl.program_id(0), num_assignments, num_experts, num_global,
                   CHUNK, E_PAD, HAS_MAP)
    tl.debug_barrier()
    before = tl.atomic_add(arrivals_ptr + arrival_slot, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if before == num_chunks - 1:
        scan_hist(hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, num_chunks, num_experts,
                  block_size, CHUNK_ROWS, E_PAD)
        tl.store(arrivals_ptr + arrival_slot, 0)


@triton.jit
def scan_hist(hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, num_chunks, num_experts, block_size,
              CHUNK_ROWS: tl.constexpr, E_PAD: tl.constexpr):
    """chunk_base = column-wise exclusive scan of hist [num_chunks, EP]; counts, offsets (padded to
    block_size; offsets[E] = rows used) and num_padded."""
    e = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)  # [EP] assignments per expert in chunks scanned so far
    for start in range(0, num_chunks, CHUNK_ROWS):
        rows = start + tl.arange(0, CHUNK_ROWS)
        ptrs = rows[:, None] * E_PAD + e[None, :]
        row_ok = rows[:, None] < num_chunks
        tile = tl.load(hist_ptr + ptrs, mask=row_ok, other=0)  # [CR, EP]
        before = tl.cumsum(tile, axis=0) - tile + running[None, :]
        tl.store(chunk_base_ptr + ptrs, before, mask=row_ok)
        running += tl.sum(tile, axis=0)
    is_expert = e < num_experts
    padded = tl.where(is_expert, (running + block_size - 1) // block_size * block_size, 0)  # [EP]
    offsets = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive; offsets[E] = rows used
    tl.store(counts_ptr + e, running, mask=is_expert)
    tl.store(offsets_ptr + e, offsets)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def align_scatter_kernel(
    ids_ptr, map_ptr, chunk_base_ptr, offsets_ptr, counts_ptr, num_padded_ptr,
    sorted_ids_ptr, expert_ids_ptr,
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks, num_chunks,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    scatter_item(tl.program_id(0), ids_ptr, map_ptr, chunk_base_ptr, offsets_ptr, counts_ptr, num_padded_ptr,
                 sorted_ids_ptr, expert_ids_ptr, num_assignments, num_experts, num_global, block_size, num_rows,
                 num_blocks, num_chunks, CHUNK, E_PAD, BLOCKS_PER_PROGRAM, BLOCK_PAD, HAS_MAP)


@triton.jit
def scatter_item(pid, ids_ptr, map_ptr, chunk_base_ptr, offsets_ptr, counts_ptr, num_padded_ptr, sorted_ids_ptr,
                 expert_ids_ptr, num_assignments, num_experts, num_global, block_size, num_rows, num_blocks, num_chunks,
                 CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK_PAD: tl.constexpr,
                 HAS_MAP: tl.constexpr):
    """The scatter's item ``pid``: chunk ``pid`` (< num_chunks) or the blocks of block item pid - num_chunks."""
    if pid < num_chunks:
        # Chunk program: place this chunk's assignments.
        lane = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lane
        valid = offs < num_assignments
        ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int64)
        local = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP)
        local = tl.where(valid, local, num_experts)
        earlier_same = (local[:, None] == local[None, :]) & (lane[None, :] < lane[:, None])  # [C, C]
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)  # [C] rank among this chunk's rows of the expert
        routed = local < num_experts
        base = tl.load(offsets_ptr + local, mask=routed, other=0) + tl.load(
            chunk_base_ptr + pid * E_PAD + local, mask=routed, other=0
        )
        tl.store(sorted_ids_ptr + base + rank, offs.to(tl.int32), mask=routed)
    else:
        # Block program: expert_ids of its blocks and the sentinel in their padding rows.
        blocks = (pid - num_chunks) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        starts = blocks * block_size  # [BP] first row of each block
        e = tl.arange(0, E_PAD)
        ends = tl.load(offsets_ptr + e + 1, mask=e < num_experts, other=2147483647)  # [EP] end row of expert e
        expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), axis=1)  # [BP] the twin's searchsorted
        used = starts < tl.load(num_padded_ptr)
        tl.store(expert_ids_ptr + blocks, tl.where(used, expert, -1), mask=blocks < num_blocks)
        safe = tl.where(used, expert, 0)
        real_end = tl.load(offsets_ptr + safe) + tl.load(counts_ptr + safe)  # [BP] end of the expert's real rows
        j = tl.arange(0, BLOCK_PAD)
        rows = starts[:, None] + j[None, :]  # [BP, B]
        pad = (~used[:, None]) | (rows >= real_end[:, None])
        in_range = (j[None, :] < block_size) & (rows < num_rows)
        sentinel = tl.full([BLOCKS_PER_PROGRAM, BLOCK_PAD], 0, tl.int32) + num_assignments
        tl.store(sorted_ids_ptr + rows, sentinel, mask=pad & in_range)


@triton.jit
def align_place_kernel(
    ids_ptr, map_ptr, hist_ptr, chunk_start_ptr, sorted_ids_ptr, expert_ids_ptr, counts_ptr, num_padded_ptr,
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks, num_chunks,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, A_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr, BLOCK_PAD: tl.constexpr, OWN_HIST: tl.constexpr, HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """The scan and the scatter in one launch (after hist), or with ``OWN_HIST`` all three: no program
    waits for another, each computes the per-expert totals itself. OWN_HIST: from all A ids (A <= A_PAD,
    one ``tl.histogram``); else from hist [num_chunks, EP], summed in [CHUNK_ROWS, EP] tiles. Chunk
    program c also sums the chunks before it, writes its start rows chunk_start[c, e] = offsets[e] +
    (assignments of chunks < c on e) and gathers them back (a barrier between: the gather crosses
    threads); block programs as in the scatter. Program 0 writes counts and num_padded."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    pid = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    is_expert = e < num_experts
    if OWN_HIST:
        a = tl.arange(0, A_PAD)
        every = local_of(ids_ptr, map_ptr, a, num_assignments, num_experts, num_global, HAS_MAP)  # [A_PAD]
        counts = tl.histogram(every, E_PAD)  # [EP]
    else:
        counts = _hist_rows(hist_ptr, num_chunks, num_chunks, E_PAD, CHUNK_ROWS)
    padded = tl.where(is_expert, (counts + block_size - 1) // block_size * block_size, 0)  # [EP]
    offsets = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive start row of each expert
    num_padded = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(counts_ptr + e, counts, mask=is_expert)
        tl.store(num_padded_ptr, num_padded)
    if pid < num_chunks:
        if OWN_HIST:
            before = tl.histogram(tl.where(a < pid * CHUNK, every, num_experts), E_PAD)  # [EP]
        else:
            before = _hist_rows(hist_ptr, pid, num_chunks, E_PAD, CHUNK_ROWS)
        tl.store(chunk_start_ptr + pid * E_PAD + e, offsets + before)
        tl.debug_barrier()
        lane = tl.arange(0, CHUNK)
        offs = pid * CHUNK + lane
        local = local_of(ids_ptr, map_ptr, offs, num_assignments, num_experts, num_global, HAS_MAP)  # [C]
        earlier_same = (local[:, None] == local[None, :]) & (lane[None, :] < lane[:, None])  # [C, C]
        rank = tl.sum(earlier_same.to(tl.int32), axis=1)  # [C] rank among this chunk's rows of the expert
        routed = local < num_experts
        base = tl.load(chunk_start_ptr + pid * E_PAD + local, mask=routed, other=0)  # [C]
        tl.store(sorted_ids_ptr + base + rank, offs, mask=routed)
    else:
        blocks = (pid - num_chunks) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
        _write_blocks(blocks, sorted_ids_ptr, expert_ids_ptr, offsets, padded, counts, num_padded,
                      num_assignments, num_experts, block_size, num_rows, num_blocks, E_PAD, BLOCK_PAD)


@triton.jit
def local_of(ids_ptr, map_ptr, offs, num_assignments, num_experts, num_global, HAS_MAP: tl.constexpr):
    """Local expert ids (int32) of the assignments ``offs``; E for a lane past A or not routed here."""
    valid = offs < num_assignments
    ids = tl.load(ids_ptr + offs, mask=valid, other=-1).to(tl.int64)
    local = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP)
    return tl.where(valid, local, num_experts).to(tl.int32)


@triton.jit
def _hist_rows(hist_ptr, upto, num_chunks, E_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """The column sums of hist [num_chunks, EP]'s rows before ``upto``: [EP]."""
    e = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, upto, CHUNK_ROWS):
        rows = start + tl.arange(0, CHUNK_ROWS)
        keep = (rows[:, None] < upto) & (rows[:, None] < num_chunks)
        total += tl.sum(tl.load(hist_ptr + rows[:, None] * E_PAD + e[None, :], mask=keep, other=0), axis=0)
    return total


@triton.jit
def align_naive_kernel(
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, counts_ptr, num_padded_ptr,
    num_assignments, num_experts, block_size,
    A_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, PDL: tl.constexpr,
):
    """The tiny-batch shortcut (A*4 <= E, no map): block a holds assignment a alone, in its first row."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    a = tl.arange(0, A_PAD)
    valid = a < num_assignments
    ids = tl.load(ids_ptr + a, mask=valid, other=-1).to(tl.int64)
    local = local_expert_ids(ids, ids_ptr, num_experts, 0, False)
    local = tl.where(valid, local, num_experts)
    routed = local < num_experts
    tl.store(expert_ids_ptr + a, tl.where(routed, local, -1).to(tl.int32), mask=valid)
    hist = tl.histogram(local.to(tl.int32), E_PAD)
    e = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e, hist, mask=e < num_experts)
    j = tl.arange(0, BLOCK_PAD)
    value = tl.where((j[None, :] == 0) & routed[:, None], a[:, None], num_assignments)  # [A_PAD, B]
    tl.store(sorted_ids_ptr + a[:, None] * block_size + j[None, :], value.to(tl.int32),
             mask=valid[:, None] & (j[None, :] < block_size))
    tl.store(num_padded_ptr, num_assignments * block_size)


@triton.jit
def align_small_kernel(
    ids_ptr, map_ptr, sorted_ids_ptr, expert_ids_ptr, counts_ptr, num_padded_ptr,
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, BLOCK_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    """The three launches above in one program, for A <= CHUNK (decode batches): the histogram, the
    offsets and the scatter stay in registers, so only the stores touch memory. A register vector
    cannot be indexed, so offsets[e] for a vector of e is a one-hot dot: sum(onehot * offsets)."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    lane = tl.arange(0, CHUNK)
    valid = lane < num_assignments
    ids = tl.load(ids_ptr + lane, mask=valid, other=-1).to(tl.int64)
    local = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP)
    local = tl.where(valid, local, num_experts).to(tl.int32)
    e = tl.arange(0, E_PAD)
    is_expert = e < num_experts
    counts = tl.histogram(local, E_PAD)  # [EP]
    padded = tl.where(is_expert, (counts + block_size - 1) // block_size * block_size, 0)
    offsets = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive start row of each expert
    tl.store(counts_ptr + e, counts, mask=is_expert)
    num_padded = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, num_padded)

    onehot = local[:, None] == e[None, :]  # [C, EP]
    base = tl.sum(tl.where(onehot, offsets[None, :], 0), axis=1)  # [C] offsets[local]
    earlier_same = (local[:, None] == local[None, :]) & (lane[None, :] < lane[:, None])  # [C, C]
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    tl.store(sorted_ids_ptr + base + rank, lane, mask=local < num_experts)

    for b0 in range(0, num_blocks, BLOCKS_PER_ITER):
        _write_blocks(b0 + tl.arange(0, BLOCKS_PER_ITER), sorted_ids_ptr, expert_ids_ptr, offsets, padded, counts,
                      num_padded, num_assignments, num_experts, block_size, num_rows, num_blocks, E_PAD, BLOCK_PAD)


@triton.jit
def _write_blocks(blocks, sorted_ids_ptr, expert_ids_ptr, offsets, padded, counts, num_padded,
                  num_assignments, num_experts, block_size, num_rows, num_blocks,
                  E_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr):
    """expert_ids of ``blocks`` [BI] and the sentinel in their padding rows, from the per-expert register
    vectors offsets, padded, counts [EP]. A register vector cannot be indexed, so the expert's real end
    is a one-hot dot over [BI, EP] (a plan keeps BI * EP <= 4096)."""
    e = tl.arange(0, E_PAD)
    is_expert = e < num_experts
    ends = tl.where(is_expert, offsets + padded, 2147483647)  # [EP] end row of each expert
    starts = blocks * block_size  # [BI] first row of each block
    expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), axis=1)  # [BI] the twin's searchsorted
    used = starts < num_padded
    tl.store(expert_ids_ptr + blocks, tl.where(used, expert, -1), mask=blocks < num_blocks)
    real_end = tl.sum(tl.where(expert[:, None] == e[None, :], (offsets + counts)[None, :], 0), axis=1)  # [BI]
    j = tl.arange(0, BLOCK_PAD)
    rows = starts[:, None] + j[None, :]  # [BI, B]
    pad = (~used[:, None]) | (rows >= real_end[:, None])
    in_range = (j[None, :] < block_size) & (rows < num_rows)
    sentinel = tl.zeros_like(rows).to(tl.int32) + num_assignments
    tl.store(sorted_ids_ptr + rows, sentinel, mask=pad & in_range)


@triton.jit
def fold_block_rows(pid_m, ids_ptr, map_ptr, num_assignments, num_experts, num_global,
                    BLOCK_M: tl.constexpr, A_PAD: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                    HAS_MAP: tl.constexpr):
    """Block pid_m of the layout, from all A ids (A <= A_PAD) with no layout in memory: (its rows' assignments
    [BM] int32, A on padding rows; its expert, int32, -1 past the rows in use; num_padded). The rows of
    expert e are its assignments in a-order (the twin's stable sort) at ranks first .. first + BM - 1, where
    first = pid_m * BM - offsets[e]; each assignment's rank among e's comes from an exclusive cumsum over
    [CHUNK] tiles of the ids, and each lane finds its row by a [BM, CHUNK] compare."""
    e = tl.arange(0, E_PAD)
    is_expert = e < num_experts
    every = local_of(ids_ptr, map_ptr, tl.arange(0, A_PAD), num_assignments, num_experts, num_global, HAS_MAP)
    counts = tl.histogram(every, E_PAD)  # [EP]
    padded = tl.where(is_expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)  # [EP]
    offsets = tl.cumsum(padded, axis=0) - padded  # [EP] exclusive start row of each expert
    num_padded = tl.sum(padded, axis=0)
    start = pid_m * BLOCK_M
    ends = tl.where(is_expert, offsets + padded, 2147483647)  # [EP]
    expert = tl.sum((ends <= start).to(tl.int32), axis=0)  # the twin's searchsorted
    expert = tl.where(start < num_padded, expert, -1)
    first = start - tl.sum(tl.where(e == expert, offsets, 0), axis=0)  # rank of the block's first row
    want = first + tl.arange(0, BLOCK_M)  # [BM] the rank each lane holds
    rows = tl.zeros([BLOCK_M], dtype=tl.int32)
    hit = tl.zeros([BLOCK_M], dtype=tl.int32)
    before = first * 0  # assignments of the expert in the tiles already walked
    for a0 in range(0, tl.where(expert >= 0, num_assignments, 0), CHUNK):  # a block past the rows in use: none
        a = a0 + tl.arange(0, CHUNK)
        mine = (local_of(ids_ptr, map_ptr, a, num_assignments, num_experts, num_global, HAS_MAP) == expert).to(tl.int32)
        rank = before + tl.cumsum(mine, axis=0) - mine  # [C]
        match = (mine[None, :] != 0) & (rank[None, :] == want[:, None])  # [BM, C]
        rows += tl.sum(tl.where(match, a[None, :], 0), axis=1)
        hit += tl.sum(match.to(tl.int32), axis=1)
        before += tl.sum(mine, axis=0)
    return tl.where(hit > 0, rows, num_assignments), expert, num_padded
