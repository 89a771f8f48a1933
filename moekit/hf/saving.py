"""What transformers' ``save_pretrained`` writes of a model moekit changed, and loading it back.

``use_moekit_blocks(model, quant=..., keep_float=False)`` leaves each swapped block's experts as moekit's quantized
buffers (``swap_free``). transformers' ``save_pretrained`` writes them under those names (renamed by the family's
conversion: Mixtral's ``mlp`` becomes ``block_sparse_moe``) and its ``from_pretrained`` does not read them: it
initialises the float experts at random and says so in a load report only. Importing ``moekit.hf`` wraps
``PreTrainedModel.save_pretrained`` once: for such a model it writes the quantized experts to ``EXPERTS_FILE`` beside
the checkpoint instead (under the model's own ``state_dict`` names, the swap's options in its metadata; the checkpoint
holds the rest), names ``"moekit"`` as the experts implementation in its config.json (a process without ``moekit.hf``
then stops on it instead of running random experts), writes both before a ``push_to_hub=True`` upload, and warns.
``from_pretrained`` (``set_check.wrap_from_pretrained``, ``loading``) finds the file (a folder's or a hub
repository's, whatever experts implementation it names): the blocks swapped with the saved options and their experts
loaded; ``loading.load_quantized_experts(model, path)`` does it by hand. A float model saved into
such a folder removes the earlier file. ``offload_experts`` replaced its blocks by ``OffloadedBlock`` modules, whose
experts and router ``from_pretrained`` cannot place either: saving such a model warns, naming the checkpoint to keep
(docs/offload.md). A model with float experts (swapped or not) saves as before, silently.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from moekit.hf.set_check import IMPLEMENTATION
from moekit.hf.swap_free import FLOAT_NAMES

EXPERTS_FILE = "moekit_quantized_experts.safetensors"
_META_KEY = "moekit_swap"  # the metadata entry: the swap's options as JSON
_WRAPPED = "_moekit_saves_freed_experts"  # set on the wrapper: a second import wraps nothing


def freed_experts(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The quantized tensors of ``model``'s blocks whose float experts were freed, by ``state_dict`` name, and each
    such block's swap options (``use_moekit_blocks``' arguments) by the block's path."""
    from moekit.hf.swap_offload import rested
    from moekit.hf.swap_state import SWAP_ATTR

    tensors, options = {}, {}
    for path, block in model.named_modules():
        swap = block.__dict__.get(SWAP_ATTR)
        if swap is None or swap.freed is None:
            continue
        prefix = f"{path}.experts." if path else "experts."
        tensors.update({prefix + n: t for n, t in rested(block, swap).items()})  # a "disk" layer's read from its file
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
        main = kwargs.get("is_main_process", args[0] if args else True)  # transformers' second argument
        if not tensors:
            result = original(self, save_directory, *args, **kwargs)
            _warn_offloaded(self)
            if main:  # an earlier save's file would load over this model's experts
                Path(save_directory, EXPERTS_FILE).unlink(missing_ok=True)
            return result
        stubs = {}
        if len(args) < 2 and kwargs.get("state_dict") is None:  # they go to EXPERTS_FILE only, once
            stubs = {f"{path}.experts.{name}".lstrip("."): torch.empty(0) for path in options for name in FLOAT_NAMES}
            kwargs["state_dict"] = {k: v for k, v in self.state_dict().items() if k not in tensors} | stubs
        with _naming_moekit(self, tensors, options), _stubs_kept(stubs):
            result = original(self, save_directory, *args, **kwargs)
        _warn_offloaded(self)
        if main:
            _write(Path(save_directory), tensors, options)
            warnings.warn(
                f"save_pretrained: {len(options)} MoE blocks of {type(self).__name__} hold moekit's "
                f"{next(iter(options.values()))['quant']} experts in place of their float ones (use_moekit_blocks(..., "
                f"keep_float=False)): they are written to {EXPERTS_FILE} beside the checkpoint, and its config.json "
                f"names experts_implementation {IMPLEMENTATION!r}. from_pretrained(path) in a process that imported "
                "moekit.hf loads them back; without moekit.hf, transformers refuses the checkpoint's "
                "experts_implementation", UserWarning, stacklevel=2)
        return result

    setattr(save_pretrained, _WRAPPED, True)
    PreTrainedModel.save_pretrained = save_pretrained


@contextlib.contextmanager
def _naming_moekit(model: nn.Module, tensors: dict[str, torch.Tensor], options: dict[str, dict]):
    """While transformers saves ``model``: its config carries ``experts_implementation = "moekit"`` (written into
    config.json: transformers' config reads the key back; without ``moekit.hf`` the load then stops on it instead of
    initialising the experts at random), and an upload (``save_pretrained(..., push_to_hub=True)``, which pushes
    inside the call) writes ``EXPERTS_FILE`` into the folder first, so that the pushed repository holds it."""
    upload = type(model)._upload_modified_files

    def upload_with_experts(working_dir, *args, **kwargs):
        _write(Path(working_dir), tensors, options)
        return upload(model, working_dir, *args, **kwargs)

    model.config.experts_implementation = IMPLEMENTATION
    model.__dict__["_upload_modified_files"] = upload_with_experts  # this call's only: removed below
    try:
        yield
    finally:
        del model.config.experts_implementation
        model.__dict__.pop("_upload_modified_files", None)


@contextlib.contextmanager
def _stubs_kept(stubs: dict[str, torch.Tensor]):
    """While transformers saves: ``stubs`` (the freed experts' float names, each a tensor of shape [0]) pass its
    ``revert_weight_conversion`` (the per-expert split of Qwen3's, Mixtral's ... fused experts, which a [0] tensor
    cannot take) as they are, so the checkpoint holds them under the model's names. A process without ``moekit.hf``
    then stops on their size ("size mismatch ... ignore_mismatched_sizes") instead of initialising the experts at
    random; moekit's load takes them for missing (``loading.wrap_stubs_missing``)."""
    from transformers import modeling_utils

    revert = modeling_utils.revert_weight_conversion

    def revert_but_stubs(model, state_dict):
        return revert(model, {k: v for k, v in state_dict.items() if k not in stubs}) | {
            k: v for k, v in state_dict.items() if k in stubs}

    modeling_utils.revert_weight_conversion = revert_but_stubs if stubs else revert
    try:
        yield
    finally:
        modeling_utils.revert_weight_conversion = revert


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


def saved_blocks(file: Path) -> tuple[str, ...]:
    """The block paths ``file`` (an ``EXPERTS_FILE``) holds, as saved (its metadata's keys; none without it)."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return tuple(json.loads((f.metadata() or {}).get(_META_KEY, "{}")))


def _rebased(model: nn.Module, options: dict[str, dict], tensors: dict[str, object]):
    """The file's block paths and tensor names in ``model``'s own: a checkpoint of the model with its head
    (``model.layers.0.mlp``) loaded into the base model (``layers.0.mlp``: ``AutoModel``), or the other way, as
    transformers loads the rest of it (the class's ``base_model_prefix``)."""
    paths = dict(model.named_modules())
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if prefix == "." or all(p in paths for p in options):
        return options, tensors
    for change in (lambda n: n.removeprefix(prefix), lambda n: prefix + n):
        if all(change(p) in paths for p in options):
            return {change(p): o for p, o in options.items()}, {change(n): t for n, t in tensors.items()}
    return options, tensors


class _FileTensors:
    """An ``EXPERTS_FILE``'s tensors under the model's names, each read from the open file when asked: a block at a
    time (the progress line counts the reads, which are the load's time on a real model; a GPU load holds one
    block's in host memory, not the file's)."""

    def __init__(self, handle, names: dict[str, str], file: Path) -> None:
        self.handle = handle  # safetensors' safe_open, open while the blocks load
        self.names = names  # the model's name -> the file's
        self.file = Path(file).resolve()  # a block whose layer accelerate offloads to "disk" reads them at each call

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(self.names[name])


def load_saved_file(model: nn.Module, file: Path, progress=None):
    """``file``'s blocks of ``model`` swapped as saved, their experts the file's quantized tensors
    (``swap_load.load_freed_blocks``: no float expert quantized, nor read); returns the ``BlockSwapReport``.
    ValueError where the file is not moekit's, holds blocks ``model`` lacks or could not swap, or mixes options."""
    from safetensors import safe_open

    from moekit.hf.swap_load import load_freed_blocks

    with safe_open(str(file), "pt") as f:
        meta = f.metadata() or {}
        if _META_KEY not in meta:  # was: "'NoneType' object is not subscriptable"
            raise ValueError(f"{file} has no {_META_KEY!r} metadata (the swap's options): it was not written by "
                             "save_pretrained of a model whose swapped blocks freed their float experts")
        options, names = _rebased(model, json.loads(meta[_META_KEY]), {name: name for name in f.keys()})
        paths = dict(model.named_modules())
        absent = sorted(p for p in options if p not in paths)
        if absent:
            raise ValueError(f"{file} holds blocks {absent} not in model ({type(model).__name__}): load it into the "
                             "model class and config it was saved from")
        kinds = {json.dumps(o, sort_keys=True) for o in options.values()}
        if len(kinds) != 1:
            raise ValueError(f"{file}: its blocks were swapped with different options {sorted(kinds)}; swap each "
                             "part with use_moekit_blocks(part, quant=..., keep_float=False), then load_state_dict "
                             "the file")
        report = load_freed_blocks(model, options, _FileTensors(f, names, file), progress)
    if report.left:
        raise ValueError(f"{file} holds the experts of {[b.path for b in report.left]}, which use_moekit_blocks could "
                         f"not swap here ({report.left[0].path}: {report.left[0].reason}): their float experts are not "
                         "in the checkpoint")
    return report
