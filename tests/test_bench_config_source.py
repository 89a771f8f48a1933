"""``moekit bench`` names the tuned file that served each triton cell (``bench.config_source``): the device's own, a
sibling's ("NVIDIA_H200 (sibling)"), or "heuristic", in the JSON and the table, with a footnote where a sibling
served. The sweep runs interpreted at a tiny shape; the sibling case fakes the CUDA queries."""

from __future__ import annotations

import json

import torch

from _config_dirs import config_dirs  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.bench.cells import Shape
from moekit.bench.config_source import cell_config_source
from moekit.bench.report import SIBLING_NOTE, footnotes, table
from moekit.bench.run import run_bench
from moekit.experts.configs import GemmTile, KernelConfig, config_file_name, write_configs

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)


def _write(directory, dtype, device: str) -> None:
    e, n, k = TINY.num_experts, TINY.n, TINY.k
    write_configs(directory / config_file_name(e, n, k, dtype, device), e, n, k, dtype, device,
                  {1: KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))})


def test_the_sweep_names_the_file_of_each_triton_cell(config_dirs):
    doc = run_bench(torch.device("cpu"), shapes=[TINY], batches=[1], backends=["triton", "grouped_mm"],
                    budget_s=0.01)
    by_backend = {c["backend"]: c["config"] for c in doc["cells"]}
    assert by_backend == {"triton": "heuristic", "grouped_mm": None}
    _write(config_dirs["user"], torch.float32, "cpu")
    doc = run_bench(torch.device("cpu"), shapes=[TINY], batches=[1], backends=["triton"], budget_s=0.01)
    assert [c["config"] for c in doc["cells"]] == ["cpu"]
    rendered = table(doc)
    assert rendered.columns[-1].header == "config" and list(rendered.columns[-1].cells) == ["cpu"]
    assert SIBLING_NOTE not in footnotes(doc) and json.dumps(doc)


def test_a_sibling_file_is_named_as_such(config_dirs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    _write(config_dirs["packaged"], torch.bfloat16, "NVIDIA_H200")
    assert cell_config_source(TINY, 64, "bfloat16", cuda) == "NVIDIA_H200 (sibling)"
    assert cell_config_source(TINY, 64, "fp8_block", cuda) == "heuristic"  # no fp8 file of this shape anywhere
    assert cell_config_source(TINY, 64, "int4_w4a16", cuda) is None  # the weight-only route: tables first
    monkeypatch.setenv("MOEKIT_SIBLING_CONFIGS", "0")
    assert cell_config_source(TINY, 64, "bfloat16", cuda) == "heuristic"
    doc = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "cells": [
        {"shape": "tiny", "M": 64, "backend": "triton", "us": 2.0, "floor_us": 1.0, "pct_floor": 50.0,
         "pct_copy_bw": 50.0, "pct_mm": 1.0, "experts_touched": 8, "config": "NVIDIA_H200 (sibling)"}]}
    assert SIBLING_NOTE in footnotes(doc)
    assert list(table(doc).columns[-1].cells) == ["NVIDIA_H200 (sibling)"]
