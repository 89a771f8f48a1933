"""Weight storage formats: bytes per weight element (b_w) and the dtype the GEMM computes in."""

from __future__ import annotations

from dataclasses import dataclass

INT4_GROUP_SIZE = 128  # the common GPTQ/AWQ/moe_wna16 group: one bf16 scale per 128 weights


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix is stored; ``bytes_per_weight`` includes its share of the scales."""

    name: str
    bits: int  # bits per weight element
    scale_bytes_per_group: float  # scale (and zero-point) bytes per group; 0 when negligible
    group_size: int  # weights sharing one scale
    compute_dtype: str  # dtype of the tensor-core GEMM (a key of GpuSpec.dense_tflops)

    @property
    def bytes_per_weight(self) -> float:
        """b_w: bytes per weight element including scales."""
        return self.bits / 8 + self.scale_bytes_per_group / self.group_size


FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16, 0.0, 1, "bf16"),
    # w8a8: fp8 weights and activations on fp8 tensor cores. DeepSeek's 128x128 fp32 block scales add
    # 4 / 16384 = 0.02% and are left out, as the published "671 GB in fp8" leaves them out.
    "fp8": WeightFormat("fp8", 8, 0.0, 1, "fp8"),
    # w4a16: int4 weights with one bf16 scale per group of 128, dequantised into bf16 GEMMs.
    "int4": WeightFormat("int4", 4, 2.0, INT4_GROUP_SIZE, "bf16"),
}


def get_format(name: str) -> WeightFormat:
    """The format for ``bf16``, ``fp8`` or ``int4``; raises ``KeyError`` naming the valid ones."""
    if name not in FORMATS:
        raise KeyError(f"dtype must be one of {sorted(FORMATS)}, got {name!r}")
    return FORMATS[name]
