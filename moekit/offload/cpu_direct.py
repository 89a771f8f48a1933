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
    wanted = _checked(x, w13, w2, topk_ids, topk_weights, experts)
    acc = torch.promote_types(x.dtype, torch.float32)
    rows = _rows(topk_ids, topk_weights, wanted)
    out = torch.zeros(x.shape, dtype=acc)  # [M, K]
    for e in sorted(rows):
        xe = _tokens_of(x, rows[e][0])  # [m, K]
        h = xe @ w13[e].t() if b13 is None else torch.addmm(b13[e], xe, w13[e].t())  # [m, R]
        a = apply_glu(h, activation)  # [m, N]
        y = a @ w2[e].t() if b2 is None else torch.addmm(b2[e], a, w2[e].t())  # [m, K]
        _add(out, y, *rows[e])
    return out.to(x.dtype)


def _checked(x, w13, w2, topk_ids, topk_weights, experts: list[int]) -> set[int]:
    """``experts`` as a set, once the arguments are checked (the experts contract's CPU side, float weights)."""
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise TypeError("the direct CPU experts take float weight tensors; quantized experts run through grouped_mm")
    if x.device.type != "cpu" or topk_ids.device.type != "cpu":
        raise ValueError(f"the direct CPU experts run on the CPU, got x on {x.device}, topk_ids on {topk_ids.device}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both "
                         f"be [M, k] with M = x's {x.shape[0]} rows")
    wanted = set(experts)
    if wanted and (min(wanted) < 0 or max(wanted) >= w13.shape[0]):
        raise ValueError(f"experts must be in [0, {w13.shape[0]}), got {sorted(wanted)}")
    return wanted


def _rows(topk_ids: torch.Tensor, topk_weights: torch.Tensor, wanted: set[int]) -> dict[int, tuple[list[int], list[float]]]:
    """expert -> (its tokens, their routing weights), for the experts in ``wanted``, tokens ascending."""
    rows: dict[int, tuple[list[int], list[float]]] = {}
    for t, (ids, ws) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist())):
        for e, w in zip(ids, ws):
            if e in wanted:
                tokens, scales = rows.setdefault(e, ([], []))
                tokens.append(t)
                scales.append(w)
    return rows


def _tokens_of(x: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """x's rows ``tokens`` [m, K] (a view for one token)."""
    return x[tokens[0]:tokens[0] + 1] if len(tokens) == 1 else x[torch.tensor(tokens)]


def _add(out: torch.Tensor, y: torch.Tensor, tokens: list[int], scales: list[float]) -> None:
    """out[tokens] += scales * y (y [m, K]; out [M, K] float32 accumulator)."""
    if len(tokens) == 1:
        out[tokens[0]].add_(y[0].to(out.dtype), alpha=scales[0])
    else:
        out.index_add_(0, torch.tensor(tokens), y.to(out.dtype) * torch.tensor(scales, dtype=out.dtype)[:, None])


def direct_share(host, inputs: list[torch.Tensor], experts: list[int], activation, pool=None) -> torch.Tensor:
    """``experts_direct`` on a layer's host weights (``parts.ExpertWeights``) and its staged [x, ids, weights];
    with ``pool`` (a ``cpu_runner.ChunkPool``) ``cpu_pooled.experts_pooled`` on it."""
    if host.scheme is not None:
        raise ValueError(f"the CPU GEMM 'direct' reads float host weights, this layer's are {host.scheme}: give "
                         f"CpuOptions(gemm=...) one of grouped_mm's ('onednn_fused', 'mm_loop')")
    w13, w2, b13, b2 = host.rebuild(host.parts)
    x, ids, weights = inputs
    if pool is not None:
        from moekit.offload.cpu_pooled import experts_pooled  # cpu_pooled imports this module's helpers
        return experts_pooled(x, w13, w2, ids, weights, experts, pool, activation=activation, b13=b13, b2=b2)
    return experts_direct(x, w13, w2, ids, weights, experts, activation=activation, b13=b13, b2=b2)
