"""The persistent weight-gradient GEMM of the Triton backward: ``weight_grad_contiguous_kernel``'s product
(``gemm_backward.py``, its twin in the tests and the device check) with a fixed grid of programs that walk
the output tiles expert by expert, each expert's tiles in one flat loop over (tile, row step).

    dW[e] = sum over expert e's rows p of L[p]^T R[p]      L [P, R], R [P, C] in the layout's rows

Why: at DeepSeek-V3's 16384 tokens an expert has ~512 rows, so a 128 x 256 tile reduces over only eight
64-row steps; a program per tile pays its pipeline fill and its 64 KB store once per eight steps, with
nothing to overlap them. In one flat loop the loads of the next tile's first steps are in flight while
this tile's result is stored; the pipeline drains only between experts. (``tl.range``'s ``flatten`` cannot
build it: the inner trip count differs per expert. A single loop over all tiles with the tile state
carried, its step count loaded, is not software-pipelined by Triton 3.6: the loads wait at once.)

Program p takes tiles p, p + G, p + 2G, ... (G programs) of the E*T tiles; tile t is expert t // T's tile
t % T (T tiles per expert, GROUP_R row tiles sweeping the column tiles together), so the G tiles in
flight share an expert's operands in L2. The tiles of an expert with no rows are stored as zeros (no
steps). Rows of a step past the expert's real rows are the layout's padding rows: zeros (block_m %
BLOCK_K == 0). No atomics, no split: every output is written once, by one program (deterministic).

Operands through TMA descriptors: l over [P, R] block [BK, BR], r over [P, C] block [BK, BC] (reads past
R, C or P give 0). OUT_DESC: out through a descriptor over [E, R, C] with block [1, BR, BC] (the store is
clipped at R and C); else masked pointer stores.

Shapes: P layout rows, E experts, R x C the weight grad of one expert; BK rows per step.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import grouped_tile


@triton.jit
def weight_grad_persistent_kernel(
    l_desc, r_desc, out_ptr,  # descriptors over l [P, R], r [P, C]; out [E, R, C] (a descriptor with OUT_DESC)
    counts_ptr, starts_ptr,  # [E] int32: real rows per expert, its first layout row
    R, C, num_experts, num_programs, stride_oe, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_R: tl.constexpr,
    OUT_DESC: tl.constexpr, FLAT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[e] = sum over e's rows of L^T R, for every tile this program owns (module docstring).
    FLAT: per expert one flat loop over (this program's tiles of it) x (its steps): the trip count and
    every coordinate are arithmetic on the induction variable and loop invariants, so Triton pipelines the
    loads across the tiles (a loop-carried tile state whose step count comes from memory is not pipelined).
    Else a loop over the tiles around the loop over steps: the pipeline fills per tile, but the
    accumulator is read only after its loop (ptxas serializes the flat loop's wgmma: C7514)."""
    tiles_r, tiles_c = tl.cdiv(R, BLOCK_R), tl.cdiv(C, BLOCK_C)
    per_expert = tiles_r * tiles_c
    pid = tl.program_id(0)
    for e in range(0, num_experts):
        first = e * per_expert + (pid - e * per_expert % num_programs + num_programs) % num_programs  # t = pid mod G
        owned = tl.maximum(((e + 1) * per_expert - first + num_programs - 1) // num_programs, 0)
        real = tl.load(counts_ptr + e)
        start = tl.load(starts_ptr + e)
        steps = (real + BLOCK_K - 1) // BLOCK_K
        if FLAT:
            acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # every tile of e ends in this loop
            for it in range(0, owned * steps):
                ki = it % steps
                tile_r, tile_c = grouped_tile(first - e * per_expert + (it // steps) * num_programs, tiles_r, tiles_c,
                                          GROUP_R)
                acc = _step(l_desc, r_desc, acc, start + ki * BLOCK_K, tile_r, tile_c, BLOCK_R, BLOCK_C, UPCAST,
                            PRECISION)
                if ki == steps - 1:  # the tile is done: store it, start the next
                    _store_tile(out_ptr, acc, e, tile_r, tile_c, R, C, stride_oe, stride_or, BLOCK_R, BLOCK_C, OUT_DESC)
                    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
            for i in range(0, tl.where(steps == 0, owned, 0)):  # an expert with no rows: zero tiles
                tile_r, tile_c = grouped_tile(first - e * per_expert + i * num_programs, tiles_r, tiles_c, GROUP_R)
                _store_tile(out_ptr, tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32), e, tile_r, tile_c, R, C,
                            stride_oe, stride_or, BLOCK_R, BLOCK_C, OUT_DESC)
        else:
            for i in range(0, owned):
                tile_r, tile_c = grouped_tile(first - e * per_expert + i * num_programs, tiles_r, tiles_c, GROUP_R)
                acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
                for ki in range(0, steps):  # none for an expert with no rows: zeros
                    acc = _step(l_desc, r_desc, acc, start + ki * BLOCK_K, tile_r, tile_c, BLOCK_R, BLOCK_C, UPCAST,
                                PRECISION)
                _store_tile(out_ptr, acc, e, tile_r, tile_c, R, C, stride_oe, stride_or, BLOCK_R, BLOCK_C, OUT_DESC)


@triton.jit
def _step(l_desc, r_desc, acc, b, tile_r, tile_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + L[b:b+BK, tile_r..]^T R[b:b+BK, tile_c..] (TMA loads)."""
    lt = l_desc.load([b, tile_r * BLOCK_R]).T  # [BR, BK]
    rt = r_desc.load([b, tile_c * BLOCK_C])  # [BK, BC]
    if UPCAST:
        lt, rt = lt.to(tl.float32), rt.to(tl.float32)
    return tl.dot(lt, rt, acc, input_precision=PRECISION)


@triton.jit
def _store_tile(out_ptr, result, e, tile_r, tile_c, R, C, stride_oe, stride_or,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, OUT_DESC: tl.constexpr):
    """out[e] rows tile_r*BR.., columns tile_c*BC.. = result [BR, BC] (clipped at R and C)."""
    if OUT_DESC:
        out_ptr.store([e, tile_r * BLOCK_R, tile_c * BLOCK_C], result.to(out_ptr.dtype).reshape([1, BLOCK_R, BLOCK_C]))
    else:
        offs_r = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
        offs_c = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
        ptrs = out_ptr + tl.cast(e, tl.int64) * stride_oe + offs_r[:, None].to(tl.int64) * stride_or + offs_c[None, :]
        tl.store(ptrs, result.to(out_ptr.dtype.element_ty), mask=(offs_r[:, None] < R) & (offs_c[None, :] < C))
