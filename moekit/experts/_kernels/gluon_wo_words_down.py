"""The int4 words down GEMM on Gluon (decode "gluon_words", issue #16 target 1, session 45): the gate-up's design
(``gluon_wo_words``: 16-byte word loads straight into mma.sync's register operand, the dot order by reshape /
permute only) on w2 with the routed weight:

    y[s A + a, k] = weight[a] * (sum over split s's columns n of h[a, n] w2[e(a), k, n]  (+ b2[e(a), k] for s = 0))

A warp owns 16 consecutive output rows (w2 rows) of one MMA A operand; a program ``num_warps`` of them on one block
of BM assignments (NAIVE: assignment pid_m alone), over its split's steps of 256 columns (grid axis 1 = split s;
SPLIT > 1: float32 partials, summed with the slots by the existing k-sum launch). h comes in the dot order the
gate-up stored it in (``gluon_wo_words.stored_column``, H_ORDER), so no launch reorders it. The zero points are taken
exactly in the decode (``gluon_wo_words.exact_halves``: code - zero in bf16, one fma a pair) instead of by x sums,
which h has none of; each half step's partial takes its group's scale.

Shapes: A assignments, E experts, K hidden (the output), N intermediate (the reduction, a multiple of 256), W =
num_warps (K a multiple of 16 W). Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. Gluon does not
run in the interpreter (CUDA sm_80+ only).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekit.experts._kernels.gluon_wo_words import STEP, STEP_WORDS, block_rows, words_loop


@gluon.jit
def down_words_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N] (dot order); w2 q / scale / zero; y [SPLIT A, K]
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,  # the routing (NAIVE: ids alone) and aligned layout
    b2_ptr,  # the expert biases [E, K] where BIASED (added by split 0, before the routed weight), else unread
    K, N, num_assignments, num_experts, split_steps,  # split_steps: steps of 256 columns a split
    stride_hm, stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr, stride_ym, stride_be,  # q in words
    BM: gl.constexpr, GROUP: gl.constexpr, NAIVE: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr,
    AHEAD: gl.constexpr = 1,  # steps of words in flight (``gluon_wo_words.words_loop``): 2 selectable, unmeasured
    MXFP4: gl.constexpr = False,  # q mxfp4 codes, s_ptr its e8m0 scales (``words_mx``); z_ptr unread
    BIASED: gl.constexpr = False,
):
    """y = routed weight * (h w2^T) over split program_id(1)'s columns for one block's rows and 16 num_warps output
    rows (module doc). Grid (blocks * K / (16 num_warps), SPLIT)."""
    R: gl.constexpr = 16 * num_warps
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])  # 16-byte loads
    x_layout: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [1, num_warps], [1, 0])  # h as int32 pairs
    num_pid_n = K // R
    pid_m = gl.program_id(0) // num_pid_n
    k0 = (gl.program_id(0) % num_pid_n) * R
    expert, rows_x, rows_c = block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                        num_assignments, BM, NAIVE, x_layout, mma)
    if (expert >= 0) & (expert < num_experts):
        # tile row u = 8 W v + 8 w + g of the words load is operand row 16 w + 8 v + g (``operand_rows``): w2 row k0 +
        u = gl.arange(0, R, layout=gl.SliceLayout(1, w_layout))
        w2_w = k0 + 16 * (u // 8 % num_warps) + 8 * (u // (8 * num_warps)) + u % 8
        w2_c = k0 + gl.arange(0, R, layout=gl.SliceLayout(1, mma))
        col0 = gl.program_id(1) * split_steps * STEP
        cols = gl.arange(0, STEP_WORDS, layout=gl.SliceLayout(0, w_layout))
        words = q_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert.to(gl.int64) * stride_qe + col0 // 8
        w_ptrs = words + (w2_w * stride_qr)[:, None] + cols[None, :]  # [R, 32]
        m = gl.arange(0, STEP // 2, layout=gl.SliceLayout(0, x_layout))
        h_rows = gl.where(rows_x < num_assignments, rows_x, 0) * (stride_hm // 2) + col0 // 2
        h_ptrs = h_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + h_rows[:, None] + m[None, :]  # [BM, 128]
        s_rows = s_ptr + expert * stride_se + w2_c * stride_sr
        z_rows = z_ptr + expert * stride_ze + w2_w * stride_zr  # in the load's rows: the decode's zero points
        acc = gl.zeros([R, BM], gl.float32, mma)
        if MXFP4:  # the scales in the words' rows (the decode's), magic bf16x2 -0 (N >= 0: a value in a register)
            neg0 = (N >> 31) - 0x7FFF8000
            acc = words_loop(acc, w_ptrs, h_ptrs, split_steps, col0, neg0, neg0, s_rows,
                             s_ptr + expert * stride_se + w2_w * stride_sr, s_rows, w2_c < K, w2_w < K,
                             rows_c < num_assignments, GROUP, 2, num_warps, AHEAD)
        else:
            magic = 0x43004300 + (N >> 31)  # bf16x2 128.0 and 1.0 (N >= 0): values ptxas holds in registers
            one = 0x3F803F80 + (N >> 31)
            acc = words_loop(acc, w_ptrs, h_ptrs, split_steps, col0, magic, one, s_rows, z_rows, s_rows, w2_c < K,
                             w2_w < K, rows_c < num_assignments, GROUP, 1, num_warps, AHEAD)
        ok_c = rows_c < num_assignments
        if BIASED:  # split 0 adds b2 (the splits' partials are summed by the k-sum)
            ok_b = (w2_c < K) & (gl.program_id(1) == 0)
            acc += gl.load(b2_ptr + expert * stride_be + w2_c, mask=ok_b, other=0.0).to(gl.float32)[:, None]
        acc = acc * gl.load(weights_ptr + rows_c, mask=ok_c, other=0.0)[None, :]
        out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
        acc = gl.convert_layout(acc, out_layout)
        k_o = k0 + gl.arange(0, R, layout=gl.SliceLayout(1, out_layout))
        a_o = gl.convert_layout(rows_c, gl.SliceLayout(0, out_layout))
        y_rows = gl.program_id(1) * num_assignments + a_o
        gl.store(y_ptr + y_rows[None, :] * stride_ym + k_o[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=(a_o < num_assignments)[None, :] & (k_o < K)[:, None])
