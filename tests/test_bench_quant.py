"""``moekit bench --dtype``: quantized cells on the CPU (grouped_mm's dequantizing path) beside the
unquantized ones, their floors against the session-5 layout contract written out here, ``vs_bf16``,
the fp8 matmul ceiling, the flag's errors, and the predicted fp8 floor curve in the plot."""

from __future__ import annotations

import json

import pytest
import torch

from moekit.analysis.formats import FORMATS, get_format
from moekit.bench import ceilings, run, sweep
from moekit.bench.ceilings import Ceilings, Fp8MmRate, measure_fp8_mm, with_fp8_mm
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.quant_cells import check_dtypes, quantized_backends
from moekit.bench.report import figure, footnotes, table
from moekit.cli import main
from moekit.quant import quantize

from _helpers import cli_error, experts_loop

ODD = Shape("odd", num_experts=8, n=25, k=40, top_k=2)  # N odd: a packed row's last byte half used; K, N < one group
FIXED = Ceilings(copy_TBps=0.0069, mm_TFLOPs=0.0249, mm_dtype="float32")
FP8_TFLOPS = 0.05
SCHEMES = ["fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4"]


@pytest.fixture(autouse=True)
def two_input_sets(monkeypatch):
    """Two rotated input sets per cell, not eight: the tiny experts sit in cache anyway; time stays short."""
    monkeypatch.setattr(sweep, "ROTATION_BYTES", 0)


@pytest.fixture
def fixed_ceilings(monkeypatch):
    """No ceiling probes (seconds on a busy CPU): fixed CPU-sized rates, fp8 included."""
    monkeypatch.setattr(run, "measure_ceilings", lambda device: FIXED)
    monkeypatch.setattr(ceilings, "measure_fp8_mm", lambda device: Fp8MmRate(FP8_TFLOPS, None))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layout_bytes(scheme: str, rows: int, cols: int) -> int:
    """Bytes of one expert's [R, C] matrix in the session-5 layouts (COMMON.md), scales and zeros included."""
    if scheme == "fp8_block":  # e4m3 q [R, C], fp32 scale [ceil(R/128), ceil(C/128)]
        return rows * cols + 4 * cdiv(rows, 128) * cdiv(cols, 128)
    if scheme == "int8_w8a16":  # int8 q [R, C], fp32 scale [R]
        return rows * cols + 4 * rows
    if scheme == "int4_w4a16":  # uint8 q [R, ceil(C/2)], fp32 scale and uint8 zero [R, ceil(C/128)]
        return rows * cdiv(cols, 2) + (4 + 1) * rows * cdiv(cols, 128)
    assert scheme == "mxfp4"  # uint8 q [R, ceil(C/2)], e8m0 scale [R, ceil(C/32)]
    return rows * cdiv(cols, 2) + rows * cdiv(cols, 32)


def test_quantized_cells_floor_is_the_packed_bytes(fixed_ceilings):
    doc = run.run_bench(torch.device("cpu"), shapes=[ODD], batches=[1, 64],
                        dtypes=["fp8", "int8_w8a16", "int4", "mxfp4"],
                        budget_s=0.01)
    n, k, top_k = ODD.n, ODD.k, ODD.top_k
    assert [c["dtype"] for c in doc["cells"] if c["M"] == 1] == ["float32", "float32", *SCHEMES]
    # the unquantized cells run every CPU backend; the quantized ones grouped_mm's dequantizing path only
    assert {(c["dtype"], c["backend"]) for c in doc["cells"] if c["M"] == 64} == {
        ("float32", "grouped_mm"), ("float32", "reference"), *((s, "grouped_mm") for s in SCHEMES)}
    for c in doc["cells"]:
        if c["dtype"] == "float32":
            expert = 3 * n * k * 4
        else:
            expert = layout_bytes(c["dtype"], 2 * n, k) + layout_bytes(c["dtype"], k, n)  # w13 [2N, K] + w2 [K, N]
        nbytes = c["experts_touched"] * expert + 2 * c["M"] * k * 4  # + x read and out written, float32
        flops = 6 * n * k * c["M"] * top_k
        rate = FP8_TFLOPS if c["dtype"] == "fp8_block" else FIXED.mm_TFLOPs
        assert c["bytes"] == pytest.approx(nbytes) and c["flops"] == flops
        assert c["floor_us"] == pytest.approx(max(nbytes / (FIXED.copy_TBps * 1e12), flops / (rate * 1e12)) * 1e6)
        assert c["mm_dtype"] == ("float8_e4m3fn" if c["dtype"] == "fp8_block" else "float32")
        assert c["pct_floor"] == pytest.approx(100 * c["floor_us"] / c["us"])
    assert doc["ceilings"]["fp8_mm_TFLOPs"] == FP8_TFLOPS and doc["ceilings"]["fp8_mm_error"] is None
    floors = {(c["M"], c["dtype"]): c["floor_us"] for c in doc["cells"]}
    assert floors[(1, "mxfp4")] < floors[(1, "int8_w8a16")] < floors[(1, "float32")]  # decode: fewer bytes
    assert floors[(64, "fp8_block")] < floors[(64, "int8_w8a16")]  # compute-bound: the fp8 rate is the higher


def test_vs_bf16_and_the_error_against_the_unquantized_output(fixed_ceilings, tmp_path):
    doc = run.run_bench(torch.device("cpu"), shapes=[ODD], batches=[1, 64], backends=["grouped_mm"],
                        dtypes=["int8_w8a16"], budget_s=0.01)
    cells = {(c["M"], c["dtype"]): c for c in doc["cells"]}
    w = make_weights(ODD, torch.float32, torch.device("cpu"))
    q13, q2 = quantize(w.w13, "int8_w8a16").dequantize(), quantize(w.w2, "int8_w8a16").dequantize()
    for m in (1, 64):
        base, quant = cells[(m, "float32")], cells[(m, "int8_w8a16")]
        assert base["vs_bf16"] is None and base["rel_err_vs_bf16"] is None
        assert quant["vs_bf16"] == pytest.approx(quant["us"] / base["us"])
        s = make_sets(ODD, m, 1, torch.float32, torch.device("cpu"))[0]  # the bench's first input set
        ref = experts_loop(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights)
        err = ((experts_loop(s.x, q13, q2, s.topk_ids, s.topk_weights) - ref).norm() / ref.norm()).item()
        assert quant["rel_err_vs_bf16"] == pytest.approx(err, rel=1e-3)
    ratios = [cells[(m, "int8_w8a16")]["vs_bf16"] for m in (1, 64)]
    assert doc["summary"]["geomean_time_vs_bf16"]["int8_w8a16"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    back = json.loads(path.read_text())
    assert {"device", "date", "commit", "dtype", "ceilings", "method", "shapes", "cells", "summary"} <= back.keys()
    assert "vs_bf16 = us / the unquantized cell's us" in back["method"]
    rows = table(back).columns[3]._cells  # the dtype column
    assert rows == ["float32", "int8_w8a16", "float32", "int8_w8a16"]
    assert any("No peer in this bench takes quantized weights" in note for note in footnotes(back))


def test_fp8_ceiling_measured_or_its_error_recorded(monkeypatch):
    rate = measure_fp8_mm(torch.device("cpu"), 64, budget_s=0.01)
    assert rate.TFLOPs > 0 and rate.error is None

    def no_fp8(*args, **kwargs):
        raise RuntimeError("_scaled_mm: no fp8 kernel for this device\nsecond line")

    monkeypatch.setattr(torch, "_scaled_mm", no_fp8)
    assert measure_fp8_mm(torch.device("cpu"), 64) == Fp8MmRate(None,
                                                                "RuntimeError: _scaled_mm: no fp8 kernel for this "
                                                                "device")
    failed = with_fp8_mm(FIXED, torch.device("cpu"), wanted=True)
    assert failed.fp8_mm_TFLOPs is None and failed.fp8_mm_error.startswith("RuntimeError")
    skipped = with_fp8_mm(FIXED, torch.device("cpu"), wanted=False)
    assert skipped.fp8_mm_TFLOPs is None and skipped.fp8_mm_error.startswith("not measured")


def test_fp8_cells_without_an_fp8_rate_say_which_rate_they_use(monkeypatch):
    monkeypatch.setattr(run, "measure_ceilings", lambda device: FIXED)
    monkeypatch.setattr(ceilings, "measure_fp8_mm", lambda device: Fp8MmRate(None, "RuntimeError: none here"))
    doc = run.run_bench(torch.device("cpu"), shapes=[ODD], batches=[64], backends=["grouped_mm"],
                        dtypes=["fp8_block"], budget_s=0.01)
    (fp8,) = [c for c in doc["cells"] if c["dtype"] == "fp8_block"]
    assert fp8["mm_dtype"] == "float32" and fp8["floor_us"] == pytest.approx(6 * 25 * 40 * 64 * 2 / 0.0249e6)
    assert any(note.startswith("No fp8 matmul rate (RuntimeError: none here)") for note in footnotes(doc))


def test_dtype_names_and_aliases():
    assert check_dtypes(None) == ["bfloat16"]
    assert check_dtypes(["fp8", "int8_w8a16", "fp8_block"]) == ["bfloat16", "fp8_block", "int8_w8a16"]
    assert check_dtypes(["mxfp4", "bf16"]) == ["bfloat16", "mxfp4"]
    with pytest.raises(ValueError, match=r"^dtype: unknown 'fp4'; must be among \['bfloat16', 'fp8_block'"):
        check_dtypes(["fp4"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device types only: nothing runs
    assert quantized_backends(["triton", "grouped_mm", "reference"], cuda, explicit=False) == ["triton"]
    # never a per-call dequantize
    assert quantized_backends(["grouped_mm", "triton"], cuda, explicit=True) == ["triton"]
    assert quantized_backends(["grouped_mm", "reference"], cuda, explicit=True) == []  # check_args refuses this
    assert quantized_backends(["grouped_mm", "reference"], cpu, explicit=False) == ["grouped_mm"]
    assert quantized_backends(["grouped_mm", "reference"], cpu, explicit=True) == ["grouped_mm", "reference"]
    assert FORMATS["mxfp4"].bytes_per_weight == 0.5 + 1 / 32 and FORMATS["int8"].bytes_per_weight == 1.0
    assert get_format("int4_w4a16") is FORMATS["int4"] and get_format("bfloat16") is FORMATS["bf16"]


def synthetic_doc() -> dict:
    """A GPU-sized results document (no run): DeepSeek-V3's experts, bf16 and fp8 triton cells."""
    shape = {"name": "deepseek-v3", "num_experts": 256, "n": 2048, "k": 7168, "top_k": 8}
    ceil = {"copy_TBps": 4.2, "mm_TFLOPs": 716.0, "mm_dtype": "bfloat16", "fp8_mm_TFLOPs": 1400.0, "fp8_mm_error": None}
    cells = []
    for m, bf16_us, fp8_us in ((1, 80.0, 60.0), (64, 2900.0, 1700.0), (4096, 9000.0, 7000.0)):
        for dtype, us in (("bfloat16", bf16_us), ("fp8_block", fp8_us)):
            cells.append({"shape": "deepseek-v3", "M": m, "backend": "triton", "dtype": dtype, "us": us,
                          "floor_us": us / 2, "pct_floor": 50.0, "noisy": False, "spread_pct": 1.0,
                          "pct_copy_bw": 50.0, "pct_mm": 1.0, "experts_touched": 8.0,
                          "vs_bf16": fp8_us / bf16_us if dtype == "fp8_block" else None})
    return {"device": "NVIDIA H200", "commit": "0" * 40, "dtype": "bfloat16", "ceilings": ceil,
            "noisy_spread_pct": 20.0, "cpu_threads": 16, "shapes": [shape], "cells": cells, "summary": {}}


def test_plot_draws_the_predicted_fp8_floor_beside_the_measured_points():
    import matplotlib.pyplot as plt

    doc = synthetic_doc()
    fig = figure(doc)
    lines = {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}
    measured = lines["fp8_block, measured"]
    assert list(measured.get_xdata()) == [1, 64, 4096] and list(measured.get_ydata()) == [60.0, 1700.0, 7000.0]
    predicted = lines["fp8_block predicted floor (analyze --dtype fp8)"]
    batches = [int(b) for b in predicted.get_xdata()]
    assert batches[0] == 1 and batches[-1] == 4096 and batches == sorted(set(batches)) and len(batches) > 10
    e, n, k, top_k = 256, 2048, 7168, 8
    for b, floor_us in zip(batches, predicted.get_ydata()):
        touched = e * (1 - (1 - top_k / e) ** b)  # uniform routing, k distinct experts per token
        weight_s = touched * 3 * n * k * 1.0 / 4.2e12  # one byte per fp8 weight at the run's copy bandwidth
        compute_s = 6 * n * k * b * top_k / 1400e12  # at the run's fp8 matmul rate
        assert floor_us == pytest.approx(max(weight_s, compute_s) * 1e6)
    assert measured.get_color() == predicted.get_color()  # one colour per dtype
    notes = footnotes(doc)
    assert any("--dtype fp8 --bandwidth 4.2 --tflops 1400" in note for note in notes)
    plt.close(fig)
    plain = {**doc, "cells": [c for c in doc["cells"] if c["dtype"] == "bfloat16"]}
    fig = figure(plain)  # no quantized cells: the one row of time / floor panels, as before --dtype
    assert len(fig.axes) == 1 and [line.get_label() for line in fig.axes[0].get_lines()][0] == "triton"
    plt.close(fig)


def test_bench_cli_dtype_on_cpu(tmp_path, capsys, fixed_ceilings):
    argv = ["bench", "--device", "cpu", "--shapes", "mixtral-8x7b", "--batches", "1", "--backends", "grouped_mm",
            "--dtype", "int8_w8a16", "--budget-s", "0.01", "--out", str(tmp_path), "--no-plot"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-*.json")
    cells = json.loads(path.read_text())["cells"]
    assert [(c["dtype"], c["backend"]) for c in cells] == [("float32", "grouped_mm"), ("int8_w8a16", "grouped_mm")]
    assert cells[1]["vs_bf16"] == pytest.approx(cells[1]["us"] / cells[0]["us"])
    out = capsys.readouterr()
    assert "xbf16" in out.out and "int8_w8a16" in out.out
    assert "[2/2] mixtral-8x7b/16 M=1 grouped_mm int8_w8a16: " in out.err


@pytest.mark.parametrize("argv,message", [
    (["--dtype", "fp4"], "--dtype: unknown 'fp4'; must be among ['bfloat16', 'fp8_block', 'int8_w8a16'"),
    (["--dtype", "bfloat16", "--budget-s", "0"], "--budget-s: expected a positive number"),
    (["--hf", "--dtype", "fp8_block"], "--dtype and --budget-s apply to the kernel cells (--dtype also to "
                                       "--cpu-experts), not to --hf"),
    (["--cpu-experts", "--budget-s", "1"], "not to --cpu-experts"),
])
def test_bad_dtype_or_budget_is_refused_naming_the_flag(argv, message, capsys):
    assert message in cli_error(capsys, ["bench", "--device", "cpu", *argv])


def test_analyze_takes_the_scheme_names_as_aliases(capsys):
    def analyze_json(dtype: str) -> dict:
        assert main(["analyze", "--preset", "deepseek-v3", "--dtype", dtype, "--batches", "1,64", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert analyze_json("fp8_block") == analyze_json("fp8")
    mxfp4 = analyze_json("mxfp4")
    assert mxfp4["dtype"] == "mxfp4" and mxfp4["bytes_per_weight"] == 0.5 + 1 / 32
    assert "--dtype: dtype must be one of" in cli_error(capsys,
                                                        ["analyze", "--preset", "deepseek-v3", "--dtype", "fp4"])
