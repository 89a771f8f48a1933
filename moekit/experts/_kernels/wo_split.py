"""The split-K gate-up of the word decode (``gemm_wo_gemv``): where the touched experts'
gate-up tiles are too few to keep the SMs' loads in flight (decode, M = 1), each tile's reduction over K is
split SPLIT ways (grid axis 1); every split stores its float32 partial gate and up sums, and one small launch
(``split_glu_kernel``) sums the splits in split order and applies the activation into h.

Partials: p [SPLIT * A, 2N] float32, row s * A + a holds split s of assignment a: gate at columns 0..N-1,
up at N..2N-1 (each already times its group scales, int8's per-row scale too: the sums are linear).
Rows of assignments no split wrote (skipped slots, M-block padding) are never read back by the down GEMM.

Folded (``WordConfig.glu_fold``): no activation launch; the down GEMM reads h through ``load_h``, which sums
its elements' partials in split order and applies the activation, rounded to h's dtype, as ``split_glu_kernel``
does (the same operations in the same order: bit-equal), one launch fewer for SPLIT x 2 float32 reads of
each h element a down program takes (from L2: the partials are A x 2N floats a split).

Shapes: A = M*k assignments, N intermediate, BN a tile's columns.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.gemm import _glu


@triton.jit
def store_partials(p_ptr, gate, up, row, ok, offs_n, n_ok, N, num_assignments, stride_pm):
    """Split ``tl.program_id(1)``'s gate and up sums [BN] float32 of assignment ``row`` into p."""
    p_row = p_ptr + (tl.program_id(1) * num_assignments + row) * stride_pm
    mask = tl.where(ok, n_ok, False)
    tl.store(p_row + offs_n, gate, mask=mask)
    tl.store(p_row + N + offs_n, up, mask=mask)


@triton.jit
def split_glu_kernel(
    p_ptr, h_ptr,  # p [SPLIT * A, 2N] float32 partials; h [A, N] out
    N, num_assignments, stride_pm, stride_hm,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
    ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None, UP_SHIFT: tl.constexpr = 0.0,
    LIMIT_AFTER: tl.constexpr = False,
):
    """h[a, n] = glu(sum_s p[s A + a, n], sum_s p[s A + a, N + n]), the splits summed in order; grid
    (A, cdiv(N, BLOCK_N)); ALPHA .. LIMIT_AFTER: ``gemm._glu``'s clamped SwiGLU (defaults: the plain act(gate) * up;
    the mma decode's variant gate-ups)."""
    wait_for_previous_kernel(PDL)
    a = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros_like(gate)
    for s in range(SPLIT):
        p_row = p_ptr + (s * num_assignments + a) * stride_pm
        gate += tl.load(p_row + offs_n, mask=n_ok, other=0.0)
        up += tl.load(p_row + N + offs_n, mask=n_ok, other=0.0)
    let_next_kernel_launch(PDL)
    h = _glu(gate, up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
    tl.store(h_ptr + a * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def load_h(h_row, offs, mask, N, split_stride, UP_SPLIT: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr):
    """Float32 h at ``offs`` (any shape, ``mask`` past the row: 0) of one assignment's row: UP_SPLIT 1 ``h_row``
    an h row, loaded; else ``h_row`` its row of split 0's partials (split s at + s * split_stride, up at + N),
    summed in split order, the activation applied and rounded to h's dtype (ROUND 1 bf16, 2 fp16, 0 float32):
    bit for bit what ``split_glu_kernel`` stores and the down GEMM would load."""
    if UP_SPLIT == 1:
        h = tl.load(h_row + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        gate = tl.zeros_like(offs).to(tl.float32)
        up = tl.zeros_like(gate)
        for s in tl.static_range(UP_SPLIT):
            gate += tl.load(h_row + s * split_stride + offs, mask=mask, other=0.0)
            up += tl.load(h_row + s * split_stride + N + offs, mask=mask, other=0.0)
        h = _glu(gate, up, ACT, 1.0, None, 0.0)
        if ROUND == 1:
            h = h.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            h = h.to(tl.float16).to(tl.float32)
    return h


@triton.jit
def h_words(x_row, ok, k0, C, stride, BKW: tl.constexpr, fs, UP_SPLIT: tl.constexpr, ACT: tl.constexpr,
            ROUND: tl.constexpr):
    """Elements 0..7 of each 8-value word of the step at k0 of one activation row (``x_row`` its first element,
    ``ok`` whether it exists; 0 past C): 8 float32 tensors [BKW], read as one [BKW, 8] tile (a word's 8 values
    are contiguous); the down GEMM's h folded from split partials where UP_SPLIT > 1 (``load_h``)."""
    k = k0 + tl.arange(0, BKW)[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BKW, 8]
    x = load_h(x_row, k * stride, k < tl.where(ok, C, 0), C, fs, UP_SPLIT, ACT, ROUND)
    even, odd = tl.split(tl.reshape(x, [BKW, 2, 2, 2]))  # element t = 4a + 2b + c: [BKW, a, b] at c = 0, 1
    e0, e1 = tl.split(even)  # [BKW, a] at b = 0, 1
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def split_range(KW, split_words, SPLIT: tl.constexpr):
    """(first, end) words of split ``tl.program_id(1)`` of a row of KW words (all of them where SPLIT is 1)."""
    if SPLIT > 1:
        w_start = tl.program_id(1) * split_words
        w_end = tl.minimum(w_start + split_words, KW)
    else:
        w_start = 0
        w_end = KW
    return w_start, w_end
