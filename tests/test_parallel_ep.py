"""EPMoE on 2 and 4 gloo ranks (spawned on loopback) against the single-process MoE.

Each world size spawns one process group that runs every scenario (a spawn costs seconds on CI's two
cores); the scenarios return numbers, and the tests below check them one by one.
Shapes: M tokens over all ranks, K=32 hidden, N=16, E experts, W ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from _parallel_harness import run_ranks
from moekit.config import MoEConfig
from moekit.experts import run_experts
from moekit.layer import MoE
from moekit.parallel import EPMoE, Placement, contiguous_placement, eplb_placement, round_robin_placement

FP32_TOL = 2e-6  # max |ep - single| / max |single|: only the summation order of a token's partials differs
FP64_TOL = 1e-13

SOFTMAX_SHARED = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=3, shared_expert_intermediate_size=32)
DEEPSEEK_LIKE = MoEConfig(
    hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, scoring="sigmoid", routed_scaling_factor=2.5,
    n_group=4, topk_group=2, use_correction_bias=True, shared_expert_intermediate_size=16,
)
# Token counts per rank: uneven, and with ranks that hold no tokens.
SPLITS = {2: [[5, 12], [17, 0]], 4: [[6, 0, 9, 2], [0, 0, 11, 0]]}


def _moe(config, seed=0, **kwargs) -> MoE:
    torch.manual_seed(seed)  # the same weights on every rank
    return MoE(config, **kwargs)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0 if out.shape == ref.shape else float("inf")
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def _compare(ep: EPMoE, moe: MoE, x_all: torch.Tensor, sizes: list[int], rank: int) -> float:
    """max relative error of this rank's EP output against the single-process output of its rows."""
    start = sum(sizes[:rank])
    ref = moe(x_all)[start : start + sizes[rank]]
    return _rel_err(ep(x_all[start : start + sizes[rank]]), ref)


def _skew(moe: MoE, hot: list[int], strength: float) -> MoE:
    """Make experts ``hot`` win selection for most tokens (selection-only correction bias)."""
    moe.e_score_correction_bias[hot] = strength
    return moe


@torch.no_grad()
def _scenarios(rank: int, world_size: int) -> dict:
    torch.manual_seed(100)
    x_all = torch.randn(17, 32)
    res: dict = {}

    for i, sizes in enumerate(SPLITS[world_size]):
        moe = _moe(SOFTMAX_SHARED)
        res[f"contiguous_fused_shared_{i}"] = _compare(EPMoE.from_moe(moe), moe, x_all[: sum(sizes)], sizes, rank)
        moe = _moe(SOFTMAX_SHARED, fuse_shared=False)
        placement = round_robin_placement(8, world_size)
        res[f"round_robin_separate_shared_{i}"] = _compare(EPMoE.from_moe(moe, placement), moe, x_all[: sum(sizes)], sizes, rank)
        # The padded (sync-free) dispatch: capacity above the largest rank's tokens, and exactly at it.
        moe = _moe(SOFTMAX_SHARED)
        for cap in (max(sizes) + 3, max(max(sizes), 1)):
            ep = EPMoE.from_moe(moe, round_robin_placement(8, world_size), max_tokens_per_rank=cap)
            res[f"padded_{i}_cap{cap - max(sizes)}"] = _compare(ep, moe, x_all[: sum(sizes)], sizes, rank)

    sizes = SPLITS[world_size][0]
    x = x_all[: sum(sizes)]
    start = sum(sizes[:rank])
    x_local = x[start : start + sizes[rank]]

    # EPLB with replicas, on skewed routing; the replicas' traffic splits evenly.
    moe = _skew(_moe(DEEPSEEK_LIKE), [0, 1], 0.3)
    counts = moe(x, return_stats=True).stats.counts
    placement = eplb_placement(counts, world_size, num_redundant=world_size)
    res["eplb_num_replicated"] = sum(c > 1 for c in placement.replica_counts())
    ep = EPMoE.from_moe(moe, placement)
    res["eplb_replicas"] = _compare(ep, moe, x, sizes, rank)
    res["eplb_replicas_padded"] = _compare(EPMoE.from_moe(moe, placement, max_tokens_per_rank=32), moe, x, sizes, rank)
    routing = ep.route_tokens(x_local).routing
    sent = ep.dispatch(x_local, routing.topk_ids, routing.topk_weights)
    ep.combine(ep.run_local_experts(sent), sent)
    ids = sent.local_ids[sent.local_ids >= 0].long()
    per_slot = torch.bincount(ids, minlength=ep.w13.shape[0])[: ep.num_local_experts].tolist()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, per_slot)
    spread = 0
    for e in range(8):
        served = [gathered[r][placement.slots[r].index(e)] for r in placement.replicas(e)]
        spread = max(spread, max(served) - min(served))
    res["eplb_replica_spread"] = spread  # each source splits e within one row: spread <= W

    # All tokens routed to rank 0's experts (contiguous: experts 0 and 1 live on rank 0).
    moe = _skew(_moe(DEEPSEEK_LIKE), [0, 1], 10.0)
    ep = EPMoE.from_moe(moe)
    res["all_on_rank0"] = _compare(ep, moe, x, sizes, rank)
    routing = ep.route_tokens(x_local).routing
    sent = ep.dispatch(x_local, routing.topk_ids, routing.topk_weights)
    ep.combine(ep.run_local_experts(sent), sent)
    res["all_on_rank0_rows_from_others"] = sum(n for r, n in enumerate(sent.recv_splits) if r != rank)

    # More ranks' worth of experts than divides evenly: E = 2W + 1.
    config = SOFTMAX_SHARED.replace(num_experts=2 * world_size + 1)
    moe = _moe(config)
    res["uneven_experts"] = _compare(EPMoE.from_moe(moe), moe, x, sizes, rank)

    # Loading a rank's slice expert by expert (no full layer on this rank) gives the same layer.
    moe = _moe(SOFTMAX_SHARED)
    ep = EPMoE(SOFTMAX_SHARED, round_robin_placement(8, world_size))
    ep.load_experts(lambda e: (moe.w13[e], moe.w2[e]))
    ep.gate.weight.copy_(moe.gate.weight)
    res["load_experts"] = _compare(ep, moe, x, sizes, rank)

    # A rank that holds no expert at all (vLLM map of all -1) still takes part and gets its tokens back.
    moe = _moe(SOFTMAX_SHARED.replace(shared_expert_intermediate_size=0))
    slots = [list(range(8))] + [[] for _ in range(world_size - 1)]
    res["rank_without_experts"] = _compare(EPMoE.from_moe(moe, Placement(8, world_size, slots)), moe, x, sizes, rank)

    # Capacity dropping applies per rank (GShard's local group): equal to MoE on this rank's tokens alone.
    moe = _moe(SOFTMAX_SHARED, capacity_factor=0.5)
    out = EPMoE.from_moe(moe)(x_local, return_stats=True)
    if sizes[rank]:
        ref = moe(x_local, return_stats=True)
        res["capacity_per_rank"] = _rel_err(out.out, ref.out)
        res["capacity_dropped"] = (out.stats.dropped, ref.stats.dropped)
    else:
        res["capacity_per_rank"], res["capacity_dropped"] = 0.0, (0, 0)

    # M = 0 on every rank, flat and with leading dims.
    moe = _moe(SOFTMAX_SHARED)
    ep = EPMoE.from_moe(moe)
    res["empty_shapes"] = [tuple(ep(torch.empty(0, 32)).shape), tuple(ep(torch.empty(2, 0, 32)).shape)]
    padded = EPMoE.from_moe(moe, max_tokens_per_rank=4)
    res["empty_shapes_padded"] = [tuple(padded(torch.empty(0, 32)).shape), tuple(padded(torch.empty(2, 0, 32)).shape)]
    try:  # every rank passes 5 > 4 tokens: each raises its own error before any payload collective
        padded(torch.randn(5, 32))
        res["over_capacity"] = "no error"
    except ValueError as err:
        res["over_capacity"] = str(err)

    # Stats: per-rank counts sum to the single-process counts.
    out = ep(x_local, return_stats=True)
    total = out.stats.counts.clone()
    dist.all_reduce(total)
    res["stats_counts_match"] = bool(torch.equal(total, moe(x, return_stats=True).stats.counts))

    # A routing from elsewhere with skipped ids: -1 (moekit) and >= E (transformers' EP sentinel).
    moe = _moe(SOFTMAX_SHARED.replace(shared_expert_intermediate_size=0))
    ep = EPMoE.from_moe(moe, round_robin_placement(8, world_size))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 11, (x.shape[0], 3), generator=gen, dtype=torch.int32)
    weights = torch.rand(x.shape[0], 3, generator=gen)
    ref = run_experts(x, moe.w13, moe.w2, ids, weights)[start : start + sizes[rank]]
    res["skipped_ids"] = _rel_err(ep.forward_routed(x_local, ids[start : start + sizes[rank]], weights[start : start + sizes[rank]]), ref)

    # bf16 against the single-process bf16 layer (relative L2).
    moe = _moe(DEEPSEEK_LIKE, dtype=torch.bfloat16)
    ep = EPMoE.from_moe(moe, round_robin_placement(8, world_size))
    ref = moe(x.bfloat16())[start : start + sizes[rank]].double()
    got = ep(x_local.bfloat16()).double()
    res["bf16_rel_l2"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if ref.numel() else 0.0

    res.update(_rebalance_scenario(rank, world_size, x, sizes))
    res.update(_mismatch_scenarios(rank, world_size))
    ep = EPMoE.from_moe(_moe(SOFTMAX_SHARED))
    with torch.enable_grad():
        res["grad_mode_output_detached"] = not ep(x_local).requires_grad  # weights require grad; no graph is built
        try:
            ep(x_local.clone().requires_grad_(True))
            res["grad_refused"] = False
        except RuntimeError as err:
            res["grad_refused"] = "forward-only" in str(err)
    return res


def _rebalance_scenario(rank, world_size, x, sizes) -> dict:
    """Track load over three steps, rebalance with 2 redundant slots, compare outputs and weights (fp64)."""
    res = {}
    start = sum(sizes[:rank])
    x = x.double()
    x_local = x[start : start + sizes[rank]]
    moe = _skew(_moe(DEEPSEEK_LIKE, dtype=torch.float64), [0, 1, 2], 0.2)
    ep = EPMoE.from_moe(moe)
    for _ in range(3):
        before = ep(x_local)
    report = ep.rebalance(num_redundant=2)
    res["rebalance_load_reset"] = float(ep.expert_load.abs().sum())
    after = ep(x_local)
    res["rebalance_loads_match"] = report.loads == (3 * moe(x, return_stats=True).stats.counts).double().tolist()
    res["rebalance_max_not_raised"] = report.max_load_after <= report.max_load_before
    res["rebalance_balancedness"] = (report.balancedness_before, report.balancedness_after)
    res["rebalance_moved"] = report.placement != contiguous_placement(8, world_size)
    res["rebalance_identical"] = _rel_err(after, before)
    res["rebalance_vs_single"] = _rel_err(after, moe(x)[start : start + sizes[rank]])
    slots = report.placement.slots[rank]
    res["rebalance_weights_exact"] = all(
        torch.equal(ep.w13[i], moe.w13[e]) and torch.equal(ep.w2[i], moe.w2[e]) for i, e in enumerate(slots)
    ) and torch.equal(ep.w13[len(slots):], moe.w13[8:])  # the fused shared slot stays
    # Rebalancing on the same loads again keeps the placement: nothing moves.
    again = ep.rebalance(num_redundant=2, loads=report.loads)
    res["rebalance_again_keeps"] = again.placement == report.placement and again.slots_received == 0
    return res


def _mismatch_scenarios(rank, world_size) -> dict:
    """A rank built with a different config or placement: every rank raises a clear ValueError."""
    res = {}
    config = SOFTMAX_SHARED.replace(top_k=2 + (rank == world_size - 1))
    try:
        EPMoE(config)
        res["config_mismatch"] = "no error"
    except ValueError as err:
        res["config_mismatch"] = str(err)
    try:
        EPMoE(SOFTMAX_SHARED, max_tokens_per_rank=8 + rank)
        res["capacity_mismatch"] = "no error"
    except ValueError as err:
        res["capacity_mismatch"] = str(err)
    try:
        EPMoE.from_moe(_moe(SOFTMAX_SHARED, seed=int(rank == 1)))  # rank 1's layer has other weights
        res["weights_mismatch"] = "no error"
    except ValueError as err:
        res["weights_mismatch"] = str(err)
    placement = contiguous_placement(8, world_size) if rank else round_robin_placement(8, world_size)
    try:
        EPMoE(SOFTMAX_SHARED, placement)
        res["placement_mismatch"] = "no error"
    except ValueError as err:
        res["placement_mismatch"] = str(err)
    return res


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results(request):
    per_rank = run_ranks(_scenarios, request.param, timeout_s=150)
    return request.param, per_rank


FP32_CASES = [
    "contiguous_fused_shared_0", "contiguous_fused_shared_1", "round_robin_separate_shared_0",
    "round_robin_separate_shared_1", "padded_0_cap3", "padded_0_cap0", "padded_1_cap3", "padded_1_cap0",
    "eplb_replicas", "eplb_replicas_padded", "all_on_rank0", "uneven_experts", "skipped_ids", "rank_without_experts", "capacity_per_rank", "load_experts",
]


@pytest.mark.parametrize("case", FP32_CASES)
def test_ep_matches_single_process(results, case):
    _, per_rank = results
    errors = [r[case] for r in per_rank]
    assert max(errors) < FP32_TOL, f"{case}: relative errors per rank {errors}"


def test_eplb_replicas_split_evenly(results):
    world_size, per_rank = results
    assert per_rank[0]["eplb_num_replicated"] >= 1
    assert per_rank[0]["eplb_replica_spread"] <= world_size


def test_skewed_routing_lands_on_rank0(results):
    _, per_rank = results
    # Ranks other than 0 only serve their own tokens' fused shared slot.
    assert all(r["all_on_rank0_rows_from_others"] == 0 for r in per_rank[1:])


def test_capacity_drops_counted_per_rank(results):
    _, per_rank = results
    assert all(r["capacity_dropped"][0] == r["capacity_dropped"][1] for r in per_rank)
    assert any(r["capacity_dropped"][0] > 0 for r in per_rank)


def test_empty_batches_everywhere(results):
    _, per_rank = results
    assert all(r["empty_shapes"] == [(0, 32), (2, 0, 32)] for r in per_rank)
    assert all(r["empty_shapes_padded"] == [(0, 32), (2, 0, 32)] for r in per_rank)


def test_padded_dispatch_refuses_more_tokens_than_capacity(results):
    _, per_rank = results
    assert all("max_tokens_per_rank=4" in r["over_capacity"] and "got 5" in r["over_capacity"] for r in per_rank)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_capacity_named_before_any_collective(bad):
    # Checked before anything touches torch.distributed: no process group is needed to see it.
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
        EPMoE(SOFTMAX_SHARED, max_tokens_per_rank=bad)


def test_stats_sum_over_ranks(results):
    _, per_rank = results
    assert all(r["stats_counts_match"] for r in per_rank)


def test_bf16_close_to_single_process(results):
    _, per_rank = results
    assert max(r["bf16_rel_l2"] for r in per_rank) < 1e-2


def test_rebalance_moves_weights_and_keeps_outputs(results):
    _, per_rank = results
    for r in per_rank:
        assert r["rebalance_loads_match"]
        assert r["rebalance_max_not_raised"]
        before, after = r["rebalance_balancedness"]
        assert after >= before
        assert r["rebalance_moved"]
        assert r["rebalance_identical"] < FP64_TOL
        assert r["rebalance_vs_single"] < FP64_TOL
        assert r["rebalance_weights_exact"]
        assert r["rebalance_load_reset"] == 0.0
        assert r["rebalance_again_keeps"]


def test_mismatched_ranks_raise_clear_errors(results):
    _, per_rank = results
    for r in per_rank:
        assert "top_k" in r["config_mismatch"] and "rank 0 vs rank" in r["config_mismatch"]
        assert "placement" in r["placement_mismatch"]
        assert "max_tokens_per_rank" in r["capacity_mismatch"]
        assert "replicated weights" in r["weights_mismatch"] and "gate" in r["weights_mismatch"]


def test_grad_input_refused(results):
    _, per_rank = results
    assert all(r["grad_refused"] and r["grad_mode_output_detached"] for r in per_rank)


def _absent_peer(rank: int, world_size: int) -> dict:
    """Rank 1 never calls forward; rank 0's forward must raise once the group's timeout passes."""
    torch.manual_seed(0)
    ep = EPMoE(SOFTMAX_SHARED)
    if rank == 1:
        time.sleep(8)
        return {"slept": True}
    start = time.monotonic()
    try:
        with torch.no_grad():
            ep(torch.randn(4, 32))
        return {"raised": False, "seconds": time.monotonic() - start}
    except RuntimeError:
        return {"raised": True, "seconds": time.monotonic() - start}


def test_absent_peer_raises_instead_of_hanging():
    per_rank = run_ranks(_absent_peer, 2, timeout_s=60, pg_timeout_s=3)
    assert per_rank[0]["raised"], per_rank[0]
    assert per_rank[0]["seconds"] < 8, per_rank[0]
