"""The fp8 Gluon path's gather (``moekit.experts.triton_gluon_fp8``): rows of x into the contiguous layout,
quantized on the way (one pass over x instead of a gather then a quantize).

gather_quant_rows_kernel: for the real rows r (sorted_ids[r] < A), x_q[r], x_s[r] = e4m3 groups of
    x[sorted_ids[r] // k] (per GROUP columns: s = amax / 448, 1 for a zero group; ``quant_fp8``'s rounding)
    and dst[sorted_ids[r]] = r; padding rows are not written (their GEMM rows are never read). A program
    takes BLOCK_R rows by GROUPS groups (GROUPS > 1: more loads in flight per program, fewer programs).
    Torch twin: ``moekit.layouts.contiguous.permute_contiguous`` then ``triton_fp8.quantize_groups``.

Shapes: x [M, K], sorted_ids [R] (padding = sentinel A = M*k), x_q [R, K] e4m3 (float32 under EMULATE),
x_s [R, ceil(K/G)] float32, dst [A] int32 (-1 = not routed here, filled by the caller).
"""

import triton
import triton.language as tl

from moekit.experts._kernels.quant_fp8 import group_scale, to_e4m3


@triton.jit
def gather_quant_rows_kernel(
    x_ptr, sorted_ptr, xq_ptr, xs_ptr, dst_ptr,
    num_rows, num_assignments, K, stride_xm, stride_qm, stride_sm,
    num_groups, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr,
    GROUPS: tl.constexpr = 1,
):
    """Program (pid_r, pid_g): rows pid_r*BR .., column groups pid_g*GROUPS .. (num_groups = ceil(K / GROUP))."""
    pid_g = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = pid_g * GROUPS * GROUP + tl.arange(0, GROUPS * GROUP)  # [GS*G]
    groups = pid_g * GROUPS + tl.arange(0, GROUPS)  # [GS]
    r_ok = rows < num_rows
    a = tl.load(sorted_ptr + rows, mask=r_ok, other=num_assignments).to(tl.int64)  # [BR]
    real = r_ok & (a < num_assignments)
    if pid_g == 0:
        tl.store(dst_ptr + a, rows.to(tl.int32), mask=real)
    tokens = tl.where(real, a // TOP_K, 0)
    mask = real[:, None] & (cols < K)[None, :]
    v = tl.load(x_ptr + tokens[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v = tl.reshape(v, (BLOCK_R, GROUPS, GROUP))  # [BR, GS, G]
    s = group_scale(tl.max(tl.abs(v), axis=2))  # [BR, GS]
    q = tl.reshape(to_e4m3(v / s[:, :, None], EMULATE), (BLOCK_R, GROUPS * GROUP))
    rows64 = rows.to(tl.int64)
    tl.store(xq_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(xs_ptr + rows64[:, None] * stride_sm + groups[None, :], s,
             mask=real[:, None] & (groups < num_groups)[None, :])
