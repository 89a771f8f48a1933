"""The options of sessions 45-49 in the layer fuzzer's draws (``_fuzz_cases``): DeepSeek-V4's sqrt(softplus) scoring,
ERNIE-4.5's renorm floor (``renorm_clamp``), the clamp after the activation (``limit_after_act``: Step-3.7,
Bailing-Hybrid; any limit, as the per-layer clamps give), a shared MLP's own activation (HY-V4), and DeepSeek-V4's
hash layers (``HashMoE``: a token-id table chooses the experts).

The first four are drawn on top of a seed's config from a stream of their own (``random.Random(f"newest{seed}")``),
so every field the seed drew before stays what it was; a combination ``MoEConfig`` refuses is checked to name a field
it changed, then left out. Hash cases are a fuzzer of their own seeds (``draw_hash_case``): ``draw_case``'s layers,
EP and offload fuzzers take plain ``MoE`` layers.

Shapes: M tokens, K hidden, E routed experts, k = top_k, V table rows.
"""

from __future__ import annotations

import random

from moekit import MoEConfig
from moekit.activations import ActivationSpec

CLAMPS = (1e-12, 0.9, 3.0)  # 1e-12: ERNIE-4.5's (bites only at extreme rows); 0.9 and 3.0 bite on ordinary rows
LIMITS = (0.5, 1.0, 7.0)  # 7.0: gpt-oss's and Step-3.7's widest; 0.5 and 1.0 bite at unit scale


def _after_act(rng: random.Random) -> ActivationSpec:
    """A clamp after the activation: min(act(gate), L) * up.clamp(-L, L), sometimes with gpt-oss's other fields."""
    name = rng.choice(["silu", "silu", "gelu", "gelu_tanh", "relu", "relu2"])
    extras = {}
    if rng.random() < 0.3:
        extras["interleaved"] = True
    if name == "silu" and rng.random() < 0.3:
        extras["alpha"] = 1.702
    if rng.random() < 0.3:
        extras["up_shift"] = 1.0
    return ActivationSpec(name=name, limit=rng.choice(LIMITS), limit_after_act=True, **extras)


SHARED_ACTIVATIONS = ("silu", "gelu", "relu2")


def draws_newest(f: dict) -> bool:
    """Whether config fields ``f`` hold one of this module's options (``fuzz_layer.py --newest`` runs only those)."""
    activation = f.get("activation")
    return (f.get("scoring") == "sqrtsoftplus" or bool(f.get("renorm_clamp")) or f.get("shared_activation") is not None
            or getattr(activation, "limit_after_act", False))


def newest_changes(f: dict, rng: random.Random) -> dict:
    """The newest options drawn for the config fields ``f`` (each on its own; {} for most seeds' half)."""
    changes = {}
    if rng.random() < 0.25:
        changes["scoring"] = "sqrtsoftplus"
    if rng.random() < 0.3:  # one family's formula or the other: the clamp replaces a drawn eps
        changes.update(renorm_clamp=rng.choice(CLAMPS), renorm_eps=0.0)
    if rng.random() < 0.2:
        changes["activation"] = _after_act(rng)
    if f.get("shared_expert_intermediate_size") and rng.random() < 0.35:
        changes["shared_activation"] = rng.choice(
            SHARED_ACTIVATIONS + (ActivationSpec("silu", limit=1.0, limit_after_act=True),
                                  ActivationSpec("gelu", limit=0.8)))
    return changes


def with_newest(f: dict, rng: random.Random) -> tuple[dict, list[tuple[dict, str]]]:
    """``f`` with the newest changes ``MoEConfig`` accepts (all of them, else each one alone on top of those taken),
    and the refusals met, (changes, message) each: the message must name a field the changes hold."""
    changes, refusals = newest_changes(f, rng), []
    for trial in ([changes] if changes else []) + ([{k: v} for k, v in changes.items()] if len(changes) > 1 else []):
        try:
            MoEConfig(**{**f, **trial})
        except (ValueError, TypeError) as err:
            refusals.append((dict(trial), str(err)))
            continue
        f = {**f, **trial}
        if trial is changes:
            break
    return f, refusals


def hash_fields(f: dict, rng: random.Random) -> dict:
    """``f`` made a hash layer's config (DeepSeek-V4): what a hash config refuses put back to its default, most times
    (the rest refused, naming it), a scoring (``with_newest`` may make it V4's sqrt(softplus) after) and a table
    size."""
    f = dict(f)
    if rng.random() < 0.9:
        f.update(use_correction_bias=False, n_group=1, topk_group=1, num_identity_experts=0,
                 sparsemixer_jitter_eps=None, shared_expert_combine="sum", nonfinite="raise",
                 expert_weight_on="output", renorm_clamp=0.0)
        f["top_k"] = min(f["top_k"], f["num_experts"])
    f["renorm_eps"] = rng.choice([0.0, 1e-20])  # the hash routers' two (HashMoE refuses others, naming it)
    f["scoring"] = rng.choice(["sqrtsoftplus", "sigmoid", "softmax"])
    f["hash_table_size"] = rng.choice([1, 3, 8, 20])
    return f


def hash_table(cfg: MoEConfig, rng: random.Random) -> list[list[int]]:
    """A table [V][k] of experts in [0, E): random rows, a repeated expert in a row sometimes (a table may hold one)."""
    e, k = cfg.num_experts, cfg.top_k
    return [rng.sample(range(e), k) if rng.random() < 0.8 else [rng.randrange(e) for _ in range(k)]
            for _ in range(cfg.hash_table_size)]
