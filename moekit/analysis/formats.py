"""Weight storage formats: bytes per weight element (b_w) and the dtype the GEMM computes in.

Each format names the ``moekit.quant`` scheme it stands for (``moekit bench --dtype`` spells formats by
those names), and ``get_format`` takes either spelling: ``fp8`` or ``fp8_block``, ``bf16`` or
``bfloat16``. The byte counts are per weight, for whole models; the exact bytes of moekit's own
layouts (every scale of a tail block, the fp32 scales and uint8 zero points of ``int4_w4a16``) are
what ``moekit bench`` counts from the quantized tensors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

INT4_GROUP_SIZE = 128  # the common GPTQ/AWQ/moe_wna16 group: one bf16 scale per 128 weights
MX_BLOCK = 32  # OCP MX: one e8m0 scale per 32 values along the reduction dim


@dataclass(frozen=True)
class WeightFormat:
    """How a weight matrix is stored; ``bytes_per_weight`` includes its share of the scales."""

    name: str
    bits: int  # bits per weight element
    scale_bytes_per_group: float  # scale (and zero-point) bytes per group; 0 when negligible
    group_size: int  # weights sharing one scale
    compute_dtype: str  # dtype of the tensor-core GEMM (a key of GpuSpec.dense_tflops)
    scheme: str | None = None  # the moekit.quant scheme ("bfloat16": unquantized) it models: its other spelling

    @property
    def bytes_per_weight(self) -> float:
        """b_w: bytes per weight element including scales."""
        return self.bits / 8 + self.scale_bytes_per_group / self.group_size


FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat("bf16", 16, 0.0, 1, "bf16", "bfloat16"),
    # w8a8: fp8 weights and activations on fp8 tensor cores. DeepSeek's 128x128 fp32 block scales add
    # 4 / 16384 = 0.02% and are left out, as the published "671 GB in fp8" leaves them out.
    "fp8": WeightFormat("fp8", 8, 0.0, 1, "fp8", "fp8_block"),
    # w8a16: int8 weights, one fp32 scale per output row: 4 bytes per K >= 2048 weights (<= 0.2%), left out.
    "int8": WeightFormat("int8", 8, 0.0, 1, "bf16", "int8_w8a16"),
    # w4a16: int4 weights with one bf16 scale per group of 128, dequantised into bf16 GEMMs (as GPTQ/AWQ
    # checkpoints ship; moekit's int4_w4a16 keeps an fp32 scale and a uint8 zero per group, 5 bytes).
    "int4": WeightFormat("int4", 4, 2.0, INT4_GROUP_SIZE, "bf16", "int4_w4a16"),
    # OCP MXFP4 (gpt-oss): e2m1 values, one e8m0 byte per 32, dequantised into bf16 GEMMs.
    "mxfp4": WeightFormat("mxfp4", 4, 1.0, MX_BLOCK, "bf16", "mxfp4"),
}
SCHEME_ALIASES = {f.scheme: name for name, f in FORMATS.items() if f.scheme not in (None, name)}  # "fp8_block" -> "fp8"


def format_names() -> list[str]:
    """Every accepted spelling: the format names, then the scheme names that alias them."""
    return sorted(FORMATS) + sorted(SCHEME_ALIASES)


def get_format(name: str) -> WeightFormat:
    """The format for a format name (``bf16``, ``fp8``, ``int8``, ``int4``, ``mxfp4``) or its scheme name
    (``bfloat16``, ``fp8_block``, ``int8_w8a16``, ``int4_w4a16``); raises ``KeyError`` naming the valid ones."""
    key = SCHEME_ALIASES.get(name, name)
    if key not in FORMATS:
        aliases = ", ".join(f"{s} = {n}" for s, n in sorted(SCHEME_ALIASES.items()))
        raise KeyError(f"dtype must be one of {sorted(FORMATS)} (or a scheme name: {aliases}), got {name!r}")
    return FORMATS[key]
