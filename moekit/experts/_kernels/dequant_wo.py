"""Dequantize weight-only packed expert weights into a dense scratch buffer (the "scratch" decode of
``triton_wo_plan``: dequantize once, then run the 16-bit grouped GEMMs of ``gemm.py``).

    q / scale / zero of experts [e0, e0 + c) of a weight [E, R, C] --> out [c, R, C] (out's dtype)

One program writes one [BLOCK_R, BLOCK_C] tile of one expert; grid (cdiv(R, BR), cdiv(C, BC), c). The
bytes are decoded by ``gemm_wo``'s own functions (``_load_weights``, ``_scales``, ``_decode``: the same
bit placement and the same single rounding of the exact weight as the fused kernels); int8's per-row
scale, which the fused kernels apply in their epilogue, multiplies here in float32 before the rounding.
Layouts as in ``moekit.experts.triton_wo``'s module docstring; every tensor is read through its strides.

Torch twin: ``moekit.experts.triton_wo.dequantize_wo(w, C)[e0 : e0 + c].to(out.dtype)``.

Shapes: R output rows of the weight, C its reduction dim (K for w13, N for w2), BR/BC the tile.
"""

import triton
import triton.language as tl

from moekit.experts._kernels.gemm_wo import _decode, _load_weights, _scales


@triton.jit
def dequant_wo_kernel(
    q_ptr, s_ptr, z_ptr, out_ptr,
    R, C, stored_cols, expert0,
    stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg,
    stride_oe, stride_or,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SPAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r, pid_c, local = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = (expert0 + local).to(tl.int64)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    r_ok = rows < R
    c0 = pid_c * BLOCK_C
    q_rows = q_ptr + expert * stride_qe + rows.to(tl.int64) * stride_qr  # [BR] pointers
    s_rows = s_ptr + expert * stride_se + rows * stride_sr
    z_rows = z_ptr + expert * stride_ze + rows * stride_zr
    raw = _load_weights(q_rows, c0, stored_cols, r_ok, stride_qc, BLOCK_C, SCHEME)
    mul, add = _scales(s_rows, z_rows, c0, C, r_ok, stride_sg, stride_zg, SPAN, GROUP, BLOCK_R, BLOCK_C, SCHEME)
    if SCHEME == 0:  # per output row, symmetric
        scale = tl.load(s_rows, mask=r_ok, other=0.0)
        w = (_decode(raw, mul, add, tl.float32, BLOCK_R, BLOCK_C, SPAN, SCHEME) * scale[:, None])
        w = w.to(out_ptr.dtype.element_ty)
    else:
        w = _decode(raw, mul, add, out_ptr.dtype.element_ty, BLOCK_R, BLOCK_C, SPAN, SCHEME)
    cols = c0 + tl.arange(0, BLOCK_C)
    out = out_ptr + local.to(tl.int64) * stride_oe + rows.to(tl.int64)[:, None] * stride_or + cols[None, :]
    tl.store(out, w, mask=r_ok[:, None] & (cols < C)[None, :])
