"""``moekit bench --hf`` on the CPU: a ``--tiny`` run through the CLI (the same code path as the GPU run,
tiny widths), the pieces it is made of, and its argument checks."""

from __future__ import annotations

import copy
import json
import logging
import math
import re

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is part of the test extras")

from moekit.bench import hf_fp64, hf_measure  # noqa: E402
from moekit.bench.hf_models import (  # noqa: E402
    build_model, experts_implementations, gathered_weight_bytes, hf_config, select_impls,
)
from moekit.bench.hf_report import hf_results_path, hf_table, step_lost_in_noise  # noqa: E402
from moekit.bench.hf_run import (  # noqa: E402
    CompiledRows, Row, default_options, float64_decode_errors, make_inputs, run_hf_bench,
)
from moekit.cli import main  # noqa: E402

from _helpers import cli_error  # noqa: E402

ROW_FIELDS = {"impl", "mode", "decode_tok_s", "step_tok_s", "prefill_ms", "logits_rel_err_vs_eager",
              "logits_rel_err_vs_fp64", "compile_graphs", "compile_graph_breaks", "recompiles",
              "errors"}
FP32_TOL = 1e-5  # design.md: an fp32 backend within 1e-5 relative L2 of a float64 reference


def _number_or_error(row: dict, metric: str) -> bool:
    value, error = row[metric], row["errors"].get(metric)
    return (isinstance(value, float) and error is None) or (value is None and isinstance(error, str) and error)


def test_bench_hf_tiny_cli(tmp_path, capsys):
    (tmp_path / "cpu-hf-2000-01-01.json").write_text("{}")  # an older run's file stays untouched
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--hf-impls", "moekit",
            "--layers", "1", "--decode-tokens", "3", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = [p for p in tmp_path.glob("cpu-hf-*.json") if "2000" not in p.name]
    doc = json.loads(path.read_text())
    assert {"device", "date", "commit", "versions", "model", "layers", "rows"} <= doc.keys()
    assert set(doc["versions"]) == {"torch", "transformers", "triton"} and doc["layers"] == 1
    assert doc["model"]["name"] == "qwen3" and doc["model"]["dtype"] == "float32"
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {("eager", "eager"), ("moekit", "eager"), ("moekit", "compiled")}  # the reference always runs
    for row in doc["rows"]:
        assert row.keys() == ROW_FIELDS
        assert _number_or_error(row, "decode_tok_s") and _number_or_error(row, "logits_rel_err_vs_eager")
        assert isinstance(row["logits_rel_err_vs_fp64"], float) and "logits_rel_err_vs_fp64" not in row["errors"]
    eager_moekit = rows[("moekit", "eager")]
    assert eager_moekit["decode_tok_s"] > 0 and eager_moekit["prefill_ms"] > 0
    assert eager_moekit["logits_rel_err_vs_eager"] < 1e-5 and rows[("eager", "eager")]["logits_rel_err_vs_eager"] == 0
    # float32 against float64: small but not zero (eager is measured too); the compiled row's decode steps
    # are teacher-forced: a step compared with the wrong position would be off by ~1, not 1e-7
    assert 0 < rows[("eager", "eager")]["logits_rel_err_vs_fp64"] < FP32_TOL
    assert eager_moekit["logits_rel_err_vs_fp64"] < FP32_TOL
    assert 0 < rows[("moekit", "compiled")]["logits_rel_err_vs_fp64"] < FP32_TOL
    assert rows[("moekit", "compiled")]["prefill_ms"] is None  # generate compiles the decode steps only
    out = capsys.readouterr().out
    assert "eager    warm moekit" in out and "compiled warm moekit" in out and str(path) in out.replace("\n", "")
    assert main(argv + ["--no-compile", "--repeats", "1", "--prefill-len", "4"]) == 0  # the same day: a new file
    assert path.exists() and (tmp_path / path.name.replace(".json", "-2.json")).exists()
    assert (tmp_path / "cpu-hf-2000-01-01.json").read_text() == "{}"


def _tiny_prefill_only(**overrides):
    cpu = torch.device("cpu")
    base = {"layers": 1, "impls": ("moekit",), "compile": False, "repeats": 1, "decode_tokens": 2, "prefill_len": 8}
    return default_options("qwen3", cpu, tiny=True, **(base | overrides))


def test_hf_dtype_builds_the_model_in_that_dtype():
    doc = run_hf_bench(torch.device("cpu"), _tiny_prefill_only(dtype="bfloat16"))
    assert doc["model"]["dtype"] == "bfloat16"
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    # bf16 against float64: far above float32's rounding, yet the same model (a wrong one would be off by ~1)
    for impl in ("eager", "moekit"):
        assert FP32_TOL < rows[(impl, "eager")]["logits_rel_err_vs_fp64"] < 5e-2
    assert rows[("moekit", "eager")]["logits_rel_err_vs_eager"] < 5e-2


def _rel_err_f64(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def test_fp64_errors_match_a_float64_forward_run_here():
    opts = _tiny_prefill_only()
    rows = {r["impl"]: r for r in run_hf_bench(torch.device("cpu"), opts)["rows"]}
    # the same model and batch, and its float64 twin made here by converting a copy of the module
    model = build_model(hf_config("qwen3", 1, tiny=True), torch.float32, torch.device("cpu"))
    batch = make_inputs(model.config.vocab_size, opts, torch.device("cpu")).batch
    twin = copy.deepcopy(model).double()
    twin.set_experts_implementation("eager")
    with torch.no_grad():
        truth = twin(batch, use_cache=False).logits  # [B, L, V]
        assert truth.dtype == torch.float64
        for impl in ("eager", "moekit"):
            model.set_experts_implementation(impl)
            expected = _rel_err_f64(model(batch, use_cache=False).logits, truth)
            assert math.isclose(rows[impl]["logits_rel_err_vs_fp64"], expected, rel_tol=1e-6), impl
            assert 0 < expected < FP32_TOL


def _fail_conversion(model, blocks_quant=None):
    raise TypeError("Cannot convert a MPS Tensor to float64 dtype")


@pytest.mark.parametrize("target,patch,text", [
    ("_float64_tensors", _fail_conversion, "TypeError: Cannot convert a MPS Tensor to float64 dtype"),
    ("free_memory_bytes", lambda device: 1 << 10, "Skipped: the float64 pass needs"),
], ids=["no-float64-on-device", "no-room"])
def test_failing_float64_pass_is_recorded_not_raised(monkeypatch, target, patch, text):
    monkeypatch.setattr(hf_fp64, target, patch)
    doc = run_hf_bench(torch.device("cpu"), _tiny_prefill_only())
    for row in doc["rows"]:
        assert row["logits_rel_err_vs_fp64"] is None and row["errors"]["logits_rel_err_vs_fp64"].startswith(text)
        assert isinstance(row["logits_rel_err_vs_eager"], float)  # the other metrics stand
    model = build_model(hf_config("qwen3", 1, tiny=True), torch.float32, torch.device("cpu"))
    decode = hf_measure.Decode(torch.tensor([3, 4]), torch.zeros(2, model.config.vocab_size), 1.0)
    compiled = CompiledRows([Row("moekit", "compiled"), Row("grouped_mm", "compiled", errors={"decode_tok_s": "E: x"})],
                            decodes={"moekit": decode})
    float64_decode_errors(model, compiled, torch.tensor([[1, 2]]))  # the compiled rows' float64 pass
    for row in compiled.rows:
        assert row.logits_rel_err_vs_fp64 is None and row.errors["logits_rel_err_vs_fp64"].startswith(text)


def test_step_rate_is_the_extra_tokens_over_the_extra_time():
    """step_tok_s: (T - 1) tokens over median(generate T) - median(generate 1), worked by hand."""
    row = Row("moekit", "compiled")
    for full, one in ((2.0, 0.5), (2.2, 0.6), (2.1, 0.4)):
        row.record("decode", full)
        row.record("decode1", one)
    out = row.finish(decode_tokens=11)
    assert out["decode_tok_s"] == pytest.approx(11 / 2.1)
    assert out["step_tok_s"] == pytest.approx(10 / (2.1 - 0.5))
    noisy = Row("moekit", "eager")
    noisy.record("decode", 1.0)
    noisy.record("decode1", 1.2)  # a 1-token call slower than the whole one: no rate rather than a negative one
    assert noisy.finish(decode_tokens=4)["step_tok_s"] is None
    doc = {"rows": [noisy.finish(decode_tokens=4), row.finish(decode_tokens=11)]}
    assert step_lost_in_noise(doc) == ["moekit (eager)"]  # the report's footnote names the row its "-" belongs to


def test_a_failed_one_token_generate_keeps_the_decode_rate(monkeypatch):
    """The 1-token generate behind step_tok_s failing costs that number only: the whole-call decode
    rate measured before it stays, and the failure is reported under step_tok_s."""
    from types import SimpleNamespace

    from moekit.bench import hf_passes

    def decode(model, prompt, tokens, compiled=None):
        if tokens == 1:
            raise RuntimeError("one-token generate failed")
        return hf_measure.Decode(torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, 4), 2.0)

    monkeypatch.setattr(hf_measure, "decode", decode)
    model = SimpleNamespace(set_experts_implementation=lambda impl: None, modules=lambda: ())
    opts = default_options("qwen3", torch.device("cpu"), tiny=True, decode_tokens=4, compile=False)
    row = Row("moekit", "compiled")
    for _ in range(2):
        hf_passes.timed_pass(model, row, make_inputs(16, opts, torch.device("cpu")), opts, compiled=object())
    out = row.finish(decode_tokens=4)
    assert out["decode_tok_s"] == pytest.approx(4 / 2.0) and out["step_tok_s"] is None
    assert "one-token generate failed" in out["errors"]["step_tok_s"] and "decode_tok_s" not in out["errors"]


def test_results_path_never_overwrites(tmp_path):
    doc = {"device": "NVIDIA H200", "date": "2030-01-02"}
    first = hf_results_path(tmp_path, doc)
    assert first.name == "NVIDIA_H200-hf-2030-01-02.json"
    first.write_text("{}")
    second = hf_results_path(tmp_path, doc)
    second.write_text("{}")
    assert second.name == "NVIDIA_H200-hf-2030-01-02-2.json"
    assert hf_results_path(tmp_path, doc).name == "NVIDIA_H200-hf-2030-01-02-3.json"


def test_results_path_carries_the_quantizer_options(tmp_path):
    """Two runs with other --hf-quant-options get names of their own (they took -2 and -3 after the scheme's name)."""
    def doc(options):
        return {"device": "NVIDIA H100 80GB HBM3", "date": "2030-01-02", "model": {"quant": "int4_w4a16"},
                "quant": {"options": options}}

    assert hf_results_path(tmp_path, doc({})).name == "NVIDIA_H100_80GB_HBM3-hf-int4_w4a16-2030-01-02.json"
    named = hf_results_path(tmp_path, doc({"group_size": 32, "symmetric": True}))
    assert named.name == "NVIDIA_H100_80GB_HBM3-hf-int4_w4a16-group_size32-symmetrictrue-2030-01-02.json"
    named.write_text("{}")
    other = hf_results_path(tmp_path, doc({"group_size": 64, "symmetric": False}))
    assert other.name == "NVIDIA_H100_80GB_HBM3-hf-int4_w4a16-group_size64-symmetricfalse-2030-01-02.json"
    block = {"device": "cpu", "date": "2030-01-02", "model": {"quant": "fp8_block"},
             "quant": {"options": {"block_shape": (64, 128)}}}
    assert hf_results_path(tmp_path, block).name == "cpu-hf-fp8_block-block_shape64x128-2030-01-02.json"
    assert hf_results_path(tmp_path, {**block, "quant": {"options": {"odd": "a/b c"}}}).name == \
        "cpu-hf-fp8_block-odda_b_c-2030-01-02.json"  # nothing but [A-Za-z0-9_.] from an option


def test_registry_discovery_and_selection():
    names = experts_implementations()
    assert names[:2] == ["eager", "moekit"] and "grouped_mm" in names
    assert select_impls(["grouped_mm"]) == ["eager", "grouped_mm"]
    with pytest.raises(ValueError, match="hf-impls must be among"):
        select_impls(["grouped-mm"])


def test_no_experts_ceiling_runs_only_when_named_and_equals_zeroed_experts():
    assert "no_experts" not in select_impls(None)
    assert select_impls(["no_experts"]) == ["eager", "no_experts"]
    assert "no_experts" not in select_impls(None)  # registered now, still never a default
    config = hf_config("qwen3", 2, tiny=True)
    model = build_model(config, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.set_experts_implementation("no_experts")
        ceiling = model(ids).logits
        for layer in model.model.layers:  # the reference: the eager loop over experts whose output is zero
            layer.mlp.experts.down_proj.zero_()
        model.set_experts_implementation("eager")
        zeroed = model(ids).logits
    torch.testing.assert_close(ceiling, zeroed, rtol=0, atol=0)


def test_no_experts_ceiling_keeps_the_router_in_its_graph():
    """Its output must depend on the routing weights (times 0), so that torch.compile cannot drop the router
    from the ceiling: autograd raises for an input the output does not use."""
    from moekit.bench.hf_models import _no_experts_forward

    hidden = torch.randn(5, 8)
    weights = torch.rand(5, 2, requires_grad=True)
    out = _no_experts_forward(None, hidden, torch.zeros(5, 2, dtype=torch.long), weights)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and not out.any()
    (grad,) = torch.autograd.grad(out.sum(), weights)
    assert torch.equal(grad, torch.zeros_like(weights))


def test_no_experts_ceiling_keeps_the_router_under_inductor():
    """Inductor's constant folder replaces a multiply by the int 0 with zeros, and then drops every op feeding it:
    a router block (gate, softmax, top-k, the ceiling) compiled by inductor still runs its top-k."""
    from torch._inductor.utils import run_and_get_code

    from moekit.bench.hf_models import _no_experts_forward

    def block(hidden, gate):
        weights, ids = torch.topk(torch.softmax(hidden @ gate, dim=-1, dtype=torch.float), 2, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(hidden.dtype)
        return hidden + _no_experts_forward(None, hidden, ids, weights)

    hidden, gate = torch.randn(3, 8), torch.randn(8, 6)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(block, backend="inductor"), hidden, gate)
    torch._dynamo.reset()
    assert torch.equal(out, hidden)
    assert "topk" in "\n".join(codes)


def test_real_widths_and_batched_mm_gather():
    qwen3, mixtral = hf_config("qwen3", 8), hf_config("mixtral", 2)
    q, m = qwen3, mixtral
    assert (q.hidden_size, q.moe_intermediate_size, q.num_experts_per_tok, q.head_dim) == (2048, 768, 8, 128)
    assert (q.num_attention_heads, q.num_key_value_heads, q.num_hidden_layers, q.vocab_size) == (32, 4, 8, 32000)
    assert (m.hidden_size, m.intermediate_size, m.num_local_experts, m.num_experts_per_tok) == (4096, 14336, 8, 2)
    assert (m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers) == (32, 8, 2)
    assert qwen3.eos_token_id is None  # generate always runs its full number of tokens
    assert gathered_weight_bytes("batched_mm", qwen3, 4096, 2) == 4096 * 8 * 3 * 768 * 2048 * 2  # ~309 GB: skipped
    assert gathered_weight_bytes("grouped_mm", qwen3, 4096, 2) == 0


def test_decode_rel_err_stops_where_tokens_diverge():
    logits = torch.randn(4, 10)
    ref = hf_measure.Decode(torch.tensor([1, 2, 3, 4]), logits, 1.0)
    off = logits.clone()
    off[3] += 100  # step 3 saw a different token 2: not comparable, not counted
    out = hf_measure.Decode(torch.tensor([1, 2, 9, 4]), off, 1.0)
    assert hf_measure.decode_rel_err(out, ref) == 0
    assert hf_measure.decode_rel_err(hf_measure.Decode(ref.tokens, off, 1.0), ref) > 1


def test_error_text_is_type_and_first_line():
    assert hf_measure.error_text(ValueError("bad dtype\nmore detail")) == "ValueError: bad dtype"
    assert hf_measure.error_text(RuntimeError("op failed\n  Explanation: got X\n  Hint: y")) == \
        "RuntimeError: op failed (Explanation: got X)"


def test_the_help_states_the_defaults_each_run_takes():
    """--layers ... --prefill-len and --compile: the help's "N GPU, N CPU, N --tiny" (and on/off) are the options a
    GPU run, a CPU run and a --tiny run take (--tiny ran 2 compiled layers on the CPU while the help said 1, off)."""
    import argparse
    import re

    from moekit.bench.hf_run import default_options
    from moekit.cli import build_parser

    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    helps = {a.dest: a.help for a in bench._actions}
    runs = {"GPU": default_options("qwen3", torch.device("cuda")), "CPU": default_options("qwen3", torch.device("cpu")),
            "--tiny": default_options("qwen3", torch.device("cpu"), tiny=True)}
    for dest in ("decode_tokens", "prompt_len", "prefill_batch", "prefill_len"):
        stated = dict((run, int(n)) for n, run in re.findall(r"(\d+) (GPU|CPU|--tiny)", helps[dest]))
        assert stated == {run: getattr(opts, dest) for run, opts in runs.items()}, dest
    assert re.search(r"8 qwen3.*; 1 CPU; 2 --tiny", helps["layers"]) and runs["GPU"].layers == 8
    assert (runs["CPU"].layers, runs["--tiny"].layers) == (1, 2)
    assert "on for CUDA and with --tiny, off on CPU" in helps["compile"]
    assert (runs["GPU"].compile, runs["--tiny"].compile, runs["CPU"].compile) == (True, True, False)


def test_table_marks_errors_and_skips():
    doc = {"device": "cpu", "layers": 1, "model": {"name": "qwen3", "widths": "tiny", "dtype": "float32"}, "rows": [
        {"impl": "batched_mm", "mode": "eager", "decode_tok_s": 5.0, "prefill_ms": None,
         "logits_rel_err_vs_eager": None,
         "logits_rel_err_vs_fp64": None,
         "errors": {"prefill_ms": "Skipped: too big", "logits_rel_err_vs_eager": "Skipped: too big",
                    "logits_rel_err_vs_fp64": "Skipped: too big"}},
        {"impl": "moekit", "mode": "compiled", "decode_tok_s": None, "prefill_ms": None,
         "logits_rel_err_vs_eager": None,
         "logits_rel_err_vs_fp64": 0.0125, "errors": {"decode_tok_s": "TorchRuntimeError: x"}}]}
    cells = [list(col.cells) for col in hf_table(doc).columns]
    assert cells[4] == ["skipped", "-"] and cells[2][1] == "[red]error[/red]"
    assert cells[3] == ["-", "[red]error[/red]"]  # no step rate recorded; the compiled decode failed
    assert cells[6] == ["skipped", "1.25e-02"]


@pytest.mark.parametrize("argv,flag", [
    (["--hf-model", "llama"], "--hf-model"),
    (["--hf-impls", "grouped-mm"], "--hf-impls"),
    (["--layers", "0"], "--layers"),
    (["--prefill-len", "0"], "--prefill-len"),
    (["--hf-dtype", "float8"], "--hf-dtype"),
    (["--compile-backend", "inductr"], "--compile-backend must be a torch.compile backend"),
])
def test_bench_hf_bad_arguments_name_the_flag(argv, flag, capsys):
    """A usage error like every other subcommand's (one line, exit 2), before any model is built."""
    assert flag in cli_error(capsys, ["bench", "--hf", "--tiny", "--device", "cpu"] + argv)


def test_moekit_blocks_runs_when_named_beside_the_experts_implementations():
    """``moekit_blocks`` (every block swapped by use_moekit_blocks) is never a default, follows "moekit" when
    named, and its rows (eager and compiled) match eager like the experts implementation's."""
    assert "moekit_blocks" not in select_impls(None)
    assert select_impls(["grouped_mm", "moekit_blocks", "moekit"]) == ["eager", "moekit", "moekit_blocks", "grouped_mm"]
    opts = default_options("qwen3", torch.device("cpu"), tiny=True, layers=1, impls=("moekit", "moekit_blocks"),
                           repeats=1, decode_tokens=2, prefill_len=8)
    doc = run_hf_bench(torch.device("cpu"), opts)
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    for mode in ("eager", "compiled"):
        row = rows[("moekit_blocks", mode)]
        assert not row["errors"] and row["decode_tok_s"] > 0 and row["logits_rel_err_vs_eager"] < 1e-5


def _failing_experts(self, hidden_states, top_k_index, top_k_weights):
    raise RuntimeError("this implementation cannot run here")


def test_an_implementation_that_failed_its_warm_up_is_not_repeated(monkeypatch, tmp_path, capsys):
    """Session 51: a CPU ``--tiny`` run with every registered implementation logged "nothing to time" for each
    eager repeat of deepgemm and sonicmoe (they fail their warm-up on a CPU): 6 lines a model. The failed row keeps its
    error, and every repeat of the rows that ran is logged."""
    from transformers.integrations.moe import ExpertsInterface

    monkeypatch.setitem(ExpertsInterface._global_mapping, "failing_here", _failing_experts)
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--hf-impls", "moekit,failing_here",
            "--layers", "1", "--decode-tokens", "2", "--repeats", "2", "--no-compile", "--out", str(tmp_path)]
    assert main(argv) == 0
    log = capsys.readouterr().out
    assert "nothing to time" not in log and "repeat 1/2 failing_here" not in log
    for rep in (1, 2):
        assert re.search(rf"eager    repeat {rep}/2 moekit: decode [\d.]+ tok/s, prefill [\d.]+ ms", log)
    (path,) = tmp_path.glob("cpu-hf-*.json")
    row = next(r for r in json.loads(path.read_text())["rows"] if r["impl"] == "failing_here")
    assert row["decode_tok_s"] is None and "cannot run here" in row["errors"]["decode_tok_s"]


def test_the_compile_config_of_another_backend_asks_for_no_mode():
    """Session 51: ``--tiny`` compiles with the "eager" backend, and transformers' CompileConfig default mode
    "reduce-overhead" (an inductor mode) made torch log "eager backend ignoring extra kwargs" once a graph: 27 lines
    of a two-model CPU run. The config generate passes to torch.compile now asks that backend for nothing it ignores
    (read from the backend's logger); inductor keeps the mode."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torch._dynamo.backends.debugging")  # the eager backend's
    logger.addHandler(handler)
    try:
        config = hf_measure.compile_config(torch.device("cpu"), "eager")
        double = torch.compile(lambda x: x * 2, **config.to_dict())
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "ignoring extra kwargs" in r.getMessage()]
    assert hf_measure.compile_config(torch.device("cpu"), "inductor").mode == "reduce-overhead"
