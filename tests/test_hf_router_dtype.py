"""The router's gate GEMM in the dtype transformers computes it, for every family the swap takes, in a bfloat16 model
as ``from_pretrained`` loads it (the weights of ``_keep_in_fp32_modules_strict`` kept in float32: DeepSeek-V3's gate and
its copies). Kolibri-1 / 1.1, Lara-Mini, the privacy filter and LongCat-Flash cast the hidden states and a bf16 gate
weight to float32 before their GEMM (``F.linear(x.float(), w.float())``): ``from_hf_config`` reads
``router_dtype="float32"`` for them. Before it their bf16 logits chose other experts than transformers' for 0.05-0.15%
of the tokens (2 to 6 of 4096; tests/_hf_router_dtype.py measures it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402

from _hf_router_dtype import FP32_GEMM, bf16_block, router_logits  # noqa: E402
from test_hf_swap_walk import _BUILT, _FAMILIES, _SWAPPED  # noqa: E402

_KEYS = [k for k in _BUILT if _FAMILIES[k].family in _SWAPPED and _FAMILIES[k].family != "axk1"]


@pytest.mark.parametrize("key", _KEYS)
def test_router_logits_are_computed_as_transformers_computes_them(key):
    """moe_from_hf's logits equal the block's router's (max abs difference <= 1e-5 of their largest: the float32 sum's
    order; a bf16 GEMM's rounding is ~4e-3 of it), 64 tokens (Inkling's router returns the routed experts' columns);
    the five float32-GEMM families' bf16 GEMM (router_dtype=None) differs by more, so they need the reader's field."""
    block, x = bf16_block(_FAMILIES[key])
    want = router_logits(block, x)
    moe = moekit_hf.moe_from_hf(block)
    with torch.no_grad():
        got = moe.route_tokens(x).router_logits.float()
    if moe.config.shared_expert_combine == "router":  # Inkling's router returns its routed columns, not the shared
        got = got[:, : moe.config.num_experts]
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    if _FAMILIES[key].family in FP32_GEMM:
        assert moe.config.router_dtype == "float32"
        assert moe.gate.weight.dtype == torch.bfloat16  # the model keeps it in its own dtype
        bf16 = torch.nn.functional.linear(x, moe.gate.weight).float()  # what router_dtype=None computed
        assert (bf16 - want).abs().max() > 1e-4 * want.abs().max()
