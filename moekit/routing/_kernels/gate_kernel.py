"""The gate GEMM in one Triton kernel: x [M, K] -> router logits [M, E] = x @ W^T (+ b), fp32 accumulation,
stored in the output's dtype.

    [Gate] -> Route -> Capacity (opt-in) -> Group -> Experts -> Combine

Torch twin: ``torch.nn.functional.linear(x, W, b)`` (what ``MoE`` runs without it).

Shapes: M tokens, K hidden, E experts; a program computes a [BLOCK_M, BLOCK_E] tile of the logits,
stepping through K by BLOCK_K. For the few rows of a decode step (a matrix-vector product bound by
reading W), a W tile of a few experts and up to 2048 columns is loaded once per step and each row of x
multiplied into it in fp32: few steps per program, many programs. (A tensor-core tile measured slower
than cuBLAS at every M on the H200; ``moekit.routing.gate`` says where each runs.)

x, W and b may be bf16 / fp16 under float32 logits (a float32 router): loaded as stored, upcast in registers. The
products and sums are then the float32 inputs' if the reduction order is: the compiler lays a load out by its bytes
(8 bf16 a thread, 4 float32: sm_90, Triton 3.6, ``benchmarks/rtr51_gate_compile_cpu.py``), and a thread sums its own
columns first, so float32 logits load every input at 4 columns a thread.
"""

import triton
import triton.language as tl


@triton.jit
def gate_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,  # [M, K], [E, K], [E], [M, E]; the last dim of each contiguous
    num_tokens, hidden, stride_xm, stride_we, stride_om,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    gate_tile(x_ptr, w_ptr, b_ptr, out_ptr, tl.program_id(0) * BLOCK_M, tl.program_id(1) * BLOCK_E, num_tokens, hidden,
              stride_xm, stride_we, stride_om, NUM_EXPERTS, BLOCK_M, BLOCK_E, BLOCK_K, HAS_BIAS)


@triton.jit
def gate_tile(
    x_ptr, w_ptr, b_ptr, out_ptr, row0, col0, num_tokens, hidden, stride_xm, stride_we, stride_om,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """logits[row0:row0+BM, col0:col0+BE] (rows and experts past the ends not stored); also the gate part
    of ``gate_route_kernel``."""
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM]
    cols = col0 + tl.arange(0, BLOCK_E)  # [BE] experts
    row_ok, col_ok = rows < num_tokens, cols < NUM_EXPERTS
    w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_we  # [BE, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        if out_ptr.dtype.element_ty == tl.float32:  # float32 logits: 4 columns a thread whatever x's and W's dtypes
            ks = tl.max_contiguous(ks, [1, 4])  # (float32's 16-byte vector), so one reduction order for all of them
        k_ok = ks < hidden
        wt = tl.load(w_row + ks, mask=col_ok[:, None] & k_ok, other=0.0)  # [BE, BK]
        for r in tl.static_range(BLOCK_M):  # one row at a time: a [BM, BK] tile of x would not fit at BK = 2048
            row = tl.minimum(row0 + r, num_tokens - 1)  # rows past M: not stored
            xr = tl.load(x_ptr + row.to(tl.int64) * stride_xm + ks, mask=k_ok, other=0.0)  # [1, BK]
            part = tl.sum(wt.to(tl.float32) * xr.to(tl.float32), axis=1)  # [BE]
            acc = tl.where(tl.arange(0, BLOCK_M)[:, None] == r, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
