"""A cheap proof that "auto" fetches every miss of a forward: the least cost any split with CPU experts can
have, against the limit hysteresis sets (``split.split_misses`` takes a split only at (1 - hysteresis) x
fetching every miss, ``gpu_only``'s cost, or less).

    split with s of n misses on the CPU costs at least  B(s) = max(G(n - s), C(s)) + s x q
        G(f): the GPU side with f fetches, the CPU busy (``gpu_side_s``)
        C(s): cpu_margin x (cpu_step_s + the s least ``cpu_time`` of the misses) + (n - s) x issue_s
        q:    the least refetch charge of one CPU expert: one fetch times the lesser of the two reuse
              classes' mean chances (``split_misses`` charges each CPU expert its class's; 0 when not given)
    proof:  min over s = 1..n of B(s) > the limit (with a relative slack of 1e-9, as ``split.cpu_room``:
            the search sums in another order)

B is convex on s = 1..n - 1 (G is a max of lines in f once f >= 1; the CPU times sorted ascending make
C convex; q x s is a line), so its minimum there is found by bisection on its forward difference, and
s = n (nothing fetched: no second call, no ``fetch_layer_s``) is priced on its own. Without a charge the
room's ends come the same way (``room_of``: G falls in s, C is convex). Before either, an O(1) check
(``cpu_too_dear``) prices one CPU expert at the least time any row count takes. The misses' CPU times
come from their few distinct row counts (``RowTimes``), so a proof costs O(distinct rows + log n) host
work, where the search sorts and prices every miss: one H200 run's "auto" planned 0.13 ms a forward at
M = 8 (gpu 0.005), much of it on forwards whose room the refetch charge closed (fetched all after the
search), with ``split.cpu_room`` walking every s three times a forward.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from moekit.offload.cost import MissCosts
from moekit.offload.prices import PriceMemo, memo_for

SLACK = 1.0 + 1e-9  # ``split.cpu_room``'s relative slack: the search sums the same times in another order


def cpu_too_dear(misses: int, costs: MissCosts, limit_s: float) -> bool:
    """The O(1) first check: True when even one CPU expert at the least time ``cpu_time`` can take (any row
    count) prices the CPU side of every split of ``misses`` misses over ``limit_s`` (``fetches_all``'s C(1),
    C rising from there: the least time at the margin is at least one fetch's ``issue_s``). Where
    ``cpu_time`` has no least over row counts (a falling line) it proves nothing."""
    table = costs.cpu_rows_s
    if len(table) > 1 or (table and costs.cpu_token_s >= 0.0):  # linear between points, never below the last above
        least = min(t for _, t in table)
    elif not table and costs.cpu_token_s >= 0.0:
        least = costs.cpu_expert_s + costs.cpu_token_s
    else:
        return False
    margin, issue = costs.cpu_margin, costs.issue_s
    return margin * least >= issue and margin * (costs.cpu_step_s + least) + (misses - 1) * issue > limit_s * SLACK


@dataclass
class RowTimes:
    """A forward's misses' CPU times, by distinct value ascending, with running counts and sums: the s least
    times' sum (T(s)) in O(distinct rows)."""

    n: int  # misses
    times: list[float]  # distinct CPU times, ascending
    ends: list[int]  # [0, then experts up to and including each time]
    sums: list[float]  # [0.0, then their summed time]

    @classmethod
    def of(cls, tokens: dict[int, int], costs: MissCosts, memo: PriceMemo | None = None) -> "RowTimes":
        """``memo``: ``prices.memo_for(costs, ...)``, when the caller has it (the CPU times from it)."""
        counts = Counter(tokens.values())
        cpu = costs.cpu_time if memo is None else memo.cpu
        times, ends, sums = [], [0], [0.0]
        for t, c in sorted((cpu(r), c) for r, c in counts.items()):  # a few distinct counts
            times.append(t)
            ends.append(ends[-1] + c)
            sums.append(sums[-1] + t * c)
        return cls(len(tokens), times, ends, sums)

    def least(self, s: int) -> float:
        """T(s): the sum of the s least CPU times (0 <= s <= n)."""
        i = min(bisect.bisect_right(self.ends, s) - 1, len(self.times) - 1)
        return self.sums[i] + (s - self.ends[i]) * self.times[i]


def room_of(rows: RowTimes, hits: int, expert_bytes: int, costs: MissCosts, limit_s: float) -> tuple[int, int] | None:
    """``split.cpu_room``'s answer for the misses ``rows`` beside ``hits`` hits: (lo, hi), the CPU expert
    counts s whose G(n - s) and C(s) are both within ``limit_s`` (with ``SLACK``), None where no s is. G
    falls as s grows and C is convex, so they are the interval from max(s_G, the first s with C within) to
    the last s with C within: s_G by bisection on G (the least s whose G fits), C's least point from the
    experts whose CPU time at the margin is below ``issue_s``, and the ends by bisection on C either side.
    O(distinct rows + log n)."""
    n, gpu = rows.n, memo_for(costs, expert_bytes).gpu
    limit, margin, issue = limit_s * SLACK, costs.cpu_margin, costs.issue_s
    if not n or gpu(hits, 0, True) > limit:
        return None

    def cpu(s: int) -> float:
        return margin * (costs.cpu_step_s + rows.least(s)) + (n - s) * issue

    lo, hi = 0, n - 1  # the most fetches f with G(f) within the limit (G(0) is)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if gpu(hits, mid, True) <= limit:
            lo = mid
        else:
            hi = mid - 1
    s_g, least = max(n - lo, 1), min(n, max(1, rows.ends[bisect.bisect_left(rows.times, issue / margin)]))
    start = max(s_g, least)
    if cpu(start) > limit:
        return None
    lo, hi = start, n  # the last s with C within: C rises from its least point on
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cpu(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    last, lo, hi = lo, s_g, start  # the first s >= s_G with C within: C falls up to its least point
    while lo < hi:
        mid = (lo + hi) // 2
        if cpu(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return lo, last


def fetches_all(rows: RowTimes, hits: int, expert_bytes: int, costs: MissCosts, limit_s: float,
                charge_s: float = 0.0, room: tuple[int, int] | None = None) -> bool:
    """True when no split with CPU experts of the misses (``rows``, beside ``hits`` hits) costs ``limit_s`` or
    less (module docstring's proof): without a charge, ``room_of`` finds no room; with one, the least B(s)
    (``least_split_s``) is over the limit, searched within ``room`` (``room_of``'s, when the caller has it:
    outside it max(G, C) alone is over the limit)."""
    if charge_s > 0.0:
        return least_split_s(rows, hits, expert_bytes, costs, charge_s, room) > limit_s * SLACK
    return room_of(rows, hits, expert_bytes, costs, limit_s) is None


def least_split_s(rows: RowTimes, hits: int, expert_bytes: int, costs: MissCosts, charge_s: float = 0.0,
                  within: tuple[int, int] | None = None) -> float:
    """The least B(s) over s = 1..n (module docstring), or over ``within`` (lo, hi), for the misses ``rows``
    beside ``hits`` hits, ``charge_s`` the least refetch charge of a CPU expert (q); inf without misses."""
    n, gpu_side = rows.n, memo_for(costs, expert_bytes).gpu
    if not n:
        return float("inf")

    def cost(s: int) -> float:
        cpu = costs.cpu_margin * (costs.cpu_step_s + rows.least(s)) + (n - s) * costs.issue_s
        gpu = gpu_side(hits, n - s, True)
        return (gpu if gpu > cpu else cpu) + s * charge_s

    first, last = within or (1, n)
    lo, hi = first, min(last, n - 1)  # s = n (no fetch left) is off the convex run: priced on its own
    best = cost(n) if last == n else float("inf")
    if lo > hi:
        return best
    while lo < hi:  # the leftmost minimum of a convex run: where its forward difference stops being negative
        mid = (lo + hi) // 2
        if cost(mid + 1) < cost(mid):
            lo = mid + 1
        else:
            hi = mid
    return min(cost(lo), best)


def least_charge_s(tokens: dict[int, int], hits: int, expert_bytes: int, costs: MissCosts,
                   reuse: dict[int, float] | None) -> float:
    """q: one fetch (at the idle link's rate) times the least chance ``split_misses`` prices a CPU expert's
    refetch by: with ``reuse`` (and ``costs.refetch == "reuse"``) the lesser mean chance of its two classes
    (chance >= 1/2 and below; a class without members aside), else this forward's hit rate."""
    if reuse is None or costs.refetch != "reuse":
        return expert_bytes / costs.link_bytes_per_s * hits / (hits + len(tokens))
    sums, counts = [0.0, 0.0], [0, 0]
    for e in tokens:
        p = reuse[e]
        hot = p >= 0.5
        sums[hot] += p
        counts[hot] += 1
    chance = min(sums[c] / counts[c] for c in (0, 1) if counts[c])
    return expert_bytes / costs.link_bytes_per_s * chance
