"""The weight dtypes of ``moekit bench --dtype``: the unquantized baseline and ``moekit.quant``'s schemes.

Each shape's random weights are quantized once (``moekit.quant.quantize`` with its defaults, as
``MoE.quantize_`` does: fp8_block 128x128 blocks, int4_w4a16 groups of 128 with zero points) and every
cell of that shape reuses them. A variant carries what its cells' floor needs: the bytes one touched
expert streams (read off the quantized tensors: packed values, scales, zero points) and the measured
matmul rate of its GEMMs (the fp8 rate for fp8_block, the dense rate for the weight-only schemes,
whose GEMMs run in the activation dtype).

Quantized cells run moekit's own quantized path: ``triton`` on the GPU (the fused fp8 and
weight-only kernels); on the CPU ``grouped_mm``, which dequantizes per call (the only CPU path; the
backends named with ``--backends`` there). No other backend in this bench has a quantized GEMM
(``grouped_mm`` on the GPU would dequantize every expert on every call), so quantized cells are
compared with moekit's unquantized cells (``vs_bf16``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.analysis.formats import FORMATS, get_format
from moekit.bench.ceilings import Ceilings
from moekit.bench.cells import ExpertWeights
from moekit.quant import SCHEMES, quantize

BASELINE = "bfloat16"  # the unquantized cells' --dtype name: bf16 on the GPU, the CPU bench's float32 there
BENCH_DTYPES = (BASELINE, *SCHEMES)
FP8 = "fp8_block"  # the one scheme whose GEMMs run in fp8, held to the fp8 matmul rate


def check_dtypes(dtypes) -> list[str]:
    """``--dtype`` values -> their bench names (BENCH_DTYPES; analyze's format names are aliases:
    ``fp8`` -> ``fp8_block``), baseline first: it is added when only quantized dtypes are asked,
    since every quantized cell is compared with it. ``ValueError`` beginning ``dtype:`` otherwise."""
    names = []
    for text in dtypes or (BASELINE,):
        try:
            name = get_format(text).scheme
        except (KeyError, TypeError):
            aliases = ", ".join(f"{n} = {f.scheme}" for n, f in FORMATS.items() if n != f.scheme)
            raise ValueError(f"dtype: unknown {text!r}; must be among {list(BENCH_DTYPES)} "
                             f"(aliases: {aliases})") from None
        if name not in names:
            names.append(name)
    return [BASELINE] + [n for n in names if n != BASELINE]


@dataclass(frozen=True)
class WeightVariant:
    """One shape's expert weights in one bench dtype."""

    dtype: str  # what the cells carry: the activation dtype when unquantized (bfloat16 / float32), else the scheme
    quantized: bool  # w13/w2 are moekit.quant QuantizedWeights
    weights: ExpertWeights  # w13 [E, 2N, K], w2 [E, K, N]: tensors or QuantizedWeights
    expert_bytes: float  # what one touched expert streams: w13 + w2, packed values + scales + zero points
    mm_TFLOPs: float  # the measured matmul rate its FLOPs are held to
    mm_dtype: str  # what that rate was measured in


def weight_variants(weights: ExpertWeights, dtypes: list[str], ceilings: Ceilings) -> list[WeightVariant]:
    """The baseline (``weights`` as they are) and each quantized dtype of ``dtypes`` (quantized here, once)."""
    w13, w2 = weights.w13, weights.w2
    num_experts = w13.shape[0]
    act_dtype = str(w13.dtype).removeprefix("torch.")
    variants = [WeightVariant(act_dtype, False, weights, (w13.nbytes + w2.nbytes) / num_experts,
                              ceilings.mm_TFLOPs, ceilings.mm_dtype)]
    for scheme in dtypes:
        if scheme == BASELINE:
            continue
        q13, q2 = quantize(w13, scheme), quantize(w2, scheme)
        rate, rate_dtype = ceilings.mm_TFLOPs, ceilings.mm_dtype
        if scheme == FP8 and ceilings.fp8_mm_TFLOPs:
            rate, rate_dtype = ceilings.fp8_mm_TFLOPs, "float8_e4m3fn"
        variants.append(WeightVariant(scheme, True, ExpertWeights(q13, q2), (q13.nbytes + q2.nbytes) / num_experts,
                                      rate, rate_dtype))
    return variants


def quantized_backends(backends: list[str], device: torch.device, explicit: bool) -> list[str]:
    """The backends quantized cells run. On CUDA: ``triton`` when among ``backends`` (grouped_mm and the
    reference dequantize every expert on every call: tens of GB and seconds at DeepSeek-V3's size). Off
    CUDA: every one of ``backends`` when the user named them (``explicit``), else ``grouped_mm``."""
    if device.type == "cuda":
        return [b for b in backends if b == "triton"]
    return list(backends) if explicit else [b for b in backends if b == "grouped_mm"]
