"""EPMoE on 2 and 4 gloo ranks (spawned on loopback) against the single-process MoE.

Each world size spawns one process group (a spawn costs seconds on CI's two cores) that runs every
scenario in ``SCENARIOS`` in order, the same list on every rank so the collectives pair up. A scenario
returns named values; each ``Check`` in ``CHECKS`` is one test case over one value on every rank.
Shapes: M tokens over all ranks, K=32 hidden, N=16, E experts, W ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from _helpers import TOLERANCE, rel_l2, rel_max_err, value_error_of
from _parallel_harness import run_ranks
from moekit.config import MoEConfig
from moekit.experts import run_experts
from moekit.layer import MoE
from moekit.parallel import EPMoE, Placement, contiguous_placement, eplb_placement, round_robin_placement

FP32_TOL = 2e-6  # max |ep - single| / max |single|: only the summation order of a token's partials differs
FP64_TOL = 1e-13

SOFTMAX_SHARED = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=3,
                           shared_expert_intermediate_size=32)
DEEPSEEK_LIKE = MoEConfig(
    hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, scoring="sigmoid", routed_scaling_factor=2.5,
    n_group=4, topk_group=2, use_correction_bias=True, shared_expert_intermediate_size=16,
)
# Every router option of session 34 on at once (the single-process MoE routes it with moekit.route)
OPTIONS_ON = DEEPSEEK_LIKE.replace(router_logit_softcap=2.0, correction_bias_on="logits", group_score="top2_sum",
                                   dropped_group_fill="zero", shared_expert_combine="average")
IDENTITY = SOFTMAX_SHARED.replace(num_identity_experts=3, use_correction_bias=True)  # LongCat-Flash's zero experts
PHI = SOFTMAX_SHARED.replace(renormalize=False, top_k=2, sparsemixer_jitter_eps=0.3)  # Phi-MoE's sparsemixer (eval)
INK = SOFTMAX_SHARED.replace(scoring="sigmoid", use_correction_bias=True, shared_expert_combine="router")  # Inkling
# Token counts per rank: uneven, and with ranks that hold no tokens.
SPLITS = {2: [[5, 12], [17, 0]], 4: [[6, 0, 9, 2], [0, 0, 11, 0]]}


@dataclass(frozen=True)
class Group:
    """One rank's view of the spawned group and of the tokens every scenario shares."""

    rank: int
    world_size: int
    x_all: torch.Tensor  # [17, 32]: the tokens of every split, the same on every rank
    sizes: list[int]  # tokens per rank of the first split, SPLITS[W][0]
    x: torch.Tensor  # [sum(sizes), 32]: all ranks' tokens of that split

    def mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor over all of ``x``."""
        start = sum(self.sizes[: self.rank])
        return rows[start : start + self.sizes[self.rank]]

    @property
    def x_local(self) -> torch.Tensor:  # [sizes[rank], 32]
        return self.mine(self.x)


def _moe(config, seed=0, **kwargs) -> MoE:
    torch.manual_seed(seed)  # the same weights on every rank
    return MoE(config, **kwargs)


def _compare(ep: EPMoE, moe: MoE, x_all: torch.Tensor, sizes: list[int], rank: int) -> float:
    """max relative error of this rank's EP output against the single-process output of its rows."""
    start = sum(sizes[:rank])
    ref = moe(x_all)[start : start + sizes[rank]]
    return rel_max_err(ep(x_all[start : start + sizes[rank]]), ref)


def _skew(moe: MoE, hot: list[int], strength: float) -> MoE:
    """Make experts ``hot`` win selection for most tokens (selection-only correction bias)."""
    moe.e_score_correction_bias[hot] = strength
    return moe


def _dispatch_and_combine(ep: EPMoE, x_local: torch.Tensor):
    """One forward by its stages; returns what the dispatch sent (``local_ids``, ``recv_splits``)."""
    routing = ep.route_tokens(x_local).routing
    sent = ep.dispatch(x_local, routing.topk_ids, routing.topk_weights)
    ep.combine(ep.run_local_experts(sent), sent)
    return sent


# --- the scenarios: run on every rank, in this order, inside one group ---------------------------------


def _splits(g: Group) -> dict:
    """Both token splits: contiguous (fused shared), round-robin (separate shared), and the padded
    (sync-free) dispatch with capacity above the largest rank's tokens and exactly at it."""
    res = {}
    for i, sizes in enumerate(SPLITS[g.world_size]):
        x = g.x_all[: sum(sizes)]
        moe = _moe(SOFTMAX_SHARED)
        res[f"contiguous_fused_shared_{i}"] = _compare(EPMoE.from_moe(moe), moe, x, sizes, g.rank)
        moe = _moe(SOFTMAX_SHARED, fuse_shared=False)
        placement = round_robin_placement(8, g.world_size)
        res[f"round_robin_separate_shared_{i}"] = _compare(EPMoE.from_moe(moe, placement), moe, x, sizes, g.rank)
        moe = _moe(SOFTMAX_SHARED)
        for cap in (max(sizes) + 3, max(max(sizes), 1)):
            ep = EPMoE.from_moe(moe, round_robin_placement(8, g.world_size), max_tokens_per_rank=cap)
            res[f"padded_{i}_cap{cap - max(sizes)}"] = _compare(ep, moe, x, sizes, g.rank)
    return res


def _eplb(g: Group) -> dict:
    """EPLB with replicas on skewed routing, exact and padded; how evenly the replicas share traffic."""
    moe = _skew(_moe(DEEPSEEK_LIKE), [0, 1], 0.3)
    counts = moe(g.x, return_stats=True).stats.counts
    placement = eplb_placement(counts, g.world_size, num_redundant=g.world_size)
    ep = EPMoE.from_moe(moe, placement)
    res = {
        "eplb_num_replicated": sum(c > 1 for c in placement.replica_counts()),
        "eplb_replicas": _compare(ep, moe, g.x, g.sizes, g.rank),
        "eplb_replicas_padded": _compare(EPMoE.from_moe(moe, placement, max_tokens_per_rank=32), moe, g.x, g.sizes,
                                         g.rank),
    }
    sent = _dispatch_and_combine(ep, g.x_local)
    ids = sent.local_ids[sent.local_ids >= 0].long()
    per_slot = torch.bincount(ids, minlength=ep.w13.shape[0])[: ep.num_local_experts].tolist()
    gathered = [None] * g.world_size
    dist.all_gather_object(gathered, per_slot)
    spread = 0
    for e in range(8):
        served = [gathered[r][placement.slots[r].index(e)] for r in placement.replicas(e)]
        spread = max(spread, max(served) - min(served))
    res["eplb_replica_spread"] = spread  # each source splits e within one row: spread <= W
    return res


def _all_on_rank0(g: Group) -> dict:
    """All tokens routed to rank 0's experts (contiguous: experts 0 and 1 live on rank 0)."""
    moe = _skew(_moe(DEEPSEEK_LIKE), [0, 1], 10.0)
    ep = EPMoE.from_moe(moe)
    res = {"all_on_rank0": _compare(ep, moe, g.x, g.sizes, g.rank)}
    sent = _dispatch_and_combine(ep, g.x_local)
    res["all_on_rank0_rows_from_others"] = sum(n for r, n in enumerate(sent.recv_splits) if r != g.rank)
    return res


def _layouts_of_experts(g: Group) -> dict:
    """E = 2W + 1 experts (uneven); a rank's slice loaded expert by expert; a rank with no expert."""
    moe = _moe(SOFTMAX_SHARED.replace(num_experts=2 * g.world_size + 1))
    res = {"uneven_experts": _compare(EPMoE.from_moe(moe), moe, g.x, g.sizes, g.rank)}
    moe = _moe(SOFTMAX_SHARED)
    ep = EPMoE(SOFTMAX_SHARED, round_robin_placement(8, g.world_size))
    ep.load_experts(lambda e: (moe.w13[e], moe.w2[e]))
    ep.gate.weight.copy_(moe.gate.weight)
    res["load_experts"] = _compare(ep, moe, g.x, g.sizes, g.rank)
    # A vLLM map of all -1 on every rank but 0: those ranks still take part and get their tokens back.
    moe = _moe(SOFTMAX_SHARED.replace(shared_expert_intermediate_size=0))
    slots = [list(range(8))] + [[] for _ in range(g.world_size - 1)]
    res["rank_without_experts"] = _compare(EPMoE.from_moe(moe, Placement(8, g.world_size, slots)), moe, g.x, g.sizes,
                                           g.rank)
    return res


def _router_options(g: Group) -> dict:
    """OPTIONS_ON with a negative-leaning bias (the zero fill picks dropped groups' experts): fused shared slots
    (their weight 0.5) and the separate shared MLP (halved), against the single-process layer."""
    res = {}
    for fuse_shared in (True, False):
        moe = _skew(_moe(OPTIONS_ON, fuse_shared=fuse_shared), list(range(8)), -0.6)
        res[f"router_options_fused_{fuse_shared}"] = _compare(EPMoE.from_moe(moe), moe, g.x, g.sizes, g.rank)
    moe = _skew(_moe(IDENTITY), [8, 9, 10], 0.05)  # identity slots on every rank, added where the token lives
    res["router_options_identity"] = _compare(EPMoE.from_moe(moe), moe, g.x, g.sizes, g.rank)
    moe = _moe(SOFTMAX_SHARED.replace(expert_weight_on="input", top_k=1, scoring="sigmoid"))  # Llama-4's router
    res["router_options_input_weighted"] = _compare(EPMoE.from_moe(moe), moe, g.x, g.sizes, g.rank)
    top2 = SOFTMAX_SHARED.replace(expert_weight_on="input", top_k=2)
    res["input_weighted_top2"] = value_error_of(lambda: EPMoE(top2))
    for name, cfg, fuse in (("sparsemixer", PHI, True), ("shared_router", INK, True), ("shared_router", INK, False)):
        moe = _skew(_moe(cfg, fuse_shared=fuse), [1, 6], 0.2) if cfg is INK else _moe(cfg).eval()
        res[f"router_options_{name}_{fuse}"] = _compare(EPMoE.from_moe(moe).eval(), moe, g.x, g.sizes, g.rank)
    return res


def _capacity(g: Group) -> dict:
    """Capacity dropping applies per rank (GShard's local group): MoE on this rank's tokens alone. The aux loss is the
    rank's part of the group's: their mean is MoE's on all the tokens (counts: the choices before the drops)."""
    moe = _moe(SOFTMAX_SHARED.replace(aux_loss_coef=0.01, z_loss_coef=0.001), capacity_factor=0.5)
    ep = EPMoE.from_moe(moe)
    out = ep(g.x_local, return_stats=True)
    aux = ep(g.x_local, return_aux_loss=True)
    dist.all_reduce(mean := aux.aux_loss.detach().clone())
    res = {"aux_loss_of_the_group": (aux.stats, float(mean) / g.world_size, float(moe(g.x, return_aux_loss=True)
                                     .aux_loss), float(aux.aux_loss), float(out.aux_loss))}
    if not g.sizes[g.rank]:
        return res | {"capacity_per_rank": 0.0, "capacity_dropped": (0, 0)}
    ref = moe(g.x_local, return_stats=True)
    return res | {"capacity_per_rank": rel_max_err(out.out, ref.out),
                  "capacity_dropped": (out.stats.dropped, ref.stats.dropped)}


def _empty_and_stats(g: Group) -> dict:
    """M = 0 on every rank (flat and with leading dims), more tokens than the padded capacity, and the
    per-rank stats summed over ranks (LongCat's identity slots counted apart, summed as the bias update sums)."""
    moe = _moe(IDENTITY)
    ep = EPMoE.from_moe(moe)
    res = {"empty_shapes": [tuple(ep(torch.empty(0, 32)).shape), tuple(ep(torch.empty(2, 0, 32)).shape)]}
    padded = EPMoE.from_moe(moe, max_tokens_per_rank=4)
    res["empty_shapes_padded"] = [tuple(padded(torch.empty(0, 32)).shape), tuple(padded(torch.empty(2, 0, 32)).shape)]
    # Every rank passes 5 > 4 tokens: each raises its own error before any payload collective.
    res["over_capacity"] = value_error_of(lambda: padded(torch.randn(5, 32)))
    total = ep(g.x_local, return_stats=True).stats.choice_counts.clone()  # [E + Z]
    dist.all_reduce(total)
    res["stats_counts_match"] = bool(torch.equal(total, moe(g.x, return_stats=True).stats.choice_counts))
    return res


def _skipped_ids(g: Group) -> dict:
    """A routing from elsewhere with skipped ids: -1 (moekit) and >= E (transformers' EP sentinel)."""
    moe = _moe(SOFTMAX_SHARED.replace(shared_expert_intermediate_size=0))
    ep = EPMoE.from_moe(moe, round_robin_placement(8, g.world_size))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 11, (g.x.shape[0], 3), generator=gen, dtype=torch.int32)
    weights = torch.rand(g.x.shape[0], 3, generator=gen)
    ref = g.mine(run_experts(g.x, moe.w13, moe.w2, ids, weights))
    return {"skipped_ids": rel_max_err(ep.forward_routed(g.x_local, g.mine(ids), g.mine(weights)), ref)}


def _bf16(g: Group) -> dict:
    """bf16 against the single-process bf16 layer (relative L2)."""
    moe = _moe(DEEPSEEK_LIKE, dtype=torch.bfloat16)
    ep = EPMoE.from_moe(moe, round_robin_placement(8, g.world_size))
    ref = g.mine(moe(g.x.bfloat16())).double()
    got = ep(g.x_local.bfloat16()).double()
    return {"bf16_rel_l2": rel_l2(got, ref) if ref.numel() else 0.0}


def _rebalance(g: Group) -> dict:
    """Track load over three steps, rebalance with 2 redundant slots, compare outputs and weights (fp64)."""
    x, x_local = g.x.double(), g.x_local.double()
    moe = _skew(_moe(DEEPSEEK_LIKE, dtype=torch.float64), [0, 1, 2], 0.2)
    ep = EPMoE.from_moe(moe)
    for _ in range(3):
        before = ep(x_local)
    report = ep.rebalance(num_redundant=2)
    res = {"rebalance_load_reset": float(ep.expert_load.abs().sum())}
    after = ep(x_local)
    slots = report.placement.slots[g.rank]
    res |= {
        "rebalance_loads_match": report.loads == (3 * moe(x, return_stats=True).stats.counts).double().tolist(),
        "rebalance_max_not_raised": report.max_load_after <= report.max_load_before,
        "rebalance_balancedness": (report.balancedness_before, report.balancedness_after),
        "rebalance_moved": report.placement != contiguous_placement(8, g.world_size),
        "rebalance_identical": rel_max_err(after, before),
        "rebalance_vs_single": rel_max_err(after, g.mine(moe(x))),
        "rebalance_weights_exact": all(
            torch.equal(ep.w13[i], moe.w13[e]) and torch.equal(ep.w2[i], moe.w2[e]) for i, e in enumerate(slots)
        ) and torch.equal(ep.w13[len(slots):], moe.w13[8:]),  # the fused shared slot stays
    }
    # Rebalancing on the same loads again keeps the placement: nothing moves.
    again = ep.rebalance(num_redundant=2, loads=report.loads)
    res["rebalance_again_keeps"] = again.placement == report.placement and again.slots_received == 0
    return res


def _mismatches(g: Group) -> dict:
    """A rank built with a different config, capacity, weights or placement: every rank raises."""
    last = g.rank == g.world_size - 1
    placement = contiguous_placement(8, g.world_size) if g.rank else round_robin_placement(8, g.world_size)
    return {
        "config_mismatch": value_error_of(lambda: EPMoE(SOFTMAX_SHARED.replace(top_k=2 + last))),
        "capacity_mismatch": value_error_of(lambda: EPMoE(SOFTMAX_SHARED, max_tokens_per_rank=8 + g.rank)),
        # rank 1's layer has other weights
        "weights_mismatch": value_error_of(lambda: EPMoE.from_moe(_moe(SOFTMAX_SHARED, seed=int(g.rank == 1)))),
        "placement_mismatch": value_error_of(lambda: EPMoE(SOFTMAX_SHARED, placement)),
    }


SCENARIOS = (_splits, _eplb, _all_on_rank0, _layouts_of_experts, _router_options, _capacity, _empty_and_stats,
             _skipped_ids, _bf16, _rebalance, _mismatches)


@torch.no_grad()
def _run_scenarios(rank: int, world_size: int) -> dict:
    torch.manual_seed(100)
    x_all = torch.randn(17, 32)
    sizes = SPLITS[world_size][0]
    g = Group(rank, world_size, x_all, sizes, x_all[: sum(sizes)])
    values = {}
    for scenario in SCENARIOS:
        values |= scenario(g)
    return values


# --- the checks: one test case each, over every rank's value -----------------------------------------


@dataclass(frozen=True)
class Check:
    """What must hold of the value a scenario recorded under ``key``, on every rank (or on one)."""

    key: str  # the scenario value read, one per rank
    holds: Callable[[object, int, int], bool]  # (value, rank, world size) -> whether it holds there
    says: str  # the condition in words: the failure message
    any_rank: bool = False  # True: holding on one rank is enough (drops happen somewhere)


def _case(name: str, holds, says: str, key: str | None = None, any_rank: bool = False):
    return pytest.param(Check(key or name, holds, says, any_rank), id=name)


def _close(key: str, tol: float = FP32_TOL, error: str = "max |ep - single| / max |single|"):
    return _case(key, lambda v, *_: v < tol, f"{error} < {tol:g}")


def _error_says(key: str, *parts: str):
    return _case(key, lambda v, *_: all(p in v for p in parts), f"every rank raises a ValueError naming {parts}")


FP32_KEYS = [
    "contiguous_fused_shared_0", "contiguous_fused_shared_1", "round_robin_separate_shared_0",
    "round_robin_separate_shared_1", "padded_0_cap3", "padded_0_cap0", "padded_1_cap3", "padded_1_cap0",
    "eplb_replicas", "eplb_replicas_padded", "all_on_rank0", "uneven_experts", "skipped_ids", "rank_without_experts",
    "capacity_per_rank", "load_experts", "router_options_fused_True", "router_options_fused_False",
    "router_options_identity", "router_options_input_weighted", "router_options_sparsemixer_True",
    "router_options_shared_router_True", "router_options_shared_router_False",
]
CHECKS = [
    *(_close(key) for key in FP32_KEYS),
    _case("eplb_num_replicated", lambda v, *_: v >= 1, "EPLB replicates at least one expert"),
    _case("eplb_replica_spread", lambda v, rank, w: v <= w, "an expert's replicas serve within W rows of each other"),
    _case("all_on_rank0_rows_from_others", lambda v, rank, w: rank == 0 or v == 0,
          "ranks other than 0 receive no rows (they only serve their own tokens' fused shared slot)"),
    _case("capacity_drops_as_moe_per_rank", lambda v, *_: v[0] == v[1],
          "EP drops as many assignments as MoE on the rank's tokens alone", key="capacity_dropped"),
    _case("capacity_drops_somewhere", lambda v, *_: v[0] > 0, "capacity 0.5 drops on some rank",
          key="capacity_dropped", any_rank=True),
    _case("aux_loss_of_the_group", lambda v, *_: v[0] is None and abs(v[1] - v[2]) <= 1e-6 * v[2] and v[3] == v[4],
          "return_aux_loss: no stats, the mean over the ranks MoE's aux loss on all their tokens, return_stats's"),
    _case("empty_shapes", lambda v, *_: v == [(0, 32), (2, 0, 32)], "empty batches keep their shape"),
    _case("empty_shapes_padded", lambda v, *_: v == [(0, 32), (2, 0, 32)], "empty batches keep their shape"),
    _error_says("over_capacity", "max_tokens_per_rank=4", "got 5"),
    _case("stats_counts_match", lambda v, *_: v, "per-rank counts (over E + Z) sum to the single-process counts"),
    _close("bf16_rel_l2", TOLERANCE[torch.bfloat16], "||ep - single|| / ||single|| in bf16"),
    _case("rebalance_loads_match", lambda v, *_: v, "the tracked loads are three steps' counts"),
    _case("rebalance_max_not_raised", lambda v, *_: v, "rebalancing does not raise the busiest rank's load"),
    _case("rebalance_balancedness", lambda v, *_: v[1] >= v[0], "balancedness (before, after) does not drop"),
    _case("rebalance_moved", lambda v, *_: v, "the skewed load moves experts"),
    _close("rebalance_identical", FP64_TOL, "max |after - before| / max |before| over the rebalance"),
    _close("rebalance_vs_single", FP64_TOL),
    _case("rebalance_weights_exact", lambda v, *_: v, "every slot holds its expert's weights, bit for bit"),
    _case("rebalance_load_reset", lambda v, *_: v == 0.0, "the tracked load restarts at zero"),
    _case("rebalance_again_keeps", lambda v, *_: v, "rebalancing on the same loads moves nothing"),
    _error_says("config_mismatch", "top_k", "rank 0 vs rank"),
    _error_says("placement_mismatch", "placement"),
    _error_says("capacity_mismatch", "max_tokens_per_rank"),
    _error_says("weights_mismatch", "replicated weights", "gate"),
    _error_says("input_weighted_top2", "expert_weight_on='input' with top_k=2", "dispatches once a forward"),
]


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results(request):
    per_rank = run_ranks(_run_scenarios, request.param, timeout_s=150)
    return request.param, per_rank


@pytest.mark.parametrize("check", CHECKS)
def test_ep(results, check: Check):
    world_size, per_rank = results
    values = [r[check.key] for r in per_rank]
    held = [check.holds(v, rank, world_size) for rank, v in enumerate(values)]
    assert any(held) if check.any_rank else all(held), f"W={world_size}: {check.says}; {check.key} per rank: {values}"


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_capacity_named_before_any_collective(bad):
    # Checked before anything touches torch.distributed: no process group is needed to see it.
    with pytest.raises(ValueError, match="max_tokens_per_rank must be a positive int"):
        EPMoE(SOFTMAX_SHARED, max_tokens_per_rank=bad)


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
