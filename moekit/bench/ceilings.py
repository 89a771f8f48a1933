"""The two ceilings every cell is held to, measured on the device in the same run.

- copy bandwidth: a large device-to-device copy, counting bytes read + written;
- dense matmul rate: a large square product on random data (zeros run faster than real data), in
  bf16 on the GPU and float32 on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.bench.timing import time_calls


@dataclass(frozen=True)
class Ceilings:
    copy_TBps: float  # device copy bandwidth, 1e12 bytes/s, read + write
    mm_TFLOPs: float  # dense matmul rate, 1e12 FLOP/s
    mm_dtype: str  # the dtype the matmul rate was measured in


def measure_ceilings(device: torch.device) -> Ceilings:
    cuda = device.type == "cuda"
    numel = (1 << 30) if cuda else (1 << 25)  # 2 GiB of bf16 on the GPU (far past the 60 MB L2), 128 MiB fp32 on the CPU
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
