"""What ``print(moe)`` says of a ``MoE`` or ``HashMoE``: its shapes, how it routes, what runs it.

A user who built or loaded a layer (``MoEConfig.from_hf_config``, a preset, ``torch.load``) checks there that it
routes as the model does: every routing field off its default is named with its value after ``scoring``, and
``router="auto"`` / ``backend="auto"`` say what they resolved to on the layer's device. ``EPMoE``'s line takes the
routing part (``routing_changes``).
"""

from __future__ import annotations

from moekit.config import ROUTER_OPTIONS, MoEConfig

# the fields that choose a token's experts or weigh them, in the order the line names them
ROUTING_FIELDS = ("renormalize", "renorm_eps", "renorm_clamp", "routed_scaling_factor", "n_group", "topk_group",
                  "use_correction_bias", *(name for name in ROUTER_OPTIONS if name != "renorm_clamp"),
                  "hash_table_size", "router_bias", "router_dtype", "nonfinite")


def routing_changes(config: MoEConfig) -> str:
    """``"(name=value, ...)"`` for each ``ROUTING_FIELDS`` entry off its default; "" for a plain softmax top-k."""
    defaults = MoEConfig.__dataclass_fields__
    changed = [f"{name}={getattr(config, name)!r}" for name in ROUTING_FIELDS
               if getattr(config, name) != defaults[name].default]
    return f" ({', '.join(changed)})" if changed else ""


def layer_line(moe) -> str:
    """The line under ``MoE(`` in ``repr(moe)`` (``moe``: a ``MoE`` or a subclass with ``resolved_router``)."""
    c = moe.config
    backend = f" ({moe.resolved_backend()})" if moe.backend == "auto" else ""
    router = f" ({moe.resolved_router()})" if moe.router == "auto" else ""
    return (f"E={c.num_experts}, k={c.top_k}, K={c.hidden_size}, N={c.moe_intermediate_size}, "
            f"scoring={c.scoring}{routing_changes(c)}, "
            f"shared={c.shared_expert_intermediate_size} ({'fused' if moe.fuse_shared else 'separate'}), "
            f"dtype={str(moe.w13.dtype)[6:]}, quant={moe.quant_scheme}, backend={moe.backend}{backend}, "
            f"router={moe.router}{router}, capacity_factor={moe.capacity_factor}")
