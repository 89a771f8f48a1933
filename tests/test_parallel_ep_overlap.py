"""``EPMoE(overlap=C)``: the micro-batch overlap on 2 and 4 gloo ranks against the single-process MoE.

One spawned group per world size runs every scenario (exact and padded dispatch, uneven and empty
chunks, ranks without tokens, replicas, a rank built with another chunk count); each value is then
checked per rank. Shapes: K=32 hidden, N=16, E=8 experts, W ranks.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import rel_max_err
from _parallel_harness import run_ranks
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.parallel import EPMoE, eplb_placement, round_robin_placement
from moekit.parallel.overlap import chunk_bounds

FP32_TOL = 2e-6  # only the summation order of a token's partials differs from the single-process layer
CONFIG = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=3, shared_expert_intermediate_size=16)
# Tokens per rank: uneven, ranks with none, and ranks with fewer tokens than chunks (empty chunks).
SPLITS = {2: [[9, 2], [0, 7]], 4: [[5, 0, 2, 8], [1, 1, 0, 3]]}


def _moe(**kwargs) -> MoE:
    torch.manual_seed(0)  # the same weights on every rank
    return MoE(CONFIG, **kwargs)


def _errors(rank: int, world_size: int, moe: MoE, x_all: torch.Tensor, sizes: list[int], **ep_kwargs) -> float:
    start = sum(sizes[:rank])
    x = x_all[: sum(sizes)]
    ref = moe(x)[start : start + sizes[rank]]
    ep = EPMoE.from_moe(moe, **ep_kwargs)
    return rel_max_err(ep(x[start : start + sizes[rank]]), ref)


@torch.no_grad()
def _scenarios(rank: int, world_size: int) -> dict:
    x_all = torch.randn(20, 32, generator=torch.Generator().manual_seed(3))
    res = {}
    for i, sizes in enumerate(SPLITS[world_size]):
        for chunks in (2, 3):
            moe = _moe()
            res[f"exact_{i}_c{chunks}"] = _errors(rank, world_size, moe, x_all, sizes, overlap=chunks)
            placement = round_robin_placement(8, world_size)
            for cap in (max(sizes) + 2, max(max(sizes), 1)):
                res[f"padded_{i}_c{chunks}_cap{cap}"] = _errors(rank, world_size, moe, x_all, sizes, overlap=chunks,
                                                                placement=placement, max_tokens_per_rank=cap)
    moe = _moe(fuse_shared=False)
    counts = moe(x_all, return_stats=True).stats.counts
    placement = eplb_placement(counts, world_size, num_redundant=world_size)
    res["eplb_replicas"] = _errors(rank, world_size, moe, x_all, SPLITS[world_size][0], overlap=2, placement=placement)
    res.update(_one_rank_fails(rank, world_size, x_all[:4]))
    try:
        EPMoE(CONFIG, overlap=2 + (rank == world_size - 1))
        res["overlap_mismatch"] = "no error"
    except ValueError as err:
        res["overlap_mismatch"] = str(err)
    return res


def _one_rank_fails(rank: int, world_size: int, x: torch.Tensor) -> dict:
    """The last rank passes float64 to a 3-chunk exact layer (its agreement carries 3 chunks of counts):
    its own error there, PeerRankError elsewhere, and the next forward works."""
    ep = EPMoE.from_moe(_moe(), overlap=3)
    try:
        ep(x.double() if rank == world_size - 1 else x)
        fault = "no error"
    except Exception as err:  # noqa: BLE001 - the test inspects what each rank raised
        fault = f"{type(err).__name__}: {err}"
    return {"fault": fault, "after_fault": rel_max_err(ep(x), _moe()(x))}


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def results(request):
    return request.param, run_ranks(_scenarios, request.param, timeout_s=150)


def test_overlap_matches_the_single_process_layer(results):
    world_size, per_rank = results
    for rank, res in enumerate(per_rank):
        errors = {k: v for k, v in res.items() if k not in ("overlap_mismatch", "fault", "after_fault")}
        assert len(errors) == 13 and max(errors.values()) < FP32_TOL, f"W={world_size} rank {rank}: {errors}"


def test_ranks_built_with_other_chunk_counts_raise_on_every_rank(results):
    _, per_rank = results
    for res in per_rank:
        assert "differ in overlap" in res["overlap_mismatch"], res["overlap_mismatch"]


@pytest.mark.parametrize("tokens, chunks", [(0, 3), (2, 3), (7, 2), (9, 3), (10, 4)])
def test_chunk_bounds_cover_the_tokens_in_order(tokens, chunks):
    bounds = chunk_bounds(tokens, chunks)
    assert len(bounds) == chunks and bounds[0][0] == 0 and bounds[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_overlap_is_named(bad):
    with pytest.raises(ValueError, match="overlap must be an int >= 1"):
        EPMoE(CONFIG, overlap=bad)


def test_one_rank_failing_under_overlap_raises_on_every_rank_and_the_group_recovers(results):
    world_size, per_rank = results
    for rank, res in enumerate(per_rank):
        if rank == world_size - 1:
            assert res["fault"].startswith("ValueError: x must be float32"), res["fault"]
        else:
            assert res["fault"].startswith(f"PeerRankError: rank {world_size - 1} failed"), res["fault"]
        assert res["after_fault"] < FP32_TOL
