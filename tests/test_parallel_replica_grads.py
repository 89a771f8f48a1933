"""EPLB's replicas train as one expert: ``EPMoE.sync_grads`` on 2 and 3 gloo ranks.

Each rank passes its own tokens (float64) and takes sum(out * r) over them; the reference is a float64 per-token loop
over all the tokens with one copy of each expert (the routing computed here: softmax, top-k, renormalised), its
gradients by autograd. After backward and ``sync_grads`` every slot of an expert (on several ranks, or twice on one)
holds that copy's gradient over W (averaged over the ranks), bit-identical across slots and ranks; an SGD step leaves
the replicas equal. The all-to-alls counted: the error agreement alone where no expert spans two ranks (no replicas,
or an expert doubled on one rank only); the agreement and one payload exchange otherwise. A rank without gradients
raises, its peers ``PeerRankError``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _helpers import rel_l2
from _parallel_harness import run_ranks
from moekit import MoE, MoEConfig
from moekit.parallel import EPMoE, Placement

CONFIG = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2, scoring="softmax",
                   renormalize=True)
PLACEMENTS = {  # world size -> name -> (slots per rank, tokens per rank, all_to_all calls sync_grads makes)
    2: {"spread_and_doubled": ([[0, 1, 2, 0], [3, 0, 1]], [13, 11], 2),  # 0: twice on rank 0 and on rank 1
        "doubled_on_one_rank": ([[0, 0, 1], [2, 3]], [10, 9], 1),  # summed locally: the agreement alone
        "no_replicas": ([[0, 1], [2, 3]], [7, 8], 1)},
    3: {"three_ranks": ([[0, 1], [2, 0], [3, 0, 1]], [9, 0, 12], 2)},  # 0 on every rank, 1 on two; rank 1 no tokens
}


def _reference(moe: MoE, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d sum(loop(x) * r) / d (w13, w2) of one copy of each expert, float64, token by token."""
    w13, w2 = moe.w13.detach().clone().requires_grad_(True), moe.w2.detach().clone().requires_grad_(True)
    n = CONFIG.moe_intermediate_size
    loss = x.new_zeros(())
    for t in range(x.shape[0]):
        p = torch.softmax(moe.gate.weight.detach() @ x[t], dim=0)  # [E]
        weights, ids = torch.topk(p, CONFIG.top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            h = w13[e] @ x[t]  # [2N]
            loss = loss + w * (w2[e] @ (F.silu(h[:n]) * h[n:])) @ r[t]
    loss.backward()
    return w13.grad, w2.grad


def _rank(rank: int, world_size: int, name: str) -> dict:
    slots, sizes, calls = PLACEMENTS[world_size][name]
    torch.manual_seed(0)  # the same layer and data on every rank
    moe = MoE(CONFIG, backend="grouped_mm", dtype=torch.float64)
    x_all, r_all = torch.randn(sum(sizes), 8, dtype=torch.float64), torch.randn(sum(sizes), 8, dtype=torch.float64)
    placement = Placement(CONFIG.num_experts, world_size, slots)
    ep = EPMoE.from_moe(moe, placement=placement)
    start, stop = sum(sizes[:rank]), sum(sizes[: rank + 1])
    (ep(x_all[start:stop]) * r_all[start:stop]).sum().backward()
    want13, want2 = _reference(moe, x_all, r_all)
    mine = placement.slots[rank]
    before = max(rel_l2(ep.w13.grad[s], want13[e]) for s, e in enumerate(mine) if len(placement.replicas(e)) > 1) \
        if any(len(placement.replicas(e)) > 1 for e in mine) else 0.0

    counted = []
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: (counted.append(1), real(*a, **k))[1]
    try:
        summed = ep.sync_grads().replicated_experts
    finally:
        dist.all_to_all_single = real
    want13, want2 = want13 / world_size, want2 / world_size  # averaged over the ranks
    errors = {s: max(rel_l2(ep.w13.grad[s], want13[e]), rel_l2(ep.w2.grad[s], want2[e])) for s, e in enumerate(mine)}
    grads = {(e, rank, s): (ep.w13.grad[s].numpy().copy(), ep.w2.grad[s].numpy().copy()) for s, e in enumerate(mine)}
    torch.optim.SGD([ep.w13, ep.w2], lr=0.5).step()
    weights = {(e, rank, s): (ep.w13[s].detach().numpy().copy(), ep.w2[s].detach().numpy().copy())
               for s, e in enumerate(mine)}
    # numpy arrays: pickled by value through the harness's queue (a tensor's shared memory dies with its rank)
    return {"calls": len(counted), "want_calls": calls, "summed": summed, "before": before, "errors": errors,
            "grads": grads, "weights": weights}


def _all(rank: int, world_size: int) -> dict:
    return {name: _rank(rank, world_size, name) for name in PLACEMENTS[world_size]}


@pytest.fixture(scope="module", params=[2, 3])
def per_rank(request):
    return request.param, run_ranks(_all, request.param, timeout_s=200)


def _same_expert_all_equal(results: list[dict], key: str) -> None:
    by_expert: dict[int, list] = {}
    for got in results:
        for (e, _, _), value in got[key].items():
            by_expert.setdefault(e, []).append(value)
    for e, values in by_expert.items():
        for a, b in values[1:]:
            assert (a == values[0][0]).all() and (b == values[0][1]).all(), (key, e)  # bit for bit


def test_every_replica_holds_the_single_copys_gradient_and_stays_equal_after_sgd(per_rank):
    world_size, ranks = per_rank
    for name in PLACEMENTS[world_size]:
        results = [r[name] for r in ranks]
        for rank, got in enumerate(results):
            assert max(got["errors"].values()) < 1e-12, (name, rank, got["errors"])
            assert got["calls"] == got["want_calls"], (name, rank)
        spread = any(got["before"] > 1e-3 for got in results)  # without the sum some replica's gradient is a share
        assert spread == (name != "no_replicas"), name
        _same_expert_all_equal(results, "grads")
        _same_expert_all_equal(results, "weights")


def _missing_grad(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    moe = MoE(CONFIG, backend="grouped_mm", dtype=torch.float64)
    ep = EPMoE.from_moe(moe, placement=Placement(4, 2, [[0, 1, 2, 0], [3, 0, 1]]))
    (ep(torch.randn(6, 8, dtype=torch.float64)) ** 2).sum().backward()
    if rank == 1:
        ep.w2.grad = None
    try:
        ep.sync_grads()
    except Exception as err:  # noqa: BLE001  (the type and message are the test's)
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_rank_without_gradients_raises_on_every_rank():
    got = run_ranks(_missing_grad, 2, timeout_s=100)
    assert got[1].startswith("ValueError: sync_grads: w2 of EPMoE layer 0 hold no gradient on rank 1: call it after "
                             "backward"), got[1]
    assert got[0].startswith("PeerRankError: rank 1 failed: ValueError: sync_grads"), got[0]
