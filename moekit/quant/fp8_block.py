"""fp8 block quantization, DeepSeek-V3's recipe: e4m3 weights with one fp32 scale per block (128x128 by
default) and activations quantized at run time per token per 128 columns.

    [x -> quantize_activations_fp8 (1 x 128)] -> [gate-up GEMM, block-scaled] -> glu
        -> [quantize_activations_fp8 (1 x 128)] -> [down GEMM, block-scaled]

Scales follow the checkpoints' ``weight_scale_inv`` convention: dequantized = q * scale, so a
checkpoint's tensors are used as they are. Shapes: E experts, R rows, C columns (the reduction dim),
(BR, BC) the block shape, M tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moekit.quant.base import QuantizedWeight, cdiv, check_3d, check_float_weight, check_tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
DEFAULT_BLOCK_SHAPE = (128, 128)
ACTIVATION_BLOCK = 128  # DeepSeek-V3: activations are quantized per token per 128 columns
REDUCTION_BLOCKS = (16, 32, 64, 128)  # the block shapes' BC every backend runs (``check_block_shape``)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Fp8BlockWeight(QuantizedWeight):
    """Layout ``fp8_block``: q [E, R, C] float8_e4m3fn, scale [E, ceil(R/BR), ceil(C/BC)] float32;
    w[e, r, c] = q[e, r, c] * scale[e, r // BR, c // BC]."""

    scheme: ClassVar[str] = "fp8_block"
    tensor_dtypes: ClassVar[dict[str, torch.dtype]] = {"q": FP8_DTYPE, "scale": torch.float32}
    tensor_fields: ClassVar[tuple[str, ...]] = tuple(tensor_dtypes)

    q: torch.Tensor  # [E, R, C] float8_e4m3fn
    scale: torch.Tensor  # [E, ceil(R/BR), ceil(C/BC)] float32; the checkpoints' weight_scale_inv
    block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE  # (BR, BC)

    def _check(self) -> None:
        check_block_shape(self.block_shape)
        check_3d(self.scheme, "q", self.q)
        e, r, c = self.q.shape
        check_tensor(self.scheme, "q", self.q, self.tensor_dtypes["q"], (e, r, c))
        br, bc = self.block_shape
        check_tensor(self.scheme, "scale", self.scale, self.tensor_dtypes["scale"], (e, cdiv(r, br), cdiv(c, bc)))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        r, c = self.q.shape[1:]
        br, bc = self.block_shape
        scale = self.scale.to(acc).repeat_interleave(br, 1)[:, :r].repeat_interleave(bc, 2)[:, :, :c]  # [E, R, C]
        return (self.q.to(acc) * scale).to(dtype)


def check_block_shape(block_shape) -> None:
    """(BR, BC), the one rule of ``quantize``, ``from_tensors`` / checkpoints and the Triton kernels' entry: BR any
    positive int (a scale per BR rows: a kernel tile straddling two blocks reads a scale per column, tested at
    100 and 48 rows under the interpreter), BC one of ``REDUCTION_BLOCKS`` (the activations' 1 x BC groups and the
    kernels' K step, BLOCK_K = BC; the reference path computes any BC, the kernels need a power of two from 16, and
    only up to 128 ran on a device)."""
    if (not isinstance(block_shape, tuple) or len(block_shape) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_shape)):
        raise ValueError(f"block_shape must be a tuple of two positive ints (rows, cols), got {block_shape!r}")
    if block_shape[1] not in REDUCTION_BLOCKS:
        raise ValueError(f"block_shape[1] (the reduction block: the activations' group and the kernels' BLOCK_K) must "
                         f"be one of {REDUCTION_BLOCKS}, got {block_shape!r}; rows (block_shape[0]) may be any "
                         "positive int; checkpoints use (128, 128)")


def quantize_fp8_block(w: torch.Tensor, block_shape=DEFAULT_BLOCK_SHAPE) -> Fp8BlockWeight:
    """Round-to-nearest block quantization of w [E, R, C]: per block scale = amax/448 (1 for an all-zero
    block), q = e4m3(w / scale), computed in float32 (float64 for float64 weights)."""
    check_float_weight("fp8_block", w)
    block_shape = tuple(block_shape) if isinstance(block_shape, list) else block_shape
    check_block_shape(block_shape)
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    e, r, c = w.shape
    br, bc = block_shape
    rb, cb = cdiv(r, br), cdiv(c, bc)
    padded = torch.nn.functional.pad(w.to(acc), (0, cb * bc - c, 0, rb * br - r))  # [E, rb*BR, cb*BC]
    amax = padded.abs().view(e, rb, br, cb, bc).amax(dim=(2, 4))  # [E, rb, cb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()  # stored float32: divide by it
    full = scale.to(acc).repeat_interleave(br, 1)[:, :r].repeat_interleave(bc, 2)[:, :, :c]  # [E, R, C]
    q = (w.to(acc) / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8BlockWeight(q=q, scale=scale, block_shape=block_shape, dtype=w.dtype)


@dataclass(frozen=True)
class Fp8Activations:
    """Activations quantized per row per ``block`` columns (the torch twin of the kernels' prologue)."""

    q: torch.Tensor  # [M, C] float8_e4m3fn
    scale: torch.Tensor  # [M, ceil(C/block)] float32; x[m, c] ~= q[m, c] * scale[m, c // block]
    block: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[M, C] in ``dtype``: q * scale, computed in float32 (float64 when asked)."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self.scale.to(acc).repeat_interleave(self.block, 1)[:, : self.q.shape[1]]  # [M, C]
        return (self.q.to(acc) * scale).to(dtype)


def quantize_activations_fp8(x: torch.Tensor, block: int = ACTIVATION_BLOCK) -> Fp8Activations:
    """x [M, C] -> e4m3 values and one float32 scale per row per ``block`` columns: s = amax(|x_block|)/448
    (1 for an all-zero block), q = e4m3(x / s) rounded to nearest (even), computed in float32."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a 2-D floating-point tensor [M, C], got {getattr(x, 'shape', type(x))}")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")
    m, c = x.shape
    nb = cdiv(c, block)
    xf = x.float()
    amax = torch.nn.functional.pad(xf.abs(), (0, nb * block - c)).view(m, nb, block).amax(dim=2)  # [M, nb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.repeat_interleave(block, 1)[:, :c]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [M, C]
    return Fp8Activations(q=q, scale=scale, block=block)


def fake_quantize_activations_fp8(x: torch.Tensor, block: int = ACTIVATION_BLOCK) -> torch.Tensor:
    """x [M, C] -> the values the fp8 GEMM sees, q * s, in float32 (float64 for float64 x)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return quantize_activations_fp8(x, block).dequantize(dtype)
