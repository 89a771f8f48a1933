"""The config-field audit of the swap: for each family ``use_moekit_blocks`` takes, every scalar field of its experts'
config changed one at a time (a bool flipped, an int + 1, a float x 1.7 + 0.3, an activation or scoring name swapped);
where the changed config still builds the block and changes its output, the swapped block must equal it (< 1e-5), or
be left with a reason. A field the block reads but ``from_hf_config`` drops would show as a mismatch.

``PYTHONPATH=.:tests python3 tests/_hf_field_audit.py [FAMILY ...]`` prints one line per (family, field) that the block
reads and the swap does not follow (none on transformers 5.25, session 50), then the counts.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import torch

# Fields that size or describe the model around the block, not its routing or experts
NOT_THE_BLOCK = {"torch_dtype", "dtype", "vocab_size", "num_hidden_layers", "max_position_embeddings", "pad_token_id",
                 "bos_token_id", "eos_token_id", "initializer_range", "rms_norm_eps", "attention_dropout", "use_cache",
                 "output_router_logits", "router_aux_loss_coef", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "tie_word_embeddings", "return_dict", "output_hidden_states", "output_attentions",
                 "is_encoder_decoder", "rope_theta", "sliding_window", "chunk_size_feed_forward"}
NAMES = {"silu": "gelu", "softmax": "sigmoid", "sigmoid": "softmax"}


@dataclass
class Verdict:
    family: str
    field: str
    value: object
    outcome: str  # "followed", "left: REASON", "MISMATCH rel L2 ...", "RAISES ..."


def changed_values(name: str, value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1] if value else [1, 2]
    if isinstance(value, float):
        return [value * 1.7 + 0.3]
    if isinstance(value, str) and name.endswith(("act", "activation", "_fn", "method", "func", "strategy")):
        return [NAMES.get(value, "silu")]
    return []


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def check_field(key: str, name: str, value, base_x: torch.Tensor, base_out) -> str | None:
    """The outcome of the block of ``key`` built with ``name=value``; None where it cannot be built or its output
    does not change (the block does not read the field at this value)."""
    import moekit.hf as moekit_hf
    from _helpers import rel_l2
    from test_hf_swap_walk import _FAMILIES, _CannotBuild, _family_block

    try:
        block, x, want = _family_block(_FAMILIES[key], **{name: value})
    except _CannotBuild:
        return None
    if x.shape == base_x.shape and torch.equal(_first(want), _first(base_out)):
        return None
    try:
        report = moekit_hf.use_moekit_blocks(torch.nn.ModuleDict({"mlp": block}))
    except Exception as err:  # noqa: BLE001  (the audit records it)
        return f"RAISES {type(err).__name__}: {str(err)[:100]}"
    if not report.swapped:
        return f"left: {report.left[0].reason[:100]}"
    with torch.no_grad():
        err = rel_l2(_first(block(x)).flatten(), _first(want).flatten())
    return "followed" if err < 1e-5 else f"MISMATCH rel L2 {err:.2e}"


def audit(key: str) -> list[Verdict]:
    """Every read field of the family ``key``'s experts config, changed, and what the swap did."""
    from test_hf_swap_walk import _FAMILIES, _family_block

    block, x, want = _family_block(_FAMILIES[key])
    verdicts = []
    for name, value in sorted(block.experts.config.to_dict().items()):
        if name in NOT_THE_BLOCK or name.startswith("_"):
            continue
        for changed in changed_values(name, value):
            outcome = check_field(key, name, changed, x, want)
            if outcome is not None:
                verdicts.append(Verdict(_FAMILIES[key].family, name, changed, outcome))
    return verdicts


if __name__ == "__main__":
    from test_hf_swap_walk import _BUILT, _FAMILIES, _SWAPPED

    warnings.simplefilter("ignore")
    wanted = set(sys.argv[1:])
    keys = [k for k in _BUILT if _FAMILIES[k].family in _SWAPPED and (not wanted or _FAMILIES[k].family in wanted)]
    counts: dict[str, int] = {}
    for key in keys:
        for v in audit(key):
            kind = v.outcome.split(" ")[0].rstrip(":")
            counts[kind] = counts.get(kind, 0) + 1
            if kind != "followed":
                print(f"{v.family} {v.field}={v.value!r}: {v.outcome}", flush=True)
    print(f"{len(keys)} families; (family, changed field) pairs the block reads: {counts}")
