"""The correction bias through a cast of the layer: DeepSeek-V3-style routing must not change when a model is cast
whole (``model.to(torch.bfloat16)``) rather than built in its dtype. Shapes: M tokens, E experts, k experts a token.
"""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig


@pytest.mark.parametrize("cast", ["to_bfloat16", "half", "double", "to_meta_and_back"])
def test_a_cast_keeps_the_correction_bias_in_float32_and_its_choice(cast):
    """``MoE(cfg).to(torch.bfloat16)`` (a model cast whole) must route as ``MoE(cfg, dtype=torch.bfloat16)``: the
    correction bias stays in float32 (its bits too), as built, so a token keeps the experts the float32 bias chooses.
    Cast with the weights, the bias lost its low bits and chose other experts (DeepSeek-V3's biases sit near a common
    offset, their differences small). Reference: top-k of sigmoid(logits) + the float32 bias, written here."""
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=64, top_k=8, scoring="sigmoid",
                    use_correction_bias=True)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(torch.randn(64) * 0.5 + 3.0)
    bias = moe.e_score_correction_bias.clone()
    if cast == "to_meta_and_back":  # built on meta, filled from a checkpoint, then cast
        saved = moe.state_dict()
        moe = moe.to("meta").to_empty(device="cpu")
        moe.load_state_dict(saved)
        moe = moe.to(torch.bfloat16)
    else:
        moe = moe.to(torch.bfloat16) if cast == "to_bfloat16" else getattr(moe, cast)()
    assert moe.e_score_correction_bias.dtype == torch.float32 and torch.equal(moe.e_score_correction_bias, bias)
    x = torch.randn(128, 64, dtype=moe.w13.dtype)
    with torch.no_grad():
        routed = moe.route_tokens(x)
    ids, logits = routed.routing.topk_ids, routed.router_logits.double()
    want = torch.topk(torch.sigmoid(logits) + bias.double(), 8, dim=-1).indices
    assert torch.equal(ids.sort(-1).values.long(), want.sort(-1).values)
