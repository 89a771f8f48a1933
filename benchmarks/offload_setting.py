"""The offload checks' layer (``offload_cal``; before session 43 also the removed ``offload_key``,
``offload_fetch``, ``offload_stall``, ``offload_tail``, ``offload_step_anatomy``): Qwen3-30B-A3B's MoE layer shape on
the GPU, a tiny one on the CPU (``--smoke``, or no GPU), its device, dtype and ``MoEConfig``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.config import MoEConfig

QWEN3_30B = {"experts": 128, "hidden": 2048, "inter": 768, "top_k": 8, "layers": 4}
SMOKE = {"experts": 16, "hidden": 64, "inter": 32, "top_k": 2, "layers": 2}


@dataclass
class OffloadSetting:
    cuda: bool  # a GPU and not --smoke
    device: torch.device
    dtype: torch.dtype  # bfloat16 on the GPU, float32 on the CPU
    shape: dict  # a copy of QWEN3_30B (cuda) or SMOKE
    config: MoEConfig  # the shape's layer


def offload_setting(smoke: bool) -> OffloadSetting:
    """The GPU's setting when there is one and ``smoke`` is off, else the CPU's."""
    cuda = torch.cuda.is_available() and not smoke
    shape = dict(QWEN3_30B if cuda else SMOKE)
    config = MoEConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"], num_experts=shape["experts"],
                       top_k=shape["top_k"])
    return OffloadSetting(cuda, torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32,
                          shape, config)
