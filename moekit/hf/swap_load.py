"""A freed checkpoint's blocks built from its quantized tensors (``saving.EXPERTS_FILE``), never from float experts.

    block.experts.gate_up_proj, down_proj (meta, or random: never read)  ──▶  removed
    the file's <block>.experts.gate_up_proj_q, _scale (, _zero), down_proj_...  ──▶  the experts' buffers (w13, w2)
    block.__class__  ──▶  the swapped class, its MoE over those buffers (swap_free.build_freed_moe)

Until session 53 a load of such a checkpoint ran ``use_moekit_blocks(model, quant=..., keep_float=False)``, which
quantized ``from_pretrained``'s random float experts (materialised and initialised first) before the file's were
loaded over them: 48 s of 50 for a 4-layer mxfp4 Qwen3-MoE on a 2-core Xeon. Here each block's ``FreedExperts`` is
read off the float experts' shapes and dtype (no values: they may sit on the meta device, where ``loading`` keeps
them under ``from_pretrained``) and the scheme's options, and the file's tensors become the buffers as they are. A
block already swapped and freed with the same options keeps its swap and takes the file's tensors
(``load_state_dict``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from moekit.hf.blocks import moe_blocks
from moekit.hf.progress import Progress, block_progress, reported
from moekit.hf.swap import (SWAP_ATTR, BlockSwapReport, LeftBlock, SwappedBlock, _rebuild_after_load, _swap_of)
from moekit.hf.swap_free import FLOAT_NAMES, FreedExperts, _meta, buffer_names
from moekit.hf.swap_offload import offloading, shell_offloaded
from moekit.hf.swap_state import SwapOptions, copied_bytes
from moekit.hf.variants import stores_transposed
from moekit.quant.base import QuantizedWeight
from moekit.quant.schemes import SCHEME_CLASSES


def load_freed_blocks(model: nn.Module, options: dict, tensors: Mapping[str, torch.Tensor],
                      progress: Progress = None) -> BlockSwapReport:
    """Each block of ``model`` named in ``options`` (its path -> ``use_moekit_blocks``' arguments, one kind for all)
    swapped with its float experts freed and ``tensors`` (``state_dict`` names; read a block at a time; ``.file``
    and ``.names``: the file and its names) as its quantized experts, left at rest where accelerate offloads the
    block's layer (``swap_offload``); a block that cannot be is in ``report.left`` with its reason. ValueError
    naming the block where the file's tensors do not fit it (missing, another shape). ``progress`` as
    ``use_moekit_blocks`` takes it."""
    o = next(iter(options.values()))
    if o["quant"] not in SCHEME_CLASSES:
        raise ValueError(f"the file's blocks were swapped with quant={o['quant']!r}, not a scheme: "
                         f"{tuple(SCHEME_CLASSES)}")
    # as the save wrote SwapOptions' own (checked then): sorted, defaults left out; JSON's lists back to tuples
    quant_options = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(o["quant_options"].items()))
    swap_options = SwapOptions(o["backend"], False, o["quant"], quant_options)
    sites = [site for site in moe_blocks(model) if site.path in options]
    modules = dict(model.named_modules())
    swapped, left = [], [LeftBlock(path, type(modules[path]).__name__, "not an MoE block (.experts and .gate/.router)")
                         for path in sorted(set(options) - {site.path for site in sites})]
    for site in reported(sites, block_progress(progress, "moekit: loading quantized experts")):
        block, swap = site.block, site.block.__dict__.get(SWAP_ATTR)
        if swap is not None:
            _refill(block, site.path, swap, swap_options, tensors)
        elif not offloading(block):
            swap = _shell(block, site.path, swap_options, tensors)
        else:  # accelerate offloads its layer
            swap = shell_offloaded(model, site.path, lambda: _shell(block, site.path, swap_options, tensors), tensors)
        if isinstance(swap, str):  # why not
            left.append(LeftBlock(site.path, type(block).__name__, swap))
            continue
        quant_bytes = sum(w.nbytes for w in (swap.moe.w13, swap.moe.w2))
        swapped.append(SwappedBlock(site.path, swap.block_cls.__name__, copied_bytes(swap.moe, block),
                                    swap.tuple_len, quant_bytes, swap.freed.freed_bytes))
    return BlockSwapReport(tuple(swapped), tuple(left))


def _refill(block: nn.Module, path: str, swap, options: SwapOptions, tensors: Mapping[str, torch.Tensor]) -> None:
    """A block swapped before: kept where freed with the same options, the file's tensors copied into its buffers
    (its ``load_state_dict`` hook rebuilds the MoE over them)."""
    if swap.freed is None or swap.options != options:
        raise ValueError(f"{path} is swapped already ({swap.options}, float experts "
                         f"{'kept' if swap.freed is None else 'freed'}), not as the file's blocks were ({options}, "
                         "freed): restore_blocks(model) first, or load into a model built from the checkpoint")
    found = _block_tensors(tensors, path, buffer_names(swap.freed))
    block.load_state_dict({f"experts.{n}": t for n, t in found.items()}, strict=False)  # the rest: the checkpoint's


def _shell(block: nn.Module, path: str, options: SwapOptions, tensors: Mapping[str, torch.Tensor]):
    """The block swapped over the file's tensors in place of its float experts (their values never read): its
    ``BlockSwap``, or why it could not be (the block as it was)."""
    experts = block.experts
    floats = [experts._parameters.get(name) for name in FLOAT_NAMES]
    if any(f is None for f in floats):
        return f"its experts hold no {' / '.join(FLOAT_NAMES)} Parameters to replace"
    held = {id(f) for f in floats}
    device = next((t.device for t in block.parameters() if id(t) not in held), floats[0].device)  # the router's
    transposed = stores_transposed(experts)
    weights = [_weight(tensors, path, name, f, options, transposed, device) for name, f in zip(FLOAT_NAMES, floats)]
    freed = FreedExperts(scheme=options.quant, fields=tuple(_meta(w) for w in weights), transposed=transposed,
                         requires_grad=any(f.requires_grad for f in floats), order=tuple(experts._parameters),
                         freed_bytes=sum(f.numel() * f.element_size() for f in floats))
    for name, w in zip(FLOAT_NAMES, weights):
        del experts._parameters[name]
        for field, t in w.tensors().items():
            experts.register_buffer(f"{name}_{field}", t)
    try:
        swap = _swap_of(block, type(block), options, None, freed)
    except (ValueError, TypeError, NotImplementedError, AttributeError, KeyError) as err:  # as use_moekit_blocks'
        for name in buffer_names(freed):
            del experts._buffers[name]
        experts._parameters.update(zip(FLOAT_NAMES, floats))
        return str(err).split("\n")[0]
    block.register_load_state_dict_post_hook(_rebuild_after_load)  # a later load of the buffers, as _free's
    return swap


def _weight(tensors: Mapping[str, torch.Tensor], path: str, name: str, float_weight: torch.Tensor,
            options: SwapOptions, transposed: bool, device: torch.device) -> QuantizedWeight:
    """The file's quantized ``name`` of the block at ``path`` on ``device``, with the fields a quantization of
    ``float_weight`` would carry, read off its shape and dtype alone; ValueError where it is not that weight's."""
    e, r, c = float_weight.shape  # the family's layout; moekit's [E, R, C] is its transpose where transposed
    shape = (e, c, r) if transposed else (e, r, c)
    cls = SCHEME_CLASSES[options.quant]
    names = {f.name for f in dataclasses.fields(cls)}
    # the options the class keeps (group_size, block_shape; not int4's symmetric), its defaults for the others
    fields = {k: v for k, v in options.quant_options if k in names} | {"dtype": float_weight.dtype}
    fields |= {"cols": shape[2]} if "cols" in names else {}  # C: the packed q alone cannot tell an odd C
    found = _block_tensors(tensors, path, [f"{name}_{field}" for field in cls.tensor_fields])
    try:
        w = cls(**fields, **{field: found[f"{name}_{field}"].to(device) for field in cls.tensor_fields})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}.experts.{name}: the file's {options.quant} tensors do not fit it: {err}") from err
    if tuple(w.shape) != shape:
        raise ValueError(f"{path}.experts.{name}: the file's {options.quant} weight is {list(w.shape)} [E, R, C], the "
                         f"model's experts {list(shape)}: load it into the config it was saved from")
    return w


def _block_tensors(tensors: Mapping[str, torch.Tensor], path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The file's tensors ``<path>.experts.<name>`` by ``name``; ValueError naming those it lacks."""
    missing = [n for n in names if f"{path}.experts.{n}" not in tensors]
    if missing:
        raise ValueError(f"the file holds no {path}.experts.{missing[0]} (of {', '.join(names)}): it was written for "
                         "another scheme, or cut short")
    return {n: tensors[f"{path}.experts.{n}"] for n in names}
