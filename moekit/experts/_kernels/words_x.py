"""The activations of the words decode in its dot order (``gluon_wo_words``; issue #16, session 45), one launch:
each step of 256 columns of a row stored so that position m holds column

    phys(m) = 128 m5 + 32 (m6 + 2 m7) + 8 (m3 + 2 m4) + 4 m0 + 2 m2 + m1          (m_i: bit i of m)

(``triton_wo_words.stored_dot_columns`` then ``dot_columns``), and the float32 sums of each 128 columns (the int4 zero
points' term). Columns past x's K (the words' padded reduction K' of a shape no multiple of 256, session 46: gpt-oss's
2880 on mxfp4) are stored as 0. Torch twin: ``triton_wo_words.x_words_torch``.

Shapes: x [M, K], out [M, K'], sums [M, K' / 128] (K' >= K a multiple of 256); a program one row's step.
"""

import triton
import triton.language as tl


@triton.jit
def x_words_kernel(x_ptr, out_ptr, sums_ptr, K, stride_xm, stride_om, stride_sm):
    """out[t, 256 s + m] = x[t, 256 s + phys(m)], sums[t, 2 s + c] = x[t, 256 s + 128 c:+128].sum(), x 0 past
    column K; grid (M, K' / 256)."""
    t, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    m = tl.arange(0, 256)
    phys = (128 * ((m >> 5) & 1) + 32 * (m >> 6) + 8 * ((m >> 3) & 3) + 4 * (m & 1) + 2 * ((m >> 2) & 1)
            + ((m >> 1) & 1))
    row = x_ptr + t * stride_xm + 256 * s
    tl.store(out_ptr + t * stride_om + 256 * s + m, tl.load(row + phys, mask=256 * s + phys < K, other=0.0))
    halves = tl.sum(tl.reshape(tl.load(row + m, mask=256 * s + m < K, other=0.0).to(tl.float32), (2, 128)), axis=1)
    tl.store(sums_ptr + t * stride_sm + 2 * s + tl.arange(0, 2), halves)
