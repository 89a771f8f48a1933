"""The offload floor's corrected model: the CPU branch as a call cost plus a per-expert time by rows
(``MissCosts.cpu_rows_s``, ``cost.fit_cpu_grid``, ``calibrate.measure_costs``'s grid), the second experts
call (``offload_floor.timeline_s``'s ``call_s``), the call after a layer's admissions (``copy_call_s``), "auto"'s split
on the same model against a brute-force search written here, and ``OffloadedMoE``'s layout report. Hand-worked numbers
and float64 loops; CPU only."""

from __future__ import annotations

import dataclasses

import itertools

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.bench.offload_floor import timeline_s
from moekit.offload import MissCosts, OffloadedMoE, OffloadStats, split_misses
from moekit.offload import calibrate
from moekit.offload.cost import fit_cpu_grid

TABLE = ((1, 0.004), (2, 0.005), (4, 0.009))  # seconds per expert at 1, 2 and 4 rows


def _table_time(rows: int) -> float:
    """TABLE read by hand: flat below 1 row, straight lines between points, the last line extended."""
    points = dict(TABLE)
    if rows in points:
        return points[rows]
    if rows == 3:
        return 0.005 + (0.009 - 0.005) / 2
    return 0.009 + (rows - 4) * (0.009 - 0.005) / 2  # rows > 4


def test_cpu_time_reads_the_table_by_rows_and_checks_it():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=1.0, cpu_token_s=1.0, cpu_step_s=0.002, cpu_rows_s=TABLE)
    for rows, want in [(1, 0.004), (2, 0.005), (3, 0.007), (4, 0.009), (7, 0.015)]:
        assert costs.cpu_time(rows) == pytest.approx(want, rel=1e-12)
    assert costs.cpu_side_s([1, 3, 7]) == pytest.approx(0.002 + 0.004 + 0.007 + 0.015)
    one = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=9.0, cpu_token_s=0.001, cpu_rows_s=((2, 0.01),))
    assert (one.cpu_time(1), one.cpu_time(2), one.cpu_time(5)) == pytest.approx((0.01, 0.01, 0.013))
    line = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.003, cpu_token_s=0.001)
    assert line.cpu_time(4) == pytest.approx(0.007)  # no table: the line
    for bad in [((2, 0.1), (1, 0.2)), ((0, 0.1),), ((1, -0.1),), ((1, 0.1), (1, 0.2))]:
        with pytest.raises(ValueError, match="cpu_rows_s"):
            MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_rows_s=bad)


def test_fit_cpu_grid_recovers_a_call_cost_and_a_per_expert_time_at_each_row_count():
    call, per = 0.0021, {1: 0.0040, 2: 0.0043, 8: 0.0110}  # not a line in rows
    timings = {(n, r): call + n * per[r] for n in (1, 8, 32) for r in per}
    got_call, got = fit_cpu_grid(timings)
    assert got_call == pytest.approx(call, rel=1e-9) and got == pytest.approx(per, rel=1e-9)
    # an intercept the data put below 0 is clamped, the slopes refitted through the origin
    got_call, got = fit_cpu_grid({(1, 1): 0.001, (3, 1): 0.0045})
    # through the origin, relative residuals: minimise (1 - s / 0.001)^2 + (1 - 3 s / 0.0045)^2
    a, b = 1 / 0.001, 3 / 0.0045
    assert got_call == 0.0 and got[1] == pytest.approx((a + b) / (a * a + b * b))
    with pytest.raises(ValueError, match="two expert counts"):
        fit_cpu_grid({(1, 1): 0.001, (4, 1): 0.002, (4, 2): 0.003})
    with pytest.raises(ValueError, match="> 0"):
        fit_cpu_grid({(1, 1): 0.0, (4, 1): 0.002})


def _moe(e=16, top_k=2) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=e, top_k=top_k),
               backend="grouped_mm", router="torch")


def test_measure_costs_fits_the_grid_of_the_rows_it_is_asked_for(monkeypatch):
    call, per = 0.0015, {1: 0.0030, 2: 0.0034, 4: 0.0050}
    seen = []

    def fake_branch(layer, group, experts, m, threads, gemm):
        seen.append((len(group), experts, m))
        return call + experts * per.get(m, 0.0) + (0.0 if gemm == "mm_loop" else 0.01)  # mm_loop is faster

    monkeypatch.setattr(calibrate, "branch", fake_branch)
    monkeypatch.setattr(calibrate, "measure_link_bandwidth", lambda device: 5e10)
    monkeypatch.setattr(calibrate, "measure_read_bandwidth", lambda device: 4e12)
    layer = OffloadedMoE.from_moe(_moe(), cache_experts=1, prefetch=None)
    costs = layer.measure_costs(repeats=2, rows=(1, 2, 4))
    assert costs.cpu_gemm == "mm_loop" and costs.cpu_step_s == pytest.approx(call, rel=1e-9)
    assert [r for r, _ in costs.cpu_rows_s] == [1, 2, 4]
    assert [t for _, t in costs.cpu_rows_s] == pytest.approx([per[1], per[2], per[4]], rel=1e-9)
    token = (per[4] - per[1]) / 3  # the line through the first and last points, for linear readers
    assert (costs.cpu_token_s, costs.cpu_expert_s) == pytest.approx((token, per[1] - token), rel=1e-9)
    assert (costs.link_bytes_per_s, costs.gpu_bytes_per_s, costs.cpu_margin) == (5e10, 4e12, 1.0)
    grid = {(experts, m) for width, experts, m in seen if m in per and experts in (1, 2, 8)}
    assert grid == {(n, r) for n in (1, 2, 8) for r in per}  # 1, k, 4k experts (k = 2) x the rows asked
    assert all(width == max(experts, 2) for width, experts, _ in seen)  # k wide calls, wider for more experts


def _stats(hits=0, fetched=0, cpu_rows=(), admitted=0, prefetched=0) -> OffloadStats:
    return OffloadStats(touched=hits + fetched + len(cpu_rows), hits=hits, fetched=fetched, cpu_experts=len(cpu_rows),
                        cpu_tokens=sum(cpu_rows), cpu_rows=tuple(cpu_rows), admitted=admitted, prefetched=prefetched)


def test_timeline_adds_the_second_call_after_the_fetches_and_prices_cpu_experts_by_their_rows():
    # link 10 ms an expert, GPU read 1 ms; fixed 3 ms a layer, a second experts call 0.5 ms
    costs = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e6, cpu_rows_s=TABLE, gpu_call_s=0.0005)
    both = _stats(hits=5, fetched=2)  # 3 + max(5 x 1, 2 x 10) + 2 x 1 + 0.5 ms
    assert timeline_s([both], 1000, costs, 0.003) == pytest.approx(0.0255)
    assert timeline_s([_stats(hits=5)], 1000, costs, 0.003) == pytest.approx(0.008)  # one call: no extra
    assert timeline_s([_stats(fetched=2)], 1000, costs, 0.003) == pytest.approx(0.025)
    cpu = _stats(hits=1, cpu_rows=(1, 3, 6))  # 3 + CPU 2 + 4 + 7 + 13 ms, the hit's 1 ms inside it
    want = 0.003 + 0.002 + sum(_table_time(r) for r in (1, 3, 6))
    assert timeline_s([cpu], 1000, costs, 0.003) == pytest.approx(want)
    assert timeline_s([both, cpu], 1000, costs, 0.003) == pytest.approx(0.0255 + want)


def test_timeline_starts_the_cpu_side_once_the_layers_fetches_and_admissions_are_issued():
    # link 10 ms an expert, GPU read 1 ms, fixed 3 ms; 1.5 ms of host time to issue each fetched or admitted expert
    costs = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e6, cpu_rows_s=TABLE, issue_s=0.0015)
    cpu = _stats(hits=1, fetched=1, cpu_rows=(6, 6, 6), admitted=1)
    # CPU: 3 + (1 + 1) x 1.5 + 2 + 3 x 13 = 47 ms; GPU: 3 + max(1, 10) + 1 = 14; link free at 3 + 20 = 23 ms
    want = 0.003 + 2 * 0.0015 + 0.002 + 3 * _table_time(6)
    assert timeline_s([cpu], 1000, costs, 0.003) == pytest.approx(want)
    gpu_only = _stats(hits=1, fetched=1)  # no CPU side: the issue time is in the fetch's own terms, not added
    assert timeline_s([gpu_only], 1000, costs, 0.003) == pytest.approx(0.003 + 0.010 + 0.001)


def test_timeline_issues_a_prefetch_after_the_layers_cpu_branch():
    # link and GPU read 1 ms an expert, fixed 3 ms, the prefetch's host work 2 ms
    costs = MissCosts(link_bytes_per_s=1e6, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e6, cpu_rows_s=TABLE)
    cpu = _stats(hits=1, cpu_rows=(4,), prefetched=1)
    # host: 3 + CPU (2 + 9) = 14 ms, then the prefetch's 2 ms: 16; its copy, queued after the CPU side, lands at 15
    assert timeline_s([cpu], 1000, costs, 0.003, prefetch_s=0.002) == pytest.approx(0.016)
    assert timeline_s([cpu], 1000, costs, 0.003) == pytest.approx(0.015)  # no host cost: the link's end
    gpu = _stats(hits=4, prefetched=1)  # no CPU side: after the hits' reads, 3 + 4 + 2 = 9 ms (link done at 4)
    assert timeline_s([gpu], 1000, costs, 0.003, prefetch_s=0.002) == pytest.approx(0.009)
    # three experts prefetched: the one prefetch_s holds, and 0.5 ms of issue for each other: 3 + 4 + 2 + 1 = 10 ms
    three = _stats(hits=4, prefetched=3)
    issued = dataclasses.replace(costs, issue_s=0.0005)
    assert timeline_s([three], 1000, issued, 0.003, prefetch_s=0.002) == pytest.approx(0.010)


def test_timeline_charges_a_call_after_a_layers_admissions_where_nothing_else_prices_it():
    # link and GPU read 1 ms an expert, fixed 3 ms; the experts call after a copy into the slots 0.5 ms dearer
    costs = MissCosts(link_bytes_per_s=1e6, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e6, cpu_rows_s=TABLE)
    admits = _stats(hits=1, cpu_rows=(4,), admitted=1)  # host: 3 + CPU (2 + 9) = 14 ms (its admission lands at 4)
    plain = _stats(hits=2)  # 3 + 2 reads = 5 ms
    assert timeline_s([admits, plain], 1000, costs, 0.003) == pytest.approx(0.019)
    assert timeline_s([admits, plain], 1000, costs, 0.003, copy_call_s=0.0005) == pytest.approx(0.0195)
    assert timeline_s([admits], 1000, costs, 0.003, copy_call_s=0.0005) == pytest.approx(0.0145)  # the last layer too
    kept = _stats(hits=1, cpu_rows=(4,))  # nothing admitted: nothing copied, no call to rebuild
    assert timeline_s([kept, plain], 1000, costs, 0.003, copy_call_s=0.0005) == pytest.approx(0.019)
    ahead = _stats(hits=1, cpu_rows=(4,), admitted=1, prefetched=1)  # the prefetch's own term holds it
    assert timeline_s([ahead, plain], 1000, costs, 0.003, 0.0, 0.002, copy_call_s=0.0005) == pytest.approx(
        timeline_s([ahead, plain], 1000, costs, 0.003, 0.0, 0.002))
    fetches = _stats(hits=1, fetched=1)  # a gpu layer's fetch: fetch_layer_s's, not charged here
    assert timeline_s([fetches], 1000, costs, 0.003, copy_call_s=0.0005) == timeline_s([fetches], 1000, costs, 0.003)


BUMPY = ((1, 0.006), (2, 0.004), (4, 0.008))  # a measured table need not rise with rows


def _bumpy_time(rows: int) -> float:
    """BUMPY read by hand (rows 1..6)."""
    return {1: 0.006, 2: 0.004, 3: 0.006, 4: 0.008, 5: 0.010, 6: 0.012}[rows]


def _brute_force(tokens: dict[int, int], hits: int, c: MissCosts, read: float, link: float) -> tuple[float, set]:
    """The cheapest split over every subset on the CPU (ties: fewer CPU experts), each expert at its
    rows' time from the table read by hand, a second GPU call where hits and fetches meet (or one call
    after the fetches where the hits' reads take less than that call), a forward
    with a fetch at least its hits' reads plus ``fetch_layer_s``, refetch at
    this forward's hit rate, and the hysteresis rule: a split with CPU experts only where it costs at
    most (1 - h) x fetching every miss."""
    h = hits / (hits + len(tokens))
    per = _table_time if c.cpu_rows_s == TABLE else _bumpy_time

    def cost(on_cpu: set) -> float:
        fetched = len(tokens) - len(on_cpu)
        if hits * read < c.gpu_call_s:  # the hits' reads cannot win back a second call: one call after the fetches
            gpu = fetched * link + (hits + fetched) * read
        else:
            gpu = max(hits * read, fetched * link) + fetched * read + (c.gpu_call_s if hits and fetched else 0.0)
        if fetched:  # a forward with any fetch takes at least its hits' reads and fetch_layer_s
            gpu = max(gpu, hits * read + c.fetch_layer_s)
        cpu = c.cpu_margin * (c.cpu_step_s + sum(per(tokens[e]) for e in on_cpu)) if on_cpu else 0.0
        return max(gpu, cpu) + len(on_cpu) * h * link

    fetch_all = cost(set())
    best = min((set(s) for r in range(1, len(tokens) + 1) for s in itertools.combinations(tokens, r)),
               key=lambda s: (cost(s), len(s)))
    return (cost(best), best) if cost(best) <= (1 - c.hysteresis) * fetch_all else (fetch_all, set())


def test_auto_splits_by_the_rows_table_and_second_call_as_brute_force_does_with_and_without_hysteresis():
    gen = torch.Generator().manual_seed(1)
    chosen = 0
    for case in range(300):
        n = int(torch.randint(1, 7, (1,), generator=gen))
        tokens = {e: int(torch.randint(1, 7, (1,), generator=gen))
                  for e in torch.randperm(30, generator=gen)[:n].tolist()}
        hits = int(torch.randint(0, 12, (1,), generator=gen))
        link = float(torch.empty(1).uniform_(0.002, 0.02, generator=gen))
        costs = MissCosts(link_bytes_per_s=1000 / link, cpu_expert_s=0.0, cpu_token_s=0.0,
                          cpu_step_s=float(torch.empty(1).uniform_(0.0, 0.02, generator=gen)), gpu_bytes_per_s=1e6,
                          cpu_margin=1.0 + case % 3 * 0.25, refetch="hit_rate",
                          cpu_rows_s=(TABLE, BUMPY)[case % 4 // 2],
                          hysteresis=0.0 if case % 2 else 0.1, gpu_call_s=(0.0, 0.004, 0.02)[case % 5 % 3],
                          fetch_layer_s=(0.0, 0.012, 0.05)[case % 7 % 3])
        split = split_misses(tokens, 1000, costs, hits)
        want_cost, want_cpu = _brute_force(tokens, hits, costs, 0.001, link)
        assert split.cost_s == pytest.approx(want_cost, rel=1e-12, abs=1e-15)
        assert set(split.cpu) == want_cpu or split.cost_s == pytest.approx(want_cost, rel=1e-12)
        chosen += bool(split.cpu)
    assert 30 < chosen < 270  # both answers occur


def test_offloaded_layout_is_the_backends_rule_over_the_cache_slots_for_this_routing():
    moe = _moe(e=16)
    moe.backend_options = {"memory_budget_bytes": 1 << 16}  # small enough that a long batch is chunked
    off = OffloadedMoE.from_moe(moe, cache_experts=6, prefetch=None, compute_misses_on="gpu")
    plain = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, top_k=2), backend="grouped_mm",
                router="torch", backend_options={"memory_budget_bytes": 1 << 16})  # the slots as a plain layer
    layouts = set()
    for m in (1, 600):
        x = torch.randn(m, 32)
        with torch.no_grad():
            got = off(x, return_stats=True).stats.layout
            want = plain(x, return_stats=True).stats.layout
        assert got == f"{want} over the expert cache (6 slots) via expert_map"
        layouts.add(want)
    assert len(layouts) == 2  # the routing's size changes the answer: it is read, not ignored
    cpu = OffloadedMoE.from_moe(_moe(e=16), cache_experts=2, prefetch=None, compute_misses_on="cpu")
    with torch.no_grad():
        text = cpu(torch.randn(3, 32), return_stats=True).stats.layout
    assert text.startswith(f"{plain(torch.randn(3, 32), return_stats=True).stats.layout} over the expert cache (2 "
                           f"slots)")
    assert "; CPU misses: " in text and cpu.last_stats.cpu_experts > 0


def test_stats_add_keeps_its_own_cpu_rows():
    total = OffloadStats(cpu_experts=1, cpu_tokens=2, cpu_rows=(2,))
    total.add(OffloadStats(cpu_experts=2, cpu_tokens=3, cpu_rows=(1, 2)))
    assert (total.cpu_experts, total.cpu_tokens, total.cpu_rows) == (3, 5, (2,))


def _least_squares_monotone(vals: list[float]) -> list[float]:
    """The least-squares nondecreasing fit by brute force: the optimum is constant on runs of consecutive values
    (each at its run's mean), so try every split into runs and keep the best nondecreasing one."""
    best, best_sse = None, float("inf")
    for cuts in itertools.product((False, True), repeat=len(vals) - 1):
        fit, start = [], 0
        for i in range(len(vals)):
            if i == len(vals) - 1 or cuts[i]:
                run = vals[start:i + 1]
                fit += [sum(run) / len(run)] * len(run)
                start = i + 1
        sse = sum((f - v) ** 2 for f, v in zip(fit, vals))
        if all(a <= b for a, b in zip(fit, fit[1:])) and sse < best_sse:
            best, best_sse = fit, sse
    return best


def test_monotone_rows_pools_adjacent_violators():
    from moekit.offload.calibrate import monotone_rows

    got = monotone_rows({1: 448.0, 2: 491.0, 4: 468.0, 8: 606.0, 16: 572.0, 32: 768.0})  # the H200 grid's, us
    assert got == pytest.approx({1: 448.0, 2: 479.5, 4: 479.5, 8: 589.0, 16: 589.0, 32: 768.0})
    assert monotone_rows({1: 3.0, 2: 2.0, 4: 1.0}) == pytest.approx({1: 2.0, 2: 2.0, 4: 2.0})  # one pool
    rising = {1: 1.0, 3: 1.0, 5: 2.5}
    assert monotone_rows(rising) == rising
    gen = torch.Generator().manual_seed(3)
    for n in (2, 3, 4, 5, 6):  # against the exact least-squares nondecreasing fit: the best feasible pooling
        for _ in range(40):
            vals = torch.rand(n, generator=gen, dtype=torch.float64).tolist()
            got = list(monotone_rows(dict(zip((1, 2, 4, 8, 16, 32), vals))).values())
            assert got == pytest.approx(_least_squares_monotone(vals), abs=1e-12)
