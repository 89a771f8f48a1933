"""The exact dispatch's send plan on one process (no process group): replica lookup, send order and
packed rows, against per-slot Python loops over the placement.

Shapes: M tokens, k slots, E=6 logical experts, S=1 fused shared slot, W=3 ranks, K=4 hidden.
"""

from __future__ import annotations

import pytest
import torch

from moekit.parallel.dispatch import ReplicaTables, _unpack, choose_replicas, pack_sends, plan_sends
from moekit.parallel.placement import Placement, round_robin_placement

E, S, W, K = 6, 1, 3, 4


def _ids(num_tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """Routed ids, the shared slot (E), and both skip markers (-1, >= E + S)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, E + S + 2, (num_tokens, top_k), generator=g, dtype=torch.int32)


def _reference_destination(placement: Placement, rank: int, expert: int) -> tuple[int, int]:
    """(serving rank, local index) of one slot without replicas; (-1, -1) for a skipped slot."""
    if 0 <= expert < E:
        (owner,) = placement.replicas(expert)
        return owner, placement.slots[owner].index(expert)
    if E <= expert < E + S:
        return rank, placement.num_local_experts(rank) + expert - E
    return -1, -1


@pytest.mark.parametrize("rank", range(W))
def test_lookup_without_replicas_matches_the_placement(rank):
    placement = round_robin_placement(E, W)
    tables = ReplicaTables.build(placement, rank, num_shared_slots=S, device="cpu", width=W)
    ids = _ids(20, 3, seed=rank)
    chosen = choose_replicas(ids, tables, rank)
    want = [[_reference_destination(placement, rank, int(e)) for e in row] for row in ids]
    assert not tables.replicated
    assert chosen.dest.tolist() == [[d for d, _ in row] for row in want]
    assert chosen.local.tolist() == [[loc for _, loc in row] for row in want]


@pytest.mark.parametrize("num_tokens, top_k", [(0, 2), (1, 1), (17, 3), (9, 5)])
def test_send_order_and_rows_match_a_loop(num_tokens, top_k):
    rank = 1
    placement = round_robin_placement(E, W)
    tables = ReplicaTables.build(placement, rank, num_shared_slots=S, device="cpu")
    ids = _ids(num_tokens, top_k, seed=num_tokens)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, K, generator=g)
    weights = torch.rand(num_tokens, top_k, generator=g)
    plan = plan_sends(ids, tables, rank, W)
    packed = pack_sends(x, weights, plan)

    dest = [[_reference_destination(placement, rank, int(e)) for e in row] for row in ids]
    keys = [(w, t) for w in range(W) for t in range(num_tokens) if any(d == w for d, _ in dest[t])]
    rows = len(keys)
    assert plan.send_counts.tolist() == [sum(1 for w, _ in keys if w == r) for r in range(W)]
    assert plan.send_key.shape == (num_tokens * min(W, top_k),)  # the bound R >= T, known without a sync
    assert plan.send_key[:rows].tolist() == [w * num_tokens + t for w, t in keys]
    assert packed.send_token[:rows].tolist() == [t for _, t in keys]
    x_rows, id_rows, weight_rows = _unpack(packed.payload[:rows], K, top_k, x.dtype, torch.float32)
    for i, (w, t) in enumerate(keys):
        assert torch.equal(x_rows[i], x[t])
        assert id_rows[i].tolist() == [loc if d == w else -1 for d, loc in dest[t]]
        assert weight_rows[i].tolist() == [float(weights[t, j]) if d == w else 0.0 for j, (d, _) in enumerate(dest[t])]


@pytest.mark.parametrize("num_rows", [1, 2])
@pytest.mark.parametrize("dtype, top_k", [(torch.float64, 3), (torch.bfloat16, 1), (torch.float32, 3)])
def test_unpack_reads_any_row_count_of_misaligned_rows(num_rows, dtype, top_k):
    """A received payload's columns at an offset or row stride their dtype cannot view (float64 rows of K = 40 with
    an odd k: 320 + 4k + 8k bytes) are copied first; a single row too, which ``contiguous()`` returns as it is (a
    size-1 dim's stride is not compared: the float64 fuzzer's EP layers failed on it, fuz44)."""
    g = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 40, generator=g).to(dtype)  # [U, K]
    ids = torch.randint(0, 8, (num_rows, top_k), generator=g, dtype=torch.int32)
    weights = torch.rand(num_rows, top_k, generator=g, dtype=torch.float64).to(torch.promote_types(dtype,
                                                                                                  torch.float32))
    rows = torch.cat([t.contiguous().view(torch.uint8) for t in (x, ids, weights)], dim=1)  # [U, B]
    got = _unpack(rows, 40, top_k, dtype, weights.dtype)
    assert all(torch.equal(a, b) for a, b in zip(got, (x, ids, weights)))
