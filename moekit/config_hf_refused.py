"""The transformers ``model_type``s ``MoEConfig.from_hf_config`` refuses, each with why: MoE families whose router,
experts or combine moekit's layer does not compute, so a layer read from their config would differ from the model
(split from ``config_hf.py`` at its size limit). Their experts still run on moekit under their own router, through
transformers' experts interface (``model.set_experts_implementation("moekit")``). ``UNSERVED``: MoE families moekit
serves neither way (no experts class behind that interface), each with why; ``moekit analyze`` still bills most."""

from __future__ import annotations

import difflib

_KEEPS = "Its experts run on moekit through model.set_experts_implementation('moekit'), which keeps its router"
REFUSED = {
    "zaya": "ZAYA's router is an MLP (down_proj to router_hidden_size plus the previous layer's router state times a "
            "learned scale, an RMSNorm, two GELU layers, out_proj over the E experts and a skip expert of weight 0), "
            "and its block takes and returns that state across layers; moekit's gate is one linear layer of x. "
            + _KEEPS,
    **dict.fromkeys(("gemma4_text", "diffusion_gemma_text"),
                    "its router RMS-normalises x without a weight, scales it by a learned vector and "
                    "hidden_size^-0.5 before its linear layer, and multiplies each chosen weight by a learned "
                    "per_expert_scale; moekit's gate is one linear layer of x. " + _KEEPS),
    "nemotron_h": "its experts are ungated (an up projection and relu^2), and a MoEConfig layer holds gated experts "
                  "(w13 [E, 2N, K]). " + _KEEPS + " (ActivationSpec('relu2', gated=False))",
    "ergo": "its experts are ungated (an up projection and relu^2) and RMS-normalise each route's output before the "
            "weighted sum; a MoEConfig layer holds gated experts and sums the weighted outputs as they are. "
            + _KEEPS,
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"),
                    "its experts' SwiGLU soft-caps the gate factor and up (tanh(x / c) * c), an activation moekit does "
                    "not implement. " + _KEEPS + " (composed)"),
    "muse_spark_text": "its experts RMS-normalise each expert's output before the routing weight "
                       "(has_post_expert_norm), and moekit's combine sums the weighted outputs as they are. "
                       + _KEEPS + " (composed)",
}

_NO_INTERFACE = "its experts are not behind transformers' experts interface, so neither moe_from_hf nor " \
                "set_experts_implementation('moekit') takes them"
UNSERVED = {
    "dbrx": "moekit does not serve DBRX: " + _NO_INTERFACE + " (DbrxExperts: w1, v1, w2 stacked [E·N, d])",
    "jetmoe": "moekit does not serve JetMoE: " + _NO_INTERFACE + " (JetMoeParallelExperts), and its attention is a "
              "mixture of attention heads routed per token (MoA), which moekit does not compute",
    "switch_transformers": "moekit does not serve Switch-Transformers: its top-1 router drops each sequence's tokens "
                           "past an expert's expert_capacity (they skip the MLP) and scales the chosen expert's output "
                           "by its softmax probability, and " + _NO_INTERFACE + " (ungated wi / relu / wo MLPs, in an "
                           "encoder-decoder)",
    "nllb-moe": "moekit does not serve NLLB-MoE: its top-2 router drops tokens past expert_capacity (at inference "
                "moe_eval_capacity_token_fraction of the batch) and its experts' outputs are scaled by "
                "1 - moe_token_dropout, and " + _NO_INTERFACE + " (ungated fc1 / relu / fc2 with biases, in an "
                "encoder-decoder)",
    "doge": "moekit does not serve Doge: its CDMoE routes over num_experts one-neuron experts (a row of down_embed "
            "and of up_embed each) by product keys (two top-sqrt(E) searches), beside a dense gated MLP; moekit's "
            "experts are MLPs of width moe_intermediate_size chosen by one linear gate",
    "vitpose_backbone": "moekit does not serve ViTPose's backbone: its experts are chosen per image by the caller's "
                        "dataset_index, not routed per token (num_experts=1, its default, is a dense MLP), so there "
                        "is no router to run and no MoE layer to bill",
}

# the fields an MoE model's config counts its routed experts by (transformers' families' spellings)
_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")


def model_type_error(model_type, fields, known) -> ValueError:
    """The error for a config whose ``model_type`` is refused or unserved (why, in a line), or that no reader in
    ``known`` reads: one short line (it listed all 70 types, 1,300 characters), with the nearest spelling, or why
    where the config counts no routed experts."""
    if model_type in REFUSED or model_type in UNSERVED:  # not the list of those it reads
        return ValueError(f"cfg.model_type {model_type!r}: {REFUSED.get(model_type) or UNSERVED[model_type]}")
    near = difflib.get_close_matches(str(model_type), sorted(known), n=1, cutoff=0.8)
    if near:
        why = f"did you mean {near[0]!r}?"
    elif not any(fields.get(k) is not None for k in _EXPERTS_KEYS):
        why = (f"its config names no routed experts ({', '.join(_EXPERTS_KEYS[:3])}, ...): a dense model has no MoE "
               "layer")
    else:
        why = "an MoE family this moekit does not read"
    return ValueError(f"cfg.model_type must be one of the {len(known)} MoE model types moekit reads (docs/hf.md#"
                      f"coverage; moekit.config.HF_READERS), got {model_type!r}: {why}")
