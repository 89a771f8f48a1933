"""Accelerator specs the byte model needs: memory bandwidth, memory capacity, dense tensor throughput.

Every figure is dense (no 2:4 structured sparsity: datasheets that quote sparse throughput are halved)
and carries its source. Capacity is what the driver reports, in GiB, because that is what an engine's
``gpu_memory_utilization`` multiplies: an "80 GB" H100 shows 81,559 MiB = 79.65 GiB.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator. ``dense_tflops[dtype]`` is the tensor-core peak for GEMMs in that dtype."""

    name: str
    bandwidth_tb_s: float  # HBM/GDDR bandwidth, 1e12 bytes per second
    memory_gib: float  # driver-reported capacity, 2**30 bytes
    dense_tflops: dict[str, float]  # dtype -> 1e12 FLOP/s, dense; a dtype absent here is not supported
    source: str  # where the numbers come from

    def __post_init__(self) -> None:
        if not self.bandwidth_tb_s > 0:
            raise ValueError(f"bandwidth_tb_s must be positive, got {self.bandwidth_tb_s}")
        if not self.memory_gib >= 0:
            raise ValueError(f"memory_gib must be >= 0, got {self.memory_gib}")
        bad = {d: v for d, v in self.dense_tflops.items() if not v > 0}
        if bad:
            raise ValueError(f"dense_tflops must be positive, got {bad}")

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.bandwidth_tb_s * 1e12

    def flops_per_s(self, dtype: str) -> float:
        """Dense peak FLOP/s for GEMMs in ``dtype``; raises ``KeyError`` naming the supported dtypes."""
        if dtype not in self.dense_tflops:
            raise KeyError(f"{self.name} has no {dtype} tensor throughput; it has {sorted(self.dense_tflops)}")
        return self.dense_tflops[dtype] * 1e12

    def ridge_intensity(self, dtype: str) -> float:
        """I*: FLOP per byte at which a kernel in ``dtype`` turns from memory- to compute-bound."""
        return self.flops_per_s(dtype) / self.bandwidth_bytes_s

    def with_overrides(
        self, bandwidth_tb_s: float | None = None, memory_gib: float | None = None,
        dense_tflops: dict[str, float] | None = None,
    ) -> "GpuSpec":
        """A copy with user-supplied values; the source says which figures were replaced."""
        changes: dict = {}
        if bandwidth_tb_s is not None:
            changes["bandwidth_tb_s"] = bandwidth_tb_s
        if memory_gib is not None:
            changes["memory_gib"] = memory_gib
        if dense_tflops:
            changes["dense_tflops"] = {**self.dense_tflops, **dense_tflops}
        if not changes:
            return self
        return dataclasses.replace(self, source=f"{self.source}; user-supplied: {', '.join(changes)}", **changes)


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "NVIDIA H100 SXM5 80GB", 3.35, 79.65, {"bf16": 989.4, "fp8": 1978.9},
        "NVIDIA H100 Tensor Core GPU datasheet (SXM: 3.35 TB/s; 1,979 BF16 / 3,958 FP8 TFLOPS with sparsity, "
        "halved); 81,559 MiB reported by nvidia-smi",
    ),
    "h200": GpuSpec(
        "NVIDIA H200 SXM 141GB", 4.8, 140.4, {"bf16": 989.4, "fp8": 1978.9},
        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 4.8 TB/s, same Hopper tensor cores as H100 SXM); "
        "143,771 MiB reported by nvidia-smi",
    ),
    "b200": GpuSpec(
        "NVIDIA B200 180GB", 8.0, 179.06, {"bf16": 2250.0, "fp8": 4500.0},
        "NVIDIA HGX B200 datasheet (8 GPUs: 36 PF BF16 / 72 PF FP8 with sparsity, per GPU and halved; "
        "8 TB/s per GPU); 183,359 MiB reported by nvidia-smi",
    ),
    "a100": GpuSpec(
        "NVIDIA A100 SXM4 80GB", 2.039, 80.0, {"bf16": 312.0},
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 2,039 GB/s; 312 BF16 TFLOPS dense; no FP8); "
        "81,920 MiB reported by nvidia-smi",
    ),
    "mi300x": GpuSpec(
        "AMD Instinct MI300X 192GB", 5.3, 191.69, {"bf16": 1307.4, "fp8": 2614.9},
        "AMD Instinct MI300X datasheet (5.3 TB/s; 1,307.4 BF16 / 2,614.9 FP8 TFLOPS dense); "
        "205,822,885,888 bytes reported by rocm-smi",
    ),
    "l40s": GpuSpec(
        "NVIDIA L40S 48GB", 0.864, 44.99, {"bf16": 362.05, "fp8": 733.0},
        "NVIDIA L40S datasheet (864 GB/s; 733 BF16 / 1,466 FP8 TFLOPS with sparsity, halved); "
        "46,068 MiB reported by nvidia-smi",
    ),
    "rtx4090": GpuSpec(
        "NVIDIA GeForce RTX 4090 24GB", 1.008, 23.99, {"bf16": 165.2, "fp8": 330.3},
        "NVIDIA Ada Lovelace architecture whitepaper, appendix (1,008 GB/s; dense tensor TFLOPS with FP32 "
        "accumulate: 165.2 BF16, 330.3 FP8); 24,564 MiB reported by nvidia-smi",
    ),
}

_ALIASES = {"h100-sxm": "h100", "h100_sxm": "h100", "a100-80gb": "a100", "4090": "rtx4090", "rtx-4090": "rtx4090"}


def gpu_names() -> list[str]:
    return sorted(GPUS)


def get_gpu(name: str) -> GpuSpec:
    """The spec for a short name (``h100``, ``mi300x``, ...); raises ``KeyError`` naming the known GPUs."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise KeyError(f"gpu must be one of {gpu_names()}, got {name!r}")
    return GPUS[key]
