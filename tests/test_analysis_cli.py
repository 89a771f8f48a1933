"""``moekit analyze``: the JSON round-trips and agrees with the library, the tables print, the plot is
written, and ``--measure`` runs the real layer on tiny shapes."""

import json
import time
import tracemalloc

import numpy as np
import pytest
from rich.console import Console

from moekit.analysis.formats import get_format
from moekit.analysis.gpus import GpuSpec, get_gpu
from moekit.analysis.report import DEFAULT_BATCHES, analyze, report_to_json
from moekit.bench.layer_measure import MeasuredRow, Measurement, graph_within_target, host_within_target
from moekit.cli import main
from moekit.cli._analyze_tables import print_measurement
from moekit.config import MoEConfig
from moekit.presets import hf_config_of_preset

from _helpers import cli_error

ROW_KEYS = {"batch", "experts_touched", "flops", "weight_bytes", "intensity", "time_floor_s", "step_time_floor_s"}
TINY = ["--experts", "8", "--top-k", "2", "--hidden", "64", "--moe-intermediate", "32"]


def run_json(capsys, *argv) -> dict:
    assert main(["analyze", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_round_trip(capsys):
    data = run_json(capsys, "--preset", "deepseek-v3", "--gpu", "h100", "--dtype", "fp8")
    json.dumps(data, allow_nan=False)  # strict JSON: an unreachable batch is null, never Infinity or NaN
    assert [r["batch"] for r in data["rows"]] == list(DEFAULT_BATCHES)
    assert all(ROW_KEYS <= set(r) for r in data["rows"])
    assert round(data["half_batch"], 1) == 21.8 and round(data["batch_95"]) == 94
    assert data["ridge_batch"] == pytest.approx(9456, rel=1e-3)
    report = analyze(MoEConfig.preset("deepseek-v3"), get_gpu("h100"), get_format("fp8"),
                     hf_config=hf_config_of_preset("deepseek-v3"), model="deepseek-v3")
    assert data == json.loads(json.dumps(report_to_json(report) | {"measured": None, "offload": None}))
    assert data["bills"]["params"]["total"] == pytest.approx(671e9, rel=0.01)


def test_analyze_takes_the_cli_s_names():
    """``analyze(cfg, "h100", "fp8")`` as a user writes it after ``moekit analyze --gpu h100 --dtype fp8``: the same
    report as with the specs (it failed on ``'str' object has no attribute``), bytes as the closed form says."""
    cfg = MoEConfig.preset("deepseek-v3")
    by_name = analyze(cfg, "h100", "fp8_block", (1, 8))
    assert report_to_json(by_name) == report_to_json(analyze(cfg, get_gpu("h100"), get_format("fp8"), (1, 8)))
    assert by_name.rows[0].cost.weight_bytes == 8 * 3 * 7168 * 2048  # k = 8 experts of w13 + w2 at 1 byte a weight
    with pytest.raises(KeyError, match="gpu must be one of"):
        analyze(cfg, "v100", "fp8")


@pytest.mark.parametrize(("call", "said"), [
    (lambda cfg: analyze(None, "h100", "fp8"), "^config must be a MoEConfig, got NoneType$"),  # was AttributeError
    (lambda cfg: analyze(cfg, "h100", "fp8", 8), r"^batches must be a sequence of ints .*, got 8$"),  # not iterable
    (lambda cfg: analyze(cfg, "h100", "fp8", (1.5,)), r"^batches must be a sequence of ints .*, got \(1.5,\)$"),
])
def test_analyze_names_a_bad_config_or_batches(call, said):
    """A batch of 1.5 tokens was swept as is; a single int and a None config failed inside with Python's messages."""
    with pytest.raises(TypeError, match=said):
        call(MoEConfig.preset("mixtral-8x7b"))
    assert analyze(MoEConfig.preset("mixtral-8x7b"), "h100", "fp8", [np.int64(8)]).rows[0].cost.batch == 8


def test_json_layer_counts(capsys):
    data = run_json(capsys, *TINY, "--batches", "1", "16")
    assert [r["batch"] for r in data["rows"]] == [1, 16]
    assert all(r["step_time_floor_s"] == r["time_floor_s"] for r in data["rows"])  # no layer count: one layer
    assert data["bills"] is None
    data = run_json(capsys, *TINY, "--layers", "10", "--batches", "4")
    assert data["rows"][0]["step_time_floor_s"] == pytest.approx(10 * data["rows"][0]["time_floor_s"])


def test_config_file_and_overrides(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf_config_of_preset("qwen3-30b-a3b")))
    data = run_json(capsys, "--config", str(path), "--bandwidth", "2.0", "--tflops", "500", "--batches", "1")
    assert data["gpu"]["bandwidth_tb_s"] == 2.0 and data["ridge_intensity"] == pytest.approx(250.0)
    assert data["rows"][0]["step_time_floor_s"] == pytest.approx(48 * 8 * 3 * 2048 * 768 / 2.0e12)


def test_tables_print(capsys):
    assert main(["analyze", "--preset", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    for text in ("B½ = 10.7", "B95 = 46.4", "ridge batch", "routed experts", "28.99", "0.5409"):
        assert text in out


def test_bad_arguments(capsys):
    assert "exactly one of" in cli_error(capsys, ["analyze", "--preset", "deepseek-v3", "--experts", "8"])
    assert "go together" in cli_error(capsys, ["analyze", "--experts", "8", "--top-k", "2"])


@pytest.mark.parametrize("argv,message", [
    (["--preset", "deepseek-v3", "--gpus", "0"], "--gpus must be >= 1"),
    (["--preset", "deepseek-v3", "--utilization", "1.5"], "--utilization must be in"),
    (["--preset", "deepseek-v3", "--reserve-gib", "-1"], "--reserve-gib must be >= 0"),
    (["--preset", "deepseek-v3", "--bandwidth", "-1"], "--bandwidth must be positive"),
    ([*TINY, "--layers", "0"], "--layers must be positive"),
    (["--experts", "8", "--top-k", "9", "--hidden", "64", "--moe-intermediate", "32"], "top_k"),
    (["--config", "/nonexistent/config.json"], "No such file"),
    ([*TINY, "--expert-load", "/nonexistent/load.json"], "--expert-load"),
])
def test_bad_numbers_exit_naming_the_flag(argv, message, capsys):
    assert message in cli_error(capsys, ["analyze", *argv])


def test_a_trillion_token_batch_is_cheap(capsys):
    # The padding columns once summed a pmf over every m in 0..B: 1.9 GB at B = 1e8, a crash at 1e12.
    tracemalloc.start()
    start = time.perf_counter()
    data = run_json(capsys, "--preset", "deepseek-v3", "--batches", "1000000000000")
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    row = data["rows"][0]
    assert row["batch"] == 10**12 and row["experts_touched"] == pytest.approx(256)
    assert row["padding_factor"]["128"] == pytest.approx(1 + 256 * 63.5 / (8 * 10**12), rel=1e-12)
    assert elapsed < 10 and peak < 50_000_000


@pytest.mark.parametrize("value", ["0", "-3", "9007199254740993", "1e12", "many"])
def test_bad_batches_exit_2_naming_the_flag_and_the_range(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--preset", "deepseek-v3", "--batches", "8", value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "--batches" in err and "[1, 2^53 = 9007199254740992]" in err and repr(value) in err


def test_plot_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    assert main(["analyze", "--preset", "qwen3-30b-a3b", "--batches", "1", "64", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_measure_tiny(tmp_path, capsys):
    out = tmp_path / "m.png"
    data = run_json(capsys, *TINY, "--batches", "1", "8", "32", "--measure", "--plot", str(out))
    measured = data["measured"]
    assert [r["batch"] for r in measured["rows"]] == [1, 8, 32]
    assert measured["scale"] == 1 and measured["hidden_size"] == 64
    for row in measured["rows"]:
        assert row["time_s"] > 0 and row["predicted_time_s"] > 0
        assert row["graph_s"] is None and row["eager_s"] > 0 and row["host_s"] > 0  # the CPU: no graph
        assert row["time_s"] == row["eager_s"] and row["host_s"] == row["eager_s"]  # one wall clock on the CPU
        assert row["graph_over_floor"] is None and row["graph_within_target"] is None
        assert row["host_rest_s"] is None and row["host_within_target"] is None  # the host does the work
        assert row["eager_over_floor"] == pytest.approx(row["eager_s"] / row["predicted_time_s"])
        assert row["spread_pct"] >= 0 and isinstance(row["noisy"], bool)
        assert 1 <= row["experts_touched"] <= 8
        assert row["predicted_experts_touched"] <= 8 and row["skew_experts_touched"] <= 8
        assert row["padding"]["16"] >= 1
    assert measured["rows"][0]["experts_touched"] == 2  # one token touches exactly k experts
    assert out.stat().st_size > 10_000


def test_unsupported_dtype_on_gpu_is_a_clear_error(capsys):
    assert "no fp8 tensor throughput" in cli_error(capsys, ["analyze", "--preset", "mixtral-8x7b", "--gpu", "a100",
                                                            "--dtype", "fp8"])
    assert "gpu must be one of" in cli_error(capsys, ["analyze", "--preset", "mixtral-8x7b", "--gpu", "tpu"])


def test_expert_load(capsys, tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps([100] * 8))
    uniform = run_json(capsys, *TINY, "--batches", "1", "4")
    balanced = run_json(capsys, *TINY, "--batches", "1", "4", "--expert-load", str(path))
    assert balanced["rows"][1]["experts_touched"] == pytest.approx(uniform["rows"][1]["experts_touched"])
    assert balanced["half_batch"] == pytest.approx(uniform["half_batch"])
    path.write_text(json.dumps([50, 50, 0, 0, 0, 0, 0, 0]))  # 50 tokens, all on experts 0 and 1
    pinned = run_json(capsys, *TINY, "--batches", "4", "--expert-load", str(path))
    assert pinned["rows"][0]["experts_touched"] == pytest.approx(2)
    assert pinned["half_batch"] is None and pinned["routing"].startswith("measured load")
    path.write_text(json.dumps([1, 2, 3]))
    assert "list of 8" in cli_error(capsys, ["analyze", *TINY, "--expert-load", str(path)])


def test_graph_target_is_judged_for_memory_bound_batches_only():
    assert graph_within_target(256, 1.15e-3, 1e-3) is True
    assert graph_within_target(8, 1.2e-3, 1e-3) is False
    assert graph_within_target(512, 1.0e-3, 1e-3) is None  # past B = 256 the GEMMs count: not judged
    assert graph_within_target(8, "RuntimeError: capture failed", 1e-3) is None
    assert graph_within_target(8, None, 1e-3) is None  # the CPU


def test_host_target_is_judged_on_the_calls_after_the_first_up_to_256():
    assert host_within_target(8, 60e-6) is True and host_within_target(256, 59e-6) is True
    assert host_within_target(1, 61e-6) is False
    assert host_within_target(512, 10e-6) is None  # past B = 256: not judged
    assert host_within_target(8, None) is None  # the CPU


def measured_row(batch: int, graph_s, floor_s: float = 1e-4, host_rest_s: float | None = 5e-5) -> MeasuredRow:
    number = graph_s if isinstance(graph_s, float) else None
    return MeasuredRow(batch, 3e-4, 25.0, True, graph_s, 3e-4, 2e-4, floor_s,
                       None if number is None else number / floor_s, 3e-4 / floor_s,
                       graph_within_target(batch, graph_s, floor_s), 2, 2.0, 2.0, {16: 16.0, 128: 128.0},
                       {16: 16.0, 128: 128.0}, host_rest_s, host_within_target(batch, host_rest_s))


def test_measured_times_table_shows_graph_eager_host_and_the_verdict():
    ceilings = GpuSpec("cuda (measured)", 4.0, 140.0, {"bfloat16": 700.0}, "measured in this run")
    rows = [measured_row(1, 1.1e-4), measured_row(64, 1.9e-4, host_rest_s=7e-5), measured_row(4096, 1.0e-4, 2e-5),
            measured_row(128, "RuntimeError: operation not permitted when stream is capturing")]
    m = Measurement("NVIDIA H200", "triton", "bfloat16", 7168, 2048, 1, "routed experts only", ceilings, rows)
    console = Console(width=300, record=True)
    print_measurement(m, console)
    text = console.export_text()
    lines = text.splitlines()
    table = lines[:lines.index(next(line for line in lines if line.startswith("graph: CUDA-graph")))]
    assert max(len(line.rstrip()) for line in table) <= 120
    by_batch = {line.split()[1]: line for line in table if line.startswith("│")}
    assert "110 µs" in by_batch["1"] and by_batch["1"].rstrip(" │").endswith("met")
    assert by_batch["64"].rstrip(" │").endswith("MISSED") and "1.9" in by_batch["64"]
    cells = {b: [c.strip() for c in line.rstrip().split("│")[1:-1]] for b, line in by_batch.items()}
    assert cells["1"][3:5] == ["200 µs", "50 µs"] and cells["1"][-2:] == ["met", "met"]  # host, rest; both verdicts
    assert cells["64"][4] == "70 µs" and cells["64"][-2:] == ["MISSED", "MISSED"]
    assert cells["4,096"][-2:] == ["", ""]  # past B = 256: neither judged
    assert "MISSED" not in by_batch["4,096"] and "met" not in by_batch["4,096"] and "5 " in by_batch["4,096"]
    assert "failed" in by_batch["128"]
    assert "graph capture failed at B=128: RuntimeError: operation not permitted" in text


def test_longcat_config_prints_the_whole_model_bills(capsys, tmp_path):
    """LongCat-Flash's config.json names num_layers, not num_hidden_layers: the bills are read all the same."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.longcat_flash")
    from tests.test_analysis_bills import LONGCAT_TINY, _longcat_by_hand

    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.LongcatFlashConfig(**LONGCAT_TINY).to_dict()))
    data = run_json(capsys, "--config", str(path), "--batches", "1")
    assert "note:" not in capsys.readouterr().err
    assert data["bills"]["params"]["total"] == _longcat_by_hand(LONGCAT_TINY)
    assert data["bills"]["params"]["num_moe_layers"] == 2


def test_expert_load_with_identity_slots(capsys, tmp_path):
    """A LongCat-Flash load file may hold the E + Z counts of MoEStats.choice_counts: the E routed ones are read
    (the byte model keeps k·E/(E+Z) experts a token) and the measured identity share is named beside the modelled."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 2,
                                  "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 3,
                                  "expert_ffn_hidden_size": 16, "ffn_hidden_size": 64, "vocab_size": 100}))
    load = tmp_path / "load.json"
    load.write_text(json.dumps([30, 10, 10, 10, 30, 10]))  # 100 slots: 40% on the identity experts
    both = run_json(capsys, "--config", str(config), "--batches", "2", "--expert-load", str(load))
    assert "identity slots 40.0% measured, 33.3% modelled" in both["routing"]
    load.write_text(json.dumps([30, 10, 10, 10]))
    routed = run_json(capsys, "--config", str(config), "--batches", "2", "--expert-load", str(load))
    assert both["rows"] == routed["rows"]  # the same routed counts: the same model
    load.write_text(json.dumps([30, 10, 10, 10, 30]))
    assert main(["analyze", "--config", str(config), "--expert-load", str(load)]) == 2
    assert "list of 4 (or 6: + identity) token counts" in capsys.readouterr().err


@pytest.mark.parametrize("options", [dict(num_identity_experts=4, renormalize=False, use_correction_bias=True),
                                     dict(scoring="sigmoid", shared_expert_intermediate_size=32,
                                          shared_expert_combine="router"),
                                     dict(shared_expert_intermediate_size=32, shared_expert_combine="average")],
                         ids=["identity", "inkling", "average"])
def test_measure_runs_the_router_options(options):
    """--measure's routed-only layer: identity slots (id -1) are not calibrated as experts and the predicted
    padding takes k·E/(E+Z); a router-weighted or averaged shared expert's combine goes back to "sum" with it."""
    from moekit.analysis.padding import padding_factor
    from moekit.bench.layer_measure import measure

    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2, **options)
    row = measure(cfg, (4,), budget_s=0.02).rows[0]
    assert row.predicted_padding[16] == pytest.approx(padding_factor(4, 8, cfg.routed_slots_per_token, 16))
    assert 1 <= row.experts_touched <= 8


def test_tables_name_the_identity_experts(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 2,
                                  "n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 3,
                                  "expert_ffn_hidden_size": 16, "ffn_hidden_size": 64, "vocab_size": 100}))
    assert main(["analyze", "--config", str(config), "--batches", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at 120 columns
    assert "k=3 (and Z=2 identity experts: 2 experts run a token)" in out


def test_measure_says_what_it_measures_on_a_terminal_only(capsys, monkeypatch):
    """``analyze --measure`` ran 17 s here before its first line: a spinner on stderr now names each step (the
    ceilings, the router's calibration, each batch); through a pipe stderr stays empty and stdout the JSON. The
    spinner redraws ~12 times a second, so a step quicker than that is named to it but may never be drawn: the
    steps are read from its updates, the drawing from the first step's line."""
    import moekit.cli.analyze as analyze_cli

    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # what makes rich take a pipe for a terminal
        monkeypatch.delenv(name, raising=False)
    argv = ["analyze", *TINY, "--batches", "1", "--measure", "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["measured"]["rows"][0]["batch"] == 1
    said, real = [], analyze_cli.working

    def recording(what):  # the real spinner, its updates also kept
        status = real(what)
        update = status.update
        status.update = lambda text, **kw: (said.append(text), update(text, **kw))[1]
        return status

    monkeypatch.setattr(analyze_cli, "working", recording)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then draws as on a terminal
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["measured"]["rows"][0]["batch"] == 1
    assert said == [f"analyze --measure: {step} ..." for step in (
        "the copy bandwidth and matmul rate of cpu", "the router's expert-touch calibration", "batch 1 (1 of 1)")]
    assert "analyze --measure: the copy bandwidth and matmul rate of cpu ..." in err, err




def test_the_parameters_table_says_whether_the_bill_is_exact(capsys, tmp_path):
    """A family billed to the parameter says so; one whose attention is read approximately (AFMoE's gated attention as
    grouped-query) says the bill is approximate and why, in the table and in the JSON."""
    transformers = pytest.importorskip("transformers")
    for model_type, exact in (("mixtral", True), ("afmoe", False)):
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps(transformers.AutoConfig.for_model(model_type).to_dict(), default=str))
        assert main(["analyze", "--config", str(path), "--batches", "1"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        said = "counted to the parameter" if exact else "approximate"
        assert said in text and ("approximate" in text) != exact, model_type
        assert run_json(capsys, "--config", str(path), "--batches", "1")["bills"]["params"]["exact"] is exact


@pytest.mark.parametrize("quantization, dtype", [
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}, "mxfp4"),  # gpt-oss's checkpoints
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8"),  # DeepSeek-V3's
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "int4"),
    ({"quant_method": "awq", "bits": 4}, "int4"),
    ({"quant_method": "bitsandbytes"}, "fp8"),  # a format the byte model has no row for: the default, said
])
def test_a_config_json_s_quantization_config_is_the_default_dtype(quantization, dtype, tmp_path, capsys):
    """A downloaded gpt-oss config.json says its experts are MXFP4: billing it as fp8 unless told (--dtype's old
    default) put 1.9x the expert bytes on its B = 1 floor. Without --dtype the file's format is billed (a format the
    byte model has no row for: the default) and a note on stderr names the file's quant_method; --dtype still
    chooses."""
    fields = dict(hf_config_of_preset("gpt-oss-20b"), quantization_config=quantization)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    assert main(["analyze", "--config", str(path), "--batches", "1", "--json"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["dtype"] == dtype and data["bytes_per_weight"] == get_format(dtype).bytes_per_weight
    assert f"quant_method {quantization['quant_method']!r}" in err
    assert run_json(capsys, "--config", str(path), "--batches", "1", "--dtype", "bf16")["dtype"] == "bf16"
