"""The shared grouping core: ``rank_within_groups`` equal to a plain loop written here, exactly."""

import pytest
import torch

from moekit.layouts import max_padded_rows, rank_within_groups


def loop_ranks(keys: list[int], num_groups: int) -> dict[str, list[int]]:
    """Walk the keys once: an element's rank is how many earlier elements share its key."""
    seen = [0] * (num_groups + 1)
    rank = []
    for key in keys:
        rank.append(seen[key])
        seen[key] += 1
    starts, total = [], 0
    for count in seen:
        starts.append(total)
        total += count
    order = [i for group in range(num_groups + 1) for i, key in enumerate(keys) if key == group]
    return {"counts": seen[:num_groups], "starts": starts, "order": order, "rank": rank}


def assert_matches_loop(keys: torch.Tensor, num_groups: int) -> None:
    got = rank_within_groups(keys, num_groups)
    want = loop_ranks(keys.tolist(), num_groups)
    for name, values in want.items():
        tensor = getattr(got, name)
        assert tensor.dtype == torch.int64, name
        assert tensor.tolist() == values, name


@pytest.mark.parametrize("num_elements, num_groups, seed", [(1, 1, 0), (37, 5, 1), (200, 16, 2), (64, 64, 3)])
def test_matches_loop_with_not_routed_keys(num_elements, num_groups, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, num_groups + 1, (num_elements,), generator=g)  # num_groups = not routed
    assert_matches_loop(keys, num_groups)


def test_empty_groups_between_used_ones():
    keys = torch.tensor([7, 2, 7, 2, 2, 0, 9, 7])  # groups 1, 3-6 and 8 empty; 9 = not routed
    assert_matches_loop(keys, 9)
    got = rank_within_groups(keys, 9)
    assert got.rank.tolist() == [0, 0, 1, 1, 2, 0, 0, 2]
    assert got.counts.tolist() == [1, 0, 3, 0, 0, 0, 0, 3, 0]


def test_every_key_not_routed():
    got = rank_within_groups(torch.full((6,), 4), 4)
    assert got.counts.tolist() == [0, 0, 0, 0]
    assert got.starts.tolist() == [0, 0, 0, 0, 0]
    assert got.rank.tolist() == list(range(6))
    assert got.order.tolist() == list(range(6))


def test_empty_input():
    assert_matches_loop(torch.zeros(0, dtype=torch.int64), 3)
    got = rank_within_groups(torch.zeros(0, dtype=torch.int32), 3)
    assert got.counts.tolist() == [0, 0, 0] and got.starts.tolist() == [0, 0, 0, 0]
    assert got.order.numel() == 0 and got.rank.numel() == 0


def test_int32_keys_and_properties():
    keys = torch.randint(0, 9, (500,), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    assert_matches_loop(keys, 8)
    got = rank_within_groups(keys, 8)
    assert sorted(got.order.tolist()) == list(range(500))  # a permutation
    assert int(got.counts.sum()) == int((keys < 8).sum())
    position = torch.arange(500)
    assert torch.equal(got.rank[got.order], position - got.starts[keys[got.order].long()])


def test_bad_keys_name_the_argument():
    with pytest.raises(ValueError, match="keys must be a 1-D integer tensor"):
        rank_within_groups(torch.zeros(2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="keys must be a 1-D integer tensor"):
        rank_within_groups(torch.zeros(3), 4)


def compositions(total: int, parts: int):
    """Every way to split ``total`` assignments over ``parts`` experts (counts >= 0)."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("num_experts, align", [(1, 4), (3, 1), (3, 4), (4, 3)])
def test_max_padded_rows_holds_every_grouping(num_experts, align):
    for num_assignments in range(9):
        worst = max(
            sum((c + align - 1) // align * align for c in counts)
            for counts in compositions(num_assignments, num_experts)
        )
        bound = max_padded_rows(num_assignments, num_experts, align)
        assert worst <= bound
        if num_assignments <= num_experts:  # one assignment per expert: every run is partial, the bound is met
            assert worst == bound
