"""Where a weight-only call runs the ring decode (``triton_wo_ring``, raw word decode) instead of the fused Triton
decodes: int4_w4a16 with group 128 or mxfp4, bf16 activations, silu, no expert map, a Hopper GPU with Gluon, the call
leaving the decode, config and split to the chooser, and a shape and batch size the H200 measured faster
(RING_MEASURED). ``run_experts_wo`` asks ``ring_route`` first."""

from __future__ import annotations

import torch

from moekit.experts.triton_gluon_launch import gluon_supported
from moekit.experts.triton_wo import WoWeight
from moekit.experts.triton_wo_ring import GROUP, RingPlan, ring_experts, ring_weight

# (scheme, E, N, K) -> (largest M measured faster, gate-up plan, down plan). H200, Triton 3.6, CUDA-graph replay,
# interleaved A/B against the chooser's pick (benchmarks/wo_ring_device_check.py).
RING_MEASURED: dict[tuple[str, int, int, int], tuple[int, RingPlan, RingPlan]] = {}
GROUPS = {"int4_w4a16": GROUP, "mxfp4": 32}  # the group size the ring reads of each scheme


def ring_route(x: torch.Tensor, w13, w2, ids: torch.Tensor, scheme: str, activation: str,
               expert_map: torch.Tensor | None, config, split_k, decode) -> tuple | None:
    """(gate-up plan, down plan) where this call runs the ring decode, else None. w13 / w2: ``WeightArgs``."""
    if decode is not None or config is not None or split_k is not None or expert_map is not None:
        return None
    if scheme not in GROUPS or activation != "silu" or x.dtype != torch.bfloat16:
        return None
    num_experts, two_n = w13.q.shape[:2]
    measured = RING_MEASURED.get((scheme, num_experts, two_n // 2, x.shape[1]))
    if measured is None or x.shape[0] > measured[0] or not w13.group_size == w2.group_size == GROUPS[scheme]:
        return None
    if not gluon_supported(x.device):
        return None
    return measured[1], measured[2]


def run_ring(x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, scheme: str,
             plans: tuple) -> torch.Tensor:
    """The experts through the ring decode: out [M, K] in x's dtype. w13 / w2: ``WeightArgs`` of ``scheme``."""
    n, k = w13.q.shape[1] // 2, x.shape[1]
    zeros = scheme == "int4_w4a16"  # mxfp4's WeightArgs carry the scale as their zero (never read)
    r13 = ring_weight(WoWeight(scheme, w13.q, w13.scale, w13.zero if zeros else None, GROUPS[scheme]), k, False)
    r2 = ring_weight(WoWeight(scheme, w2.q, w2.scale, w2.zero if zeros else None, GROUPS[scheme]), n, False)
    return ring_experts(x.contiguous(), r13, r2, ids, weights, *plans)
