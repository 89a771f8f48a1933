"""Persistent block-scaled fp8 grouped GEMMs (issue #15, 8 <= M <= 1024): ``gemm_fp8``'s gate-up and down tiles,
walked by a fixed grid of programs (about one per SM, ``PROGRAMS``), each looping over tiles t = pid, pid + P, ...
in the grouped order of ``gemm._grid_position`` (an expert's M-blocks sweep the N tiles together, so its weight
tile is read from HBM once). What a program pays once instead of once a tile: its launch and setup, and (the tile
loop and the K loop fused into one pipelined loop, ``tl.range(flatten=True)``) the pipeline's fill, the next tile's
first loads issued under this tile's epilogue (H200, Qwen3-30B-A3B, both GEMMs persistent, not flattened against
flattened: M = 1024 263.2 / 253.8 µs, 512 209.2 / 193.3; raw/*-cb26041-fp8mid-ck1.*).

Torch twin: ``moekit.experts.triton_fp8.fused_experts_fp8_torch``; the same products in the same order as
``gemm_fp8``'s kernels (each tile's K loop and epilogue are theirs), so the outputs are bit-equal to them.

Shapes as ``gemm_fp8``: the block-aligned layout only (no tiny-batch NAIVE blocks, no folded alignment, no k-sum in
the down GEMM); the tile count is read from ``num_padded`` on the device (no host sync). The gate-up tile holds
whole scale groups (h re-quantized in its epilogue: BN a multiple of BK), x comes quantized (``quant_fp8``), no
SWAP_AB. W_DESC: the weights through TMA descriptors, as there; PAIR_DOT (gate-up): ``gemm_fp8``'s. Biases and the
activation variant (session 41, asked for by name only: ``triton_fp8_persistent.choose_persistent``): b13 and the spec
in the gate-up epilogue, b2 in the down's, as ``gemm_fp8``'s; interleaved gate/up rows through TMA only (its row
tiles, ``gemm_fp8_interleaved``); without them the kernels are the ones before (sm_90 SASS identical).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import grouped_tile, let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.gemm_fp8 import (
    _pair_split, _pair_step, _scaled_dot, _step_scale, _store_h, _weight_scale_ptrs, _with_b2,
)
from moekit.experts._kernels.gemm_fp8_interleaved import row_scale_ptrs, variant_h


@triton.jit
def _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, num_assignments, BLOCK_M: tl.constexpr):
    """(rows [BM] int64 of M-block pid_m, A on padding; row_ok [BM]; its expert int64): a block in use."""
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, rows < num_assignments, tl.load(expert_ids_ptr + pid_m).to(tl.int64)


@triton.jit
def gate_up_fp8_persistent_kernel(
    # x_q [M, K], x_s [M, KB], w13 [E, 2N, K] (W_DESC: its descriptor) + scale, h_q [A, N], h_s [A, NB]
    xq_ptr, xs_ptr, w_ptr, ws_ptr, hq_ptr, hs_ptr,
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, map_ptr,  # ids, map: unread (the plan's pointer list)
    b13_ptr, N, K, num_assignments, top_k,  # b13 [E, 2N] or None (plain calls)
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_hm, stride_hsm,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr, W_DESC: tl.constexpr,
    ONE_BLOCK: tl.constexpr, PDL: tl.constexpr, PAIR_DOT: tl.constexpr = False, PAIR_CHUNK: tl.constexpr = 64,
    ACT: tl.constexpr = None, INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False):  # ACT ..: ``gemm_fp8``'s; INTERLEAVED: W_DESC
    wait_for_previous_kernel(PDL)
    num_pid_m, num_pid_n = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M), tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rows, row_ok, expert = _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, num_assignments, BLOCK_M)
        token = tl.where(row_ok, rows // top_k, 0)  # [BM] the gather: x row of each assignment
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        x_ptrs = xq_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
        xs_ptrs = xs_ptr + token * stride_xsm  # [BM] scale of K-step 0
        if W_DESC:  # a descriptor over w13 as [E*2N, K], blocks [BN, BK] (INTERLEAVED: 2BN rows a tile)
            w_row = (expert * 2 * N + pid_n * (BLOCK_N * (1 + INTERLEAVED))).to(tl.int32)
        else:
            wg_ptrs = (w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
                       + offs_k[:, None] * stride_wk)
        s_ptr = ws_ptr + expert * stride_wse
        sg_ptrs, su_ptrs = row_scale_ptrs(s_ptr, pid_n, N, stride_wsn, BLOCK_N, GROUP_N, W_DESC) if INTERLEAVED else (
            _weight_scale_ptrs(s_ptr, pid_n * BLOCK_N, stride_wsn, BLOCK_N, GROUP_N, ONE_BLOCK),
            _weight_scale_ptrs(s_ptr, N + pid_n * BLOCK_N, stride_wsn, BLOCK_N, GROUP_N, ONE_BLOCK))
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N * (2 if PAIR_DOT else 1)], dtype=tl.float32)  # PAIR_DOT: gate and up
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # [BM, BN] each, or (PAIR_DOT) unused
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            xa = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            step = k0 // BLOCK_K
            if PAIR_DOT:
                xs = tl.load(xs_ptrs + step, mask=row_ok, other=0.0)
                acc_gate = _pair_step(acc_gate, xa, w_ptr, expert.to(tl.int32), pid_n, k0, xs,
                                      sg_ptrs + step * stride_wsk, su_ptrs + step * stride_wsk, BLOCK_N, BLOCK_K,
                                      PAIR_CHUNK, UPCAST, False)
            else:
                if W_DESC:  # [BK, BN] each; past K the descriptor reads zeros (INTERLEAVED: the two row tiles)
                    wg, wu = w_ptr.load([w_row, k0]).T, w_ptr.load([w_row + (BLOCK_N if INTERLEAVED else N), k0]).T
                else:
                    wg = tl.load(wg_ptrs + k0 * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                    wu = tl.load(wg_ptrs + N * stride_wn + k0 * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                                 other=0.0)
                xs = tl.load(xs_ptrs + step, mask=row_ok, other=0.0)
                acc_gate += _scaled_dot(xa, wg, UPCAST) * _step_scale(xs, sg_ptrs + step * stride_wsk, n_ok,
                                                                      ONE_BLOCK)
                acc_up += _scaled_dot(xa, wu, UPCAST) * _step_scale(xs, su_ptrs + step * stride_wsk, n_ok, ONE_BLOCK)
        acc_gate, acc_up = _pair_split(acc_gate, acc_up, BLOCK_M, BLOCK_N, PAIR_CHUNK, PAIR_DOT, False)
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up if ACT is None else variant_h(acc_gate, acc_up, b13_ptr, expert,
            offs_n, n_ok, N, BLOCK_M, BLOCK_N, ACT, INTERLEAVED, W_DESC, ALPHA, LIMIT, UP_SHIFT,
            LIMIT_AFTER)  # [BM, BN] fp32
        _store_h(h, hq_ptr, hs_ptr, rows, row_ok, pid_n, N, stride_hm, stride_hsm, BLOCK_M, BLOCK_N, BLOCK_K,
                 EMULATE, False)
    let_next_kernel_launch(PDL)


@triton.jit
def down_fp8_persistent_kernel(
    # h_q [A, N], h_s [A, NB], w2 [E, K, N] (W_DESC: its descriptor) + scale, y [A, K], routed weights [A]
    hq_ptr, hs_ptr, w_ptr, ws_ptr, y_ptr, weights_ptr,
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # unread (the plan's pointer list: ids, then the k-sum's three)
    b2_ptr,  # [E, K] or None (plain calls)
    K, N, num_assignments,
    stride_hm, stride_hsm, stride_we, stride_wk, stride_wn, stride_wse, stride_wsk, stride_wsn, stride_ym,
    GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, W_DESC: tl.constexpr, ONE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    num_pid_m, num_pid_n = tl.cdiv(tl.load(num_padded_ptr), BLOCK_M), tl.cdiv(K, BLOCK_N)
    offs_red = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rows, row_ok, expert = _tile_rows(pid_m, sorted_ids_ptr, expert_ids_ptr, num_assignments, BLOCK_M)
        safe_rows = tl.where(row_ok, rows, 0)
        offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out_ok = offs_out < K
        h_ptrs = hq_ptr + safe_rows[:, None] * stride_hm + offs_red[None, :]  # [BM, BK]
        hs_ptrs = hs_ptr + safe_rows * stride_hsm  # [BM] scale of step 0
        if W_DESC:  # a descriptor over w2 as [E*K, N], blocks [BN, BK]
            w_row = (expert * K + pid_n * BLOCK_N).to(tl.int32)
        else:
            w_ptrs = (w_ptr + expert * stride_we + offs_out[None, :].to(tl.int64) * stride_wk
                      + offs_red[:, None] * stride_wn)
        s_ptrs = _weight_scale_ptrs(ws_ptr + expert * stride_wse, pid_n * BLOCK_N, stride_wsk, BLOCK_N, GROUP_N,
                                    ONE_BLOCK)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_K):
            red_ok = offs_red < N - n0
            ha = tl.load(h_ptrs + n0, mask=row_ok[:, None] & red_ok[None, :], other=0.0)
            if W_DESC:  # rows past K are never stored, columns past N read 0
                wb = w_ptr.load([w_row, n0]).T  # [BK, BN]
            else:
                wb = tl.load(w_ptrs + n0 * stride_wn, mask=red_ok[:, None] & out_ok[None, :], other=0.0)
            hs = tl.load(hs_ptrs + n0 // BLOCK_K, mask=row_ok, other=0.0)
            acc += _scaled_dot(ha, wb, UPCAST) * _step_scale(hs, s_ptrs + (n0 // BLOCK_K) * stride_wsn, out_ok,
                                                             ONE_BLOCK)
        acc = _with_b2(acc, b2_ptr, expert, offs_out, out_ok, K)  # before the routed weight, as ``gemm_fp8``'s
        acc = acc * tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + safe_rows[:, None] * stride_ym + offs_out[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])
    let_next_kernel_launch(PDL)
