"""torch's grouped GEMM (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``) where this torch runs it.

The grouped-GEMM layouts (``moekit.experts.grouped_mm``) call it for every expert's rows at once; the device check
``benchmarks/variants_grouped_mm_device_check.py`` probes it.

Shapes: A rows grouped by expert (rows offs[e-1]:offs[e]), E experts, w [E, out, in].
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def grouped_mm_fn():
    """torch's grouped GEMM function, or None where this torch has none."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs a grouped GEMM of ``dtype`` on ``device_type`` (probed once)."""
    fn = grouped_mm_fn()
    if fn is None:
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        fn(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_takes(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes a [A, in] @ w [E, out, in]^T as they are: 16-byte aligned row strides on
    both operands, and a B that is row- or column-major (w's storage [E, out, in] or transformers' transposed
    [E, in, out], both read as is)."""
    aligned = (a.shape[1] * a.element_size()) % 16 == 0 and (w.shape[1] * w.element_size()) % 16 == 0
    aligned = aligned and (w.stride(2) == 1 or w.stride(1) == 1)
    return aligned and grouped_mm_supported(a.device.type, a.dtype)
