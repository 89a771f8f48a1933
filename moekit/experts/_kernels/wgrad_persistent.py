"""The persistent weight-gradient GEMM of the Triton backward: ``weight_grad_contiguous_kernel``'s product
(``gemm_backward.py``, its twin in the tests and the device check) with a fixed grid of programs that walk
the output tiles, expert by expert, in one flat loop over (tile, row step).

    dW[e] = sum over expert e's rows p of L[p]^T R[p]      L [P, R], R [P, C] in the layout's rows

Why: at DeepSeek-V3's 16384 tokens an expert has ~512 rows, so a 128 x 256 tile reduces over only eight
64-row steps; a program per tile pays its pipeline fill and its 64 KB store once per eight steps, with
nothing to overlap them. One flat loop carries the pipeline across tiles: the loads of the next tile's
first steps are in flight while this tile's result is stored (``tl.range``'s ``flatten`` cannot do it:
the inner trip count differs per expert).

Program p takes tiles p, p + G, p + 2G, ... (G programs); tile t is expert t // T's tile t % T (T tiles per
expert, GROUP_R row tiles sweeping the column tiles together), so the G tiles in flight share an expert's
operands in L2. A tile of an expert with no rows runs one step (on whatever rows follow) and stores zeros.
Rows of a step past the expert's real rows are the layout's padding rows: zeros (block_m % BLOCK_K == 0).
No atomics, no split: every output is written once, by one program (deterministic).

Operands through TMA descriptors: l over [P, R] block [BK, BR], r over [P, C] block [BK, BC] (reads past
R, C or P give 0). OUT_DESC: out through a descriptor over [E, R, C] with block [1, BR, BC] (the store is
clipped at R and C); else masked pointer stores.

Shapes: P layout rows, E experts, R x C the weight grad of one expert; BK rows per step.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_of(tile, tiles_r, tiles_c, GROUP_R: tl.constexpr):
    """(row tile, column tile) of an expert's tile index: GROUP_R row tiles sweep the column tiles together."""
    per_group = GROUP_R * tiles_c
    first_r = (tile // per_group) * GROUP_R
    group_r = tl.minimum(tiles_r - first_r, GROUP_R)
    return first_r + (tile % per_group) % group_r, (tile % per_group) // group_r


@triton.jit
def _program_steps(counts, num_experts, per_expert, pid, num_programs, BLOCK_K: tl.constexpr,
                   E_PAD: tl.constexpr):
    """Loop length of program pid: over the experts, (its tiles of the expert) x max(1, the expert's steps)."""
    ee = tl.arange(0, E_PAD)
    hi = tl.maximum((ee + 1) * per_expert - pid, 0)  # this program's tiles t < (e+1) T: cdiv(hi, G)
    lo = tl.maximum(ee * per_expert - pid, 0)
    owned = (hi + num_programs - 1) // num_programs - (lo + num_programs - 1) // num_programs
    steps = tl.maximum((counts + BLOCK_K - 1) // BLOCK_K, 1)
    return tl.sum(tl.where(ee < num_experts, owned * steps, 0), axis=0)


@triton.jit
def weight_grad_persistent_kernel(
    l_desc, r_desc, out_ptr,  # descriptors over l [P, R], r [P, C]; out [E, R, C] (a descriptor with OUT_DESC)
    counts_ptr,  # [E] int32 real rows per expert
    R, C, num_experts, block_m, num_programs, stride_oe, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_R: tl.constexpr,
    E_PAD: tl.constexpr, OUT_DESC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[e] = sum over e's rows of L^T R, for every tile this program owns (module docstring)."""
    tiles_r, tiles_c = tl.cdiv(R, BLOCK_R), tl.cdiv(C, BLOCK_C)
    per_expert = tiles_r * tiles_c
    pid = tl.program_id(0)
    ee = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + ee, mask=ee < num_experts, other=0)  # [EP]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = tl.cumsum(padded, axis=0) - padded  # [EP] each expert's first layout row
    total = _program_steps(counts, num_experts, per_expert, pid, num_programs, BLOCK_K, E_PAD)
    tile = pid - num_programs  # advanced before the first step
    zero = pid * 0  # int32 scalars carried by the loop
    ki, n_steps, start, real, row0, col0, e = zero, zero, zero, zero, zero, zero, zero
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for _ in range(0, total):
        if ki == n_steps:  # the next tile of this program
            tile += num_programs
            e = tile // per_expert
            tile_r, tile_c = _tile_of(tile % per_expert, tiles_r, tiles_c, GROUP_R)
            row0, col0 = tile_r * BLOCK_R, tile_c * BLOCK_C
            start = tl.sum(tl.where(ee == e, starts, 0), axis=0)
            real = tl.sum(tl.where(ee == e, counts, 0), axis=0)
            n_steps = tl.maximum((real + BLOCK_K - 1) // BLOCK_K, 1)
            ki = zero
        b = start + ki * BLOCK_K
        lt = l_desc.load([b, row0]).T  # [BR, BK]
        rt = r_desc.load([b, col0])  # [BK, BC]
        if UPCAST:
            lt, rt = lt.to(tl.float32), rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc, input_precision=PRECISION)
        ki += 1
        if ki == n_steps:  # the tile is done: store it (zeros for an expert with no rows), start the next
            result = tl.where(real > 0, acc, 0.0)
            if OUT_DESC:
                out_ptr.store([e, row0, col0], result.to(out_ptr.dtype).reshape([1, BLOCK_R, BLOCK_C]))
            else:
                offs_r = row0 + tl.arange(0, BLOCK_R)
                offs_c = col0 + tl.arange(0, BLOCK_C)
                ptrs = out_ptr + e.to(tl.int64) * stride_oe + offs_r[:, None].to(tl.int64) * stride_or + offs_c[None, :]
                tl.store(ptrs, result.to(out_ptr.dtype.element_ty), mask=(offs_r[:, None] < R) & (offs_c[None, :] < C))
            acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
