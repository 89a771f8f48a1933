"""gpt-oss's interleaved gate/up rows (gate j at w13 row 2j, up j at 2j + 1) in the fp8 gate-up GEMM
(``gemm_fp8.gate_up_fp8_kernel``'s INTERLEAVED; issue #15): the weight scales of the rows a tile reads, and (W_DESC) the
split of its products into gate and up.

Pointer loads (session 40): a tile's gate and up columns j are read as two [BK, BN] tiles of rows 2j and 2j + 1, each
column with its own row block's scale (a tile's columns span two row blocks).
TMA (W_DESC, session 41): the plain calls' descriptor over w13 as [E*2N, K]; a tile of BN columns is 2BN rows in place,
loaded each K-step as two [BN, BK] row tiles (the gate and up of its first BN/2 columns, then of its last BN/2), each
within one weight scale block (GROUP_N a multiple of BN: ONE_BLOCK's one scalar a step; the second tile's block clamped
to the expert's last where it lies past 2N), multiplied as plain calls multiply their gate and up tiles; the epilogue
splits the two products into the columns' gate and up (``row_tile_pairs``, in ``variant_h``; columns past N, rows of
the next expert or the descriptor's zeros, set to 0 there, out of every amax). BN is one h group (BLOCK_K): the plan
takes it so (``triton_fp8_plan.fp8_descriptors_allowed``). K tails read zeros past K (the descriptor's bounds).

Torch twin: ``moekit.experts.triton_fp8.fused_experts_fp8_torch``.
"""

import triton
import triton.language as tl

from moekit.experts._kernels.gemm import _gate_up_epilogue


@triton.jit
def row_scale_ptrs(ws_ptr, pid_n, N, stride_wsn, BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr, W_DESC: tl.constexpr):
    """K-step 0's weight scale pointers of tile pid_n's rows, ws_ptr at the expert's scales: [BN] each for its gate and
    up columns j, the row blocks of rows 2j and 2j + 1 (``gemm_fp8._weight_scale_ptrs`` without ONE_BLOCK); W_DESC: two
    scalars, the row blocks of its two row tiles (rows 2 pid_n BN .. and 2 pid_n BN + BN ..; each in one block, the
    plan's rule), the second clamped to the expert's last block (a tile past 2N: its columns are past N, zeroed in the
    epilogue)."""
    if W_DESC:
        last = tl.cdiv(2 * N, GROUP_N) - 1
        ptrs = (ws_ptr + ((2 * pid_n * BLOCK_N) // GROUP_N) * stride_wsn,
                ws_ptr + tl.minimum(((2 * pid_n + 1) * BLOCK_N) // GROUP_N, last) * stride_wsn)
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = ws_ptr + ((2 * offs_n) // GROUP_N) * stride_wsn, ws_ptr + ((2 * offs_n + 1) // GROUP_N) * stride_wsn
    return ptrs


@triton.jit
def row_tile_pairs(acc_a, acc_b, n_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """INTERLEAVED with W_DESC: (gate [BM, BN], up [BM, BN]) of a tile's columns from acc_a and acc_b [BM, BN], the
    products of its two row tiles (w13's rows in place: gate j, up j, gate j + 1, ...; acc_a the first BN/2 columns',
    acc_b the last BN/2 columns'); columns past N (rows of the next expert, or zeros) set to 0."""
    gate_a, up_a = tl.split(tl.reshape(acc_a, [BLOCK_M, BLOCK_N // 2, 2]))  # [BM, BN/2] each
    gate_b, up_b = tl.split(tl.reshape(acc_b, [BLOCK_M, BLOCK_N // 2, 2]))
    gate = tl.reshape(tl.permute(tl.join(gate_a, gate_b), [0, 2, 1]), [BLOCK_M, BLOCK_N])
    up = tl.reshape(tl.permute(tl.join(up_a, up_b), [0, 2, 1]), [BLOCK_M, BLOCK_N])
    return tl.where(n_ok[None, :], gate, 0.0), tl.where(n_ok[None, :], up, 0.0)


@triton.jit
def variant_h(acc_gate, acc_up, b13_ptr, expert, offs_n, n_ok, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              ACT: tl.constexpr, INTERLEAVED: tl.constexpr, W_DESC: tl.constexpr, ALPHA: tl.constexpr,
              LIMIT: tl.constexpr, UP_SHIFT: tl.constexpr,
              LIMIT_AFTER: tl.constexpr):
    """h [BM, BN] fp32 of a variant call's tile (ACT not None) from its accumulators [BM, BN] (unswapped): with
    INTERLEAVED and W_DESC first split into gate and up (``row_tile_pairs``), then + b13 and the gated activation
    (``gemm._gate_up_epilogue``)."""
    if INTERLEAVED and W_DESC:
        acc_gate, acc_up = row_tile_pairs(acc_gate, acc_up, n_ok, BLOCK_M, BLOCK_N)
    return _gate_up_epilogue(acc_gate, acc_up, b13_ptr, expert, offs_n, n_ok, N, 2 * N, 1, ACT, True, INTERLEAVED,
                             ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
