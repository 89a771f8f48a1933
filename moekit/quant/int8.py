"""int8 weight-only quantization (vLLM's ``use_int8_w8a16``): symmetric, one scale per output channel;
activations stay in the model dtype.

Shapes: E experts, R rows (output channels), C columns (the reduction dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moekit.quant.base import QuantizedWeight, check_3d, check_float_weight, check_tensor

INT8_MAX = 127  # symmetric: codes -127..127 (-128 unused, so +-amax both round-trip)


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Int8Weight(QuantizedWeight):
    """Layout ``int8_w8a16``: q [E, R, C] int8, scale [E, R] float32; w[e, r, c] = q[e, r, c] * scale[e, r]."""

    scheme: ClassVar[str] = "int8_w8a16"
    tensor_dtypes: ClassVar[dict[str, torch.dtype]] = {"q": torch.int8, "scale": torch.float32}
    tensor_fields: ClassVar[tuple[str, ...]] = tuple(tensor_dtypes)

    q: torch.Tensor  # [E, R, C] int8
    scale: torch.Tensor  # [E, R] float32

    def _check(self) -> None:
        check_3d(self.scheme, "q", self.q)
        e, r, c = self.q.shape
        check_tensor(self.scheme, "q", self.q, self.tensor_dtypes["q"], (e, r, c))
        check_tensor(self.scheme, "scale", self.scale, self.tensor_dtypes["scale"], (e, r))

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.q.to(acc) * self.scale.to(acc)[:, :, None]).to(dtype)

    def _dequantize_expert(self, expert: int, dtype: torch.dtype, rows: slice) -> torch.Tensor:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.q[expert, rows].to(acc) * self.scale[expert, rows].to(acc)[:, None]).to(dtype)  # [r, C]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Round-to-nearest (half to even) per-row symmetric quantization of w [E, R, C]: scale = amax/127
    (1 for an all-zero row), q = round(w / scale)."""
    check_float_weight("int8_w8a16", w)
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    wf = w.to(acc)
    amax = wf.abs().amax(dim=2) if w.shape[2] else wf.new_zeros(w.shape[:2])  # [E, R]
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).float()  # stored float32: divide by it
    q = torch.round(wf / scale.to(acc)[:, :, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Int8Weight(q=q, scale=scale, dtype=w.dtype)
