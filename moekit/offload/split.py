"""``compute_misses_on="auto"``'s decision: the cheapest split of a forward's misses between the link
and the CPU (``split_misses``), priced by ``cost``'s model, and the cheap bound that skips its search.

    room:    the CPU expert counts s a split could be taken with (``cpu_room``): its cost is at least
             max(GPU side with n - s fetches, the CPU side of the s cheapest misses) whatever the misses'
             reuse, and it is taken only at (1 - hysteresis) x fetching every miss or less: O(distinct
             rows + log n) float work (``bound.room_of``); where no s can be taken, "auto" fetches every
             miss as "gpu" does (``plan.plan_forward``; the refetch charge closes more rooms: ``bound``)
    prepare: the room and the classes, found once per forward for ``surely_fetched`` and the search
    search:  the exact cheapest split over the two reuse classes (``split_misses``), its runs kept to
             that room (the same answer: a split outside it costs more than the hysteresis allows)
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.offload.bound import RowTimes, room_of
from moekit.offload.cost import MissCosts, MissSplit, fetch_rate, gpu_only
from moekit.offload.prices import memo_for

@dataclass(frozen=True)
class Prepared:
    """What ``surely_fetched`` and ``split_misses`` both start from for one forward (``prepare``), computed once."""

    fetch_all: MissSplit  # every miss fetched (``gpu_only``)
    limit_s: float  # (1 - hysteresis) x its cost: what a split with CPU experts must not exceed
    room: tuple[int, int] | None  # ``cpu_room`` at that limit
    classes: tuple | None  # ``_classes`` kept to the room (None without room)


def prepare(tokens: dict[int, int], hits: int, expert_bytes: int, costs: MissCosts,
            reuse: dict[int, float] | None = None, room: tuple[int, int] | None | bool = False) -> Prepared:
    """The forward's ``Prepared`` (``room``: ``cpu_room``'s answer when the caller has it, None included;
    False: found here)."""
    fetch_all = gpu_only(tokens, expert_bytes, costs, hits)
    limit_s = (1.0 - costs.hysteresis) * fetch_all.cost_s
    if room is False:
        room = cpu_room(tokens, hits, expert_bytes, costs, limit_s)
    classes = None if room is None else _classes(tokens, hits, costs, reuse, room[1], memo_for(costs, expert_bytes).cpu)
    return Prepared(fetch_all, limit_s, room, classes)


def split_misses(tokens: dict[int, int], expert_bytes: int, costs: MissCosts, hits: int = 0,
                 reuse: dict[int, float] | None = None, prepared: Prepared | None = None) -> MissSplit:
    """The split of the missed experts (``tokens``: expert -> its routed assignments in this forward;
    ``hits``: cached experts the GPU computes meanwhile) with the smallest ``cost_s``: the predicted
    forward time plus, for each expert left on the CPU (not cached), one fetch times p, its chance of
    being touched again while a fetched copy would still be cached (a refetch, deferred to later).

    p: with ``costs.refetch == "reuse"`` and ``reuse`` (expert -> its chance, ``ExpertCache.reuse``),
    the mean over the expert's class among these misses, the classes being "likely reused" (p >= 1/2,
    and an infinite p: a cache that has not yet evicted, where a CPU-kept expert misses at every later
    touch, so no miss goes to the CPU) and "likely evicted first" (below); otherwise (``"hit_rate"``,
    session 8's, or no ``reuse``) h = hits / touched this forward for every miss. With h, a 75% cache
    at M = 1 on the H200 (still filling after the bench's 61 steps) kept a few hot experts on the CPU
    step after step: 0.03 less hit rate and 1.09-1.15x the pure fetch's step.

    Exact: within a class every expert costs the same to fetch and to leave uncached, so the best split
    with a of one class and b of the other on the CPU takes the a and b with the least CPU time
    (``cpu_time``: by rows, not always the fewest rows when a measured table is not monotone); for a
    fixed b the cost is convex in a (the GPU side falls linearly with fewer fetches under a max, the
    CPU side adds ever dearer experts, less one fetch's ``issue_s`` each), so its leftmost minimum is found by galloping
    from the previous b's then bisection, for every b. The one exception, a second GPU call (``gpu_call_s``) saved when
    no miss is fetched at all, is the last point of the last run: it is priced on its own; so is it where
    ``fetch_layer_s`` (the least a forward with any fetch takes) falls away with the last fetch. Ties go to fewer CPU
    experts, then fewer likely-reused ones.

    Hysteresis: the best split with CPU experts is taken only where it costs at most (1 -
    ``costs.hysteresis``) x ``gpu_only``'s; otherwise every miss is fetched. The model's differences of
    a few percent are within its error (the CPU rate drifts by tens of percent over a run), and a decision flipping
    on them sends a hot expert to the CPU one step and over the link the next. ``prepared``: ``prepare``'s
    answer for the same arguments, when the caller has it."""
    p = prepared or prepare(tokens, hits, expert_bytes, costs, reuse)
    fetch_all, limit_s, room = p.fetch_all, p.limit_s, p.room
    if room is None:
        return fetch_all
    fetch_one = expert_bytes / costs.link_bytes_per_s
    _, times, members, classes, sums = p.classes
    charge = [fetch_one * total / len(c) if c else 0.0 for c, total in zip(members, sums)]
    prices = _Prices(len(tokens), len(members[0]), costs,
                     *[_cumulative([times[tokens[e]] for e in c]) for c in classes],
                     *charge, hits, memo_for(costs, expert_bytes).gpu)
    drop = (hits > 0 and costs.gpu_call_s > 0) or costs.fetch_layer_s > 0  # fetching nothing saves a step
    found = _cheapest(prices.cost_fn(), len(members[0]), len(members[1]), drop, fetch_all.cost_s,
                      prices.bound_or_none(),
                      room)
    if found is None:
        return fetch_all
    a, b = found
    on_cpu, fetched = classes[0][:a] + classes[1][:b], len(tokens) - a - b
    best = MissSplit(sorted(set(tokens).difference(on_cpu)), sorted(on_cpu), *prices.sides(a, b),
                     fetched * expert_bytes / fetch_rate(costs, True), prices.refetch(a, b))
    return best if best.cost_s <= limit_s else fetch_all


def _classes(tokens: dict[int, int], hits: int, costs: MissCosts, reuse: dict[int, float] | None, most: int,
             cpu=None):
    """(each miss's chance of reuse, CPU time by rows, the two classes' members, each class's ``most``
    cheapest on the CPU, cheapest first, each class's summed chance): ``split_misses``' classes (its docstring).
    The order is by (CPU time, rows, expert), found by rows: a forward's misses have a few distinct row
    counts, so each class's experts are taken a row count at a time in that order until ``most`` (no
    per-expert sort key); ``cpu``: the CPU time by rows (``prices.PriceMemo.cpu``; None: ``costs.cpu_time``)."""
    if reuse is not None and costs.refetch == "reuse":
        chance = reuse  # keyed by (at least) the misses
    else:
        chance = dict.fromkeys(tokens, hits / (hits + len(tokens)))
    cpu = cpu or costs.cpu_time
    times = {t: cpu(t) for t in set(tokens.values())}  # by rows: a few distinct counts
    members = [[e for e in tokens if not chance[e] >= 0.5], [e for e in tokens if chance[e] >= 0.5]]  # misses' order
    sums = [sum([chance[e] for e in m]) for m in members]
    order = sorted(times, key=lambda r: (times[r], r))
    classes = []
    for c in members:
        taken: list[int] = []
        for rows in order:  # at decode the cheapest row count usually fills ``most`` alone
            if len(taken) >= most:
                break
            taken.extend(sorted([e for e in c if tokens[e] == rows]))
        classes.append(taken[:most])
    return chance, times, members, classes, sums


def surely_fetched(tokens: dict[int, int], hits: int, expert_bytes: int, costs: MissCosts,
                   reuse: dict[int, float] | None = None, prepared: Prepared | None = None) -> list[int]:
    """The misses every split ``split_misses`` can return fetches (sorted): all of them where ``cpu_room``
    finds no room, else all but each class's ``most`` cheapest (the CPU takes the cheapest of a class first,
    and no more than room's ``most`` CPU experts in all). Their copies can be issued before the search.
    ``prepared`` as ``split_misses`` takes it."""
    p = prepared or prepare(tokens, hits, expert_bytes, costs, reuse)
    if p.room is None:
        return sorted(tokens)
    candidates = {e for c in p.classes[3] for e in c}
    return sorted(e for e in tokens if e not in candidates)


@dataclass(frozen=True)
class _Prices:
    """``split_misses``' prices of a of the first class and b of the second on the CPU (a + b >= 1), from the
    classes' cumulative CPU times (``cum0``, ``cum1``: their cheapest first, as far as the search may take
    them), the first class's size, their per-expert refetch charges and the GPU side by fetch count (``gpu``:
    ``prices.PriceMemo.gpu`` of the costs with ``hits``, CPU busy); plain floats, no MissSplit built per probe."""

    n: int  # misses
    n0: int  # of which in the first class
    costs: MissCosts
    cum0: list[float]
    cum1: list[float]
    charge0: float
    charge1: float
    hits: int
    gpu: object  # (hits, fetched, busy) -> GPU side seconds

    def sides(self, a: int, b: int) -> tuple[float, float]:
        """(GPU side, CPU side)."""
        c, f = self.costs, self.n - a - b
        return self.gpu(self.hits, f, True), c.cpu_margin * (c.cpu_step_s + self.cum0[a] + self.cum1[b]) + f * c.issue_s

    def refetch(self, a: int, b: int) -> float:
        return (a * self.charge0 if a else 0.0) + (b * self.charge1 if b else 0.0)

    def cost_fn(self):
        """``cost(a, b)``: ``MissSplit.cost_s`` of the split, without building it (``sides`` + ``refetch``, the
        same sums in the same order, its terms bound to locals: the search calls it a few hundred times)."""
        n, hits, gpu, cum0, cum1 = self.n, self.hits, self.gpu, self.cum0, self.cum1
        margin, step, issue, charge0, charge1 = (self.costs.cpu_margin, self.costs.cpu_step_s, self.costs.issue_s,
                                                 self.charge0, self.charge1)
        by_fetches: dict[int, float] = {}  # this search's GPU sides (from the memo once each)

        def cost(a: int, b: int) -> float:
            f = n - a - b
            gpu_s = by_fetches.get(f)
            if gpu_s is None:
                gpu_s = by_fetches[f] = gpu(hits, f, True)
            cpu_s = margin * (step + cum0[a] + cum1[b]) + f * issue
            return (gpu_s if gpu_s > cpu_s else cpu_s) + ((a * charge0 if a else 0.0) + (b * charge1 if b else 0.0))
        return cost

    def bound(self, b: int) -> float:
        """A lower bound of ``cost(a, b)`` over every a: its CPU side and refetch at a = 0, less every first-class
        expert's issue (a's CPU time and refetch are >= 0, each of its experts takes one issue off)."""
        c = self.costs
        return c.cpu_margin * (c.cpu_step_s + self.cum1[b]) + (self.n - self.n0 - b) * c.issue_s + (
            b * self.charge1 if b else 0.0)

    def bound_or_none(self):
        """``bound``, where it is nondecreasing in b: its steps are the second class's CPU times (ascending)
        at the margin plus its charge less one issue, so from the least step on; else None."""
        least = self.costs.cpu_margin * (self.cum1[1] if len(self.cum1) > 1 else 0.0) + self.charge1
        return self.bound if least >= self.costs.issue_s else None


def _cheapest(cost, n0: int, n1: int, drop: bool, fetch_all_s: float, bound=None,
              room: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``split_misses``' search: the cheapest (a, b) by ``cost(a, b)`` over a <= n0, b <= n1 (a + b >= 1), None
    where fetching every miss (``fetch_all_s``) costs no more; the leftmost minimum of each b's convex run of a
    (``_leftmost``, started from the previous b's); ``drop``: fetching nothing saves a second GPU call (or
    ``fetch_layer_s``), so that one point (a, b) = (n0, n1) is off its run and priced on its own. Ties: fewer
    CPU experts, then fewer of the second class. ``bound(b)``: a lower bound of cost(a, b) over every a,
    nondecreasing in b (or None): the runs stop at the first b whose bound exceeds the best price so far (no
    later b can reach it). ``room`` (lo, hi): only lo <= a + b <= hi is searched (``cpu_room``: every split the
    caller can take lies there; a run cut to an interval is still convex, and its leftmost minimum there is
    the run's own wherever that one can be taken).
    Prices are plain floats (a MissSplit, its sorted lists, is built once for the winner: at M = 32, 75
    misses a layer, building one per probe took 16 ms of host time a layer on a 2-core host)."""
    best, rank, found = fetch_all_s, (0, 0), None
    least, most = room if room is not None else (1, n0 + n1)

    def offer(a: int, b: int, c: float) -> None:
        nonlocal best, rank, found
        if (c, a + b, b) < (best, *rank):
            best, rank, found = c, (a + b, b), (a, b)

    if drop and most >= n0 + n1:
        offer(n0, n1, cost(n0, n1))
    hint = None
    for b in range(min(n1, most) + 1):
        if bound is not None and bound(b) > best * (1.0 + 1e-12):
            break
        lo = max(1 if b == 0 else 0, least - b)  # a = b = 0: no CPU side at all
        hi = min(n0 - (1 if drop and b == n1 else 0), most - b)
        if lo > hi:
            continue
        price = _run(cost, b)
        hint = _leftmost(price, lo, hi, lo if hint is None else hint)
        offer(hint, b, price(hint))
    return found


def _run(cost, b: int):
    """``cost(a, b)`` as a function of a, each a priced once (the probes of a run share their neighbours)."""
    seen: dict[int, float] = {}

    def price(a: int) -> float:
        c = seen.get(a)
        if c is None:
            c = seen[a] = cost(a, b)
        return c
    return price


def _leftmost(price, lo: int, hi: int, hint: int) -> int:
    """The leftmost minimum of ``price`` over lo..hi, a convex run: the first a where price(a + 1) < price(a)
    (still falling) is False, hi if none; by galloping from ``hint`` (clamped to lo..hi) to a bracket, then
    bisection in it (the previous b's answer is near: a few probes, not log(n0) each)."""
    h = min(max(hint, lo), hi)
    if h < hi and price(h + 1) < price(h):  # the answer is right of h
        left, step = h + 1, 1
        while True:
            probe = h + step
            if probe >= hi:
                right = hi
                break
            if not price(probe + 1) < price(probe):
                right = probe
                break
            left, step = probe + 1, step * 2
    else:  # the answer is h or left of it
        right, step = h, 1
        while True:
            probe = h - step
            if probe < lo:
                left = lo
                break
            if price(probe + 1) < price(probe):
                left = probe + 1
                break
            right, step = probe, step * 2
    while left < right:
        mid = (left + right) // 2
        if price(mid + 1) < price(mid):
            left = mid + 1
        else:
            right = mid
    return left


def cpu_room(tokens: dict[int, int], hits: int, expert_bytes: int, costs: MissCosts,
             limit_s: float) -> tuple[int, int] | None:
    """(lo, hi): every split of the misses ``tokens`` with s >= 1 experts on the CPU whose ``cost_s`` is at
    most ``limit_s`` has lo <= s <= hi; None where no such split exists (then "auto" fetches every miss).

    A split with s CPU experts costs at least max(G(n - s), C(s)): G the GPU side with n - s fetches and
    the CPU busy (``gpu_side_s``), C(s) = ``cpu_margin`` x (``cpu_step_s`` + the s least ``cpu_time`` of
    the misses) + (n - s) x ``issue_s``; the refetch charge is >= 0 and any s experts' CPU times sum to
    at least the s least. G(f) is nondecreasing in f, so once G(n - s) is within the limit it stays so for
    every larger s; C is convex in s (its steps, the sorted CPU times at the margin less ``issue_s``, rise),
    so the s with C within the limit are an interval: ``bound.room_of`` finds its ends by bisection.
    Compared with a relative slack of 1e-9 (the search sums the same times in another order)."""
    return room_of(RowTimes.of(tokens, costs), hits, expert_bytes, costs, limit_s)


def _cumulative(values: list[float]) -> list[float]:
    """[0, v0, v0 + v1, ...]."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out

