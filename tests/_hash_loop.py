"""A hash-routed layer (``moekit.HashMoE``, DeepSeek-V4's sqrt(softplus) scores) as a float64 per-token loop: the
reference of the hash layer's tests (the layer alone, offloaded, expert-parallel).

Shapes: M tokens, K hidden, N expert width, E experts, k = top_k.
"""

from __future__ import annotations

import torch


def mlp64(w13: torch.Tensor, w2: torch.Tensor, xt: torch.Tensor, width: int) -> torch.Tensor:
    """w2 @ (silu(gate) * up) in float64 for one token xt [K]; w13 [2 width, K] (gate rows, then up), w2 [K, width]."""
    h = w13.double() @ xt  # [2 width]
    return w2.double() @ (torch.nn.functional.silu(h[:width]) * h[width:])


def hash_layer_loop(moe, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``moe`` (a ``HashMoE`` scoring by sqrtsoftplus, renormalised) per token in float64: the sum over its table row
    of weight x w2 @ (silu(gate) * up), + the shared MLP (its own weights, or the fused slots' rows E.. of w13 / w2,
    each of weight 1). x [..., K], token_ids x's shape without K -> x's shape, float64."""
    c = moe.config
    k, n, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    out = []
    for xt, t in zip(x.detach().double().reshape(-1, k), token_ids.reshape(-1).tolist()):
        s = torch.nn.functional.softplus(moe.gate.weight.detach().double() @ xt).sqrt()  # [E]
        row = moe.tid2eid[t].tolist()
        total = sum(float(s[i]) for i in row) + 1e-20
        acc = sum(float(s[i]) / total * c.routed_scaling_factor * mlp64(moe.w13[i].detach(), moe.w2[i].detach(), xt, n)
                  for i in row)
        if moe.fuse_shared:
            acc = acc + sum(mlp64(moe.w13[i].detach(), moe.w2[i].detach(), xt, n)
                            for i in range(e, moe.w13.shape[0]))
        elif moe.shared_w13 is not None:
            acc = acc + mlp64(moe.shared_w13.detach(), moe.shared_w2.detach(), xt, moe.shared_w2.shape[1])
        out.append(acc)
    return torch.stack(out).reshape(x.shape)
