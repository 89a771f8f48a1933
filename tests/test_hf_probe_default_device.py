"""The experts probes (``moekit.hf.variants.build_plan``) under a default device other than the weights' own:
``with torch.device("cuda"): AutoModelForCausalLM.from_config(...)`` builds the plan while CUDA is the default, and
the probes drew from a CPU generator onto it ("Expected a 'cuda' device type for generator but found 'cpu'",
session 54's ft54 device check on an H100). On this CPU the meta device stands in for CUDA: every probe tensor is
made on the CPU, so the plan is the one made without the context."""

import pytest
import torch
import transformers

from moekit.hf.variants import build_plan


def _experts(family: str):
    sizes = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, vocab_size=64, head_dim=16,
                 hidden_size=32, num_experts_per_tok=2)
    if family == "qwen3":
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, intermediate_size=32, **sizes)
    else:  # gpt-oss: clamped, with biases (the gate probe's clamp sweeps)
        cfg = transformers.GptOssConfig(intermediate_size=16, num_local_experts=4, **sizes)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
def test_the_plan_under_another_default_device_is_the_plan_without_it(family):
    plain = build_plan(_experts(family))
    experts = _experts(family)  # on the CPU; its plan built while the default device is another
    with torch.device("meta"):
        under = build_plan(experts)
    assert plain.activation == under.activation and plain.activation is not None
    assert (plain.fused, plain.gated, plain.transposed, plain.has_bias) == (
        under.fused, under.gated, under.transposed, under.has_bias)
