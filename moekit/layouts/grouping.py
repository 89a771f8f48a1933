"""The one grouping every stage shares: where each element lands when elements are stably grouped by
an integer key (an expert, a replica's expert, a capacity bucket), and where each (token, slot)
assignment lands when each expert's run is rounded up to a multiple of ``align`` rows.

    [Route] -> [Group: rank_within_groups -> aligned_positions -> a layout] -> Experts -> Combine

Shapes: N elements, G groups, M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts.
All of it runs as device ops with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._checks import check_int


@dataclass
class GroupRanks:
    """A stable counting sort of N keys in [0, G]; key G is "in no group" (not routed, not here)."""

    counts: torch.Tensor  # [G] int64; counts[g] = elements with key g; sums to N minus the elements with key G
    # [G+1] int64; exclusive cumsum of the counts: key g's run is order[starts[g]:starts[g] + count]
    starts: torch.Tensor
    order: torch.Tensor  # [N] int64; element indices sorted by key, stably: within a run, in input order
    # [N] int64; rank[i] = elements before i with the same key (0..count-1); rank[order[p]] = p - starts[key]
    rank: torch.Tensor


def rank_within_groups(keys: torch.Tensor, num_groups: int) -> GroupRanks:
    """Group ``keys`` [N] (integers in [0, num_groups]) and rank every element within its group.

    The key ``num_groups`` collects what belongs to no group; its elements sort last and are ranked
    among themselves like any other key. Ties keep input order, so the rank of an element is the
    number of earlier elements with the same key. Keys outside [0, num_groups] are not checked (that
    would sync with the host); callers map them to ``num_groups`` first (``to_local_ids`` does).
    """
    if keys.dim() != 1 or keys.is_floating_point() or keys.is_complex():
        raise ValueError(f"keys must be a 1-D integer tensor, got shape {tuple(keys.shape)} {keys.dtype}")
    check_int("num_groups", num_groups, minimum=0)
    keys = keys.long()
    counts_all = torch.zeros(num_groups + 1, dtype=torch.int64, device=keys.device)
    counts_all.scatter_add_(0, keys, torch.ones_like(keys))  # [G+1]
    starts = torch.cumsum(counts_all, 0) - counts_all  # [G+1]
    order = torch.sort(keys, stable=True).indices  # [N]
    rank = torch.empty_like(keys)
    rank[order] = torch.arange(keys.numel(), device=keys.device) - starts[keys[order]]  # [N]
    return GroupRanks(counts=counts_all[:num_groups], starts=starts, order=order, rank=rank)


@dataclass
class AlignedPositions:
    """Where every assignment goes in an expert-grouped, ``align``-padded row space."""

    local_ids: torch.Tensor  # [A] int64; local expert of each assignment, E where it is not routed here
    dst: torch.Tensor  # [A] int64; destination row of each assignment, -1 where it is not routed here
    counts: torch.Tensor  # [E] int32; real rows of each expert; sums to the routed assignments
    offsets: torch.Tensor  # [E+1] int64; padded start row of each expert; offsets[E] = rows used


def to_local_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Flatten ids [M, k] to local expert ids [A] (int64), with ``num_experts`` for "not here".

    An id < 0 (skipped or dropped), an id >= the map's length, and a map entry of -1 all mean
    "not here"; none of them is ever wrapped onto a valid expert.
    """
    flat = topk_ids.reshape(-1).long()  # [A]
    if expert_map is not None:
        table = torch.cat([expert_map.long(), expert_map.new_full((1,), -1).long()])  # [E_global + 1]
        safe = torch.where((flat >= 0) & (flat < expert_map.numel()), flat, expert_map.numel())
        flat = table[safe]  # [A]
    routed = (flat >= 0) & (flat < num_experts)
    return torch.where(routed, flat, num_experts)


def max_padded_rows(num_assignments: int, num_experts: int, align: int) -> int:
    """Rows that hold any grouping of A assignments with every run padded to ``align``:
    A + min(E, A)*(align-1), since at most min(E, A) experts leave a partial run. Use it to size a
    buffer once (a static shape, no host sync)."""
    return num_assignments + min(num_experts, num_assignments) * (align - 1)


def aligned_positions(
    topk_ids: torch.Tensor, num_experts: int, align: int, expert_map: torch.Tensor | None = None
) -> AlignedPositions:
    """Group the assignments of ``topk_ids`` [M, k] by local expert, each expert's run starting on a
    multiple of ``align``; assignments keep their a-order within a run."""
    check_int("num_experts", num_experts)
    check_int("align", align)
    local = to_local_ids(topk_ids, num_experts, expert_map)  # [A]
    groups = rank_within_groups(local, num_experts)
    padded = (groups.counts + align - 1) // align * align  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=local.device)
    offsets[1:] = torch.cumsum(padded, 0)
    dst = torch.where(local < num_experts, offsets[local] + groups.rank, -1)  # [A]
    return AlignedPositions(local_ids=local, dst=dst, counts=groups.counts.to(torch.int32), offsets=offsets)


def scatter_to_rows(values: torch.Tensor, dst: torch.Tensor, num_rows: int, fill: int | float) -> torch.Tensor:
    """rows[dst[a]] = values[a] for dst[a] >= 0; every other row of the [num_rows, ...] result is ``fill``."""
    rows = values.new_full((num_rows + 1, *values.shape[1:]), fill)  # the extra row absorbs dst = -1
    index = torch.where(dst >= 0, dst, num_rows)
    rows[index] = values
    return rows[:num_rows]


def assignments_of_rows(dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The inverse of ``dst`` [A] (row of each assignment, -1 = none): [num_rows] int64, the assignment
    a = t*k + j each row holds, and A on rows no assignment lands on (padding). Only A integers are
    scattered; the activation rows themselves are then gathered once (``gather_assigned_rows``)."""
    num_assignments = dst.numel()
    assignment = torch.arange(num_assignments, device=dst.device)
    return scatter_to_rows(assignment, dst, num_rows, fill=num_assignments)


def gather_assigned_rows(x: torch.Tensor, src_of_row: torch.Tensor, top_k: int, fill: float) -> torch.Tensor:
    """rows[r] = x[src_of_row[r] // k], and ``fill`` where src_of_row[r] = A (= M*k, so A // k = M reads the
    appended fill row): one gather of [T, K], no scatter of activations. x [M, K] -> [T, K]."""
    x_ext = torch.cat([x, x.new_full((1, x.shape[1]), fill)])  # [M+1, K]; a copy of M rows, not of T
    return x_ext[src_of_row // top_k]


def combine_rows(rows: torch.Tensor, src_of_row: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The weighted inverse of a grouping: rows [T, D] (row r computed for assignment src_of_row[r]) ->
    out [M, D] with out[t] = sum_j topk_weights[t, j] * rows[row of (t, j)], in float32 (float64 for
    float64 rows); assignments with no row contribute 0.

    Rows with src_of_row = A (padding, or rows a GEMM left unwritten) land, with weight 0, in a dropped
    row M, so even a NaN there never reaches the output. On the CPU one ``index_add_`` pass (serial over
    the rows, hence deterministic); elsewhere the rows go back to slot order and are summed over k,
    because ``index_add_`` on CUDA adds in a nondeterministic order.
    """
    num_tokens, top_k = topk_weights.shape
    acc = torch.promote_types(rows.dtype, torch.float32)
    weights = torch.cat([topk_weights.reshape(-1).to(acc), topk_weights.new_zeros(1, dtype=acc)])  # [A+1]
    scaled = rows.to(acc) * weights[src_of_row, None]  # [T, D]
    if rows.device.type == "cpu":
        out = rows.new_zeros((num_tokens + 1, rows.shape[1]), dtype=acc)
        return out.index_add_(0, src_of_row // top_k, scaled)[:num_tokens]  # [M, D]
    per_slot = rows.new_zeros((num_tokens * top_k + 1, rows.shape[1]), dtype=acc).index_copy_(0, src_of_row, scaled)
    return per_slot[:-1].view(num_tokens, top_k, -1).sum(dim=1)  # [M, D]
