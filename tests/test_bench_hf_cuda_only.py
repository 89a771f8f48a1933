"""``moekit bench --hf`` on a CPU leaves transformers' CUDA-only experts implementations (deepgemm, sonicmoe: their
modules' requirements say CUDA) out of its default list; named, such a row says why it was not attempted instead of
recording the failed attempt's error."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is part of the test extras")

from moekit.bench.hf_models import experts_implementations, select_impls  # noqa: E402
from moekit.cli import main  # noqa: E402

CUDA_ONLY = {"deepgemm", "sonicmoe"}


def test_the_default_list_on_a_cpu_leaves_the_cuda_only_ones_out():
    known = set(experts_implementations())
    assert CUDA_ONLY <= known  # transformers 5.25 registers both: the check below can fail
    on_cpu = select_impls(None, device=torch.device("cpu"))
    assert not CUDA_ONLY & set(on_cpu) and {"eager", "moekit", "grouped_mm", "batched_mm"} <= set(on_cpu)
    assert CUDA_ONLY <= set(select_impls(None, device=torch.device("cuda")))  # the GPU's default keeps them
    assert select_impls(["sonicmoe"], device=torch.device("cpu")) == ["eager", "sonicmoe"]  # named: kept


def _run(tmp_path, *impls: str) -> dict:
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--layers", "1", "--decode-tokens",
            "2", "--prefill-len", "4", "--repeats", "1", "--no-compile", "--out", str(tmp_path)]
    assert main(argv + (["--hf-impls", ",".join(impls)] if impls else [])) == 0
    (path,) = tmp_path.glob("cpu-hf-*.json")
    return json.loads(path.read_text())


def test_tiny_cpu_run_by_default_has_no_cuda_only_rows(tmp_path, capsys):
    doc = _run(tmp_path)
    impls = {row["impl"] for row in doc["rows"]}
    assert not CUDA_ONLY & impls and {"eager", "moekit", "grouped_mm"} <= impls
    for row in doc["rows"]:  # every row that ran measured, none failed
        assert row["errors"] == {}, row
    assert "deepgemm" not in capsys.readouterr().out


def test_a_named_cuda_only_implementation_says_why_it_did_not_run(tmp_path, capsys):
    doc = _run(tmp_path, "deepgemm")
    (row,) = [row for row in doc["rows"] if row["impl"] == "deepgemm"]
    assert row["decode_tok_s"] is None
    assert row["errors"]["decode_tok_s"].startswith("NotOnCPU: transformers' deepgemm runs on CUDA only")
    assert row["errors"]["decode_tok_s"].endswith("not attempted")
