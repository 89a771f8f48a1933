"""Expert-parallel layers (``EPMoE``) on the fuzzer's seeded configs over 2 and 3 gloo ranks (``_fuzz_ep``): each
rank's output for its rows (uneven shares, empty ones included; contiguous or round-robin placement, uneven with 3
ranks; EPLB rebalanced, with redundant replicas) against the float64 loop on the whole batch, routed from the ranks'
logits (with capacity dropping: on the rank's own rows, its dropped count too); the configs EPMoE refuses must
name what they refuse; and the gradients (``_fuzz_ep_grad``) against float64 autograd through the loop. One spawn
per world size runs every seed. ``benchmarks/fuzz_layer.py --ep`` runs more."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from _fuzz_cases import draw_case
from _fuzz_check import Outcome
from _fuzz_ep import check_ep, ep_case, ep_options, ep_takes, rank_cases
from _fuzz_ep_grad import check_ep_grads, ep_grad_seeds, rank_grads
from _parallel_harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

SEEDS = {w: [s for s in seeds if ep_takes(draw_case(s))] for w, seeds in ((2, range(0, 60)), (3, range(60, 120)))}


GRAD_SEEDS = {w: ep_grad_seeds(range(0, 120), w) for w in (2, 3)}


def _outputs_and_gradients(rank: int, world_size: int) -> tuple:
    """On each rank (spawned): the forward cases, then the gradient cases."""
    return rank_cases(rank, world_size, SEEDS[world_size]), rank_grads(rank, world_size, GRAD_SEEDS[world_size])


@pytest.fixture(scope="module")
def spawned():
    """{W: [each rank's (outputs, gradients)]}: one spawn per world size (a spawn costs seconds)."""
    return {w: run_ranks(_outputs_and_gradients, w, timeout_s=300, pg_timeout_s=120) for w in SEEDS}


@pytest.fixture(scope="module")
def ranks(spawned):
    return {w: [r[0] for r in per_rank] for w, per_rank in spawned.items()}


@pytest.fixture(scope="module")
def grad_ranks(spawned):
    return {w: [r[1] for r in per_rank] for w, per_rank in spawned.items()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ep_layers_match_the_float64_loop(ranks, world_size):
    outcome = Outcome()
    check_ep(SEEDS[world_size], ranks[world_size], world_size, outcome)
    assert outcome.compared >= 10 and outcome.refusals >= 3, (outcome.compared, outcome.refusals)
    assert not outcome.failures, "\n".join(outcome.failures)


def test_the_seeds_reach_every_ep_option(ranks):
    """Both placements, exact and padded dispatch, overlapped chunks, empty and uneven shares, fused and separate
    shared experts, every float dtype, refusals."""
    taken = [(w, s) for w, seeds in SEEDS.items() for s in seeds if ranks[w][0][s].refusal is None]
    cases = [ep_case(draw_case(s)) for _, s in taken]
    opts = [ep_options(s) for _, s in taken]
    assert {o.round_robin for o in opts} == {True, False} and {o.padded for o in opts} == {True, False}
    assert {o.overlap for o in opts} == {1, 2, 3}
    assert any(ranks[w][r][s].start == ranks[w][r][s].stop for w, s in taken for r in range(w))  # an empty share
    assert any(c.config.num_experts % 3 for (w, _), c in zip(taken, cases) if w == 3)  # uneven placement
    assert any(c.fuse_shared and c.config.num_shared_slots for c in cases)
    assert any(not c.fuse_shared and c.config.has_shared_expert for c in cases)
    assert {c.dtype for c in cases} == {torch.float32, torch.bfloat16, torch.float64, torch.float16}
    assert any(ranks[w][0][s].refusal for w, seeds in SEEDS.items() for s in seeds)
    # capacity per rank with drops on some rank, both drop policies; EPLB with and without redundant replicas
    capacity = [(w, s) for (w, s), c in zip(taken, cases) if c.capacity_factor is not None]
    assert any(ranks[w][r][s].dropped for w, s in capacity for r in range(w))
    assert {draw_case(s).drop_policy for _, s in capacity} == {"position", "weight"}
    assert {o.eplb for o in opts} == {None, 0, 1, 2}
    assert any(ranks[w][r][s].replicas for w, s in taken for r in range(w))


def test_the_checks_fail_on_a_rank_that_drops_one_more(ranks):
    """A capacity case's dropped count one high on rank 0: every seed whose rank 0 compared fails (the count is held
    to the loop's over that rank's own tokens)."""
    compared, failing = [], []
    for w in SEEDS:
        bent = [{s: dataclasses.replace(r, dropped=r.dropped + (rank == 0)) for s, r in by_seed.items()}
                for rank, by_seed in enumerate(ranks[w])]
        for s in SEEDS[w]:
            if draw_case(s).capacity_factor is None or ranks[w][0][s].refusal is not None:
                continue
            plain, outcome = Outcome(), Outcome()
            check_ep([s], ranks[w], w, plain)
            check_ep([s], bent, w, outcome)
            assert not plain.failures, plain.failures
            compared += [(w, s)] if ranks[w][0][s].stop > 0 and plain.compared else []
            failing += [(w, s)] if outcome.failures else []
    assert len(compared) >= 3 and set(compared) <= set(failing), (compared, failing)


def test_the_checks_fail_on_an_ep_output_off_by_a_little(ranks):
    """Each rank's output 0.1% high: every float32 seed that compared fails."""
    w = 2
    bent = [{s: dataclasses.replace(r, out=None if r.out is None else r.out * 1.001) for s, r in rank.items()}
            for rank in ranks[w]]
    seeds = [s for s in SEEDS[w] if draw_case(s).dtype == torch.float32 and ranks[w][0][s].refusal is None
             and draw_case(s).m > 0]
    compared, failing = [], []
    for s in seeds:
        plain, outcome = Outcome(), Outcome()
        check_ep([s], ranks[w], w, plain)
        check_ep([s], bent, w, outcome)
        compared += [s] if plain.compared else []  # not every token left out for a near tie
        failing += [s] if outcome.failures else []
    assert len(compared) >= 3 and failing == compared, (compared, failing)
    assert all(isinstance(r.out, np.ndarray) for rank in bent for r in rank.values() if r.refusal is None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ep_gradients_match_float64_autograd_through_the_loop(grad_ranks, world_size):
    """x's rows, every expert's gradient (from the rank that holds it), the replicated weights' summed over the
    ranks, against float64 autograd through the loop on the whole batch."""
    outcome = Outcome()
    check_ep_grads(GRAD_SEEDS[world_size], grad_ranks[world_size], world_size, outcome)
    assert outcome.compared >= 40, outcome.compared
    assert not outcome.failures, "\n".join(outcome.failures)


def test_the_gradient_checks_fail_on_a_wrong_ep_gradient(grad_ranks):
    """One expert gradient 0.1% high on rank 0: every float32 seed that compared fails."""
    w = 2
    bent = [{s: dataclasses.replace(g, grads={**g.grads, "w13": g.grads["w13"] * (1.001 if r == 0 else 1.0)})
             for s, g in rank.items()} for r, rank in enumerate(grad_ranks[w])]
    seeds = [s for s in GRAD_SEEDS[w] if draw_case(s).dtype == torch.float32]
    compared, failing = [], []
    for s in seeds:
        plain, outcome = Outcome(), Outcome()
        check_ep_grads([s], grad_ranks[w], w, plain)
        check_ep_grads([s], bent, w, outcome)
        compared += [s] if plain.compared and bent[0][s].slots and np.abs(bent[0][s].grads["w13"]).max() > 0 else []
        failing += [s] if outcome.failures else []
    assert len(compared) >= 3 and set(compared) <= set(failing), (compared, failing)


def test_the_gradient_seeds_reach_eplb_replicas(grad_ranks):
    """Some trained case ran on a rebalanced placement with redundant replicas (their gradients summed per expert)."""
    replicated = [(w, s) for w, seeds in GRAD_SEEDS.items() for s in seeds
                  if sum(len(rank[s].slots) for rank in grad_ranks[w]) > draw_case(s).config.num_experts]
    assert len(replicated) >= 2, replicated
