"""The cache what-if (``moekit.offload.whatif.replay``, ``moekit simulate cache``) and the offload byte
model (``moekit analyze --offload``): the replay predicts what the real layers' cache does on the same
routing, and the byte model's numbers follow from its formulas, written out here."""

from __future__ import annotations

import json

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.analysis.formats import get_format
from moekit.analysis.gpus import get_gpu
from moekit.analysis.offload import offload_cost
from moekit.analysis.touch import experts_touched
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, OffloadStats, link_layers
from moekit.offload.whatif import RoutingTrace, replay
from moekit.sim.cache import cache_what_if, decode_trace

from _helpers import cli_error

E, K, N = 8, 16, 8


@pytest.mark.parametrize("place", ["gpu", "cpu", "auto"])
@pytest.mark.parametrize("prefetch", [None, "previous", "router"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_of_the_layers_own_routing_predicts_their_cache(policy, prefetch, place):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    moes = [MoE(cfg, backend="grouped_mm", router="torch") for _ in range(3)]
    cache = ExpertCache(12, device="cpu", policy=policy)
    # a CPU expert costs about one fetch (3NK floats over 1 GB/s): "auto" splits, "cpu" admits 1-2
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-7, cpu_step_s=3e-7)
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch=prefetch, compute_misses_on=place, costs=costs)
              for m in moes]
    link_layers(layers)
    touched, predicted, tokens = [], [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(3, K, generator=gen)
        step_t, step_p, step_n = [], [[]], []
        for i, moe in enumerate(moes):
            ids = moe.route_tokens(x).routing.topk_ids.flatten().tolist()
            step_t.append(sorted(set(ids)))
            step_n.append({e: ids.count(e) for e in set(ids)})
            if i + 1 < len(moes):
                step_p.append(sorted(set(moes[i + 1].route_tokens(x).routing.topk_ids.flatten().tolist())))
            x = layers[i](x)
        touched.append(step_t)
        predicted.append(step_p)
        tokens.append(step_n)
    bytes_one = 3 * N * K * 4
    predicted_stats = replay(RoutingTrace(E, touched, predicted, tokens), 12, policy, prefetch, place=place,
                             costs=costs, expert_bytes=bytes_one)
    assert predicted_stats.as_dict() | {"bytes_transferred": 0} == cache.stats.as_dict() | {"bytes_transferred": 0}
    if place != "gpu":  # the mode's own behaviour, not an all-fetch cache's
        assert cache.stats.cpu_experts > 0
    assert cache.stats.hits > 0 and (cache.stats.admitted > 0 or place != "cpu")


def test_skewed_streams_hit_more_and_router_prefetch_helps():
    uniform = decode_trace(32, 4, 3, 40, 1, skew=0.0, drift=0.3, seed=0)
    skewed = decode_trace(32, 4, 3, 40, 1, skew=0.7, drift=0.3, seed=0)
    rate = {(name, r.prefetch): r.hit_rate for name, trace in (("u", uniform), ("s", skewed))
            for r in cache_what_if(trace, [0.25], ["lfu"])}
    assert rate["s", "none"] > rate["u", "none"] + 0.1
    assert rate["s", "router"] > rate["s", "none"]
    assert rate["u", "router"] > rate["u", "none"]


def test_uniform_hit_rate_is_the_cache_fraction_by_monte_carlo():
    # Uniform routing, no prefetch: every expert is equally likely to be cached, so h -> C / (E * L).
    trace = decode_trace(16, 2, 2, 400, 1, skew=0.0, drift=1.0, seed=3)
    row = cache_what_if(trace, [0.5], ["lru"])[0]
    assert abs(row.hit_rate - 0.5) < 0.06


def test_offload_byte_model_follows_its_formulas():
    cfg = MoEConfig(hidden_size=7168, moe_intermediate_size=2048, num_experts=256, top_k=8, num_moe_layers=58)
    fmt, gpu = get_format("bf16"), get_gpu("h200")
    c = offload_cost(cfg, 4, fmt, gpu, link_bytes_s=50e9, cache_experts=256 * 58 // 4, cpu_flops=2e12)
    touched = experts_touched(4, 256, 8)
    expert_bytes = 3 * 7168 * 2048 * 2
    assert c.hit_rate == pytest.approx(0.25)
    assert c.missed_experts == pytest.approx(0.75 * touched)
    assert c.link_time_s == pytest.approx(0.75 * touched * expert_bytes / 50e9)
    gpu_s = max(touched * expert_bytes / gpu.bandwidth_bytes_s, 4 * 8 * 6 * 7168 * 2048 / gpu.flops_per_s("bf16"))
    assert c.step_time_s == pytest.approx(58 * max(gpu_s, c.link_time_s))
    cpu_s = 0.75 * touched * (4 * 8 / touched) * 6 * 7168 * 2048 / 2e12
    assert c.step_time_cpu_s == pytest.approx(58 * max(0.25 * gpu_s, cpu_s))


def test_offload_cpu_column_streams_each_missed_experts_bytes():
    # decode on the CPU is bound by the weights' bytes: misses x expert bytes / read rate + a step price
    cfg = MoEConfig(hidden_size=7168, moe_intermediate_size=2048, num_experts=256, top_k=8, num_moe_layers=2)
    fmt, gpu = get_format("bf16"), get_gpu("h200")
    c = offload_cost(cfg, 1, fmt, gpu, link_bytes_s=55e9, cache_experts=128, cpu_read_bytes_s=49e9, cpu_step_s=3e-4)
    expert_bytes = 3 * 7168 * 2048 * 2
    misses = 8 * 0.75  # one token touches 8 experts; a quarter of all experts cached
    assert c.missed_experts == pytest.approx(misses)
    assert c.cpu_time_s == pytest.approx(3e-4 + misses * expert_bytes / 49e9)
    both = offload_cost(cfg, 1, fmt, gpu, link_bytes_s=55e9, cache_experts=128, cpu_read_bytes_s=49e9,
                        cpu_step_s=3e-4, cpu_flops=1e12)
    assert both.cpu_time_s == pytest.approx(c.cpu_time_s + misses * 6 * 7168 * 2048 / 1e12)


def test_analyze_offload_cli(capsys):
    from moekit.cli import main

    assert main(["analyze", "--preset", "mixtral-8x7b", "--gpu", "h200", "--dtype", "bf16", "--offload",
                 "--cache-experts", "64", "--hit-rate", "0.6", "--batches", "1,8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["offload"]
    assert [r["batch"] for r in rows] == [1, 8] and all(r["hit_rate"] == 0.6 for r in rows)
    assert all(r["step_time_cpu_s"] is None for r in rows)
    assert main(["analyze", "--preset", "mixtral-8x7b", "--gpu", "h200", "--dtype", "bf16", "--offload",
                 "--cache-experts", "64", "--hit-rate", "0.6", "--batches", "1", "--cpu-gbps", "49",
                 "--cpu-step-us", "300", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["offload"]
    assert row["cpu_time_s"] == pytest.approx(3e-4 + row["link_time_s"] * 25e9 / 49e9)  # link at the default 25 GB/s
    assert "--cpu-gbps must be positive" in cli_error(
        capsys, ["analyze", "--preset", "mixtral-8x7b", "--offload", "--cpu-gbps", "0"])
    assert "--hit-rate must be in [0, 1]" in cli_error(
        capsys, ["analyze", "--preset", "mixtral-8x7b", "--offload", "--hit-rate", "2"])
    assert "--cache-experts must be in" in cli_error(
        capsys, ["analyze", "--preset", "mixtral-8x7b", "--offload", "--cache-experts", "100000"])


def test_simulate_cache_cli(capsys):
    from moekit.cli import main

    assert main(["simulate", "cache", "--experts", "16", "--top-k", "2", "--layers", "2", "--steps", "10",
                 "--fractions", "0.25,0.5", "--policies", "lru", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["cache_experts"], r["prefetch"]) for r in rows] == [
        (8, "none"), (8, "previous"), (8, "router"), (16, "none"), (16, "previous"), (16, "router")]
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in rows)
    assert "--top-k must be <= --experts" in cli_error(capsys, ["simulate", "cache", "--experts", "4", "--top-k", "6"])
    assert "expected a cache fraction in (0, 1]" in cli_error(capsys, ["simulate", "cache", "--fractions", "1.5"])


def test_bench_offload_tiny_writes_rows(tmp_path, capsys):
    from moekit.cli import main

    assert main(["bench", "--offload", "--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "1,4",
                 "--cache-fractions", "0.5", "--offload-steps", "2"]) == 0
    (path,) = tmp_path.glob("*-offload-*.json")
    doc = json.loads(path.read_text())
    assert {"device", "date", "commit", "link_GBps", "rows"} <= set(doc)
    rows = doc["rows"]
    assert sorted((r["stream"], r["M"], r["policy"], r["prefetch"], r["compute_misses_on"]) for r in rows) == sorted(
        (s, m, pol, pre, p) for s in ("uniform", "skewed") for m in (1, 4) for pol in ("lfu", "lru")
        for pre in (("none", "router") if s == "skewed" else ("none",)) for p in ("gpu", "cpu", "auto"))
    for r in rows:  # every mode: the what-if replays the same cache, decisions and stream
        assert r["hit_rate"] == pytest.approx(r["sim_hit_rate"])
        assert r["x_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        phases = r["cpu_stage_ms"] + r["cpu_wait_ms"] + r["cpu_compute_ms"] + r["cpu_back_ms"]
        assert r["cpu_ms"] == pytest.approx(phases) and (r["cpu_ms"] > 0) == (r["cpu_tokens_per_step"] > 0)
    assert doc["cpu_margin"] >= 1.0 and doc["cpu_threads"] >= 1
    for cell in doc["cells"]:  # per cell: each mode's x floor and auto against the faster pure mode
        same = [r for r in rows if all(r[f] == cell[f] for f in ("stream", "cache_fraction", "policy", "prefetch",
                                                                 "M"))]
        assert cell["x_floor"] == {r["compute_misses_on"]: r["x_floor"] for r in same}
        step = {r["compute_misses_on"]: r["step_ms"] for r in same}
        assert cell["auto_vs_best"] == pytest.approx(step["auto"] / min(step["gpu"], step["cpu"]))
    assert len(doc["cells"]) == len(rows) // 3
    out = capsys.readouterr().out
    assert "auto / better pure mode" in out and "prefetch (router) on skewed streams" in out
    # the CPU price the floor and auto use, as the document records it: every rows point printed
    line = next(x for x in out.splitlines() if x.startswith("CPU µs per expert by its rows: "))
    assert doc["cpu_rows_us"] and all(f"{r}: {us:.0f}" in line for r, us in doc["cpu_rows_us"].items())


def test_bench_offload_tiny_quantized_counts_packed_bytes(tmp_path, capsys):
    from moekit.cli import main

    assert main(["bench", "--offload", "--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "2",
                 "--cache-fractions", "0.5", "--offload-steps", "2", "--offload-dtype", "int8_w8a16"]) == 0
    (path,) = tmp_path.glob("*-offload-int8_w8a16-*.json")
    doc = json.loads(path.read_text())
    k, n = doc["hidden"], doc["inter"]
    assert doc["dtype"] == "int8_w8a16"
    assert doc["expert_bytes"] == (2 * n * k + 2 * n * 4) + (k * n + k * 4)  # int8 q + fp32 row scales, w13 + w2
    for r in doc["rows"]:
        assert r["hit_rate"] == pytest.approx(r["sim_hit_rate"])
    assert "--offload-dtype must be float or one of" in cli_error(
        capsys, ["bench", "--offload", "--tiny", "--device", "cpu", "--offload-dtype", "int3"])


def test_bench_offload_places_and_streams_select_rows(tmp_path, capsys):
    from moekit.cli import main

    assert main(["bench", "--offload", "--tiny", "--device", "cpu", "--out", str(tmp_path), "--batches", "2",
                 "--cache-fractions", "0.5", "--offload-steps", "2", "--offload-places", "gpu",
                 "--offload-streams", "skewed"]) == 0
    (path,) = tmp_path.glob("*-offload-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["stream"], r["prefetch"], r["compute_misses_on"]) for r in rows] == [
        ("skewed", p, "gpu") for _ in ("lfu", "lru") for p in ("none", "router")]
    doc = json.loads(path.read_text())  # the first line says what ran: not DeepSeek-V3's widths, no GPU
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"--tiny: tiny layers (E={doc['experts']}, K={doc['hidden']}, N={doc['inter']}, top-")
    assert "the cache in host memory, no GPU" in first
    with pytest.raises(SystemExit):
        main(["bench", "--offload", "--tiny", "--device", "cpu", "--offload-places", "disk"])
    assert "expected gpu, cpu or auto, got 'disk'" in capsys.readouterr().err


def test_replay_measured_from_a_step_counts_only_the_steps_after_it():
    trace = decode_trace(16, 2, 2, 12, 3, skew=0.3, drift=0.3, seed=0)
    first = RoutingTrace(16, trace.touched[:5], trace.predicted[:5], trace.tokens[:5])
    for prefetch in (None, "previous", "router"):
        whole, warm = replay(trace, 6, "lru", prefetch), replay(first, 6, "lru", prefetch)
        later = replay(trace, 6, "lru", prefetch, measure_from=5)
        assert (later.touched, later.hits, later.fetched, later.prefetched) == (
            whole.touched - warm.touched, whole.hits - warm.hits, whole.fetched - warm.fetched,
            whole.prefetched - warm.prefetched)


def test_bookkeeping_only_moves_experts_in_without_copying_them():
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
              router="torch")
    cache = ExpertCache(3, device="cpu", policy="lru")
    layer = OffloadedMoE.from_moe(moe, cache=cache, prefetch=None)
    stats = OffloadStats()
    with cache.bookkeeping_only():
        cache.ensure(layer.layer_id, [4, 6], stats)
    w13 = cache.slot_weights[0]  # [C, 2N, K]
    slots = cache.cached(layer.layer_id)
    assert set(slots) == {4, 6} and stats.fetched == 2 and stats.bytes_transferred == 2 * 3 * N * K * 4
    assert not any(torch.equal(w13[s], moe.w13[e]) for e, s in slots.items())  # stale: nothing was copied
    cache.release(layer.layer_id, [4, 6])
    cache.ensure(layer.layer_id, [1], stats)  # outside: a real copy
    assert torch.equal(w13[cache.cached(layer.layer_id)[1]], moe.w13[1])


def test_bench_timeline_floor_queues_copies_in_issue_order():
    import dataclasses

    from moekit.bench.offload_floor import sum_floor_s, timeline_s

    # units: one expert's bytes; the link moves one per second (one per 2 s beside CPU work), the GPU
    # reads ten per second, the CPU pays 0.5 s per forward and 2 s per expert
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=2.0, cpu_token_s=0.0, cpu_step_s=0.5, gpu_bytes_per_s=10.0,
                      link_cpu_bytes_per_s=0.5)
    # fetch lands at 1.0, read by 1.1; prefetch queued at 0 -> 3.0
    first = OffloadStats(hits=2, fetched=1, prefetched=2)
    second = OffloadStats(hits=1, cpu_experts=2, cpu_tokens=2, admitted=2)  # admissions behind the prefetch: 3.0 -> 5.0
    # the second layer starts at 1.1; its CPU side ends at 1.1 + 4.5 = 5.6, after its admissions: 5.6
    idle = dataclasses.replace(costs, link_cpu_bytes_per_s=None)  # the link at its idle rate throughout
    assert timeline_s([first, second], 1, idle) == pytest.approx(5.6)
    # beside CPU work its admissions take 2 s each: 3.0 -> 7.0, and its result waits for them
    assert timeline_s([first, second], 1, costs) == pytest.approx(7.0)
    # session 8's floor: max(0.3 read, 1 fetched) + max(0.1 read, 4.5 CPU) = 5.5, above 5 moved experts
    assert sum_floor_s([first, second], 1, costs) == pytest.approx(5.5)
    # the CPU branch as it ran in place of the model: 6.5 s from 1.1 ends at 7.6, after the admissions;
    # 2 s ends at 3.1, so the admissions (7.0) end the step
    assert timeline_s([first, second], 1, idle, measured=[0.0, 6.5]) == pytest.approx(7.6)
    assert timeline_s([first, second], 1, costs, measured=[0.0, 2.0]) == pytest.approx(7.0)
    assert timeline_s([first, second], 1, costs, measured=[0.0, 4.5]) == timeline_s([first, second], 1, costs)
