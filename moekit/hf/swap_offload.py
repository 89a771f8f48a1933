"""A freed block in a layer accelerate offloads (``from_pretrained(..., device_map=...)`` with the layer on "disk", or
on "cpu" beside a GPU): its quantized experts rest where the map puts the layer and are read to the execution device
for each call, as accelerate reads the layer's other weights.

    at rest   the router's weight on meta (accelerate's), the experts' gate_up_proj_q, _scale, ... on meta (a "disk"
              layer: read from the experts file at each call, as accelerate reads model.safetensors) or on the CPU
              (a "cpu" layer); the block's MoE on meta
    a call    the router's (and a shared expert's) weights read by their accelerate hooks, the quantized tensors read
              to the router's device, an MoE built over them (~2 ms here), run, and all of it let go of

accelerate hooks each offloaded module that holds tensors, and each reads its own when it is called; moekit's layer
calls neither the router nor the experts module (it reads their tensors), so the block calls their hooks itself. Those
hooks would not serve the quantized tensors: with ``offload_buffers=False`` (accelerate's default) the experts' hook
keeps its buffers on the execution device, always (a GPU holding every offloaded layer's quantized experts); with
``offload_buffers=True`` it reads each from its weights map, which holds no tensor of moekit's file. Until session 54
such a block's float experts were made real and initialised on the CPU, then the block was refused (on meta).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moekit.hf.swap_free import FLOAT_NAMES, buffer_names
from moekit.hf.swap_state import SWAP_ATTR, build_moe, router_of
from moekit.quant.schemes import SCHEME_CLASSES

# every scheme's quantized buffer names (gate_up_proj_q, down_proj_scale, ...)
_QUANTIZED = sorted({f"{name}_{field}" for name in FLOAT_NAMES for cls in SCHEME_CLASSES.values()
                     for field in cls.tensor_fields})


@dataclass(frozen=True)
class OffloadedExperts:
    """Where an offloaded freed block's quantized tensors rest between calls (``BlockSwap.offload``)."""

    file: Path | None  # the experts file they are read from at each call (a "disk" layer: on meta at rest); None: CPU
    names: tuple[str, ...]  # the file's names of the block's quantized tensors, in ``buffer_names`` order


def offloading(block: nn.Module, swap=None) -> list[nn.Module]:
    """The block's modules (itself included) whose accelerate hook offloads their own tensors between calls, but
    those ``swap`` calls (its shared expert, gate, output norm: their hooks read them when called)."""
    called = [m for m in (swap.shared, swap.shared_gate, swap.output_norm) if m is not None] if swap else []
    passed = {id(m) for module in called for m in module.modules()}
    return [m for m in block.modules() if id(m) not in passed and getattr(getattr(m, "_hf_hook", None), "offload", 0)]


@contextlib.contextmanager
def onloaded(block: nn.Module, swap=None):
    """The block's offloaded tensors (but those ``swap`` calls) read to their execution device by their accelerate
    hooks (as calls of those modules would), and put back to rest (meta) after; the experts' float and quantized
    tensors are out of the hooks' sight meanwhile (no weights map holds them: the hook would look them up with
    ``offload_buffers=True``)."""
    done = []
    try:
        for module in offloading(block, swap):
            with _out_of_sight(block.experts):
                module._hf_hook.pre_forward(module)
            done.append(module)
        yield
    finally:
        for module in reversed(done):
            with _out_of_sight(block.experts):
                module._hf_hook.post_forward(module, None)


def shell_offloaded(model: nn.Module, path: str, shell: Callable, tensors):
    """``shell()`` (the block at ``path`` swapped over the file's tensors) run with the block's offloaded tensors
    read (once, at the load), its quantized tensors then put to rest where the map places the layer (a "disk" layer's
    read again from ``tensors.file`` at each call, under their names there, ``tensors.names``); returns what ``shell``
    returned (its ``BlockSwap``, or why not)."""
    block = model.get_submodule(path)
    experts = block.experts
    with onloaded(block):
        swap = shell()
    if isinstance(swap, str):
        return swap
    on_disk = _placed(model, path) == "disk"
    for name in buffer_names(swap.freed):
        experts._buffers[name] = experts._buffers[name].to("meta" if on_disk else "cpu")
    names = tuple(tensors.names[f"{path}.experts.{name}"] for name in buffer_names(swap.freed))
    swap.offload = OffloadedExperts(tensors.file if on_disk else None, names)
    swap.moe = swap.moe.to("meta")  # its router weight is the one the hook read for the build, no one else's now
    return swap


@contextlib.contextmanager
def hidden(tensors: dict, names):
    """``names`` out of ``tensors`` (a module's ``_parameters`` or ``_buffers``) for a while, then back in their
    place in its order (``FreedExperts.order`` reads the Parameters')."""
    order = list(tensors)
    held = {name: tensors.pop(name) for name in names if name in tensors}
    try:
        yield
    finally:
        now = {**held, **tensors}  # the others as they are now (a hook may have replaced them)
        tensors.clear()
        tensors.update({name: now.pop(name) for name in order if name in now})
        tensors.update(now)  # any added meanwhile, last


@contextlib.contextmanager
def _out_of_sight(experts: nn.Module):
    """The experts module's float Parameters and quantized buffers (every scheme's names), hidden."""
    with hidden(experts._parameters, FLOAT_NAMES), hidden(experts._buffers, _QUANTIZED):
        yield


def _placed(model: nn.Module, path: str) -> str:
    """The place ``model.hf_device_map`` (accelerate's dispatch writes it) gives the module at ``path``: its longest
    name that is ``path`` or holds it."""
    places = getattr(model, "hf_device_map", None) or {}
    holders = [name for name in places if name == "" or path == name or path.startswith(f"{name}.")]
    return str(places[max(holders, key=len)]) if holders else ""


def run_offloaded(block: nn.Module, swap, forward: Callable, *args, **kwargs):
    """``forward(block, *args, **kwargs)`` with the block's offloaded tensors read by their hooks, its quantized
    tensors on the router's device (read from the file, or moved from the CPU) and an MoE over them; all of it let go
    of after."""
    experts = block.experts
    rest = {name: experts._buffers[name] for name in buffer_names(swap.freed)}
    with onloaded(block, swap):
        device = router_of(block).weight.device
        live = {name: t.to(device) for name, t in rested(block, swap).items()}
        experts._buffers.update(live)
        resting, swap.moe = swap.moe, build_moe(block, swap.options, swap.freed)
        modules = swap.modules
        swap.track(block)
        # as at the swap: a router or experts module wrapped since (peft) still sends the call to the own forward
        # (rev54: tracked again at each call, the wrapper passed ``own_forward_needed`` and was left out, silently)
        swap.modules = modules
        try:
            return forward(block, *args, **kwargs)
        finally:
            experts._buffers.update(rest)
            swap.moe = resting


def rested(block: nn.Module, swap) -> dict[str, torch.Tensor]:
    """The block's quantized tensors by their names in its experts module (``gate_up_proj_q``, ...), real: read from
    the experts file where they rest on meta (a "disk" layer's), else as they rest."""
    rest = {name: block.experts._buffers[name] for name in buffer_names(swap.freed)}
    if swap.offload is None or swap.offload.file is None:
        return rest
    from safetensors import safe_open

    with safe_open(str(swap.offload.file), "pt") as f:
        return {name: f.get_tensor(saved) for name, saved in zip(rest, swap.offload.names)}


def refuse_restoring_offloaded(model: nn.Module) -> None:
    """``restore_blocks``: ValueError naming the first block whose quantized experts rest offloaded; float experts
    dequantized from them would have no place in accelerate's offload (its weights map holds none)."""
    path = next((p for p, m in model.named_modules() if getattr(m.__dict__.get(SWAP_ATTR), "offload", None)), None)
    if path is not None:
        raise ValueError(f"restore_blocks: {path}'s quantized experts are offloaded with its layer (device_map "
                         f"{_placed(model, path)!r}: read to the execution device at each call), where float experts "
                         "dequantized from them would have no place; load the checkpoint with its MoE layers on a "
                         "device (the CPU where there is no GPU) to restore them")
