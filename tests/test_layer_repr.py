"""What ``print(moe)`` says of a layer's routing: a user who built or loaded a layer (``from_hf_config``, a preset,
``torch.load``) checks there that it routes as the model does. Every routing field off its default is named, with
its value, and what ``router="auto"`` resolved to on the layer's device (as ``backend="auto"`` is); a plain
softmax top-k layer says nothing more than before.
"""

from __future__ import annotations

import torch

from moekit import HashMoE, MoE, MoEConfig

BASE = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2)


def test_a_plain_layer_s_line_names_no_routing_option():
    text = repr(MoE(MoEConfig(**BASE)))
    assert "E=8, k=2, K=32, N=16, scoring=softmax, shared=0 (separate)" in text
    assert "router=auto (torch), capacity_factor=None" in text  # no Triton on this device: route in torch


def test_deepseek_v3_s_router_is_named_field_by_field():
    """DeepSeek-V3's rule written out by hand: sigmoid, 4 of 8 groups, the correction bias, x2.5, w / (sum + 1e-20);
    each one changes which experts a token takes or their weights, and the line named none of them."""
    cfg = MoEConfig(**BASE, scoring="sigmoid", n_group=4, topk_group=2, use_correction_bias=True,
                    routed_scaling_factor=2.5, renorm_eps=1e-20)
    text = repr(MoE(cfg))
    assert ("scoring=sigmoid (renorm_eps=1e-20, routed_scaling_factor=2.5, n_group=4, topk_group=2, "
            "use_correction_bias=True), shared=0") in text


def test_ernie_s_clamp_and_other_families_options_are_named():
    assert "scoring=softmax (renorm_clamp=1e-12, use_correction_bias=True)," in repr(
        MoE(MoEConfig(**BASE, renorm_clamp=1e-12, use_correction_bias=True)))
    assert "scoring=sigmoid (renormalize=False, expert_weight_on='input')," in repr(
        MoE(MoEConfig(**{**BASE, "top_k": 1}, scoring="sigmoid", renormalize=False, expert_weight_on="input")))
    assert "scoring=softmax (router_logit_softcap=30.0, num_identity_experts=2, router_bias=True)," in repr(
        MoE(MoEConfig(**BASE, router_logit_softcap=30.0, num_identity_experts=2, router_bias=True)))


def test_a_hash_layer_names_its_table_and_its_router():
    cfg = MoEConfig(**BASE, scoring="sqrtsoftplus", hash_table_size=50, renorm_eps=1e-20)
    text = repr(HashMoE(cfg))
    assert "scoring=sqrtsoftplus (renorm_eps=1e-20, hash_table_size=50)," in text
    assert "router=auto (torch)," in text  # on the CPU "auto" looks the table up in torch
    assert "router=torch, capacity_factor" in repr(HashMoE(cfg, router="torch", dtype=torch.float32))


def test_an_expert_parallel_layer_names_the_routing_of_the_layer_it_shards():
    import torch.distributed as dist

    from moekit.parallel import EPMoE

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = MoEConfig(**BASE, scoring="sigmoid", n_group=4, topk_group=2, use_correction_bias=True)
        text = repr(EPMoE.from_moe(MoE(cfg)))
    finally:
        dist.destroy_process_group()
    assert "rank=0/1, E=8, local=8, k=2, K=32, N=16, scoring=sigmoid (n_group=4, topk_group=2, " \
           "use_correction_bias=True), shared_slots=0" in text
