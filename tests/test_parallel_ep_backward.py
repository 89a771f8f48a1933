"""EPMoE trains: gradients on 2 gloo ranks against the single-process MoE's over all the tokens.

Each rank passes its own rows of x and takes sum(out * r) over them; the single-process layer takes the
same loss over all rows. Then: x's gradient is the rank's rows of the single one, a local expert's
gradient is its logical expert's (every rank's tokens reach it through the all-to-alls' transposes),
and the replicated weights' gradients (gate, shared expert, fused shared slots) summed over the ranks
are the single ones, as data parallelism sums them. Exact and padded dispatch; a rank with no tokens;
the micro-batch overlap (each chunk's gradients return synchronously in backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _helpers import rel_l2
from _parallel_harness import run_ranks
from moekit import MoE, MoEConfig
from moekit.parallel import EPMoE
from moekit.parallel.weights import shard_experts

TOL = 1e-5  # float32: only the order of summation differs
DEEPSEEK_LIKE = MoEConfig(
    hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, scoring="sigmoid", routed_scaling_factor=2.5,
    use_correction_bias=True, shared_expert_intermediate_size=8,
)
QWEN2_LIKE = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=3,
                       shared_expert_intermediate_size=16, shared_expert_gate=True)
CASES = {  # name -> (config, fuse_shared, tokens per rank, max_tokens_per_rank, overlap chunks)
    "fused_shared_exact": (DEEPSEEK_LIKE, True, [5, 9], None, 1),
    "separate_shared_padded": (QWEN2_LIKE, False, [7, 4], 8, 1),
    "rank_without_tokens": (DEEPSEEK_LIKE, True, [11, 0], None, 1),
    "overlap_exact": (QWEN2_LIKE, True, [9, 6], None, 3),
    "overlap_padded": (DEEPSEEK_LIKE, False, [6, 8], 8, 2),
}


def _errors(rank: int, world_size: int, name: str) -> dict:
    config, fuse_shared, sizes, cap, overlap = CASES[name]
    torch.manual_seed(0)  # the same weights and data on every rank
    moe = MoE(config, fuse_shared=fuse_shared, backend="grouped_mm")
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    x_all, r_all = torch.randn(sum(sizes), 16), torch.randn(sum(sizes), 16)
    ep = EPMoE.from_moe(moe, max_tokens_per_rank=cap, overlap=overlap)

    x_ref = x_all.clone().requires_grad_(True)
    (moe(x_ref) * r_all).sum().backward()
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    x_mine = x_all[start:stop].clone().requires_grad_(True)
    out = ep(x_mine)
    (out * r_all[start:stop]).sum().backward()

    local = ep.num_local_experts
    errors = {"out": rel_l2(out.detach(), moe(x_all)[start:stop].detach()) if stop > start else 0.0,
              "x": rel_l2(x_mine.grad, x_ref.grad[start:stop]) if stop > start else 0.0}
    for w in ("w13", "w2"):
        want = shard_experts(getattr(moe, w).grad, ep.placement, rank)
        got = getattr(ep, w).grad.clone()
        errors[f"{w}_local"] = rel_l2(got[:local], want[:local])
        dist.all_reduce(got)  # the fused shared slots: every rank's tokens' share, summed
        errors[f"{w}_shared_slots"] = rel_l2(got[local:], want[local:]) if got.shape[0] > local else 0.0
    for p_name in ("gate.weight", "shared_w13", "shared_w2", "shared_gate.weight"):
        got = dict(ep.named_parameters()).get(p_name)
        if got is not None:
            summed = got.grad.clone()
            dist.all_reduce(summed)
            errors[p_name] = rel_l2(summed, dict(moe.named_parameters())[p_name].grad)
    return errors


def _all_cases(rank: int, world_size: int) -> dict:
    return {name: _errors(rank, world_size, name) for name in CASES}


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(_all_cases, 2, timeout_s=200)  # one spawned group for every case (a spawn costs seconds)


@pytest.mark.parametrize("name", list(CASES))
def test_ep_grads_match_the_single_process_layer(per_rank, name):
    for rank, by_case in enumerate(per_rank):
        errors = by_case[name]
        assert "gate.weight" in errors and "w13_local" in errors
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"rank {rank}: relative L2 errors >= {TOL}: {bad}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_whose_experts_receive_no_rows_trains(world_size):
    for rank, errors in enumerate(run_ranks(_no_rows_errors, world_size, timeout_s=120, pg_timeout_s=30)):
        bad = {k: v for k, v in errors.items() if not v < TOL}
        assert not bad, f"rank {rank}: relative L2 errors >= {TOL}: {bad}"


def _idle_grad_error(grad) -> float:
    """0 for a zero gradient; inf for None: a user's optimizer step or DDP-style all-reduce over the parameters
    expects a gradient on every rank, zero where its experts saw no token."""
    return float("inf") if grad is None else float(grad.abs().max())


def _no_rows_errors(rank: int, world_size: int) -> dict:
    """Every token on rank 0's experts (a gate bias of +-10), so the other ranks' experts receive no rows (or, padded,
    rows whose slots all skip): every rank's loss still backpropagates (such a rank's experts output had no graph: its
    backward skipped the transposed all-to-alls, and rank 0's waited for them, or its loss had no gradient; the
    fuzzer's EP gradients found it, fuz44), and their experts' gradients are zeros, not None."""
    errors = {}
    cases = (("output", [3, 2, 1], None, "grouped_mm"), ("output", [3, 0, 2], None, "grouped_mm"),
             ("input", [1, 1, 1], None, "grouped_mm"), ("output", [3, 2, 2], 3, "reference"))  # the last: padded
    num_experts = 2 * world_size  # 2 a rank, contiguous: rank 0 holds experts 0 and 1
    for weight_on, sizes, cap, backend in cases:
        sizes = sizes[:world_size]
        config = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=num_experts, top_k=1, router_bias=True,
                           expert_weight_on=weight_on)
        torch.manual_seed(0)
        moe = MoE(config, backend=backend)
        with torch.no_grad():
            moe.gate.bias.copy_(torch.tensor([10.0, 10.0] + [-10.0] * (num_experts - 2)))
        x_all, r_all = torch.randn(sum(sizes), 16), torch.randn(sum(sizes), 16)
        ep = EPMoE.from_moe(moe, max_tokens_per_rank=cap)
        x_ref = x_all.clone().requires_grad_(True)
        (moe(x_ref) * r_all).sum().backward()
        start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
        x_mine = x_all[start:stop].clone().requires_grad_(True)
        (ep(x_mine) * r_all[start:stop]).sum().backward()
        name = f"{weight_on}{sizes}{cap}{backend}"
        errors[f"{name} x"] = rel_l2(x_mine.grad, x_ref.grad[start:stop]) if stop > start else 0.0
        for w in ("w13", "w2"):
            got = getattr(ep, w).grad
            errors[f"{name} {w}"] = (rel_l2(got, shard_experts(getattr(moe, w).grad, ep.placement, rank)) if rank == 0
                                     else _idle_grad_error(got))  # the other ranks' experts saw no token
        summed = ep.gate.weight.grad.clone()
        dist.all_reduce(summed)
        errors[f"{name} gate"] = rel_l2(summed, moe.gate.weight.grad)
    return errors
