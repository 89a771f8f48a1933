"""The CPU branch's experts without a token layout: "direct", one of ``cpu_path.CPU_GEMMS``.

    x [M, K], ids [M, k] (global expert ids, -1 dropped), weights [M, k], experts E_cpu  ->  [M, K]
    out[t] = sum over (t, j) with ids[t, j] in E_cpu of weights[t, j] * w2[e] @ glu(w13[e] @ x[t] + b13[e]) + b2[e]

The misses a decode forward sends to the CPU are a few experts of 1-2 rows each. grouped_mm's CPU path
first builds a layout of all M x k assignments (sort, ranks, gathers), loops over all E experts and
combines by a scatter: some 20 torch calls before and after the GEMMs, each paying the dispatcher and,
above its grain, an OpenMP region of the branch's thread team. Here the (token, slot) pairs of each CPU
expert are found on the host from the ids as Python lists (M x k of them, already in host memory), and
each expert costs its two GEMMs, the activation and one add into a float32 [M, K]: the weights are read
in place (float host weights only; quantized ones take grouped_mm's path, which dequantizes per expert).
Experts run in ascending id order and each token's terms are added in that order, in float32, rounded
once to x's dtype at the end.
"""

from __future__ import annotations

import torch

from moekit.activations import ActivationSpec, apply_glu


def experts_direct(
    x: torch.Tensor,  # [M, K], CPU
    w13: torch.Tensor,  # [E, R, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k] integer, CPU
    topk_weights: torch.Tensor,  # [M, k] float, CPU
    experts: list[int],
    *,
    activation: str | ActivationSpec = "silu",
    b13: torch.Tensor | None = None,  # [E, R]
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """``experts``' share of the experts contract for x's tokens (module docstring), in x's dtype."""
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise TypeError("experts_direct takes float weight tensors; quantized experts run through grouped_mm")
    if x.device.type != "cpu" or topk_ids.device.type != "cpu":
        raise ValueError(f"experts_direct runs on the CPU, got x on {x.device}, topk_ids on {topk_ids.device}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [M, k] with M = x's {x.shape[0]} rows")
    wanted = set(experts)
    if wanted and (min(wanted) < 0 or max(wanted) >= w13.shape[0]):
        raise ValueError(f"experts must be in [0, {w13.shape[0]}), got {sorted(wanted)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    rows: dict[int, tuple[list[int], list[float]]] = {}
    for t, (ids, ws) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for e, w in zip(ids, ws):
            if e in wanted:
                tokens, scales = rows.setdefault(e, ([], []))
                tokens.append(t)
                scales.append(w)
    out = torch.zeros(x.shape, dtype=acc)  # [M, K]
    for e in sorted(rows):
        tokens, scales = rows[e]
        one = len(tokens) == 1
        xe = x[tokens[0]:tokens[0] + 1] if one else x[torch.tensor(tokens)]  # [m, K]
        h = xe @ w13[e].t() if b13 is None else torch.addmm(b13[e], xe, w13[e].t())  # [m, R]
        a = apply_glu(h, activation)  # [m, N]
        y = a @ w2[e].t() if b2 is None else torch.addmm(b2[e], a, w2[e].t())  # [m, K]
        if one:
            out[tokens[0]].add_(y[0].to(acc), alpha=scales[0])
        else:
            out.index_add_(0, torch.tensor(tokens), y.to(acc) * torch.tensor(scales, dtype=acc)[:, None])
    return out.to(x.dtype)


def direct_share(host, inputs: list[torch.Tensor], experts: list[int], activation) -> torch.Tensor:
    """``experts_direct`` on a layer's host weights (``parts.ExpertWeights``) and its staged [x, ids, weights]."""
    if host.scheme is not None:
        raise ValueError(f"the CPU GEMM 'direct' reads float host weights, this layer's are {host.scheme}: give "
                         f"CpuOptions(gemm=...) one of grouped_mm's ('onednn_fused', 'mm_loop')")
    w13, w2, b13, b2 = host.rebuild(host.parts)
    x, ids, weights = inputs
    return experts_direct(x, w13, w2, ids, weights, experts, activation=activation, b13=b13, b2=b2)
