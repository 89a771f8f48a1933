"""The words gate-up's epilogue (decode "gluon_words", issue #16; moved out of ``gluon_wo_words`` and given the
activation variants in session 46): the accumulator's gate and up rows into h, with gpt-oss's expert biases and
clamped SwiGLU where asked (``ActivationSpec``: b13 added by accumulator row, gate <= limit and |up| <= limit by the
row's parity, h = gate sigmoid(alpha gate) (up + up_shift); with ``limit_after_act`` the gate's clamp on
gate sigmoid(alpha gate) instead: Step-3.7), stored in the dot order the down GEMM reads
(``stored_column``) or as a split's float32 partials. Each thread holds the gate and the up sum of the same output
(mma C rows g and g + 8), so the variant moves nothing: a load, a clamp and two FMAs an output.

Shapes: acc [16 W, BM] (W warps; row 16 w + 8 v + g: warp w's gate (v = 0) or up (v = 1) row of output n0 + 8 w + g),
h [A, N], b13 [E, 2N] in w13's row order. Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def stored_column(col):
    """Where column ``col`` of an activation row lies in the stored dot order (``triton_wo_words.x_words``): its
    step's column 128 c + 32 q + 8 j + 4 p + 2 h + g at 64 q + 32 c + 8 j + 4 h + 2 g + p."""
    t = col & 255  # the column in its step (STEP 256; a plain int: the tests run this on torch)
    c, q, j = (t >> 7) & 1, (t >> 5) & 3, (t >> 3) & 3
    p, h, g = (t >> 2) & 1, (t >> 1) & 1, t & 1
    return col - t + 64 * q + 32 * c + 8 * j + 4 * h + 2 * g + p


@gluon.jit
def store_h(acc, h_ptr, b13_ptr, expert, w13_c, row_ok, rows_c, ok_c, up_row, n0, N, num_assignments, stride_hm,
            stride_be, num_warps: gl.constexpr, H_ORDER: gl.constexpr, SPLIT: gl.constexpr, BIASED: gl.constexpr,
            LIMIT: gl.constexpr, ALPHA: gl.constexpr, UP_SHIFT: gl.constexpr, LIMIT_AFTER: gl.constexpr = False):
    """acc [R, BM] (rows: w13 rows w13_c [R], up_row [R] 1 on the up rows) -> h of the block's rows_c (module doc);
    SPLIT > 1: the split's float32 gate sums at p[s A + a, n], up sums at p[s A + a, N + n] (no variant)."""
    BM: gl.constexpr = acc.type.shape[1]
    if BIASED:
        acc += gl.load(b13_ptr + expert * stride_be + w13_c, mask=row_ok, other=0.0).to(gl.float32)[:, None]
    if LIMIT > 0:  # |up| <= LIMIT; gate <= LIMIT, or with LIMIT_AFTER act(gate) <= LIMIT (below)
        up = (up_row == 1)[:, None]
        if LIMIT_AFTER:
            acc = gl.where(up, gl.maximum(gl.minimum(acc, LIMIT), -LIMIT), acc)
        else:
            acc = gl.where(up, gl.maximum(gl.minimum(acc, LIMIT), -LIMIT), gl.minimum(acc, LIMIT))
    # acc rows: warp w's gate rows then up rows -> gate, up [8 W, BM], each thread both of its outputs
    both = gl.permute(gl.reshape(acc, [num_warps, 2, 8, BM]), [0, 2, 3, 1])  # [W, 8, BM, gate / up]
    gate, up = gl.split(both)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
    cols_o = n0 + gl.arange(0, 8 * num_warps, layout=gl.SliceLayout(1, out_layout))
    rows_o = gl.convert_layout(rows_c, gl.SliceLayout(0, out_layout))
    ok_o = gl.convert_layout(ok_c, gl.SliceLayout(0, out_layout))[None, :] & (cols_o < N)[:, None]
    if SPLIT > 1:  # this split's float32 sums, gate then up
        p_rows = h_ptr + (gl.program_id(1) * num_assignments + rows_o)[None, :].to(gl.int64) * stride_hm
        gl.store(p_rows + cols_o[:, None], gl.convert_layout(gl.reshape(gate, [8 * num_warps, BM]), out_layout),
                 mask=ok_o)
        gl.store(p_rows + N + cols_o[:, None], gl.convert_layout(gl.reshape(up, [8 * num_warps, BM]), out_layout),
                 mask=ok_o)
    else:
        if ALPHA == 1.0 and UP_SHIFT == 0.0 and not LIMIT_AFTER:
            glu = gate / (1.0 + gl.exp(-gate)) * up
        elif LIMIT_AFTER:  # Step-3.7, Bailing-Hybrid: min(act(gate), LIMIT)
            glu = gl.minimum(gate / (1.0 + gl.exp(-ALPHA * gate)), LIMIT) * (up + UP_SHIFT)
        else:
            glu = gate / (1.0 + gl.exp(-ALPHA * gate)) * (up + UP_SHIFT)
        h = gl.convert_layout(gl.reshape(glu, [8 * num_warps, BM]), out_layout)
        if H_ORDER:
            cols_o = stored_column(cols_o)
        gl.store(h_ptr + rows_o[None, :] * stride_hm + cols_o[:, None], h.to(h_ptr.dtype.element_ty), mask=ok_o)
