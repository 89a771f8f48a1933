"""The config dict ``MoEConfig.from_hf_config``'s readers read (split from ``config_hf.py`` at its size limit): a
missing field raises ``MissingConfigField`` naming it and the model type; ``get_field`` takes its other spellings;
``in_file_words`` says a bad value under the key the config.json holds it by, not moekit's field for it."""

from __future__ import annotations

import contextlib
import re
import traceback
from pathlib import Path
from typing import Any

from moekit.config_hf_clamps import MoELayerRule


class MissingConfigField(KeyError):
    """A config lacks a field the layer's reader needs. ``fields`` are the accepted spellings; ``null``: the config
    holds it as None (a class default such as DeepSeek-V2's ``num_experts_per_tok``, a file's ``null``)."""

    def __init__(self, fields: tuple[str, ...], model_type: Any, null: bool = False):
        super().__init__(fields[0])
        self.fields, self.model_type, self.null = fields, model_type, null

    def __str__(self) -> str:
        return self.message()

    def message(self, source: str = "config") -> str:
        """The sentence, with ``source`` saying which config (``config.json at PATH``)."""
        others = "".join(f" (or {name!r})" for name in self.fields[1:])
        null = " (it is null)" if self.null else ""
        return f"{source} has no {self.fields[0]!r}{others}{null}: a {self.model_type} MoE layer needs it"


class Fields(dict):
    """A config dict whose missing field raises ``MissingConfigField`` naming it, not a bare KeyError; a reader that
    counts the MoE layers by a rule of its fields leaves it here (``count_moe_layers``), for ``layer=``'s check."""

    moe_layer_rule: MoELayerRule | None = None

    def __getitem__(self, name: str) -> Any:
        value = super().__getitem__(name)  # a missing one: __missing__
        self.__dict__.setdefault("read", {})[name] = value  # what the readers read, in order: ``in_file_words``
        return value

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def __missing__(self, name: str) -> Any:
        raise MissingConfigField((name,), self.get("model_type"))


# MoEConfig's fields (and ActivationSpec's, for gpt-oss's clamp) -> every config.json key a reader reads one from (a
# nested one as its path: DBRX's ffn_config.moe_top_k, moekit.analysis.billed)
FILE_KEYS = {
    "hidden_size": ("hidden_size", "moe_hidden_size", "moe_latent_size", "d_model"),
    "moe_intermediate_size": ("moe_intermediate_size", "intermediate_size", "expert_ffn_hidden_size",
                              "ffn_config.ffn_hidden_size"),
    "num_experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts",
                    "ffn_config.moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts",
              "ffn_config.moe_top_k"),
    "n_group": ("n_group", "num_expert_group"), "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor", "moe_router_scaling_factor", "router_scaling_factor",
                              "moe_routed_scaling_factor", "route_scale"),
    "renorm_clamp": ("moe_norm_min",), "renormalize": ("norm_topk_prob", "moe_renormalize"),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size", "shared_experts_intermediate_size",
                                        "n_shared_experts", "num_shared_experts", "moe_num_shared_experts",
                                        "shared_intermediate_size", "share_expert_dim", "num_shared_expert"),
    "num_identity_experts": ("zero_expert_num",), "router_logit_softcap": ("moe_router_logit_softcapping",),
    "sparsemixer_jitter_eps": ("router_jitter_noise",), "activation": ("hidden_act",),
    "num_moe_layers": ("num_hidden_layers", "num_layers", "first_k_dense_replace", "num_dense_layers"),
    "limit": ("swiglu_limit",), "alpha": ("swiglu_alpha",),
}


@contextlib.contextmanager
def in_file_words(d: dict):
    """Re-raise a TypeError / ValueError of reading ``d`` (a ``Fields``) under the config's own keys: each moekit
    field the message names, said first as the keys it was read from and the values they hold (``cfg.moe_norm_min=-1
    (moekit's renorm_clamp): renorm_clamp must be ...``); an error inside a reader (``float('abc')``) names the last
    key it read. A message that already starts with ``cfg.`` names the config's keys itself. A key so named that holds
    None is missing, not bad: ``MissingConfigField(null=True)`` names it."""
    try:
        yield
    except (TypeError, ValueError) as err:
        message, read = str(err), d.__dict__.get("read", {})
        if message.startswith("cfg.") or not read:
            raise
        said = []
        for field in dict.fromkeys(re.findall(r"[a-z_]+", message)):
            keys = [key for key in FILE_KEYS.get(field, ()) if key in read]
            if any(read[key] is None for key in keys):
                null = next(key for key in keys if read[key] is None)
                raise MissingConfigField((null,), d.get("model_type"), null=True) from err
            if keys:
                named = ", ".join(f"cfg.{key}={read[key]!r}" for key in keys)
                said.append(named if keys == [field] else f"{named} (moekit's {field})")
        if not said and Path(traceback.extract_tb(err.__traceback__)[-1].filename).name.startswith("config_hf"):
            key = next(reversed(read))
            said.append(f"reading cfg.{key}={read[key]!r}")
        if not said:
            raise
        raise type(err)(f"{'; '.join(said)}: {message}") from err


def get_field(d: dict, *names: str, default: Any = KeyError) -> Any:
    """The first of ``names`` present (and not None) in d: config.json and transformers' own
    ``to_dict()`` spell some fields differently (Qwen3's num_experts vs num_local_experts)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is KeyError:
        raise MissingConfigField(names, d.get("model_type"))
    return default
