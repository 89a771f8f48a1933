"""EPLB against independent references: an exhaustive optimum on small cases, DeepSeek's EPLB
(written here from its description, global policy: one group, one node), and EPMoE running a
placement that holds an expert twice on one rank.

Shapes: E logical experts, W ranks (GPUs), R redundant (spare) slots, P = E + R physical slots.
Cost model of both sides: a replica serves an equal share load[e] / replicas[e]; a GPU's load is the
sum over its slots; quality = the maximum GPU load (lower is better).
"""

from __future__ import annotations

import itertools
import random

import torch

from _parallel_harness import run_ranks
from moekit.parallel import EPMoE, Placement, contiguous_placement, eplb_placement, load_lower_bound, rank_loads

REL = 1e-9  # relative slack for "no higher than": the two sides sum the same shares in other orders


def _deepseek_reference(loads: list[float], world_size: int, num_redundant: int) -> list[float]:
    """DeepSeek's EPLB (global policy) -> the load of each GPU.

    Replicate: R times, one more replica to the expert with the largest load / replicas (first on ties).
    Balanced packing: the P physical experts sorted by per-replica load, heaviest first, each to the GPU
    with the smallest load that still has a free slot (P / W slots per GPU; first on ties). Nothing
    stops two replicas of one expert from landing on the same GPU.
    """
    counts = [1] * len(loads)
    for _ in range(num_redundant):
        hottest = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[hottest] += 1
    physical = sorted((loads[e] / counts[e] for e in range(len(loads)) for _ in range(counts[e])), reverse=True)
    per_gpu = len(physical) // world_size
    gpu_load, gpu_used = [0.0] * world_size, [0] * world_size
    for share in physical:
        gpu = min((g for g in range(world_size) if gpu_used[g] < per_gpu), key=lambda g: (gpu_load[g], g))
        gpu_load[gpu] += share
        gpu_used[gpu] += 1
    return gpu_load


def _brute_force_best(loads: list[float], world_size: int, num_redundant: int) -> float:
    """min over every placement of the maximum GPU load: each GPU's slots (P // W, one more on the first
    P % W GPUs) any multiset of experts, every expert in at least one slot."""
    num_experts = len(loads)
    base, extra = divmod(num_experts + num_redundant, world_size)
    per_gpu = [itertools.combinations_with_replacement(range(num_experts), base + (g < extra))
               for g in range(world_size)]
    best = float("inf")
    for gpus in itertools.product(*per_gpu):
        counts = [0] * num_experts
        for held in gpus:
            for e in held:
                counts[e] += 1
        if min(counts) > 0:
            best = min(best, max(sum(loads[e] / counts[e] for e in held) for held in gpus))
    return best


def _zipf(num_experts: int, exponent: float, rng: random.Random) -> list[float]:
    loads = [1000.0 / (i + 1) ** exponent for i in range(num_experts)]
    rng.shuffle(loads)
    return loads


def _peak(loads, world_size: int, num_redundant: int) -> float:
    p = eplb_placement(loads, world_size, num_redundant)
    assert p.num_physical_experts == len(loads) + num_redundant
    return max(rank_loads(p, loads))


def test_regression_strongly_skewed_spare_equals_gpus():
    """Issue 12: fixed greedy counts [2, 1, 2, 1] gave 36.5 / 19.5; counts [1, 2, 2, 1] give 28 / 28."""
    loads = [18, 1, 19, 18]
    assert sorted(rank_loads(eplb_placement(loads, 2, 2), loads)) == [28.0, 28.0]
    assert _brute_force_best(loads, 2, 2) == 28.0
    assert max(_deepseek_reference(loads, 2, 2)) == 28.0


def test_two_replicas_on_one_gpu_where_only_that_is_optimal():
    """[16, 13, 3] on 2 GPUs with 1 spare slot: 16 / 16 needs expert 0 in both slots of one GPU
    (distinct experts per GPU reach 17.5 at best: {0, 1} / {0, 2} or worse)."""
    loads = [16, 13, 3]
    p = eplb_placement(loads, 2, 1)
    assert sorted(p.slots) == [[0, 0], [1, 2]]
    assert rank_loads(p, loads) == [16.0, 16.0]
    assert _brute_force_best(loads, 2, 1) == 16.0


def test_regression_zipf_where_greedy_counts_fall_short():
    """Issue 12: Zipf-1.6, E=256, W=8, R=8. DeepSeek's counts cannot do better than 1.044 x the mean;
    choosing counts and placement together reaches the mean within 1e-3."""
    loads = _zipf(256, 1.6, random.Random(1))
    mean = sum(loads) / 8
    reference = max(_deepseek_reference(loads, 8, 8)) / mean
    assert reference > 1.04
    assert _peak(loads, 8, 8) / mean < 1.001


def _small_cases():
    rng = random.Random(0)
    for num_experts, world_size, num_redundant in itertools.product((2, 3, 4), (2, 3), range(4)):
        if num_experts + num_redundant < world_size or num_redundant > num_experts * (world_size - 1):
            continue
        for trial in range(8):
            if trial % 2:
                loads = [rng.randint(0, 20) for _ in range(num_experts)]
            else:
                loads = [round(rng.paretovariate(1.0), 3) for _ in range(num_experts)]
            yield loads, world_size, num_redundant


def test_optimal_on_small_cases():
    """E <= 4, W <= 3, R <= 3 (divisible or not): eplb reaches the exhaustive optimum exactly
    (the guarantee is measured here, not proven: the search is a heuristic in general)."""
    checked = 0
    for loads, world_size, num_redundant in _small_cases():
        best = _brute_force_best(loads, world_size, num_redundant)
        assert best >= load_lower_bound(loads, world_size, num_redundant) * (1 - REL)
        got = _peak(loads, world_size, num_redundant)
        assert got <= best * (1 + REL), (loads, world_size, num_redundant, got, best)
        checked += 1
    assert checked > 150


def _sweep_cases(count: int):
    """Seeded sample: E in {4, 8, 16, 64, 256}, W in {2, 4, 8, 16} with W dividing E + R, R in 0..2W;
    loads uniform, Zipf (exponent 0.8-2.0) or one hot expert."""
    rng = random.Random(12)
    shapes = [(e, w, r) for e in (4, 8, 16, 64, 256) for w in (2, 4, 8, 16) for r in range(2 * w + 1)
              if (e + r) % w == 0 and e + r >= w and r <= e * (w - 1)]
    for _ in range(count):
        num_experts, world_size, num_redundant = rng.choice(shapes)
        kind = rng.choice(["uniform", "zipf", "hot"])
        if kind == "uniform":
            loads = [rng.uniform(0.0, 1.0) for _ in range(num_experts)]
        elif kind == "zipf":
            loads = _zipf(num_experts, rng.uniform(0.8, 2.0), rng)
        else:
            loads = [rng.uniform(0.0, 1.0) for _ in range(num_experts)]
            loads[rng.randrange(num_experts)] = rng.uniform(0.2, 0.6) * num_experts
        yield loads, world_size, num_redundant


def test_never_worse_than_deepseek_sweep():
    for loads, world_size, num_redundant in _sweep_cases(250):
        p = eplb_placement(loads, world_size, num_redundant)
        got = max(rank_loads(p, loads))
        reference = max(_deepseek_reference(loads, world_size, num_redundant))
        assert got <= reference * (1 + REL), (len(loads), world_size, num_redundant, got, reference)
        assert got >= load_lower_bound(loads, world_size, num_redundant) * (1 - REL)
        assert ([p.num_local_experts(r) for r in range(world_size)]
                == [p.num_physical_experts // world_size] * world_size)


def test_deterministic_and_spread_when_equal():
    """Same loads, same placement; with uniform loads nothing needs an expert twice on a GPU."""
    loads = _zipf(64, 1.2, random.Random(3))
    assert eplb_placement(loads, 8, 8) == eplb_placement(list(loads), 8, 8)
    p = eplb_placement([1.0] * 16, 4, 4)
    assert all(len(set(s)) == len(s) for s in p.slots)


# ----- EPMoE with an expert twice on one rank (2 gloo ranks) ---------------------------------------

DOUBLED = Placement(8, 2, [[0, 1, 4, 4, 2], [3, 5, 6, 7, 4]])  # expert 4: two slots on rank 0, one on rank 1
WIDE = Placement(8, 2, [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]])  # DOUBLED's slot counts, at most 2 replicas an expert


@torch.no_grad()
def _doubled_scenario(rank: int, world_size: int) -> dict:
    from moekit.config import MoEConfig
    from moekit.layer import MoE

    config = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2,
                       shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    moe = MoE(config, dtype=torch.float64)
    torch.manual_seed(1)
    x = torch.randn(24, 32, dtype=torch.float64)
    local = x[12 * rank : 12 * (rank + 1)]
    ref = moe(x)[12 * rank : 12 * (rank + 1)]
    err = lambda out: float((out - ref).abs().max() / ref.abs().max())  # noqa: E731
    res = {"exact": err(EPMoE.from_moe(moe, DOUBLED)(local)),
           "padded": err(EPMoE.from_moe(moe, DOUBLED, max_tokens_per_rank=12)(local))}
    ep = EPMoE.from_moe(moe, contiguous_placement(8, world_size))
    res["received"] = ep.apply_placement(DOUBLED)  # from contiguous: rank 0 receives expert 4 into two slots
    res["moved"] = err(ep(local))
    res["weights"] = all(torch.equal(ep.w13[i], moe.w13[e]) for i, e in enumerate(DOUBLED.slots[rank]))
    # the same slot counts, but expert 4 on 3 slots: more replicas than the W-wide tables held (an in-place copy of
    # the tables raised "size of tensor a (2) must match ... (3)"; found by the fuzzer's EPLB draws, fix45)
    ep = EPMoE.from_moe(moe, WIDE)
    w13 = ep.w13
    ep.apply_placement(DOUBLED)
    res["wider"], res["same_w13"] = err(ep(local)), ep.w13 is w13
    ep = EPMoE.from_moe(moe, WIDE)
    ep.graph_captured = True
    try:
        ep.apply_placement(DOUBLED)
        res["captured"] = "applied"
    except ValueError as e:
        res["captured"] = str(e)
    return res


def test_epmoe_serves_an_expert_held_twice_on_a_rank():
    """Dispatch, the padded dispatch and moving weights all work with a doubled expert (no code change
    needed there): outputs equal the single-process layer, each slot gets its expert's weights."""
    per_rank = run_ranks(_doubled_scenario, 2, timeout_s=150)
    for res in per_rank:
        assert res["exact"] < 1e-13 and res["padded"] < 1e-13 and res["moved"] < 1e-13 and res["wider"] < 1e-13
        assert res["weights"] and res["same_w13"]  # the slot count kept: the weights stay in their Parameter
        assert "replicas to 3 (> 2)" in res["captured"] and "captured CUDA graph" in res["captured"]
    # move_experts sends expert 4 to rank 0 twice (one row per slot) but counts distinct experts received.
    assert [res["received"] for res in per_rank] == [1, 1]
