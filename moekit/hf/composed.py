"""The composed path: moekit's grouping and grouped GEMMs with a transformers experts module's own code
between them, for what moekit does not fuse (a custom ``_apply_gate``, a post-expert norm, an
activation it lacks). Correct for any module of the experts interface; slower than a fused backend.

    [Group: permute_contiguous] -> [w13 GEMM (+b13)] -> [module._apply_gate / act_fn] -> [w2 GEMM (+b2)]
        -> [module.post_expert_norm] -> [Combine: weighted sum over the k slots]

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate (2N gated).
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.experts.grouped_mm import group_gemm_op
from moekit.hf.variants import ExpertsPlan, apply_module_gate
from moekit.layouts import combine_contiguous, permute_contiguous


def run_composed(
    module: nn.Module,
    plan: ExpertsPlan,
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K] (a view when transposed); [E, N, K] ungated
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]; ids outside [0, E) (transformers' EP sentinel) are skipped
    topk_weights: torch.Tensor,  # [M, k]
    b13: torch.Tensor | None,  # [E, 2N] / [E, N]
    b2: torch.Tensor | None,  # [E, K]
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * norm(w2[e] @ gate(w13[e] @ x[t] + b13[e]) + b2[e]), in x.dtype, where gate
    is ``module._apply_gate`` (gated) or ``module.act_fn`` and norm ``module.post_expert_norm`` or none."""
    num_experts = w13.shape[0]
    # static_rows = A: align 1 needs no more, and a fixed size needs no host sync. Unrouted rows trail.
    layout = permute_contiguous(x, topk_ids, num_experts, align=1, static_rows=topk_ids.numel())
    offs = layout.offsets[1:].to(torch.int32)  # [E] end row of each expert
    expert_of_row = layout.segment_ids.long().clamp(min=0)  # [A]; trailing rows are never combined
    h = group_gemm_op(layout.x_perm, w13, offs)  # [A, 2N]
    if b13 is not None:
        h = h + b13[expert_of_row]
    h = apply_module_gate(module, h) if plan.gated else module.act_fn(h)  # [A, N]
    y = group_gemm_op(h.to(w2.dtype), w2, offs)  # [A, K]
    if b2 is not None:
        y = y + b2[expert_of_row]
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return combine_contiguous(y, layout, topk_weights).to(x.dtype)  # [M, K]
