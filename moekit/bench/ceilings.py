"""The ceilings every cell is held to, measured on the device in the same run.

- copy bandwidth: a large device-to-device copy, counting bytes read + written;
- dense matmul rate: a large square product on random data (zeros run faster than real data), in
  bf16 on the GPU and float32 on the CPU;
- fp8 matmul rate (runs with fp8_block cells): ``torch._scaled_mm`` on a square e4m3 product with fp32
  per-tensor scales, bf16 out, fast accumulation; None, with the error, where the device or the torch
  build has no fp8 matmul. ``measure_fp8_mm`` is the one definition (benchmark scripts call it too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moekit.bench.timing import time_calls

FP8_MM_SIZE = {"cuda": 8192, "cpu": 1024}  # the square fp8 product: 8192^3 on the GPU (the issue's), small on a CPU


@dataclass(frozen=True)
class Ceilings:
    copy_TBps: float  # device copy bandwidth, 1e12 bytes/s, read + write
    mm_TFLOPs: float  # dense matmul rate, 1e12 FLOP/s
    mm_dtype: str  # the dtype the matmul rate was measured in
    fp8_mm_TFLOPs: float | None = None  # e4m3 torch._scaled_mm rate, 1e12 FLOP/s; None: not measured or failed
    fp8_mm_error: str | None = None  # why fp8_mm_TFLOPs is None ("not measured: ..." when the run had no fp8 cells)


@dataclass(frozen=True)
class Fp8MmRate:
    """One fp8 matmul-rate probe: the rate, or why there is none."""

    TFLOPs: float | None  # 2·n³ / time, 1e12 FLOP/s; None when the probe failed
    error: str | None  # "<exception type>: <message>" when it failed, else None


def measure_ceilings(device: torch.device) -> Ceilings:
    cuda = device.type == "cuda"
    # 2 GiB of bf16 on the GPU (far past the 60 MB L2), 128 MiB fp32 on the CPU
    numel = (1 << 30) if cuda else (1 << 25)
    dtype = torch.bfloat16 if cuda else torch.float32
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    us = time_calls([lambda: dst.copy_(src)], device, budget_s=0.3)
    copy = 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e12
    del src, dst
    n = 8192 if cuda else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    us = time_calls([lambda: a @ b], device, budget_s=0.5)
    return Ceilings(copy_TBps=copy, mm_TFLOPs=2 * n**3 / (us * 1e-6) / 1e12, mm_dtype=str(dtype).removeprefix("torch."))


def measure_fp8_mm(device: torch.device, n: int | None = None, *, fast_accum: bool = True,
                   budget_s: float = 0.3) -> Fp8MmRate:
    """The e4m3 matmul rate: ``torch._scaled_mm`` of two random n x n e4m3 matrices (the second
    column-major, as it requires) with fp32 per-tensor scales of 1, bf16 out. n defaults to
    FP8_MM_SIZE of the device type. A RuntimeError, TypeError or AttributeError (no fp8 kernel for this
    GPU, a CPU build without it, a torch without ``_scaled_mm``) gives ``TFLOPs=None`` and its message."""
    n = n or FP8_MM_SIZE.get(device.type, FP8_MM_SIZE["cpu"])
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)  # [n, n] row-major
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # [n, n] column-major
        one = torch.ones((), device=device)  # fp32 per-tensor scale

        def mm():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

        us = time_calls([mm], device, budget_s=budget_s)
    except (RuntimeError, TypeError, AttributeError) as err:
        return Fp8MmRate(None, f"{type(err).__name__}: {err}".splitlines()[0])
    return Fp8MmRate(2 * n**3 / (us * 1e-6) / 1e12, None)


def with_fp8_mm(ceilings: Ceilings, device: torch.device, wanted: bool) -> Ceilings:
    """``ceilings`` with the fp8 matmul rate measured when ``wanted`` (the run has fp8 cells), else
    recorded as not measured."""
    if not wanted:
        return dataclasses.replace(ceilings, fp8_mm_TFLOPs=None, fp8_mm_error="not measured: no fp8_block cells")
    rate = measure_fp8_mm(device)
    return dataclasses.replace(ceilings, fp8_mm_TFLOPs=rate.TFLOPs, fp8_mm_error=rate.error)
