"""Layouts: integer metadata equal to naive loops written here; the inverses invert; padding is never read."""

import math

import pytest
import torch

from moekit.layouts import (
    align_block, choose_layout, gather_rows, masked_layout, masked_layout_measured_cap_syncs,
    max_padded_rows, permute_contiguous, scatter_rows, unmask, unpermute_contiguous,
)
from moekit.routing import Routing, apply_capacity


def random_ids(m, k, e, seed, with_skips=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k]
                       for _ in range(m)]) if m else torch.zeros(0, k, dtype=torch.int64)
    if with_skips and m:
        ids[torch.rand(m, k, generator=g) < 0.2] = -1
    return ids.int()


def local_of(global_id, expert_map, num_experts):
    if global_id < 0:
        return None
    if expert_map is not None:
        if global_id >= len(expert_map) or expert_map[global_id] < 0:
            return None
        global_id = expert_map[global_id]
    return global_id if global_id < num_experts else None


def naive_block_layout(ids, num_experts, block, expert_map=None):
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for e in range(num_experts):
        mine = [a for a, g in enumerate(flat) if local_of(g, expert_map, num_experts) == e]
        if not mine:
            continue
        padded = math.ceil(len(mine) / block) * block
        rows += mine + [len(flat)] * (padded - len(mine))
        blocks += [e] * (padded // block)
    return rows, blocks


CASES = [(1, 1, 4, 4), (7, 2, 5, 3), (33, 6, 8, 16), (64, 8, 12, 16), (40, 3, 3, 64), (5, 7, 7, 2)]


@pytest.mark.parametrize("m, k, e, block", CASES)
def test_block_aligned_equals_naive_loop(m, k, e, block):
    ids = random_ids(m, k, e, seed=m + e, with_skips=True)
    layout = align_block(ids, e, block, allow_naive=False)
    rows, blocks = naive_block_layout(ids, e, block)
    used = int(layout.num_padded)
    assert used == len(rows) and used % block == 0
    assert layout.sorted_ids[:used].tolist() == rows
    assert (layout.sorted_ids[used:] == m * k).all()
    assert layout.expert_ids[: used // block].tolist() == blocks
    assert (layout.expert_ids[used // block:] == -1).all()
    assert layout.max_padded == m * k + min(e, m * k) * (block - 1)
    assert int(layout.counts.sum()) == int((ids >= 0).sum())


def test_vllm_docstring_example():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]]) - 1  # zero-based experts
    layout = align_block(ids, 4, 4)
    assert layout.sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]


def test_expert_map_minus_one_never_contributes():
    ids = random_ids(20, 3, 8, seed=5)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1])  # this rank holds experts 0, 2, 4, 6
    layout = align_block(ids, 4, 8, expert_map=expert_map)
    rows, blocks = naive_block_layout(ids, 4, 8, expert_map.tolist())
    assert layout.sorted_ids[: int(layout.num_padded)].tolist() == rows
    assert layout.expert_ids[: len(blocks)].tolist() == blocks
    assert not layout.naive
    real = layout.sorted_ids[layout.sorted_ids < 60].long()
    assert set(ids.reshape(-1)[real].tolist()) <= {0, 2, 4, 6}


def test_tiny_batch_shortcut_needs_no_sort():
    ids = torch.tensor([[9, 3]], dtype=torch.int32)
    layout = align_block(ids, 64, 16)
    assert layout.naive and layout.expert_ids.tolist() == [9, 3]
    assert layout.sorted_ids.view(2, 16)[:, 0].tolist() == [0, 1]
    assert (layout.sorted_ids.view(2, 16)[:, 1:] == 2).all()
    x = torch.randn(1, 6)
    torch.testing.assert_close(scatter_rows(gather_rows(x, layout), layout), x.repeat(2, 1))


@pytest.mark.parametrize("m, k, e, block", CASES)
def test_block_gather_scatter_inverts_and_never_reads_padding(m, k, e, block):
    ids = random_ids(m, k, e, seed=7 * m + e, with_skips=True)
    x = torch.randn(m, 10, 3)[:, :, 0]  # non-contiguous input
    layout = align_block(ids, e, block)
    rows = gather_rows(x, layout, fill=float("nan"))
    back = scatter_rows(rows, layout)  # [A, D]
    expected = x.repeat_interleave(k, 0) * (ids.reshape(-1, 1) >= 0)
    torch.testing.assert_close(back, expected)  # finite: the NaN padding rows were never read


@pytest.mark.parametrize("m, k, e, align", [(1, 1, 4, 4), (33, 6, 8, 16), (64, 2, 5, 128), (9, 3, 3, 1)])
@pytest.mark.parametrize("static", [False, True])
def test_contiguous_permute_and_inverse(m, k, e, align, static):
    ids = random_ids(m, k, e, seed=m, with_skips=True)
    x = torch.randn(m, 12).t().contiguous().t()  # non-contiguous
    rows = max_padded_rows(m * k, e, align) if static else None
    layout = permute_contiguous(x, ids, e, align=align, static_rows=rows, fill=float("nan"))
    flat = ids.reshape(-1).tolist()
    for expert in range(e):  # each segment starts aligned and holds that expert's tokens in order
        start, count = int(layout.offsets[expert]), int(layout.counts[expert])
        assert start % align == 0
        mine = [a // k for a, g in enumerate(flat) if g == expert]
        assert count == len(mine)
        torch.testing.assert_close(layout.x_perm[start:start + count], x[mine])
        assert (layout.segment_ids[start:start + count] == expert).all()
    real = layout.segment_ids >= 0
    assert int(real.sum()) == sum(g >= 0 for g in flat)
    assert torch.isnan(layout.x_perm[~real]).all()
    back = unpermute_contiguous(layout.x_perm, layout)
    torch.testing.assert_close(back, x[:, None, :].expand(m, k, 12) * (ids >= 0)[..., None])
    if static:
        assert layout.total_rows == rows
    else:
        assert layout.total_rows == int(layout.offsets[-1])


def test_contiguous_static_rows_too_small_raises():
    with pytest.raises(ValueError, match="static_rows must be >="):
        permute_contiguous(torch.randn(4, 3), random_ids(4, 2, 4, 0), 4, align=8, static_rows=8)


@pytest.mark.parametrize("measured", [False, True])
def test_masked_layout_and_inverse(measured):
    m, k, e = 30, 3, 6
    ids = random_ids(m, k, e, seed=3, with_skips=True)
    x = torch.randn(m, 5)
    if measured:
        layout = masked_layout_measured_cap_syncs(x, ids, e, round_to=4, fill=float("nan"))
        assert layout.m_max == math.ceil(int(layout.counts.max()) / 4) * 4
    else:
        layout = masked_layout(x, ids, e, fill=float("nan"))
        assert layout.m_max == m * k  # holds any routing, duplicate ids within a token included
    for expert in range(e):
        mine = [a // k for a, g in enumerate(ids.reshape(-1).tolist()) if g == expert]
        assert int(layout.counts[expert]) == len(mine)
        torch.testing.assert_close(layout.x_masked[expert, : len(mine)], x[mine])
        assert torch.isnan(layout.x_masked[expert, len(mine):]).all()
    torch.testing.assert_close(unmask(layout.x_masked, layout), x[:, None].expand(m, k, 5) * (ids >= 0)[..., None])


def test_masked_explicit_cap_overflow_raises():
    ids = torch.zeros(10, 1, dtype=torch.int32)  # all ten tokens on expert 0
    with pytest.raises(ValueError, match="m_max=4 is smaller"):
        masked_layout(torch.randn(10, 2), ids, 3, m_max=4)


def hand_count_drops(ids, weights, e, capacity, policy):
    """Walk assignments in priority order, keeping the first `capacity` per expert."""
    m, k = ids.shape
    order = [(j, t) for j in range(k) for t in range(m)]
    if policy == "weight":
        order.sort(key=lambda jt: -float(weights[jt[1], jt[0]]))  # stable: ties keep position order
    seen, dropped = [0] * e, set()
    for j, t in order:
        g = int(ids[t, j])
        if 0 <= g < e:
            seen[g] += 1
            if seen[g] > capacity:
                dropped.add((t, j))
    return dropped


@pytest.mark.parametrize("policy", ["position", "weight"])
@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25, 2.0])
def test_capacity_drops_equal_hand_count(policy, cf):
    m, k, e = 40, 2, 8
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.multinomial(torch.tensor([8.0, 4, 2, 1, 1, 1, 1, 1]), k, generator=g)
                       for _ in range(m)]).int()
    weights = torch.rand(m, k, generator=g)
    result = apply_capacity(Routing(ids, weights), e, cf, policy)
    capacity = math.ceil(cf * m * k / e)
    assert result.capacity == capacity
    expected = hand_count_drops(ids, weights, e, capacity, policy)
    got = {(t, j) for t, j in result.dropped_mask.nonzero().tolist()}
    assert got == expected and int(result.dropped) == len(expected)
    assert (result.routing.topk_ids[result.dropped_mask] == -1).all()
    assert (result.routing.topk_weights[result.dropped_mask] == 0).all()
    assert (result.kept_counts <= capacity).all()
    assert int(result.kept_counts.sum()) + len(expected) == m * k


def test_huge_capacity_drops_nothing():
    ids = random_ids(16, 2, 4, 1)
    result = apply_capacity(Routing(ids, torch.rand(16, 2)), 4, 100.0)
    assert int(result.dropped) == 0 and torch.equal(result.routing.topk_ids, ids)


def test_chooser_respects_budget_and_explains():
    args = dict(num_tokens=512, top_k=8, num_experts=256, hidden_size=7168, intermediate_size=2048, dtype_bytes=2)
    roomy = choose_layout(memory_budget_bytes=2**34, **args)
    assert roomy.name == "block_aligned" and "fewest GEMM rows" in roomy.reason
    est = {x.name: x for x in roomy.estimates}
    assert est["masked"].peak_bytes > est["contiguous"].peak_bytes > est["block_aligned"].peak_bytes
    tight = choose_layout(memory_budget_bytes=1, **args)
    assert tight.name == "none" and "chunks" in tight.reason
    counts = [512 * 8] + [0] * 255  # everything on one expert: the measured cap is the cheap masked layout
    no_sync = choose_layout(memory_budget_bytes=2**34, counts=counts, allow_sync=False, block_size=128, **args)
    assert (no_sync.name in ("block_aligned", "contiguous")
            and not {x.name: x for x in no_sync.estimates}[no_sync.name].syncs)


def test_empty_batch_gives_empty_layouts():
    ids, x = torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 4)
    for allow_naive in (True, False):
        layout = align_block(ids, 4, 4, allow_naive=allow_naive)
        assert layout.sorted_ids.numel() == 0 and int(layout.num_padded) == 0
        assert scatter_rows(gather_rows(x, layout), layout).shape == (0, 4)
    contiguous = permute_contiguous(x, ids, 4, align=4)
    assert contiguous.total_rows == 0 and unpermute_contiguous(contiguous.x_perm, contiguous).shape == (0, 2, 4)
    masked = masked_layout(x, ids, 4)
    assert int(masked.counts.sum()) == 0 and unmask(masked.x_masked, masked).shape == (0, 2, 4)
    capped = apply_capacity(Routing(ids, torch.zeros(0, 2)), 4, 1.0)
    assert capped.capacity == 0 and int(capped.dropped) == 0


def duplicate_ids(m, k, e, seed):
    """Ids drawn with replacement, so a token often routes twice to one expert; some slots skipped
    (-1) or on transformers' EP sentinel (id >= E)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (m, k), generator=g)
    ids[:3] = torch.tensor([[0] * k, [0] * k, [1] * k])  # the rows: tokens 0 and 1 both twice on expert 0
    ids[torch.rand(m, k, generator=g) < 0.1] = -1
    ids[torch.rand(m, k, generator=g) < 0.1] = e
    return ids.int()


def per_slot_loop(x, ids, e):
    """float64: what every layout's round trip must give, y[t, j] = (ids[t, j] + 1) * x[t] for a routed slot, else 0."""
    out = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            g = int(ids[t, j])
            if 0 <= g < e:
                out[t, j] = (g + 1) * x[t].double()
    return out


@pytest.mark.parametrize("m, k, e", [(3, 2, 2), (17, 4, 3), (40, 3, 5)])
def test_duplicate_ids_in_a_row_keep_every_slot(m, k, e):
    ids = duplicate_ids(m, k, e, seed=m)
    x = torch.randn(m, 6)
    expected = per_slot_loop(x, ids, e)
    scale = torch.arange(1, e + 2, dtype=torch.float32)  # expert g multiplies its rows by g + 1; [E+1], padding too

    masked = masked_layout(x, ids, e, fill=float("nan"))
    assert masked.m_max == m * k and int(masked.counts.sum()) == int(((ids >= 0) & (ids < e)).sum())
    y = masked.x_masked * scale[:e, None, None]
    torch.testing.assert_close(unmask(y, masked).double(), expected)

    contiguous = permute_contiguous(x, ids, e, align=4, fill=float("nan"))
    y = contiguous.x_perm * scale[contiguous.segment_ids.long()][:, None]
    torch.testing.assert_close(unpermute_contiguous(y, contiguous).double(), expected)

    for allow_naive in (True, False):
        block = align_block(ids, e, 4, allow_naive=allow_naive)
        block_expert = block.expert_ids.long().repeat_interleave(4)[: block.max_padded]  # [R] expert of each row
        y = gather_rows(x, block, fill=float("nan")) * scale[block_expert][:, None]
        torch.testing.assert_close(scatter_rows(y, block).view(m, k, 6).double(), expected)


def test_masked_explicit_cap_counts_duplicate_ids():
    ids = torch.tensor([[0, 0], [0, 0], [1, 1]], dtype=torch.int32)  # expert 0 holds 4 assignments > M = 3
    with pytest.raises(ValueError, match="m_max=3 is smaller than the busiest expert's 4 rows"):
        masked_layout(torch.randn(3, 2), ids, 2, m_max=3)
    assert masked_layout(torch.randn(3, 2), ids, 2, m_max=4).m_max == 4
