"""benchmarks/cpu_experts.py on a tiny shape: every row runs, errors are small, files never overwrite."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_experts.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cpu_experts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_json_and_never_overwrites(tmp_path, capsys):
    bench = load_script()
    args = ["--shape", "4,8,16,2", "--batches", "1,3", "--repeats", "2", "--out-dir", str(tmp_path)]
    first, second = bench.main(args), bench.main(args)
    assert first != second and first.exists() and second.name.endswith("-2.json")
    doc = json.loads(first.read_text())
    assert doc["threads"] >= 1 and len(doc["loadavg_before"]) == 3 and [b["M"] for b in doc["batches"]] == [1, 3]
    rows = doc["batches"][1]["rows"]
    expected = {*bench.MOEKIT_VARIANTS, "hf_grouped_mm", "hf_batched_mm", "hf_eager", "dense_mm"}
    assert expected <= set(rows)
    assert all(r["rel_err_vs_hf_eager"] < 1e-5 for r in rows.values() if r["rel_err_vs_hf_eager"] is not None)
    assert doc["batches"][0]["moekit_plan"] == "contiguous"
    assert "implementation" in capsys.readouterr().out
