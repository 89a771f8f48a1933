"""``offload_experts``: a transformers MoE model whose routed experts live in host memory behind one GPU
expert cache, so a model larger than the GPU decodes.

    every MoE block (router + experts [+ shared]) ──moe_from_hf──▶ MoE ──OffloadedMoE.from_moe──▶ block
    one ExpertCache of gpu_budget_bytes // bytes-per-expert slots, shared by the blocks in model order
    (bytes per expert: w13 + w2 (+ biases) of one expert; packed bytes, scales included, for fp8 experts;
    at most E x blocks slots: every expert resident)

Load the model on the CPU, call ``offload_experts(model, gpu_budget_bytes=..., device="cuda")``, then
move the rest of the model to the GPU (``model.to("cuda")``: the host-resident experts are not module
tensors, so they stay where they are). Each block keeps its own router, correction bias and shared
expert on the device; ``link_layers`` lets each block prefetch the next one's predicted experts. A hash-routed block
(DeepSeek-V4's first layers) becomes an ``OffloadedHashMoE``: its table stays on the device with the gate, its
experts share the cache, and its block routes by the ``input_ids`` the decoder layer passes.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit._checks import check_module
from moekit.hf.blocks import moe_blocks, moe_from_hf
from moekit.hf.progress import Progress, block_progress, reported
from moekit.offload import ExpertCache, OffloadedMoE, expert_nbytes, link_layers
from moekit.offload.slot_cap import cap_slots


class OffloadedBlock(nn.Module):
    """A transformers MoE block's replacement: hidden_states [B, S, K] (or [M, K]) -> the same shape."""

    def __init__(self, moe: OffloadedMoE) -> None:
        super().__init__()
        self.moe = moe

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` [B, S]: DeepSeek-V4's decoder layer passes them to every block; a hash layer
        (``OffloadedHashMoE``) routes by them (None: its error naming ``token_ids``), a top-k layer reads them not."""
        if getattr(self.moe, "takes_token_ids", False):
            return self.moe(hidden_states, token_ids=input_ids)
        return self.moe(hidden_states)


def offload_experts(model: nn.Module, gpu_budget_bytes: int, *, device: torch.device | str = "cuda",
                    policy: str = "lfu", prefetch: str | None = "router", compute_misses_on: str = "gpu",
                    backend: str = "auto", progress: Progress = None) -> ExpertCache:
    """Replace every MoE block of ``model`` (a module with ``.experts`` of transformers' experts interface
    and a ``.gate``/``.router``) by an ``OffloadedBlock``; returns the shared ``ExpertCache``, whose
    ``stats`` count hits, misses and bytes over every block. Raises when the budget holds no expert; a budget of
    more slots than the model's experts (E x MoE blocks) is capped there, with a warning.
    With ``compute_misses_on="auto"`` the miss costs are measured once (on the first block's experts)
    and shared by every block. ``progress``: None (default) a line on stderr when stderr is a terminal, True always,
    False never, or a callable ``progress(done, total)`` called after each block (``moekit.hf.progress``)."""
    check_module("model", model)
    report = block_progress(progress, "offload_experts")
    blocks = [(site.parent, site.name, site.block) for site in moe_blocks(model)]
    if not blocks:
        again = any(isinstance(m, OffloadedBlock) for m in model.modules())  # its blocks are OffloadedBlocks now
        raise ValueError(f"model has no MoE block (a module with .experts and .gate/.router): {type(model).__name__}"
                         + ("; its blocks are offloaded already (OffloadedBlock)" if again else ""))
    first = moe_from_hf(blocks[0][2], backend=backend)
    expert_bytes = expert_nbytes(first)  # packed bytes for quantized (fp8) experts: the budget holds more
    if not isinstance(gpu_budget_bytes, int) or gpu_budget_bytes < expert_bytes:
        raise ValueError(f"gpu_budget_bytes must be an int of at least one expert's {expert_bytes} bytes, "
                         f"got {gpu_budget_bytes!r}")
    most = first.config.num_experts * len(blocks)  # every expert of every block resident: more slots hold nothing
    slots = cap_slots(gpu_budget_bytes // expert_bytes, most, f"gpu_budget_bytes={gpu_budget_bytes}")
    cache = ExpertCache(slots, device=device, policy=policy)
    layers = []
    for i, (parent, name, block) in enumerate(reported(blocks, report)):
        moe = first if i == 0 else moe_from_hf(block, backend=backend)
        layer = OffloadedMoE.from_moe(moe, cache=cache, prefetch=prefetch, compute_misses_on=compute_misses_on)
        setattr(parent, name, OffloadedBlock(layer))
        layers.append(layer)
    if compute_misses_on == "auto":
        costs = layers[0].measure_costs()
        for layer in layers:
            layer.costs = costs
    link_layers(layers)
    return cache

