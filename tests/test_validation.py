"""Every argument a constructor or stage cannot honour is refused up front, with an error that names it."""

import pytest
import torch

from moekit import MoEConfig, route
from moekit.layer import MoE
from moekit.layouts import (align_block, masked_layout, masked_layout_measured_cap_syncs, permute_contiguous,
                            rank_within_groups)
from moekit.routing import Routing, apply_capacity, expert_capacity

BASE = dict(hidden_size=8, moe_intermediate_size=4, num_experts=8, top_k=2)
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(top_k=True), ValueError, "top_k must be a positive int"),
        (dict(num_experts=8.0), ValueError, "num_experts must be a positive int"),
        (dict(hidden_size=-8), ValueError, "hidden_size must be a positive int"),
        (dict(top_k=9), ValueError, "top_k must be <= num_experts"),
        (dict(n_group=3), ValueError, "divisible by n_group"),
        (dict(n_group=2, topk_group=3), ValueError, "topk_group must be <= n_group"),
        (dict(shared_expert_intermediate_size=-4), ValueError, "shared_expert_intermediate_size must be an int >= 0"),
        (dict(shared_expert_intermediate_size=4.5), ValueError, "shared_expert_intermediate_size must be an int >= 0"),
        (dict(num_moe_layers=0), ValueError, "num_moe_layers must be a positive int"),
        (dict(renormalize=1), TypeError, "renormalize must be a bool"),
        (dict(use_correction_bias="yes"), TypeError, "use_correction_bias must be a bool"),
        (dict(routed_scaling_factor=INF), ValueError, "routed_scaling_factor must be > 0 and finite"),
        (dict(routed_scaling_factor=NAN), ValueError, "routed_scaling_factor must be > 0 and finite"),
        (dict(routed_scaling_factor=True), ValueError, "routed_scaling_factor must be > 0 and finite"),
        (dict(nonfinite="ignore"), ValueError, "nonfinite must be"),
    ],
)
def test_config_refuses(changes, error, match):
    with pytest.raises(error, match=match):
        MoEConfig(**{**BASE, **changes})


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(capacity_factor=INF), ValueError, "capacity_factor must be > 0 and finite"),
        (dict(capacity_factor=NAN), ValueError, "capacity_factor must be > 0 and finite"),
        (dict(capacity_factor=-1.0), ValueError, "capacity_factor must be > 0"),
        (dict(capacity_factor=True), ValueError, "capacity_factor must be > 0"),
        (dict(stats_block_size=0), ValueError, "stats_block_size must be a positive int"),
        (dict(stats_block_size=-64), ValueError, "stats_block_size must be a positive int"),
        (dict(stats_block_size=64.0), ValueError, "stats_block_size must be a positive int"),
        (dict(stats_block_size=True), ValueError, "stats_block_size must be a positive int"),
        (dict(num_local_experts=-1), ValueError, "num_local_experts must be an int >= 0"),
        (dict(fuse_shared="no"), TypeError, "fuse_shared must be a bool"),
        (dict(dtype=torch.int32), TypeError, "dtype must be a floating-point torch.dtype"),
        (dict(drop_policy="random"), ValueError, "drop_policy must be"),
        (dict(backend="cutlass"), ValueError, "backend must be one of"),
    ],
)
def test_module_refuses(kwargs, error, match):
    with pytest.raises(error, match=match):
        MoE(MoEConfig(**BASE), **kwargs)


def test_module_refuses_a_config_that_is_not_one():
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        MoE(BASE)


@pytest.mark.parametrize(
    "x, error, match",
    [
        (torch.tensor(1.0), ValueError, r"x must have last dim hidden_size=8, got shape \(\)"),
        (torch.zeros(3, 7), ValueError, "x must have last dim hidden_size=8"),
        (torch.zeros(3, 8, dtype=torch.int64), TypeError, "x must be a floating-point tensor"),
        ([[0.0] * 8], TypeError, "x must be a torch.Tensor"),
        # a float32 MoE given bfloat16 (a model's activations): the message said only "must share a dtype"
        (torch.zeros(3, 8, dtype=torch.bfloat16), TypeError, r"x, w13 and w2 must share a dtype, got x torch.bfloat16, "
         r"w13 torch.float32, w2 torch.float32: cast x to the weights' dtype, or the weights to x's \(moe.to\(dtype\)"),
    ],
)
def test_forward_refuses(x, error, match):
    with pytest.raises(error, match=match):
        MoE(MoEConfig(**BASE))(x)


@pytest.mark.parametrize(
    "x, error, match",
    [
        ([[0.0] * 8], TypeError, "^x2d must be a torch.Tensor, got list$"),
        (None, TypeError, "^x2d must be a torch.Tensor, got NoneType$"),
        (torch.zeros(3, 8, dtype=torch.int64), TypeError, "^x2d must be a floating-point tensor, got torch.int64$"),
        (torch.zeros(2, 3, 8), ValueError, r"^x2d must be \[M, hidden_size=8\], got shape \(2, 3, 8\)$"),
        (torch.zeros(8), ValueError, r"^x2d must be \[M, hidden_size=8\], got shape \(8,\)$"),
        (torch.zeros(3, 7), ValueError, r"^x2d must be \[M, hidden_size=8\], got shape \(3, 7\)$"),
    ],
)
def test_route_tokens_refuses(x, error, match):
    """Each one failed inside (AttributeError, the router's or a matmul's message) or, the int tensor, routed."""
    with pytest.raises(error, match=match):
        MoE(MoEConfig(**BASE)).route_tokens(x)


def test_route_refuses_a_config_that_is_not_one():
    with pytest.raises(TypeError, match="config must be a MoEConfig"):
        route(torch.randn(2, 8), BASE)


@pytest.mark.parametrize("capacity_factor", [INF, NAN, 0.0, True])
def test_capacity_refuses(capacity_factor):
    routing = Routing(torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2))
    with pytest.raises(ValueError, match="capacity_factor must be > 0 and finite"):
        apply_capacity(routing, 8, capacity_factor)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        expert_capacity(4, 2, 0, 1.0)


IDS, X = torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: align_block(IDS, 0, 16), "num_experts must be a positive int"),
        (lambda: align_block(IDS, 8, True), "block_size must be a positive int"),
        (lambda: align_block(IDS, 8, 16.0), "block_size must be a positive int"),
        (lambda: permute_contiguous(X, IDS, 8, align=0), "align must be a positive int"),
        (lambda: permute_contiguous(X, IDS, 8.0), "num_experts must be a positive int"),
        (lambda: permute_contiguous(X, IDS, 8, align=4, static_rows=-1), "static_rows must be an int >= 0"),
        (lambda: masked_layout(X, IDS, 8, m_max=0), "m_max must be a positive int"),
        (lambda: masked_layout(X, IDS, 8, m_max=2.5), "m_max must be a positive int"),
        (lambda: masked_layout(X, IDS, -1), "num_experts must be a positive int"),
        (lambda: masked_layout_measured_cap_syncs(X, IDS, 8, round_to=0), "round_to must be a positive int"),
        (lambda: rank_within_groups(IDS.reshape(-1), -1), "num_groups must be an int >= 0"),
    ],
)
def test_layouts_refuse(call, match):
    with pytest.raises(ValueError, match=match):
        call()
