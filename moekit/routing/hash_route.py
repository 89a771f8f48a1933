"""Hash routing (DeepSeek-V4's first MoE layers): a fixed table of token ids chooses the experts, the scores weigh them.

    [Route: token ids [M] -> table [V, k] -> ids [M, k]; logits [M, E] -> scores -> gathered at ids -> weights]
    -> Capacity (opt-in) -> Shared slots -> Group -> Experts -> Combine

Weights as transformers' ``DeepseekV4HashRouter``: s = score(logits) (``config.scoring``: V4's sqrt(softplus)), the
table's experts' s, divided by their sum + ``RENORM_EPS`` (``config.renormalize``; ``check_hash_eps``), times
``routed_scaling_factor``. Renormalised, sqrt(softplus) is e^(x/2) where softplus is subnormal or 0 (logits below
-87.3 in float32): the formula's weights there, where transformers' sqrt of a subnormal (0 below -103.9) weighs a row of
such experts 0 (session 51); unrenormalised, a weight keeps transformers' rounding (within 1e-19 of the formula).
No sort, no choice: it runs in torch on every device (the fused Triton router chooses top-k and is never used here).

Shapes: M tokens, E routed experts, k = top_k, V table rows (``config.hash_table_size``).
"""

from __future__ import annotations

import torch

from moekit.config import MoEConfig
from moekit.routing.route import Routing, assert_logits_finite, router_scores, soft_capped

RENORM_EPS = 1e-20  # DeepseekV4HashRouter's weights / (sum + 1e-20); a row of all-zero scores weighs 0, not NaN


def check_hash_eps(config: MoEConfig) -> None:
    """The hash routers (this one and the fused kernel) divide by sum + RENORM_EPS, V4's (``MoEConfig.renorm_eps``
    1e-20, as ``from_hf_config`` reads V4's hash layers; 0, a hand-built config's default, is taken as it): any other
    eps is refused rather than ignored."""
    if config.renorm_eps not in (0.0, RENORM_EPS):
        raise ValueError(f"renorm_eps: the hash routers divide by sum(w) + {RENORM_EPS} (DeepSeek-V4's hash layers) at "
                         f"renorm_eps 0 or {RENORM_EPS}, got {config.renorm_eps!r}")


def hash_route(router_logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor,
               config: MoEConfig) -> Routing:
    """logits [M, E], token ids [M] (integers in [0, V)), table [V, k] int64 of experts in [0, E) (``check_table``:
    at load) -> the ``Routing`` of the module doc: ids [M, k] int32 in the table's order (not by score), weights
    [M, k] in the logits' dtype promoted to float32 at least. Ids outside [0, V) raise a ValueError naming
    ``token_ids`` on the CPU, a device-side assert on a GPU or while compiling (no host sync)."""
    if config.hash_table_size is None:
        raise ValueError("config.hash_table_size is None: hash_route routes by a token-id table (route: top-k)")
    check_hash_eps(config)
    logits = _checked_logits(router_logits, config)  # [M, E] float32 (float64 when given)
    ids = table[check_token_ids(token_ids, logits.shape[0], config.hash_table_size)]  # [M, k] int64
    scores = router_scores(soft_capped(logits, config), config.scoring, config.renormalize)  # [M, E]
    weights = scores.gather(1, ids)  # [M, k]
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORM_EPS)
    if config.routed_weight_scale != 1.0:
        weights = weights * config.routed_weight_scale
    # masked_tokens None: a non-finite logit raises above, so none can be masked (a per-call zero tensor built and
    # filled for nothing was one of this path's ~20 launches: the CPU profile of session 48)
    return Routing(topk_ids=ids.to(torch.int32), topk_weights=weights, masked_tokens=None)


def _checked_logits(router_logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if not isinstance(router_logits, torch.Tensor) or not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating-point torch.Tensor, got {_what(router_logits)}")
    if router_logits.dim() != 2 or router_logits.shape[1] != config.num_experts:
        raise ValueError(f"router_logits must have shape [M, num_experts={config.num_experts}], got "
                         f"{tuple(router_logits.shape)}")
    logits = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))  # [M, E]
    if logits.numel():
        assert_logits_finite(torch.isfinite(logits).all(), logits)
    return logits


def check_token_ids(token_ids: torch.Tensor, num_tokens: int, table_rows: int) -> torch.Tensor:
    """token_ids [M] of an integer dtype, each in [0, table_rows): returned as given; else a clear error naming
    ``token_ids`` (the range: a ValueError on the CPU, a device-side assert elsewhere or while compiling)."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.is_floating_point() or token_ids.is_complex() \
            or token_ids.dtype == torch.bool:
        raise TypeError(f"token_ids must be an integer torch.Tensor (the model's input ids), got {_what(token_ids)}")
    if token_ids.shape != (num_tokens,):
        raise ValueError(f"token_ids must have shape [M={num_tokens}], one id a token, got {tuple(token_ids.shape)}")
    if not token_ids.numel():
        return token_ids
    inside = ((token_ids >= 0) & (token_ids < table_rows)).all()
    if token_ids.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(inside, "token_ids outside [0, hash_table_size)")  # no host sync
    elif not bool(inside):
        bad = ((token_ids < 0) | (token_ids >= table_rows)).nonzero()[:5, 0]
        raise ValueError(f"token_ids must be in [0, hash_table_size={table_rows}) (the routing table's rows), got "
                         f"{token_ids[bad].tolist()} at tokens {bad.tolist()}")
    return token_ids


def check_table(table: torch.Tensor, config: MoEConfig, name: str = "tid2eid") -> torch.Tensor:
    """The routing table [V, k] (V = ``config.hash_table_size``, k = ``top_k``) of an integer dtype, every entry an
    expert in [0, E), as int64; else an error naming ``name`` (one host read: called at load, never per forward)."""
    v, k, e = config.hash_table_size, config.top_k, config.num_experts
    if not isinstance(table, torch.Tensor) or table.is_floating_point() or table.is_complex() \
            or table.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer torch.Tensor [V, k] of expert ids, got {_what(table)}")
    if table.shape != (v, k):
        raise ValueError(f"{name} must have shape [hash_table_size={v}, top_k={k}], got {tuple(table.shape)}")
    outside = (table < 0) | (table >= e)  # [V, k]
    if bool(outside.any()):
        rows = outside.any(dim=1).nonzero()[:5, 0]
        raise ValueError(f"{name} must hold experts in [0, num_experts={e}); rows {rows.tolist()} hold "
                         f"{table[rows].tolist()}")
    return table.long()


def default_table(config: MoEConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[V, k] int64: row v = (v*k + j) mod E for j < k, a valid table spreading the ids over the experts (what a
    fresh ``HashMoE`` holds until a model's table is loaded)."""
    v, k = config.hash_table_size, config.top_k
    return torch.arange(v * k, dtype=torch.int64, device=device).remainder(config.num_experts).view(v, k)


def _what(value) -> str:
    return f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
