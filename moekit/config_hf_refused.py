"""The transformers ``model_type``s ``MoEConfig.from_hf_config`` refuses, each with why: MoE families whose router,
experts or combine moekit's layer does not compute, so a layer read from their config would differ from the model
(split from ``config_hf.py`` at its size limit). Their experts still run on moekit under their own router, through
transformers' experts interface (``model.set_experts_implementation("moekit")``)."""

from __future__ import annotations

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
