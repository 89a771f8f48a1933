"""int4 weight-only quantization (vLLM's ``use_int4_w4a16``): group-wise along the reduction dim with
zero points (``symmetric=False``, default) or a fixed zero of 8 (``symmetric=True``); activations stay
in the model dtype.

Packing: two 4-bit codes per byte along C, element 2i in the low nibble (the byte layout the Triton
kernel reads: one uint8 load gives two neighbouring K values). AWQ/GPTQ int32 tensors convert to it
once at load (``moekit.quant.formats``).

Shapes: E experts, R rows, C columns (the reduction dim), G = ceil(C/g) groups of g columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moekit.quant.base import (
    QuantizedWeight,
    cdiv,
    check_3d,
    check_float_weight,
    check_tensor,
    decode_nibbles,
    pack_nibbles,
    pad_cols,
    unpack_nibbles,
)

GROUP_SIZES = (32, 64, 128)
SYMMETRIC_ZERO = 8
INT4_MAX = 15
CODE_VALUES = tuple(float(c) for c in range(INT4_MAX + 1))  # code -> its value before zero and scale


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Int4Weight(QuantizedWeight):
    """Layout ``int4_w4a16``: q [E, R, ceil(C/2)] uint8 (two codes 0..15 per byte, element 2i low),
    scale [E, R, G] float32, zero [E, R, G] uint8 (0..15); w[e, r, c] = (code - zero[e, r, c // g]) *
    scale[e, r, c // g]."""

    scheme: ClassVar[str] = "int4_w4a16"
    tensor_dtypes: ClassVar[dict[str, torch.dtype]] = {"q": torch.uint8, "scale": torch.float32, "zero": torch.uint8}
    tensor_fields: ClassVar[tuple[str, ...]] = tuple(tensor_dtypes)

    q: torch.Tensor  # [E, R, ceil(C/2)] uint8
    scale: torch.Tensor  # [E, R, G] float32
    zero: torch.Tensor  # [E, R, G] uint8, 0..15 (8 for every group of a symmetric weight)
    group_size: int = 128  # g, one of GROUP_SIZES
    cols: int  # C, the logical reduction dim (q alone cannot tell an odd C)

    def _check(self) -> None:
        check_group_size(self.group_size)
        check_3d(self.scheme, "q", self.q)
        if not isinstance(self.cols, int) or isinstance(self.cols, bool) or self.cols < 0:
            raise ValueError(f"{self.scheme}: cols must be an int >= 0, got {self.cols!r}")
        e, r = self.q.shape[:2]
        check_tensor(self.scheme, "q", self.q, self.tensor_dtypes["q"], (e, r, cdiv(self.cols, 2)))
        groups = cdiv(self.cols, self.group_size)
        check_tensor(self.scheme, "scale", self.scale, self.tensor_dtypes["scale"], (e, r, groups))
        check_tensor(self.scheme, "zero", self.zero, self.tensor_dtypes["zero"], (e, r, groups))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.q.shape[:2], self.cols))

    def codes(self) -> torch.Tensor:
        """The unpacked codes [E, R, C] uint8 (0..15)."""
        return unpack_nibbles(self.q, self.cols)

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        g, c = self.group_size, self.cols
        zero = self.zero.to(acc).repeat_interleave(g, 2)[:, :, :c]  # [E, R, C]
        scale = self.scale.to(acc).repeat_interleave(g, 2)[:, :, :c]  # [E, R, C]
        return ((self.codes().to(acc) - zero) * scale).to(dtype)

    def _dequantize_expert(self, expert: int, dtype: torch.dtype, rows: slice) -> torch.Tensor:
        """The same (code - zero) * scale per element in the same precision, on [r, G, g] with the group's
        zero and scale broadcast (no [r, C] copies of them) and the codes decoded by one byte gather."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale, zero = self.scale[expert, rows], self.zero[expert, rows]  # [r, G]
        r, groups, g = scale.shape[0], scale.shape[1], self.group_size
        w = pad_cols(decode_nibbles(self.q[expert, rows], CODE_VALUES, acc), g).view(r, groups, g)
        w.sub_(zero.to(acc)[:, :, None]).mul_(scale.to(acc)[:, :, None])
        return w.view(r, groups * g)[:, :self.cols].to(dtype).contiguous()  # [r, C]


def check_group_size(group_size) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False) -> Int4Weight:
    """Round-to-nearest group-wise quantization of w [E, R, C] along C.

    Asymmetric (default): per group lo = min(w, 0), hi = max(w, 0) (zero always representable),
    scale = (hi - lo)/15, zero = round(-lo/scale), code = clamp(round(w/scale) + zero, 0, 15).
    Symmetric: scale = amax/7, zero = 8, code = clamp(round(w/scale) + 8, 0, 15). An all-zero group
    gets scale 1. A last group shorter than g (odd C) uses only its own columns.
    """
    check_float_weight("int4_w4a16", w)
    check_group_size(group_size)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    e, r, c = w.shape
    groups = cdiv(c, group_size)
    grouped = pad_cols(w.to(acc), group_size).reshape(e, r, groups, group_size)  # zero padding: no min/max change
    if symmetric:
        amax = grouped.abs().amax(dim=3)  # [E, R, G]
        scale = torch.where(amax > 0, amax / 7, torch.ones_like(amax)).float()
        zero = torch.full_like(scale, SYMMETRIC_ZERO, dtype=torch.uint8)
    else:
        lo, hi = grouped.amin(dim=3).clamp(max=0), grouped.amax(dim=3).clamp(min=0)  # [E, R, G]
        scale = torch.where(hi > lo, (hi - lo) / INT4_MAX, torch.ones_like(hi)).float()
        zero = torch.round(-lo / scale.to(acc)).clamp(0, INT4_MAX).to(torch.uint8)
    codes = torch.round(grouped / scale.to(acc)[..., None]) + zero.to(acc)[..., None]  # [E, R, G, g]
    codes = codes.clamp(0, INT4_MAX).view(e, r, groups * group_size)[:, :, :c]
    return Int4Weight(q=pack_nibbles(codes), scale=scale, zero=zero, group_size=group_size, cols=c, dtype=w.dtype)
