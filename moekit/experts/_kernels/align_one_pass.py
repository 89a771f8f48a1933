"""The chunked alignment (``align.py``: hist, scan, scatter) in one launch of a persistent grid.

Torch twin: ``moekit.layouts.block_aligned.align_block``; the same histogram rows, scan and scatter as the
three launches of ``align.py``, so the layout is equal element for element.

Shapes: A = M*k assignments, C = CHUNK assignments per chunk, num_chunks = ceil(A / C), EP = next_pow2(E + 1)
histogram bins, R = rows of sorted_ids, R/B blocks; P programs (<= the device's SMs x a few, all resident:
the launch is cooperative, so a grid that cannot be resident fails to launch instead of waiting forever), the
first Q of them (chunk programs) owning cpp = chunks_per_program consecutive chunks each.

    phase 1  chunk program p writes hist[p] = the histogram of its chunks; every program arrives on sync[slot]
             (acq_rel, GPU scope); the last to arrive scans hist's Q rows (chunk_base [Q, EP], counts, offsets,
             num_padded), then sets sync[slot + 1]
    barrier  every program waits for sync[slot + 1] (acquire): everything phase 2 reads is written then
    phase 2  chunk program p places its chunks in order, from a running start row per expert (offsets +
             chunk_base[p], advanced by each chunk's histogram); the block items (expert_ids, padding) go to the
             programs from the last one down: P - 1 takes item 0, P - 2 item 1, ..., then around again
    exit     each program counts itself out on sync[slot + 2]; the last sets all three back to 0

One row per program instead of one per chunk keeps the one-program scan short at large A (H200, Qwen3 A = 131072,
the alignment alone: 45.6 µs against 69.3 for hist + scan and scatter, and 84.4 for a row per chunk).

The next kernel in the stream is let launch only after the barrier: before it, all P programs are resident
(each has arrived), so a dependent kernel can never take the SMs a program still waits for.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.align import local_of, scan_hist, scatter_item


@triton.jit
def align_one_pass_kernel(
    ids_ptr, map_ptr, hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, sorted_ids_ptr,
    expert_ids_ptr, sync_ptr,  # hist, chunk_base: [>= Q, EP] (a row per chunk program); sync: int32 [slot + 3], 0s
    num_assignments, num_experts, num_global, block_size, num_rows, num_blocks, num_chunks, num_block_items, sync_slot,
    chunks_per_program, chunk_programs,
    CHUNK: tl.constexpr, E_PAD: tl.constexpr, CHUNK_ROWS: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
    BLOCK_PAD: tl.constexpr, HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    e = tl.arange(0, E_PAD)
    lo = pid * chunks_per_program
    hi = tl.minimum(lo + chunks_per_program, num_chunks)  # <= lo past the chunk programs: no chunk
    if pid < chunk_programs:
        mine = tl.zeros([E_PAD], dtype=tl.int32)  # [EP]
        for chunk in range(lo, hi):
            offs = chunk * CHUNK + tl.arange(0, CHUNK)
            mine += tl.histogram(local_of(ids_ptr, map_ptr, offs, num_assignments, num_experts, num_global, HAS_MAP),
                                 E_PAD)
        tl.store(hist_ptr + pid * E_PAD + e, mine)
    tl.debug_barrier()
    before = tl.atomic_add(sync_ptr + sync_slot, 1, sem="acq_rel", scope="gpu")
    if before == programs - 1:  # every hist row written and visible (the others' releases, this acquire)
        scan_hist(hist_ptr, chunk_base_ptr, counts_ptr, offsets_ptr, num_padded_ptr, chunk_programs, num_experts,
                  block_size, CHUNK_ROWS, E_PAD)
        tl.debug_barrier()
        tl.atomic_xchg(sync_ptr + sync_slot + 1, 1, sem="release", scope="gpu")
    scanned = tl.atomic_add(sync_ptr + sync_slot + 1, 0, sem="acquire", scope="gpu")
    while scanned == 0:
        scanned = tl.atomic_add(sync_ptr + sync_slot + 1, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    let_next_kernel_launch(PDL)
    if pid < chunk_programs:
        row = chunk_base_ptr + pid * E_PAD  # [EP] the running start rows (a register vector cannot be indexed)
        start = tl.load(row + e) + tl.load(offsets_ptr + e)  # [EP] the next free row of each expert for this program
        lane = tl.arange(0, CHUNK)
        for chunk in range(lo, hi):
            tl.store(row + e, start)
            tl.debug_barrier()
            offs = chunk * CHUNK + lane
            local = local_of(ids_ptr, map_ptr, offs, num_assignments, num_experts, num_global, HAS_MAP)  # [C]
            earlier_same = (local[:, None] == local[None, :]) & (lane[None, :] < lane[:, None])  # [C, C]
            rank = tl.sum(earlier_same.to(tl.int32), axis=1)  # [C] rank among this chunk's rows of the expert
            routed = local < num_experts
            base = tl.load(row + local, mask=routed, other=0)  # [C]
            tl.store(sorted_ids_ptr + base + rank, offs, mask=routed)
            tl.debug_barrier()  # every lane has read the row before the next chunk writes it
            start += tl.histogram(local, E_PAD)
    for item in range(programs - 1 - pid, num_block_items, programs):
        scatter_item(num_chunks + item, ids_ptr, map_ptr, chunk_base_ptr, offsets_ptr, counts_ptr, num_padded_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_assignments, num_experts, num_global, block_size, num_rows,
                     num_blocks, num_chunks, CHUNK, E_PAD, BLOCKS_PER_PROGRAM, BLOCK_PAD, HAS_MAP)
    tl.debug_barrier()
    left = tl.atomic_add(sync_ptr + sync_slot + 2, 1, sem="acq_rel", scope="gpu")
    if left == programs - 1:  # every program is past the barrier: the three slots go back to 0
        tl.store(sync_ptr + sync_slot, 0)
        tl.store(sync_ptr + sync_slot + 1, 0)
        tl.store(sync_ptr + sync_slot + 2, 0)
