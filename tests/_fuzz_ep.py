"""Expert-parallel layers (``moekit.parallel.EPMoE``) on the fuzzer's cases against the float64 loop of
``_fuzz_reference``: what ``test_fuzz_ep`` asserts and ``benchmarks/fuzz_layer.py --ep`` counts.

    W gloo ranks (``_parallel_harness.run_ranks``), one spawn for many seeds: each rank builds the case's MoE (the same
    weights everywhere), EPMoE.from_moe over a contiguous or round-robin placement, exact or padded dispatch, 1-3
    overlapped chunks (``ep_options``), passes its own rows of the batch
    (uneven, a rank may have none) and returns its output and logits -> the parent routes the whole batch in the loop
    from the ranks' logits and checks each rank's rows

Capacity dropping applies over each rank's own tokens (EPMoE's contract, GShard's per-group capacity), so a case with
a capacity factor is checked rank by rank: each rank's output and dropped count against the loop on its rows alone.
EPLB (``ep_options``' ``eplb``): before the checked call the layer rebalances, with 0-2 redundant replica slots, to
loads drawn from the seed (the same on every rank), so tokens reach replicas through the replica tables.

Cases EPMoE takes (its documented refusals: quantized layers, expert biases, input-weighted experts with top_k > 1,
are checked to name themselves on rank 0's side): no NaN gate rows (a collective error, ``test_parallel_ep_faults``),
the torch router.

Shapes: M tokens of the whole batch, K hidden, W ranks.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from _fuzz_cases import FuzzCase, build, draw_case
from _fuzz_check import Outcome, check_output
from _fuzz_reference import LayerWeights, reference_moe


@dataclass
class RankResult:
    """One rank's share of one case: its rows [start, stop) of the batch, their output and logits (or a refusal), as
    float64 NumPy arrays (exact for every float dtype): a tensor would travel through shared memory that a finished
    rank no longer serves."""

    start: int
    stop: int
    out: np.ndarray | None  # [rows, K]
    logits: np.ndarray | None  # [rows, W_router]
    refusal: str | None = None
    dropped: int = 0  # assignments this rank's capacity dropped (its call's stats)
    replicas: int = 0  # redundant slots of the placement the checked call ran on (EPLB), 0 without


def ep_takes(case: FuzzCase) -> bool:
    return not case.nan_gate_rows


@dataclass
class EpOptions:
    """The EP layer's options from the seed's own stream."""

    round_robin: bool  # the placement: round-robin, else contiguous
    overlap: int  # chunks of the micro-batch (moekit.parallel.overlap); 1 = none
    padded: bool  # max_tokens_per_rank = M: the padded dispatch (W*C rows on the wire), else the exact one
    eplb: int | None  # rebalance with this many redundant slots before the call (``eplb_loads``); None: no EPLB


def ep_options(seed: int) -> EpOptions:
    rng = random.Random(f"epp{seed}")
    return EpOptions(round_robin=rng.random() < 0.5, overlap=rng.choice([1, 1, 2, 3]), padded=rng.random() < 0.3,
                     eplb=rng.choice([None, None, 0, 1, 2]))


def eplb_loads(case: FuzzCase) -> list[float]:
    """[E] skewed expert loads from the seed (a few hot experts), the same on every rank."""
    rng = random.Random(f"eplb{case.seed}")
    return [rng.expovariate(1.0) ** 3 for _ in range(case.config.num_experts)]


def ep_layer(moe, case: FuzzCase, world_size: int, eplb: bool = True):
    """The case's EPMoE on this rank (its options: ``ep_options``; ``eplb``: rebalanced where they say so), in eval
    mode. Collective."""
    from moekit.parallel import EPMoE, contiguous_placement, round_robin_placement

    opts = ep_options(case.seed)
    placement = (round_robin_placement if opts.round_robin else contiguous_placement)(case.config.num_experts,
                                                                                      world_size)
    cap = max(case.m, 1) if opts.padded else None
    ep = EPMoE.from_moe(moe, placement, max_tokens_per_rank=cap, overlap=opts.overlap).eval()
    if eplb and opts.eplb is not None:
        ep.rebalance(opts.eplb, loads=eplb_loads(case))
    return ep


def ep_case(case: FuzzCase) -> FuzzCase:
    """The case on the torch router (the fused one is interpreted: not in spawned ranks), grouped_mm's defaults."""
    return dataclasses.replace(case, router="torch", grouped_mm_options={})


def rows_of(m: int, rank: int, world_size: int, seed: int) -> tuple[int, int]:
    """Rank's rows of M: cut points drawn from the seed (uneven, empty shares included)."""
    rng = random.Random(f"rows{seed}")
    cuts = sorted(rng.randint(0, m) for _ in range(world_size - 1))
    bounds = [0, *cuts, m]
    return bounds[rank], bounds[rank + 1]


def rank_cases(rank: int, world_size: int, seeds: list[int]) -> dict[int, RankResult]:
    """Run on each rank (spawned): every seed's case through EPMoE; refusals returned as their messages."""
    results = {}
    for seed in seeds:
        case = ep_case(draw_case(seed))
        moe, x = build(case, random.Random(f"epb{seed}").choice(["grouped_mm", "reference"]))
        start, stop = rows_of(case.m, rank, world_size, seed)
        try:
            ep = ep_layer(moe, case, world_size)
        except (TypeError, ValueError) as err:
            results[seed] = RankResult(start, stop, None, None, str(err))
            continue
        with torch.no_grad():
            call = ep(x[start:stop], return_stats=True)
        results[seed] = RankResult(start, stop, call.out.double().numpy(), call.router_logits.double().numpy(),
                                   dropped=int(call.stats.dropped), replicas=ep.placement.num_redundant)
    return results


def refused_for(case: FuzzCase, world_size: int) -> list[str]:
    """What EPMoE refuses in ``case`` on ``world_size`` ranks: the words one of which its message must hold."""
    cfg = case.config
    causes = {"expert_bias": cfg.expert_bias, "quantized": case.scheme is not None,
              "expert_weight_on": cfg.expert_weight_on == "input" and cfg.top_k > 1,
              "num_experts": cfg.num_experts < world_size}  # a placement gives every rank an expert
    return [word for word, refused in causes.items() if refused]


def check_ep(seeds: list[int], ranks: list[dict[int, RankResult]], world_size: int, result: Outcome) -> None:
    """Every seed's ranks' outputs against the loop on the whole batch, routed from the ranks' logits."""
    for seed in seeds:
        case = ep_case(draw_case(seed))
        shares = [r[seed] for r in ranks]
        if shares[0].refusal is not None:
            result.refusals += 1
            named = refused_for(case, world_size)
            if not any(word in shares[0].refusal for word in named):
                result.fail(f"ep W={world_size} seed {seed}: refusal names none of {named}: {shares[0].refusal}")
            continue
        moe, x = build(case, "reference")
        if case.capacity_factor is not None:
            _check_per_rank(case, moe, x, shares, f"ep W={world_size} seed {seed}", result)
            continue
        logits = torch.cat([torch.from_numpy(s.logits) for s in shares])  # [M, W_router]
        ref = reference_moe(LayerWeights.of(moe), case.config, x, logits)
        for rank, share in enumerate(shares):
            rows = [t for t in range(share.start, share.stop) if t not in set(ref.ambiguous_tokens)]
            mine = [t - share.start for t in rows]
            if rows:
                what = f"ep W={world_size} seed {seed} rank {rank}"
                check_output(torch.from_numpy(share.out)[mine], ref.out[rows], case, what, result)


def _check_per_rank(case: FuzzCase, moe, x: torch.Tensor, shares: list[RankResult], what: str,
                    result: Outcome) -> None:
    """A capacity case: each rank's output and dropped count against the loop on its own rows (capacity over them),
    left out where a near tie decided a drop (or any token: the drops of every token depend on it)."""
    for rank, share in enumerate(shares):
        if share.stop == share.start:
            continue
        ref = reference_moe(LayerWeights.of(moe), case.config, x[share.start:share.stop],
                            torch.from_numpy(share.logits), capacity_factor=case.capacity_factor,
                            drop_policy=case.drop_policy)
        if ref.capacity_ambiguous or ref.ambiguous_tokens:
            result.skipped_ambiguous += 1
            continue
        if share.dropped != ref.dropped:
            result.fail(f"{what} rank {rank}: dropped {share.dropped}, the reference {ref.dropped}")
        check_output(torch.from_numpy(share.out), ref.out, case, f"{what} rank {rank}", result)
