"""What a forward does with its missed experts, by ``compute_misses_on``: the one decision
(``plan_forward``) that both ``OffloadedMoE`` runs and the cache what-if (``whatif.replay``) replays,
so the replay predicts the hit rate of the mode that ran, not that of an all-fetch cache.

    "gpu":  every miss fetched into the cache
    "cpu":  every miss computed on the CPU; the busiest copied into the cache afterwards ("admitted")
    "auto": ``split.split_misses``'s cheapest split (each miss's reuse from the cache's history,
            ``ExpertCache.reuse``); the busiest CPU misses admitted afterwards

Admissions keep the cache learning the hot set while misses run on the CPU; they ride the link in
the background, so by default only as many as fit in the link's idle time during this forward
(predicted CPU side, without ``cpu_margin``, minus the link time of this forward's fetches, in whole
fetches at the link's rate while the CPU computes, ``MissCosts.link_cpu_bytes_per_s``, when measured:
the result's copy back queues behind them on the host-to-device copy engine; ``OffloadedMoE`` queues
them before its CPU compute, so they travel during it), and at least one when nothing was fetched (so an all-CPU forward
still teaches the cache). A later forward's fetches queue behind admissions, which is why "auto" does not admit into a
busy link.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.offload.cache import ExpertCache
from moekit.offload.cost import MissCosts, MissSplit, cpu_never_wins, fetch_rate, gpu_side_s
from moekit.offload.bound import RowTimes, cpu_too_dear, fetches_all, least_charge_s, room_of
from moekit.offload.prices import memo_for
from moekit.offload.split import Prepared, prepare, split_misses, surely_fetched

PLACES = ("gpu", "cpu", "auto")


class Proofs:
    """"auto"'s per-M answer, kept for one costs (reset when they change): whether no forward of m tokens can
    use the CPU (``cost.cpu_never_wins``): then the layer plans by "gpu" itself, no pricing at all. A forward
    "auto" does price is proved all-fetch, where it is, by ``bound.fetches_all`` in ``plan_forward``."""

    def __init__(self) -> None:
        self.costs, self.never = None, {}

    def never_wins(self, m: int, touched: int, expert_bytes: int, costs: MissCosts) -> bool:
        if costs is not self.costs:
            self.costs, self.never = costs, {}
        if m not in self.never:
            self.never[m] = cpu_never_wins(touched, m, expert_bytes, costs)
        return self.never[m]


@dataclass(frozen=True)
class MissPlan:
    """One forward's misses by destination (each list sorted by expert id, ``admit`` busiest first)."""

    fetch: list[int]  # copied into the cache, computed on the GPU
    cpu: list[int]  # computed on the CPU from their host weights
    admit: list[int]  # of ``cpu``: copied into the cache after the forward, for later forwards


def plan_misses(place: str, tokens: dict[int, int], hits: int, expert_bytes: int, costs: MissCosts | None,
                admit_per_forward: int | None = None, reuse: dict[int, float] | None = None,
                prepared: Prepared | None = None) -> MissPlan:
    """The plan for the misses ``tokens`` (expert -> routed assignments) of a forward with ``hits``
    cached experts. ``costs`` is required for "auto"; for "cpu" it only sizes the admissions (one per
    forward without it). ``admit_per_forward`` fixes the admissions per forward (0: none). ``reuse``:
    each miss's chance of reuse while cached ("auto" prices its refetch by it; ``split.split_misses``);
    ``prepared``: the search's inputs for the same arguments (``split.prepare``), when the caller has them."""
    if place not in PLACES:
        raise ValueError(f"compute_misses_on must be one of {PLACES}, got {place!r}")
    if place == "gpu" or not tokens:
        return MissPlan(sorted(tokens), [], [])
    if place == "auto":
        if costs is None:
            raise ValueError("compute_misses_on='auto' needs costs (MissCosts)")
        split = split_misses(tokens, expert_bytes, costs, hits, reuse, prepared)
    elif costs is None:
        split = MissSplit([], sorted(tokens), 0.0, 0.0, 0.0)
    else:
        cpu_s = costs.cpu_side_s(list(tokens.values())) * costs.cpu_margin
        split = MissSplit([], sorted(tokens), gpu_side_s(hits, 0, expert_bytes, costs), cpu_s, 0.0)
    busiest = sorted(split.cpu, key=lambda e: (-tokens[e], e))
    return MissPlan(split.fetch, split.cpu, busiest[: _admissions(split, expert_bytes, costs, admit_per_forward)])


def _admissions(split: MissSplit, expert_bytes: int, costs: MissCosts | None, admit_per_forward: int | None) -> int:
    """How many of the split's CPU misses to admit (module docstring)."""
    if not split.cpu:
        return 0
    if admit_per_forward is not None:
        return admit_per_forward
    if costs is None:
        return 1
    fetch_one = expert_bytes / fetch_rate(costs, cpu_busy=True)  # admissions travel while the CPU computes
    # the model's CPU time, not the priced one
    model_s = (split.cpu_s - len(split.fetch) * costs.issue_s) / costs.cpu_margin
    idle = max(model_s - split.link_s, 0.0)
    count = int(idle / fetch_one) if fetch_one > 0 else len(split.cpu)
    return count if split.fetch else max(count, 1)


def plan_forward(cache: ExpertCache, layer: int, place: str, tokens: dict[int, int], hits: int, expert_bytes: int,
                 costs: MissCosts | None, admit_per_forward: int | None = None, issue=None) -> MissPlan:
    """``plan_misses`` for a forward of ``layer`` on ``cache`` after its ``lookup`` (``tokens``: the misses;
    ``expert_bytes``: what one costs to fetch, which a weightless replay's cache does not know).
    "auto" fetches every miss without a search where a bound proves no split can be taken: one CPU expert
    at its least time too dear (``bound.cpu_too_dear``, O(1)), no room without a refetch charge
    (``bound.room_of``: then the misses' reuse chances are not asked for), no room with the least charge
    by the chances from the cache's history (``bound.fetches_all``; ``ExpertCache.reuse``, where it prices
    refetches by them); else the room and the classes are kept for the search (``split.prepare``) and
    ``issue(experts)``, when given, is called before the search with the misses every split it can take
    fetches (``split.surely_fetched``; not where that is every miss), so their copies travel while the
    host searches; the plan's ``fetch`` holds them. The same plan as the search alone (the proofs are
    lower bounds of every split's cost). (Finding the classes and the early fetches before the charged
    proof, so those copies left sooner, made the forwards that proof decides 20-90% dearer on the replay.)"""
    if place != "auto" or costs is None or not tokens:
        return plan_misses(place, tokens, hits, expert_bytes, costs, admit_per_forward)
    costs = costs.for_plan()  # a CPU branch's average stall priced on its side (``MissCosts.cpu_tail_s``)
    fetch_all, memo = MissPlan(sorted(tokens), [], []), memo_for(costs, expert_bytes)
    limit_s = (1.0 - costs.hysteresis) * memo.gpu(hits, len(tokens))  # ``gpu_only``'s cost
    if cpu_too_dear(len(tokens), costs, limit_s):
        return fetch_all
    rows = RowTimes.of(tokens, costs, memo)
    room = room_of(rows, hits, expert_bytes, costs, limit_s)  # ``split.cpu_room``
    if room is None:
        return fetch_all
    reuse = cache.reuse(layer, list(tokens)) if costs.refetch == "reuse" else None
    if fetches_all(rows, hits, expert_bytes, costs, limit_s, least_charge_s(tokens, hits, expert_bytes, costs, reuse),
                   room):
        return fetch_all
    prepared = prepare(tokens, hits, expert_bytes, costs, reuse, room)
    if issue is not None:
        sure = surely_fetched(tokens, hits, expert_bytes, costs, reuse, prepared)
        if sure:
            issue(sure)
    return plan_misses(place, tokens, hits, expert_bytes, costs, admit_per_forward, reuse, prepared)
