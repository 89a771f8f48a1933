"""What transformers' ``save_pretrained`` writes of a model moekit changed, and loading it back.

``use_moekit_blocks(model, quant=..., keep_float=False)`` leaves each swapped block's experts as moekit's quantized
buffers (``swap_free``). transformers' ``save_pretrained`` writes them under those names (renamed by the family's
conversion: Mixtral's ``mlp`` becomes ``block_sparse_moe``) and its ``from_pretrained`` does not read them: it
initialises the float experts at random and says so in a load report only. Importing ``moekit.hf`` wraps
``PreTrainedModel.save_pretrained`` once: for such a model it writes the quantized experts to ``EXPERTS_FILE`` beside
the checkpoint instead (under the model's own ``state_dict`` names, the swap's options in its metadata; the checkpoint
holds the rest) and warns how to load it: ``from_pretrained``, then ``load_quantized_experts(model, path)``, which
swaps the blocks with the saved options and loads the tensors. ``offload_experts`` replaced its blocks by
``OffloadedBlock`` modules, whose experts and router ``from_pretrained`` cannot place either: saving such a model
warns, naming the checkpoint to keep (docs/offload.md). A model with float experts (swapped or not) saves as before,
silently.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from moekit._checks import check_module

EXPERTS_FILE = "moekit_quantized_experts.safetensors"
_META_KEY = "moekit_swap"  # the metadata entry: the swap's options as JSON
_WRAPPED = "_moekit_saves_freed_experts"  # set on the wrapper: a second import wraps nothing


def freed_experts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The quantized tensors of ``model``'s blocks whose float experts were freed, by ``state_dict`` name, and each
    such block's swap options (``use_moekit_blocks``' arguments) by the block's path."""
    from moekit.hf.swap import SWAP_ATTR
    from moekit.hf.swap_free import buffer_names

    tensors, options = {}, {}
    for path, block in model.named_modules():
        swap = block.__dict__.get(SWAP_ATTR)
        if swap is None or swap.freed is None:
            continue
        names = set(buffer_names(swap.freed))
        prefix = f"{path}." if path else ""
        tensors.update({prefix + n: t for n, t in block.named_buffers() if n.rsplit(".", 1)[-1] in names})
        o = swap.options
        options[path] = {"quant": o.quant, "quant_options": dict(o.quant_options), "backend": o.backend}
    return tensors, options


def wrap_save_pretrained() -> None:
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        tensors, options = freed_experts(self)
        if tensors and len(args) < 2 and kwargs.get("state_dict") is None:  # they go to EXPERTS_FILE only, once
            kwargs["state_dict"] = {k: v for k, v in self.state_dict().items() if k not in tensors}
        result = original(self, save_directory, *args, **kwargs)
        _warn_offloaded(self)
        if tensors and kwargs.get("is_main_process", args[0] if args else True):  # transformers' second argument
            _write(Path(save_directory), tensors, options)
            first = next(iter(options.values()))
            warnings.warn(
                f"save_pretrained: {len(options)} MoE blocks of {type(self).__name__} hold moekit's {first['quant']} "
                "experts in place of their float ones (use_moekit_blocks(..., keep_float=False)); transformers' "
                f"from_pretrained cannot read them and would initialise those experts at random: they are written to "
                f"{EXPERTS_FILE} beside the checkpoint; load with model = {type(self).__name__}.from_pretrained(path), "
                "then moekit.hf.load_quantized_experts(model, path)", UserWarning, stacklevel=2)
        return result

    setattr(save_pretrained, _WRAPPED, True)
    PreTrainedModel.save_pretrained = save_pretrained


def _blocks(names) -> set[str]:
    """The block paths of quantized-experts names, ``<block>.experts.<buffer>``."""
    return {name.rsplit(".", 2)[0] for name in names}


def _warn_offloaded(model: nn.Module) -> None:
    from moekit.hf.offload import OffloadedBlock

    offloaded = [name for name, m in model.named_modules() if isinstance(m, OffloadedBlock)]
    if offloaded:
        warnings.warn(
            f"save_pretrained: offload_experts replaced {len(offloaded)} MoE blocks of {type(model).__name__} "
            f"(OffloadedBlock, {offloaded[0]}: ...), whose experts and router are written under moekit's names; "
            "transformers' from_pretrained does not read them and initialises those blocks at random. Keep the "
            "checkpoint the model was loaded from, or torch.save(model.state_dict()) and load_state_dict it into a "
            "model offloaded alike (docs/offload.md, Saving an offloaded model)", UserWarning, stacklevel=3)


def _write(directory: Path, tensors: dict[str, torch.Tensor], options: dict[str, dict]) -> None:
    from safetensors.torch import save_file

    data = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    save_file(data, str(directory / EXPERTS_FILE), metadata={_META_KEY: json.dumps(options)})


def load_quantized_experts(model: nn.Module, path: str | os.PathLike):
    """Give ``model`` (``from_pretrained`` of a checkpoint ``save_pretrained`` wrote from a model whose swapped
    blocks freed their float experts) those blocks back: each named in ``EXPERTS_FILE`` swapped with the options it
    was saved with (``use_moekit_blocks(..., keep_float=False)``), then its quantized experts loaded; returns the
    swap's ``BlockSwapReport``. FileNotFoundError where ``path`` has no such file; ValueError where the model lacks a
    block the file holds, or the file's blocks were swapped with different options."""
    from safetensors import safe_open

    from moekit.hf.swap import use_moekit_blocks

    check_module("model", model)
    file = Path(path) / EXPERTS_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file; save_pretrained writes it for a model whose swapped blocks "
                                "freed their float experts (use_moekit_blocks(..., keep_float=False))")
    with safe_open(str(file), "pt") as f:
        options = json.loads(f.metadata()[_META_KEY])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    paths = dict(model.named_modules())
    absent = sorted(p for p in options if p not in paths)
    if absent:
        raise ValueError(f"{file} holds blocks {absent} not in model ({type(model).__name__}): load it into the "
                         "model class and config it was saved from")
    kinds = {json.dumps(o, sort_keys=True) for o in options.values()}
    if len(kinds) != 1:
        raise ValueError(f"{file}: its blocks were swapped with different options {sorted(kinds)}; swap each part "
                         "with use_moekit_blocks(part, quant=..., keep_float=False), then load_state_dict the file")
    o = next(iter(options.values()))
    report = use_moekit_blocks(model, backend=o["backend"], quant=o["quant"], quant_options=o["quant_options"] or None,
                               keep_float=False, progress=False)
    unsaved = sorted(_blocks(freed_experts(model)[0]) - _blocks(tensors))
    if unsaved:  # swapped and freed now, quantized from from_pretrained's random experts: never silently
        raise ValueError(f"{file} holds no experts of {unsaved} (swapped on their own before saving?), which "
                         "use_moekit_blocks swapped now from from_pretrained's random experts: load into a model "
                         "swapped as the saved one was, then load_state_dict the file")
    model.load_state_dict(tensors, strict=False)  # a shape or dtype another scheme has: the quantized load's error
    return report
