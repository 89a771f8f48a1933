"""The float64 reference of ``moekit bench --hf`` with its experts streamed, for a model whose float64 copy does not
fit (DeepSeek-V3's experts: 90 GB a layer in float64, against 80 GB on an H100): every parameter outside the
``*.experts`` modules is copied to float64 as before (``hf_fp64``), and the experts stay as stored; each experts call
runs ``STREAM_EXPERTS`` experts at a time:

    experts call: x [T, K], ids [T, k], weights [T, k]
      for each chunk of experts [a, a + C):
        its parameters in float64 (e4m3 ones dequantized exactly: ``hf_quant.dequantize_float64``)   [C, ...]
        rows: the (token, slot) pairs routed into the chunk                                          [R]
        y = the module's own eager forward on x[rows], one expert a row (id - a), its routing weight  [R, K]
        out[token] += y                                                                              (float64)

The module's own forward, not a rewrite of it: each family's experts (biases, layouts, ``FP8Experts``' loop, which
takes a float weight as a plain linear) compute as in the whole-copy reference; only the order of the float64 sum
over a token's experts differs (~1e-16 relative). DeepSeek-V3 at the bench's 2 layers: 7.4 GB of float64 outside
the experts plus a chunk of 8 experts (2.8 GB), against 188 GB for the whole copy.

Shapes: T tokens, k experts a token, K hidden width, R routed rows of a chunk, C experts a chunk.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import torch
from torch import nn

from moekit.bench.hf_quant import block_scale, dequantize_float64

STREAM_EXPERTS = 8  # experts of a chunk: their float64 copy is the pass's only expert-sized allocation


def experts_paths(model: nn.Module) -> list[str]:
    """The dotted names of ``model``'s experts modules (``*.experts``: every family the bench runs)."""
    return [name for name, _ in model.named_modules() if name.endswith(".experts")]


def _under(name: str, paths: list[str]) -> bool:
    return any(name.startswith(path + ".") for path in paths)


def float64_outside_experts(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every floating parameter and buffer of ``model`` outside its experts modules, as a float64 copy, by name."""
    paths = experts_paths(model)
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name: t.detach().to(torch.float64) for name, t in named
            if t.is_floating_point() and not _under(name, paths)}


def streamed_bytes(model: nn.Module) -> int:
    """Bytes of the streamed pass's float64 copies: everything outside the experts, and one chunk of the largest
    experts module's parameters."""
    paths = experts_paths(model)
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    outside = sum(8 * t.numel() for name, t in named if t.is_floating_point() and not _under(name, paths))
    chunk = max((sum(8 * p.numel() * min(STREAM_EXPERTS, p.shape[0]) // p.shape[0]
                     for p in model.get_submodule(path).parameters() if p.is_floating_point()) for path in paths),
                default=0)
    return outside + chunk


def chunk_float64(module: nn.Module, start: int, stop: int) -> dict[str, torch.Tensor]:
    """The parameters of experts ``[start, stop)`` of ``module`` (those whose first dimension is its experts), in
    float64; e4m3 ones with block scales dequantized (their scales sliced alongside, no longer read)."""
    out = {}
    for name, p in module.named_parameters(recurse=False):
        if p.dim() == 0 or p.shape[0] != module.num_experts or not p.is_floating_point():
            continue
        scale = block_scale(module, name)
        out[name] = (p[start:stop].double() if scale is None
                     else dequantize_float64(p[start:stop], scale[start:stop], module.block_size))
    return out


def _stream_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """[T, K]: ``module``'s experts on ``hidden_states`` [T, K] (``top_k_index`` / ``top_k_weights`` [T, k]), a chunk
    of experts at a time, each through a shallow copy of the module holding that chunk's float64 parameters."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float64, device=hidden_states.device)  # [T, K]
    for start in range(0, module.num_experts, STREAM_EXPERTS):
        stop = min(start + STREAM_EXPERTS, module.num_experts)
        token, slot = torch.nonzero((top_k_index >= start) & (top_k_index < stop), as_tuple=True)  # [R] each
        if token.numel() == 0:
            continue
        chunk = copy.copy(module)  # its config, attributes and buffers; its own parameter dict below
        chunk.__dict__.pop("forward", None)  # the class's forward: the model's experts implementation (eager)
        chunk.__dict__["_parameters"] = {**module._parameters, **chunk_float64(module, start, stop)}
        ids = (top_k_index[token, slot] - start)[:, None]  # [R, 1]: the chunk's own expert numbers
        rows = chunk(hidden_states[token], ids, top_k_weights[token, slot][:, None])  # [R, K]
        out.index_add_(0, token, rows.to(torch.float64))
    return out.to(hidden_states.dtype)


@contextlib.contextmanager
def streamed_experts(model: nn.Module):
    """While open, every experts module of ``model`` runs ``_stream_forward`` (its instance's ``forward``); the
    model's experts implementation, which that forward's chunks call, must be transformers' eager one."""
    modules = [model.get_submodule(path) for path in experts_paths(model)]
    for module in modules:
        module.forward = _stream_forward.__get__(module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward
