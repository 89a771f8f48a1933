"""Quantized expert weights: fp8 block-scaled (DeepSeek-V3), int8 and int4 weight-only, MXFP4 (gpt-oss).

    w [E, R, C] --quantize(w, scheme, **options)--> QuantizedWeight --.dequantize()--> float32 [E, R, C]
    checkpoint tensors --formats.from_* / from_tensors--> QuantizedWeight (never requantized)

| scheme         | bits/weight (+ scales)      | activations                    | options                         |
| -------------- | --------------------------- | ------------------------------ | ------------------------------- |
| ``fp8_block``  | 8 + fp32 per 128x128 block  | e4m3, per token per 128 cols   | block_shape=(128, 128)          |
| ``int8_w8a16`` | 8 + fp32 per row            | model dtype                    |                                 |
| ``int4_w4a16`` | 4 + fp32 scale, u8 zero / g | model dtype                    | group_size=128, symmetric=False |
| ``mxfp4``      | 4 + e8m0 per 32             | model dtype                    |                                 |

The tensor layouts (what the Triton kernels read) are documented on each class. ``MoE.quantize_``
quantizes a layer's routed experts in place; the ``reference`` and ``grouped_mm`` backends run them
through ``run_quantized``; ``experts_fp8_block_reference`` is the fp8 recipe's torch definition.
"""

from moekit.quant.base import QuantizedWeight
from moekit.quant.emulate import check_quantized_pair, experts_fp8_block_reference, run_quantized
from moekit.quant.formats import cat_rows, from_awq, from_deepseek_fp8, from_gpt_oss_mxfp4, from_gptq, stack_experts
from moekit.quant.fp8_block import (
    Fp8Activations,
    Fp8BlockWeight,
    fake_quantize_activations_fp8,
    quantize_activations_fp8,
)
from moekit.quant.int4 import Int4Weight
from moekit.quant.int8 import Int8Weight
from moekit.quant.module import (
    install_quantized_experts_,
    move_quantized_,
    quant_scheme_of,
    quantize_experts_,
    refuse_quantized_into_float,
)
from moekit.quant.mxfp4 import Mxfp4Weight, e2m1_decode
from moekit.quant.schemes import SCHEMES, from_tensors, is_quantized, quantize, scheme_of_tensors, scheme_options

__all__ = [
    "SCHEMES", "QuantizedWeight", "Fp8BlockWeight", "Int8Weight", "Int4Weight", "Mxfp4Weight", "Fp8Activations",
    "quantize", "from_tensors", "is_quantized", "scheme_options", "scheme_of_tensors",
    "quantize_activations_fp8", "fake_quantize_activations_fp8", "e2m1_decode",
    "experts_fp8_block_reference", "run_quantized", "check_quantized_pair",
    "from_deepseek_fp8", "from_gpt_oss_mxfp4", "from_gptq", "from_awq", "cat_rows", "stack_experts",
    "quantize_experts_", "install_quantized_experts_", "quant_scheme_of", "move_quantized_",
    "refuse_quantized_into_float",
]
