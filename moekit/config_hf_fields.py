"""The config dict ``MoEConfig.from_hf_config``'s readers read (split from ``config_hf.py`` at its size limit): a
missing field raises ``MissingConfigField`` naming it and the model type; ``get_field`` takes its other spellings."""

from __future__ import annotations

from typing import Any

from moekit.config_hf_clamps import MoELayerRule


class MissingConfigField(KeyError):
    """A config lacks a field the layer's reader needs. ``fields`` are the accepted spellings."""

    def __init__(self, fields: tuple[str, ...], model_type: Any):
        super().__init__(fields[0])
        self.fields, self.model_type = fields, model_type

    def __str__(self) -> str:
        return self.message()

    def message(self, source: str = "config") -> str:
        """The sentence, with ``source`` saying which config (``config.json at PATH``)."""
        others = "".join(f" (or {name!r})" for name in self.fields[1:])
        return f"{source} has no {self.fields[0]!r}{others}: a {self.model_type} MoE layer needs it"


class Fields(dict):
    """A config dict whose missing field raises ``MissingConfigField`` naming it, not a bare KeyError; a reader that
    counts the MoE layers by a rule of its fields leaves it here (``count_moe_layers``), for ``layer=``'s check."""

    moe_layer_rule: MoELayerRule | None = None

    def __missing__(self, name: str) -> Any:
        raise MissingConfigField((name,), self.get("model_type"))


def get_field(d: dict, *names: str, default: Any = KeyError) -> Any:
    """The first of ``names`` present (and not None) in d: config.json and transformers' own
    ``to_dict()`` spell some fields differently (Qwen3's num_experts vs num_local_experts)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is KeyError:
        raise MissingConfigField(names, d.get("model_type"))
    return default
