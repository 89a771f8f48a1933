"""An ``OffloadedMoE``'s ``state_dict`` holds its routed experts: the host store's, under the names of the ``MoE`` it
was built from (float: ``w13`` [E, 2N, K], ``w2`` [E, K, N]; quantized: ``w13.q``, ``w13.scale`` ..., as
``MoE.quantize_`` saves them; ``b13`` [E, 2N], ``b2`` [E, K] with expert biases). So an offloaded layer saves what
the (un-fused) ``MoE`` saves, and loads its own state_dict or the ``MoE``'s. Without this its own empty rows
(``w13`` [0, 2N, K]: it holds no expert itself) were all a save kept of the experts, and a load kept the layer's.

A load writes the host store in place (all of the layer's experts or none) and drops the layer's experts from the
cache's slots, so the next forward fetches the new ones.
"""

from __future__ import annotations

import torch

from moekit.quant import scheme_of_tensors

OWN_ROWS = ("w13", "w2", "b13", "b2")  # the layer's own Parameters, with no expert rows (num_local_experts=0)


def save_host_experts(layer, destination: dict, prefix: str) -> None:
    """After ``nn.Module._save_to_state_dict``: the empty own rows out, the host parts in: a part alone in its block
    (w13's, w2's) as the view, no copy; one of the small parts' shared block (scales, zero points, biases) copied,
    as ``torch.save`` refuses storages viewed as several dtypes."""
    for name in OWN_ROWS:
        destination.pop(prefix + name, None)
    for name, part in layer.cache.host(layer.layer_id).parts.items():
        alone = part.untyped_storage().nbytes() == part.numel() * part.element_size()
        destination[prefix + name] = part if alone else part.clone()


def load_host_experts(layer, state_dict: dict, prefix: str, missing_keys: list, error_msgs: list) -> None:
    """Before ``MoE._load_from_state_dict``: take the host parts' entries out of ``state_dict`` (load_state_dict's own
    copy) into the host store, each checked for shape and dtype (a float part takes another float dtype, cast as
    torch's load does); a missing one is a missing key and nothing is written. The own empty rows are then loaded
    from themselves (nothing of theirs is in a state_dict)."""
    cache, layer_id = layer.cache, layer.layer_id
    host = cache.host(layer_id)
    parts, given, other = host.parts, {}, _other_format(state_dict, prefix, host.scheme or "float")
    for name, part in parts.items():
        t = state_dict.pop(prefix + name, None)
        if t is None and other:
            continue  # said once, by _other_format's error below
        if t is None:
            missing_keys.append(prefix + name)
        elif t.shape != part.shape or not (t.dtype == part.dtype or (name in OWN_ROWS and t.is_floating_point())):
            error_msgs.append(f"{prefix}{name}: the state_dict's {list(t.shape)} {t.dtype} does not fit this "
                              f"offloaded layer's experts, {list(part.shape)} {part.dtype}")
        else:
            given[name] = t
    if len(given) == len(parts):  # all or nothing: a part alone would mix two layers' experts
        if cache.device.type == "cuda":
            torch.cuda.synchronize(cache.device)  # no fetch of the old host bytes still in flight
        with torch.no_grad():
            for name, t in given.items():
                parts[name].copy_(t)
        cache.evict(layer_id, list(cache.cached(layer_id)))  # their slots hold the old experts
    error_msgs.extend(other)
    for name in OWN_ROWS:
        if layer._parameters.get(name) is not None:
            state_dict[prefix + name] = layer._parameters[name]


def _other_format(state_dict: dict, prefix: str, own: str) -> list[str]:
    """One error a weight (``w13``, ``w2``) whose entries in ``state_dict`` are of another format than this layer's
    experts (float, or a scheme told by ``scheme_of_tensors``), those entries taken out (not unexpected keys too)."""
    errors = []
    for weight in ("w13", "w2"):
        key = prefix + weight
        fields = {k[len(key) + 1:]: k for k in state_dict if k.startswith(key + ".")}
        held = "float" if key in state_dict and not fields else (
            scheme_of_tensors({f: state_dict[k] for f, k in fields.items()}) if fields else None)
        if held is not None and held != own:
            errors.append(f"{key}: the state_dict holds {held} experts, this offloaded layer's are {own}: offload a "
                          f"MoE of that format (OffloadedMoE.from_moe) and load it there")
            for k in [key, *fields.values()]:
                state_dict.pop(k, None)
    return errors
