"""The bench harness and the tuner on the CPU: the byte model, the results document, the CLI, and the
tuner's search and resume (with a fake timer: the kernels themselves are tested elsewhere)."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from moekit.bench import tuning
from moekit.bench.cells import Shape, cell_model, measured_experts_touched, uniform_routing
from moekit.bench.report import plot, results_path, table, write_json
from moekit.bench.run import Cell, geomean_speedup, run_bench
from moekit.bench import timing
from moekit.bench.timing import NOISY_SPREAD_PCT, host_from_idle, time_calls
from moekit.cli import main
from moekit.experts.configs import KernelConfig, config_file_name, load_configs

from _helpers import cli_error

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)


def test_cell_model_counts_touched_experts_and_activations():
    model = cell_model(TINY, 4, touched=3, element_size=2, copy_TBps=1.0, mm_TFLOPs=1.0)
    assert model.bytes == 3 * (3 * 24 * 40 * 2) + 2 * 4 * 40 * 2  # weights of 3 experts + x read + out written
    assert model.flops == 6 * 24 * 40 * 4 * 2
    assert model.floor_us == pytest.approx(max(model.bytes, model.flops) / 1e12 * 1e6)


def test_uniform_routing_is_seeded_and_distinct():
    routing = uniform_routing(64, TINY, torch.device("cpu"), seed=3)
    ids, w = routing.topk_ids, routing.topk_weights
    ids2 = uniform_routing(64, TINY, torch.device("cpu"), seed=3).topk_ids
    assert torch.equal(ids, ids2) and ids.dtype == torch.int32
    assert all(len(set(row.tolist())) == TINY.top_k for row in ids)  # k distinct experts per token
    torch.testing.assert_close(w.sum(1), torch.ones(64))
    assert measured_experts_touched(torch.tensor([[0, 3], [3, 5]]), 8) == 3


def test_time_calls_cpu():
    a = torch.randn(64, 64)
    assert time_calls([lambda: a @ a], torch.device("cpu"), budget_s=0.01) > 0


def test_host_from_idle_divides_each_sample_by_its_calls(monkeypatch):
    clock = [0.0]  # seconds; each call of fn advances it by its sample's cost
    costs = iter([3e-6] * 4 + [5e-6] * 4 + [2e-6] * 4)  # 3 samples of 4 calls

    def fn():
        clock[0] += next(costs)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    got = host_from_idle(fn, torch.device("cpu"), calls=4, samples=3)
    assert got == pytest.approx([3.0, 5.0, 2.0])  # µs per call
    assert next(costs, None) is None  # exactly calls * samples calls


def test_run_bench_document(tmp_path):
    doc = run_bench(torch.device("cpu"), shapes=[TINY], batches=[1, 5], backends=["grouped_mm", "reference"])
    assert {"device", "date", "commit", "ceilings", "cells"} <= doc.keys()
    assert doc["ceilings"]["copy_TBps"] > 0 and doc["ceilings"]["mm_TFLOPs"] > 0
    assert {(c["M"], c["backend"]) for c in doc["cells"]} == {(1, "grouped_mm"), (1, "reference"), (5, "grouped_mm"),
                                                              (5, "reference")}
    assert doc["noisy_spread_pct"] == NOISY_SPREAD_PCT and doc["cpu_threads"] >= 1
    for c in doc["cells"]:
        assert {"shape", "M", "backend", "us", "bytes", "flops", "floor_us"} <= c.keys()
        assert c["pct_floor"] == pytest.approx(100 * c["floor_us"] / c["us"])
        assert c["repeats"] >= 5 and c["spread_pct"] >= 0 and c["noisy"] == (c["spread_pct"] > NOISY_SPREAD_PCT)
        assert 0 < c["min_us"] <= c["us"] <= c["max_us"]
        # one wall clock on the CPU
        assert c["eager_us"] == c["host_rest_us"] == c["us"] and c["host_us"] == c["us"] > 0
    path = write_json(doc, results_path(tmp_path, doc))
    assert path.name == f"cpu-{doc['date']}.json" and json.loads(path.read_text())["cells"]
    assert plot(doc, path.with_suffix(".png")).stat().st_size > 0
    assert table(doc).row_count == 4


def test_geomean_speedup():
    def cell(m, backend, us, dtype="bfloat16"):
        return Cell("s", m, backend, dtype, us, min_us=us, max_us=us, spread_pct=0.0, noisy=False, repeats=5,
                    eager_us=us, host_us=us, experts_touched=1, bytes=1, flops=1, floor_us=1, pct_floor=1,
                    pct_copy_bw=1, tflops=1, pct_mm=1, graph=False, mm_dtype="bfloat16")

    cells = [cell(1, "triton", 1.0), cell(1, "grouped_mm", 2.0), cell(2, "triton", 1.0), cell(2, "grouped_mm", 8.0)]
    assert geomean_speedup(cells) == pytest.approx(4.0)
    # a quantized cell pairs only with its own dtype: triton int8 at M=1 has no grouped_mm partner
    assert geomean_speedup([*cells, cell(1, "triton", 100.0, "int8_w8a16")]) == pytest.approx(4.0)
    assert geomean_speedup([cell(1, "grouped_mm", 1.0)]) is None


def test_bench_cli_on_cpu(tmp_path, capsys):
    rc = main(["bench", "--device", "cpu", "--shapes", "mixtral-8x7b", "--batches", "1",
               "--backends", "grouped_mm", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    (path,) = tmp_path.glob("cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["cells"][0]["shape"] == "mixtral-8x7b/16" and "copy_TBps" in doc["ceilings"]


def test_bench_cli_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    """The JSON is written and the skipped PNG is a line naming the extra, not a silence."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # how a missing package fails to import
    rc = main(["bench", "--device", "cpu", "--shapes", "mixtral-8x7b", "--batches", "1",
               "--backends", "grouped_mm", "--budget-s", "0.01", "--out", str(tmp_path)])
    assert rc == 0 and len(list(tmp_path.glob("cpu-*.json"))) == 1 and not list(tmp_path.glob("*.png"))
    assert 'no plot: needs matplotlib, which is not installed: pip install "moekit[plot]"' in capsys.readouterr().out


@pytest.mark.parametrize("argv,flag", [
    (["tune", "--preset", "nope"], "--preset"),
    (["tune", "--shape", "64,1408,2048"], "--shape"),
    (["tune", "--shape", "8,a,4,2"], "--shape"),
    (["tune", "--shape", "8,16,16,9"], "--shape"),
])
def test_cli_bad_arguments_name_the_flag(argv, flag, capsys):
    assert flag in cli_error(capsys, argv)


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "mixtral-8x8b"], "--shapes: shape must be one of"),
    (["--backends", "grouped-mm"], "--backends: unknown ['grouped-mm']; must be among"),
    (["--batches", "0,8"], "--batches"),
    (["--device", "tpu"], "--device"),
])
def test_bench_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    assert message in cli_error(capsys, ["bench", "--device", "cpu", *argv])


def test_tuner_search_and_resume(tmp_path, monkeypatch):
    timed = []

    def fake_timer(shape, num_tokens, scheme, device, weights):
        def measure(configs: list[KernelConfig]) -> list[float]:  # cheapest: up BLOCK_N 64, down BLOCK_K 256
            timed.extend(configs)
            return [10 + abs(cfg.up.BLOCK_N - 64) + abs(cfg.down.BLOCK_K - 256) / 64 for cfg in configs]
        return measure

    monkeypatch.setattr(tuning, "_timer", fake_timer)
    path = tuning.tune(TINY, [1, 64], torch.bfloat16, device="cpu", out_dir=tmp_path, budget_s=0.0)
    partial = path.with_suffix(".partial.json")
    assert json.loads(partial.read_text())["configs"].keys() == {"1"}  # the budget stopped it after one M
    first = len(timed)
    path = tuning.tune(TINY, [1, 64], torch.bfloat16, device="cpu", out_dir=tmp_path)
    assert not partial.exists() and path.name == config_file_name(8, 24, 40, torch.bfloat16, "cpu")
    assert len(timed) > first and all(c.BLOCK_M >= 16 for c in timed[first:])  # M=1 was not tuned again
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    configs = load_configs(8, 24, 40, torch.bfloat16, "cpu")
    assert configs[1].up.BLOCK_N == 64 and configs[1].down.BLOCK_K == 256
    measured = json.loads(path.read_text())["measured"]
    assert measured["64"]["us"] <= measured["64"]["heuristic_us"]
    # Retuning one M keeps the file's other entries.
    before = load_configs(8, 24, 40, torch.bfloat16, "cpu")
    tuning.tune(TINY, [1024], torch.bfloat16, device="cpu", out_dir=tmp_path)
    after = load_configs(8, 24, 40, torch.bfloat16, "cpu")
    assert set(after) == {1, 64, 1024} and after[1] == before[1] and after[64] == before[64]


def test_block_m_candidates():
    assert tuning.block_m_candidates(1, Shape("q", 128, 768, 2048, 8)) == [16]  # naive: one row per block
    cands = tuning.block_m_candidates(1024, Shape("q", 128, 768, 2048, 8))  # 64 rows per expert
    assert 64 in cands and all(16 <= b <= 128 for b in cands)
    assert math.prod(len(tuning.tile_candidates(b, w)) for b in (16, 128) for w in ("up", "down")) > 0
