"""What an ``OffloadedMoE`` keeps on the device: the gate (and its bias), the correction bias, the shared expert
(un-fused into a separate MLP) and, for a hash layer, its routing table; copied from the ``MoE`` it offloads.

    MoE (gate, bias, shared [fused or not], tid2eid) --copy_resident--> OffloadedMoE (device); experts -> ExpertCache
"""

from __future__ import annotations

import torch

from moekit.layer import MoE
from moekit.routing.shared import unfused_shared


def copy_resident(layer: MoE, moe: MoE) -> None:
    """``layer``'s resident weights from ``moe``'s, each in its own dtype (a float32 router in a bf16 model, or in a
    quantized one whose logical dtype is bf16, stays float32: rounding it would change the routing)."""
    with torch.no_grad():
        take(layer.gate.weight, moe.gate.weight)
        if moe.gate.bias is not None:
            take(layer.gate.bias, moe.gate.bias)
        if moe.e_score_correction_bias is not None:
            take(layer.e_score_correction_bias, moe.e_score_correction_bias)
        if layer.shared_gate is not None:
            take(layer.shared_gate.weight, moe.shared_gate.weight)
        if "tid2eid" in moe._buffers:  # a HashMoE's [V, k] table: who runs which experts (checked at its load)
            take(layer.tid2eid, moe.tid2eid)
        if layer.shared_w13 is None:
            return
        if moe.fuse_shared:
            e = moe.config.num_experts
            shared_w13, shared_w2 = unfused_shared(moe.w13[e:], moe.w2[e:], moe.config.activation)  # [2SN, K], [K, SN]
            take(layer.shared_w13, shared_w13)
            take(layer.shared_w2, shared_w2)
        else:
            take(layer.shared_w13, moe.shared_w13)
            take(layer.shared_w2, moe.shared_w2)


def take(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (a parameter or buffer, kept as the same object) holds a copy of ``src`` on ``dst``'s device, in
    ``src``'s dtype."""
    dst.data = src.detach().to(dst.device, copy=True)
