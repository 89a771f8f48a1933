"""fp8 (e4m3) quantization of activation rows, in groups of G columns: s = amax(|group|) / 448, q =
round_to_e4m3(v / s), so v ~= q * s. Used on x before the gate-up GEMM (its own kernel) and on the
[A, N] intermediate inside the gate-up GEMM's epilogue (``gemm_fp8``).

Torch twin: ``moekit.experts.triton_fp8.quantize_groups``.

Shapes: R rows, C columns, G group size (the weight block's reduction width, 128 by default),
CB = ceil(C / G) scale columns; BR rows per program.

EMULATE (the CPU interpreter only): the interpreter's float32 -> float8e4nv conversion is wrong
(Triton 3.9: 17.0 -> 18 where round-to-nearest-even gives 16, subnormals flushed to 0, 464 -> NaN), so
there the value is rounded onto the e4m3 grid in float32 arithmetic and kept as float32 (equal to
torch's ``.to(float8_e4m3fn)`` on every value tried: 262144 values across the range, ties and
subnormals included). On the GPU the hardware conversion (round to nearest even) is used.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def group_scale(amax):
    """s = amax / 448 (e4m3's largest finite value); a group of zeros gets s = 1 (it quantizes to 0s)."""
    return tl.where(amax > 0, amax / 448.0, 1.0)


@triton.jit
def _round_e4m3_f32(v):
    """v (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as float32."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2^-6 the grid is the subnormal step 2^-9
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: 2^(exponent - 3)
    t = v / step  # exact: a power-of-two divisor; |t| <= 16
    return ((t + 12582912.0) - 12582912.0) * step  # adding 1.5 * 2^23 rounds t to an integer, ties to even


@triton.jit
def to_e4m3(v, EMULATE: tl.constexpr):
    """v (float32) clamped to +-448 and rounded to e4m3: float8e4nv, or float32 under EMULATE."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    if EMULATE:
        return _round_e4m3_f32(v)
    return v.to(tl.float8e4nv)


@triton.jit
def quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr,  # x [R, C] float, q [R, C] e4m3 (float32 under EMULATE), s [R, CB] float32
    num_rows, C, stride_xr, stride_xc, stride_qr, stride_sr,
    BLOCK_R: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr,
):
    """Program (pid_r, g) quantizes rows pid_r*BR .. of column group g."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    group = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = group * GROUP + tl.arange(0, GROUP)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (cols < C)[None, :]
    rows64 = rows.to(tl.int64)
    v = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :] * stride_xc, mask=ok, other=0.0).to(tl.float32)
    s = group_scale(tl.max(tl.abs(v), axis=1))  # [BR]
    q = to_e4m3(v / s[:, None], EMULATE)  # [BR, G]
    tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rows64 * stride_sr + group, s, mask=row_ok)
