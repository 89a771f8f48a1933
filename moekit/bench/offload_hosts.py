"""Host-resident expert weights for ``moekit bench --offload``: random layers in pinned host memory,
float or quantized, each layer its own weights (``host_shells``), as a model's layers are."""

from __future__ import annotations

import dataclasses

import torch

from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.quant import install_quantized_experts_, quantize


def host_shells(config: MoEConfig, dtype, device, scheme: str | None = None, layers: int = 1) -> list[MoE]:
    """``layers`` host layers (``host_shell``), each its own expert weights, as a model's layers are."""
    return [host_shell(config, dtype, device, scheme) for _ in range(layers)]


def host_shell(config: MoEConfig, dtype, device, scheme: str | None = None) -> MoE:
    """A CPU ``MoE`` whose expert weights are one host set (pinned on CUDA), filled in chunks on ``device``;
    with a ``scheme``, quantized chunk by chunk on ``device`` and kept packed (never a float copy of the layer)."""
    shell = MoE(config, num_local_experts=0, dtype=dtype, device="cpu", fuse_shared=False, router="torch")
    e, n, k = config.num_experts, config.moe_intermediate_size, config.hidden_size
    weights = [_host_weight((e, 2 * n, k), dtype, device, scheme), _host_weight((e, k, n), dtype, device, scheme)]
    if scheme is None:
        shell.w13, shell.w2 = (torch.nn.Parameter(w, requires_grad=False) for w in weights)
    else:
        install_quantized_experts_(shell, *weights)
    return shell


def _host_weight(shape: tuple[int, int, int], dtype, device, scheme: str | None, chunk: int = 16):
    """Random [E, R, C] weights (std 1/sqrt(C)) in host memory (pinned on CUDA), float or packed."""
    pin, e = device.type == "cuda", shape[0]
    out, parts = None, {}
    for i in range(0, e, chunk):
        w = torch.randn((min(chunk, e - i), *shape[1:]), device=device, dtype=dtype) * shape[-1] ** -0.5
        q = w if scheme is None else quantize(w, scheme)
        tensors = {"w": q} if scheme is None else q.tensors()
        if out is None:
            parts = {name: torch.empty((e, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for name, t in tensors.items()}
            out = q
        for name, t in tensors.items():
            parts[name][i:i + t.shape[0]].copy_(t)
    return parts["w"] if scheme is None else dataclasses.replace(out, **parts)
