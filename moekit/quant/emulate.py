"""The quantized experts computed exactly in torch: the definitions every quantized kernel is checked
against, and the entry the ``reference`` and ``grouped_mm`` backends call when handed QuantizedWeights.

- weight-only schemes (int8_w8a16, int4_w4a16, mxfp4): the weights dequantized, then the backend's own
  dense path (activations stay in the model dtype).
- fp8_block (DeepSeek-V3): ``experts_fp8_block_reference``:

    x -> fake-quantize 1 x BC (e4m3, s = amax/448) -> gate-up with dequantized w13 (+ b13) -> glu
      -> fake-quantize 1 x BC -> down with dequantized w2 (+ b2) -> times the routed weight, summed over slots

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moekit.activations import apply_glu
from moekit.layouts.grouping import to_local_ids
from moekit.quant.base import QuantizedWeight
from moekit.quant.fp8_block import Fp8BlockWeight, fake_quantize_activations_fp8


def check_quantized_pair(w13, w2) -> str:
    """Both weights quantized with one scheme (a mixed pair has no kernel); returns the scheme."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedWeight):
            raise TypeError(f"{name} must be a QuantizedWeight like the other expert weight, got {type(w).__name__}")
    if w13.scheme != w2.scheme:
        raise TypeError(f"w13 and w2 must share a quantization scheme, got {w13.scheme!r} and {w2.scheme!r}")
    return w13.scheme


def run_quantized(
    dense_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,  # [M, K]
    w13: QuantizedWeight,  # [E, 2N, K] logical
    w2: QuantizedWeight,  # [E, K, N] logical
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    weight_dtype: torch.dtype,
    dense_options: dict | None = None,
    **contract,
) -> torch.Tensor:
    """A backend's quantized entry. ``contract``: the experts signature's keywords (activation,
    expert_map, b13, b2). Weight-only schemes: ``dense_fn`` on the weights dequantized to
    ``weight_dtype`` (with ``dense_options``, the backend's own keywords); fp8_block:
    ``experts_fp8_block_reference``."""
    if check_quantized_pair(w13, w2) == "fp8_block":
        return experts_fp8_block_reference(x, w13, w2, topk_ids, topk_weights, **contract)
    return dense_fn(x, w13.dequantize(weight_dtype), w2.dequantize(weight_dtype), topk_ids, topk_weights,
                    **contract, **(dense_options or {}))


def experts_fp8_block_reference(
    x: torch.Tensor,  # [M, K]
    w13: Fp8BlockWeight,  # [E, 2N, K] logical
    w2: Fp8BlockWeight,  # [E, K, N] logical
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation="silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, 2N]
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """DeepSeek-V3's fp8 block recipe, exactly: activations quantized per token per BC columns (the
    weights' column block) before each GEMM, weights dequantized, float32 accumulation (float64 for
    float64 x); returns x.dtype. Ids outside [0, E) or mapped to -1 are skipped."""
    check_quantized_pair(w13, w2)
    acc = torch.promote_types(x.dtype, torch.float32)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    local = to_local_ids(topk_ids, num_experts, expert_map).view(num_tokens, top_k)  # [M, k]
    xq = fake_quantize_activations_fp8(x, w13.block_shape[1]).to(acc)  # [M, K], per token: the gather commutes
    out = torch.zeros(num_tokens, x.shape[1], dtype=acc, device=x.device)  # [M, K]
    for expert in range(num_experts):
        tokens, slots = (local == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        one = slice(expert, expert + 1)
        h = xq[tokens] @ w13.select_experts(one).dequantize(acc)[0].t()  # [m, 2N]
        if b13 is not None:
            h = h + b13[expert].to(acc)
        a = fake_quantize_activations_fp8(apply_glu(h, activation), w2.block_shape[1]).to(acc)  # [m, N]
        y = a @ w2.select_experts(one).dequantize(acc)[0].t()  # [m, K]
        if b2 is not None:
            y = y + b2[expert].to(acc)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(acc))
    return out.to(x.dtype)
