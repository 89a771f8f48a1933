""""auto"'s cheaper search: the price memo (``prices.PriceMemo``) answers what the calls answer; the galloping
leftmost-minimum (``split._leftmost``) finds what a scan finds from any hint; on decode-sized forwards (20-90
misses, two reuse classes, rows 1-8) ``split_misses`` reaches the cheapest split that an exhaustive loop over
every (a, b) (a of one class's cheapest, b of the other's, priced by the model written out here) finds, and
``plan_forward`` returns ``split_misses``' plan. CPU only."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.offload import ExpertCache, MissCosts, split_misses
from moekit.offload.cost import gpu_side_s
from moekit.offload.plan import plan_forward
from moekit.offload.prices import PriceMemo, memo_for
from moekit.offload.split import _leftmost, _run

from test_offload_room import BYTES, _gpu_s


def _u(gen: torch.Generator, lo: float, hi: float) -> float:
    return float(torch.empty(1).uniform_(lo, hi, generator=gen))


def _costs(gen: torch.Generator) -> MissCosts:
    """Linear CPU costs (no table) over the ranges that make splits and fetch-alls both common at 20-90 misses."""
    return MissCosts(link_bytes_per_s=BYTES / _u(gen, 0.1, 0.3), cpu_expert_s=_u(gen, 0.05, 0.6),
                     cpu_token_s=_u(gen, 0.0, 0.05), cpu_step_s=_u(gen, 0.0, 3.0),
                     gpu_bytes_per_s=BYTES / _u(gen, 0.0, 0.02) if _u(gen, 0, 1) > 0.3 else math.inf,
                     cpu_margin=1.0 if _u(gen, 0, 1) > 0.5 else _u(gen, 1.0, 1.4),
                     link_cpu_bytes_per_s=BYTES / _u(gen, 0.1, 0.4) if _u(gen, 0, 1) > 0.5 else None,
                     issue_s=_u(gen, 0.0, 0.05) if _u(gen, 0, 1) > 0.3 else 0.0,
                     hysteresis=(0.0, 0.05)[int(_u(gen, 0, 2))],
                     gpu_call_s=_u(gen, 0.0, 0.2) if _u(gen, 0, 1) > 0.5 else 0.0,
                     fetch_layer_s=_u(gen, 0.0, 1.0) if _u(gen, 0, 1) > 0.5 else 0.0)


def _decode_case(gen: torch.Generator):
    n = int(torch.randint(20, 91, (1,), generator=gen))
    experts = torch.randperm(256, generator=gen)[:n].tolist()
    tokens = {e: int(torch.randint(1, 9, (1,), generator=gen)) for e in sorted(experts)}
    chance = {e: _u(gen, 0, 1) for e in tokens}
    return tokens, int(torch.randint(0, 60, (1,), generator=gen)), _costs(gen), chance


def _exhaustive(tokens, hits, c: MissCosts, chance) -> tuple[float, set, float]:
    """The least cost over every (a, b): a of the unlikely-reused class's and b of the likely-reused class's
    misses on the CPU, each class's cheapest first (by CPU time, rows, expert); the forward is both sides at
    once (the CPU's after the fetches' issue, at the margin) plus each CPU expert's class mean chance times
    one fetch; taken only at (1 - hysteresis) x fetching all or less. Every split of a given (a, b) costs
    at least this prefix's (same GPU side and charge, no less CPU time). Returns (the least cost, its CPU
    experts, the next-least cost of another (a, b))."""
    classes = [sorted((e for e in tokens if (chance[e] >= 0.5) == hot),
                      key=lambda e: (c.cpu_expert_s + tokens[e] * c.cpu_token_s, tokens[e], e))
               for hot in (False, True)]
    fetch_one = BYTES / c.link_bytes_per_s
    charge = [fetch_one * sum(chance[e] for e in m) / len(m) if m else 0.0 for m in classes]
    n, fetch_all = len(tokens), _gpu_s(len(tokens), hits, c, False)
    priced = [(fetch_all * (1.0 - c.hysteresis), ())]  # fetching all wins at that price or less
    for a in range(len(classes[0]) + 1):
        for b in range(len(classes[1]) + 1):
            if a + b == 0:
                continue
            on_cpu = classes[0][:a] + classes[1][:b]
            cpu = c.cpu_margin * (c.cpu_step_s + sum(c.cpu_expert_s + tokens[e] * c.cpu_token_s for e in on_cpu))
            cost = max(_gpu_s(n - a - b, hits, c, True), cpu + (n - a - b) * c.issue_s) + a * charge[0] + b * charge[1]
            priced.append((cost, tuple(on_cpu)))
    priced.sort(key=lambda p: p[0])
    (best, on_cpu), runner_up = priced[0], priced[1][0]
    return (fetch_all, set(), runner_up) if not on_cpu else (best, set(on_cpu), runner_up)


def test_the_memo_answers_what_the_calls_answer():
    gen = torch.Generator().manual_seed(31)
    for _ in range(40):
        costs = _costs(gen)
        memo = memo_for(costs, BYTES)
        assert memo_for(costs, BYTES) is memo and memo_for(costs, BYTES + 1) is not memo
        memo = PriceMemo(costs, BYTES)
        for _ in range(20):
            hits, fetched, busy = (int(torch.randint(0, 50, (1,), generator=gen)),
                                   int(torch.randint(0, 50, (1,), generator=gen)),
                                   bool(torch.randint(0, 2, (1,), generator=gen)))
            want = gpu_side_s(hits, fetched, BYTES, costs, busy)
            assert memo.gpu(hits, fetched, busy) == want and memo.gpu(hits, fetched, busy) == want  # stored, then read
            rows = int(torch.randint(1, 40, (1,), generator=gen))
            assert memo.cpu(rows) == costs.cpu_time(rows) == memo.cpu(rows)


def test_galloping_finds_the_leftmost_minimum_of_a_convex_run_from_any_hint():
    """Convex runs with flat stretches (slopes ascending, some repeated, zeros among them), any start: the first
    index of the least value within lo..hi, as a scan finds it; each price asked at most once per a."""
    gen = torch.Generator().manual_seed(32)
    for _ in range(500):
        size = int(torch.randint(1, 50, (1,), generator=gen))
        slopes = sorted(int(s) for s in torch.randint(-6, 6, (size,), generator=gen))
        values = [0]
        for s in slopes:
            values.append(values[-1] + s)  # convex: its steps ascend
        lo = int(torch.randint(0, size + 1, (1,), generator=gen))
        hi = lo + int(torch.randint(0, size + 1 - lo, (1,), generator=gen))
        hint = int(torch.randint(lo - 5, hi + 6, (1,), generator=gen))
        asked = []

        def price(a: int, values=values, asked=asked) -> float:
            assert lo <= a <= hi  # never asks outside the run
            asked.append(a)
            return float(values[a])

        want = min(range(lo, hi + 1), key=lambda a: (values[a], a))
        assert _leftmost(_run(lambda a, b: price(a), 0), lo, hi, hint) == want
        assert len(asked) == len(set(asked))


def test_decode_sized_searches_reach_the_exhaustive_least_cost():
    gen = torch.Generator().manual_seed(33)
    kinds = {"split": 0, "fetch": 0, "both": 0, "unique": 0}
    for _ in range(120):
        tokens, hits, costs, chance = _decode_case(gen)
        split = split_misses(tokens, BYTES, costs, hits, chance)
        want, on_cpu, runner_up = _exhaustive(tokens, hits, costs, chance)
        assert split.cost_s == pytest.approx(want, rel=1e-9, abs=1e-12)
        assert sorted(split.fetch + split.cpu) == sorted(tokens)
        if runner_up > want * (1 + 1e-6):  # a unique winner: the same experts on the CPU
            assert set(split.cpu) == on_cpu
            kinds["unique"] += 1
        kinds["split" if split.cpu else "fetch"] += 1
        kinds["both"] += len({chance[e] >= 0.5 for e in split.cpu}) == 2
    assert kinds["split"] > 20 and kinds["fetch"] > 20 and kinds["both"] > 5 and kinds["unique"] > 60, kinds


def test_plan_forward_returns_the_search_plan_on_decode_sized_forwards():
    gen = torch.Generator().manual_seed(34)
    cache = ExpertCache(64, device="cpu", policy="lfu")
    layer = cache.register(torch.empty(256, 0, 0), torch.empty(256, 0, 0))
    for _ in range(150):
        tokens, hits, costs, chance = _decode_case(gen)
        cache.reuse = lambda _layer, experts, _chance=chance: {e: _chance[e] for e in experts}
        issued = []
        plan = plan_forward(cache, layer, "auto", tokens, hits, BYTES, costs, issue=issued.extend)
        want = split_misses(tokens, BYTES, costs, hits, chance)
        assert (plan.fetch, plan.cpu) == (want.fetch, want.cpu)
        assert set(issued) <= set(plan.fetch)  # early fetches are fetched in every split the search can take
