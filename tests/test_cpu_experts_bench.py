"""``moekit bench --cpu-experts`` on tiny shapes: the CLI end to end (JSON, tables, progress, never
overwriting), its usage errors, the run without transformers, the recorded error of moekit's row
against a float64 loop written here, and the earlier results in benchmarks/results still read."""

import json
from pathlib import Path

import pytest
import torch

from moekit.bench import cpu_measure
from moekit.bench.cpu_report import report_lines, summary_lines
from moekit.cli import main
from moekit.experts.grouped_mm import experts_grouped_mm

from _helpers import cli_error, experts_loop

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
TINY = ["bench", "--cpu-experts", "--shape", "4,8,16,2", "--batches", "1,3", "--repeats", "2"]
ROW_KEYS = {"us", "min_us", "max_us", "spread_pct", "noisy", "repeats", "gflops", "rel_err_vs_hf_eager", "pct_of_dense"}
BATCH_KEYS = {"M", "dense_gflops", "moekit_plan", "moekit_chunk_tokens", "packed_bytes", "rows"}
DOC_KEYS = {"cpu", "date", "commit", "torch", "threads", "shape", "dtype", "repeats", "pack_budget_bytes",
            "loadavg_before", "loadavg_after", "batches"}


def _run(argv: list[str], capsys) -> tuple[Path, str, str]:
    assert main(argv) == 0
    out, err = capsys.readouterr()
    return Path(out.strip().splitlines()[-1].removeprefix("wrote ")), out, err


@pytest.fixture
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # --threads sets the process's count


def test_tiny_cli_run_writes_json_prints_the_tables_and_never_overwrites(tmp_path, capsys, keep_threads):
    pytest.importorskip("transformers")
    first, out, err = _run([*TINY, "--out", str(tmp_path), "--threads", "1"], capsys)
    second, _, _ = _run([*TINY, "--out", str(tmp_path)], capsys)
    assert first.name.endswith(f"-cpu-experts-{json.loads(first.read_text())['date']}.json")
    assert second.name == first.name.replace(".json", "-2.json") and first.exists()
    doc = json.loads(first.read_text())
    assert DOC_KEYS <= set(doc) and doc["threads"] == 1 and doc["shape"] == {"E": 4, "N": 8, "K": 16, "k": 2}
    assert len(doc["loadavg_before"]) == 3 and doc["repeats"] == 2 and [b["M"] for b in doc["batches"]] == [1, 3]
    for batch in doc["batches"]:
        assert BATCH_KEYS <= set(batch)
        assert {*cpu_measure.ROWS, "dense_mm"} <= set(batch["rows"])
        assert all(ROW_KEYS <= set(r) and r["repeats"] == 2 for r in batch["rows"].values())
        errs = [r["rel_err_vs_hf_eager"] for n, r in batch["rows"].items() if not n.startswith("dense")]
        assert all(e is not None and e < 1e-5 for e in errs)
        dense = max(r["gflops"] for n, r in batch["rows"].items() if n.startswith("dense"))
        moekit = batch["rows"]["moekit"]
        assert moekit["pct_of_dense"] == pytest.approx(100 * moekit["gflops"] / dense)
    assert "moekit ms" in out and "transformers best" in out and "best/moekit" in out and "moekit % dense" in out
    for batch in doc["batches"]:  # the summary line per M: moekit ms, the fastest hf row, the ratio
        hf = {n.removeprefix("hf_"): r["us"] / 1e3 for n, r in batch["rows"].items() if n.startswith("hf_")}
        best = min(hf, key=hf.get)
        moekit_ms = batch["rows"]["moekit"]["us"] / 1e3
        line = next(s for s in out.splitlines() if s.split()[:2] == [str(batch["M"]), f"{moekit_ms:.2f}"])
        assert line.split()[2:5] == [best, f"{hf[best]:.2f}", f"{hf[best] / moekit_ms:.2f}x"]
    assert "[1/2] M=1 done" in err and "[2/2] M=3 done" in err and "threads=1" in err


@pytest.mark.parametrize("argv, flag", [
    (["--shape", "4,8,16"], "--shape"),
    (["--shape", "4,8,x,2"], "--shape"),
    (["--shape", "2,8,16,4"], "--shape"),  # k > E
    (["--batches", "0"], "--batches"),
    (["--batches", "1,x"], "--batches"),
    (["--repeats", "0"], "--repeats"),
    (["--threads", "0"], "--threads"),
    (["--backends", "nope"], "--backends"),
    (["--device", "cuda"], "--device"),
    (["--hf"], "--cpu-experts"),
    (["--dtype", "fp8_block"], "--dtype"),
    (["--act-dtype", "float16"], "--act-dtype"),
])
def test_bad_option_names_the_flag(argv, flag, capsys, tmp_path):
    line = cli_error(capsys, ["bench", "--cpu-experts", "--out", str(tmp_path), *argv])
    assert flag in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--shape", "4,8,16,2"], ["--threads", "1"], ["--act-dtype", "bfloat16"]],
                         ids=["shape", "threads", "act_dtype"])
def test_cpu_options_without_cpu_experts_are_refused(argv, capsys, tmp_path):
    line = cli_error(capsys, ["bench", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert argv[0] in line and "--cpu-experts" in line


def test_without_transformers_the_hf_rows_are_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cpu_measure, "transformers_version", lambda: None)
    path, out, err = _run([*TINY, "--out", str(tmp_path)], capsys)
    doc = json.loads(path.read_text())
    assert doc["notes"] == [cpu_measure.NO_TRANSFORMERS] and doc["transformers"] is None
    for batch in doc["batches"]:
        assert set(cpu_measure.MOEKIT_VARIANTS) | {"dense_mm"} <= set(batch["rows"])
        assert not [n for n in batch["rows"] if n.startswith("hf_")]
        assert all(r["rel_err_vs_hf_eager"] is None for r in batch["rows"].values())
    assert "transformers is not installed" in out and "transformers is not installed" in err
    assert [s.split()[2] for s in summary_lines(doc)[1:]] == ["-", "-"]  # no best transformers row


@pytest.mark.parametrize("act_dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_quantized_rows_beside_the_unquantized_ones(tmp_path, capsys, act_dtype, tol):
    path, out, _ = _run([*TINY, "--out", str(tmp_path), "--backends", "moekit", "--act-dtype", act_dtype,
                         "--dtype", "bfloat16,int8_w8a16,int4_w4a16,mxfp4"], capsys)
    doc = json.loads(path.read_text())
    assert doc["schemes"] == ["int8_w8a16", "int4_w4a16", "mxfp4"] and doc["dtype"] == act_dtype
    for batch in doc["batches"]:
        rows = batch["rows"]
        for scheme, kernels in (("int8_w8a16", ["dequant", "int8pack"]), ("int4_w4a16", ["dequant", "int4pack"]),
                                ("mxfp4", ["dequant", "int8pack"])):
            names = [f"{k}[{scheme}]" for k in ("moekit", "dequant_all", *kernels)]
            assert set(names) <= set(rows)
            assert all(rows[n]["rel_err_vs_reference"] < tol for n in names)
            # the packed bytes of the touched experts: less than dequant_all (every expert read, written dense)
            assert rows[names[0]]["weight_bytes"] < rows[names[1]]["weight_bytes"]
        assert rows["moekit"]["rel_err_vs_reference"] is None and rows["moekit"]["weight_bytes"] > 0
    assert "before ms" in out and "after/unq" in out and "dequant_all[mxfp4]" in out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_moekits_recorded_error_agrees_with_a_float64_loop():
    pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(3)
    shape = cpu_measure.ExpertsShape(experts=6, intermediate=12, hidden=24, top_k=3)
    w13, w2 = cpu_measure.expert_weights(shape, gen)
    p = cpu_measure.problem(20, w13, w2, shape.top_k, gen)  # ~10 rows per expert: the packed path runs
    assert all(len(set(row.tolist())) == shape.top_k for row in p.ids)  # k distinct experts per token
    batch = cpu_measure.measure_batch(p, {"moekit", "hf_eager"}, rounds=1)
    truth = experts_loop(p.x, p.w13, p.w2, p.ids, p.weights)
    module, eager = cpu_measure.hf_experts(p.w13, p.w2, shape.top_k)
    with torch.inference_mode():
        moekit = experts_grouped_mm(p.x, p.w13, p.w2, p.ids, p.weights)  # what the moekit row runs
        hf = eager(module, p.x, p.ids.long(), p.weights)  # transformers' own per-expert loop
    e_moekit, e_hf = _rel(moekit, truth), _rel(hf, truth)
    assert e_moekit < 1e-6 and e_hf < 1e-6  # both fp32 roundings of the float64 truth
    recorded = batch["rows"]["moekit"]["rel_err_vs_hf_eager"]
    assert recorded == pytest.approx(_rel(moekit, hf), rel=1e-6, abs=1e-12)
    # their distance is at most the sum of their distances to the truth (norms equal to ~1e-7)
    assert 0 <= recorded <= (e_moekit + e_hf) * (1 + 1e-6)
    assert batch["rows"]["hf_eager"]["rel_err_vs_hf_eager"] == 0.0


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*-cpu-experts-*.json")), ids=lambda p: p.name)
def test_earlier_results_still_read(path):
    doc = json.loads(path.read_text())
    lines = report_lines(doc)
    summary = summary_lines(doc)[1:]
    assert len(summary) == len(doc["batches"]) and all(s in lines for s in summary)
    for batch, line in zip(doc["batches"], summary):
        hf = min(r["us"] for n, r in batch["rows"].items() if n.startswith("hf_"))
        assert line.split()[4] == f"{hf / batch['rows']['moekit']['us']:.2f}x"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*-cpu-quant-*.json")), ids=lambda p: p.name)
def test_quantized_results_still_read(path):
    doc = json.loads(path.read_text())
    lines = report_lines(doc)
    quant = [line for line in lines if line.split()[:1] and line.split()[0] in doc["schemes"]]
    assert len(quant) == len(doc["schemes"]) * len(doc["batches"])
    for line in quant:  # before / after as recorded
        scheme, m = line.split()[:2]
        rows = next(b["rows"] for b in doc["batches"] if b["M"] == int(m))
        assert line.split()[-1] == f"{rows[f'dequant_all[{scheme}]']['us'] / rows[f'moekit[{scheme}]']['us']:.1f}"


def test_interleaved_rounds_vary_each_calls_predecessor():
    # each call timed once a round, after a warm-up round; across rounds a call follows different calls (a rotation
    # would keep one predecessor for ever, and on the CPU the call before shapes the one after)
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in "abcde"}
    timings = cpu_measure.interleaved(calls, rounds=8)
    assert set(timings) == set("abcde")
    rounds = [log[i:i + 5] for i in range(5, len(log), 5)]  # the warm-up round first
    assert len(rounds) == 8 and all(sorted(r) == list("abcde") for r in rounds)
    before = {name: {r[r.index(name) - 1] for r in rounds if r.index(name) > 0} for name in "abcde"}
    assert all(len(previous) >= 2 for previous in before.values()), before
