"""``moekit bench --hf --hf-model deepseek-v4 / step-3.7`` on the CPU: the presets at their published widths (meta
models), a ``--tiny`` run of each through the CLI with its logits checked here against the same model converted to
float64 (and against that model without its SwiGLU clamp: the clamp bites at the tiny widths), the drawn hash table,
the rows not attempted and why, and the usage error where the installed transformers lacks a family.

Shapes: V vocabulary, k experts a token, E experts, B x L the prefill batch."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")
pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 (>= 5.17)")
pytest.importorskip("transformers.models.step3p7", reason="transformers with Step-3.7 (>= 5.17)")

from moekit.bench import hf_models  # noqa: E402
from moekit.bench.hf_models import MODELS, build_model, hf_config, not_run  # noqa: E402
from moekit.bench.hf_run import default_options, make_inputs  # noqa: E402
from moekit.cli import main  # noqa: E402

from _helpers import cli_error  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
FP32_TOL = 1e-5  # design.md: an fp32 backend within 1e-5 relative L2 of a float64 reference
CARD_BYTES = 80e9  # one H100's memory
CPU = torch.device("cpu")


def _meta_model(name: str, layers: int):
    config = hf_config(name, layers)
    auto = transformers.AutoModelForCausalLM if config.get_text_config() is config else (
        transformers.AutoModelForImageTextToText)
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.bfloat16)


def test_deepseek_v4_at_its_published_widths_hash_then_top_k_layers():
    c = hf_config("deepseek-v4", MODELS["deepseek-v4"].default_layers)
    assert (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok) == (4096, 2048, 256, 6)
    assert (c.scoring_func, c.routed_scaling_factor, c.swiglu_limit, c.hc_mult) == ("sqrtsoftplus", 1.5, 10.0, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size, c.eos_token_id) == (
        64, 1, 512, 32000, None)
    assert c.mlp_layer_types == ["hash_moe", "moe"]
    model = _meta_model("deepseek-v4", 3)
    gates = [type(layer.mlp.gate).__name__ for layer in model.model.layers]
    assert gates == ["DeepseekV4HashRouter", "DeepseekV4TopKRouter", "DeepseekV4TopKRouter"]
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (256, 2 * 2048, 4096)


def test_step_3_7_at_its_published_widths_every_layer_moe_the_last_clamped():
    c = hf_config("step-3.7", MODELS["step-3.7"].default_layers)
    t = c.get_text_config()
    assert (t.hidden_size, t.moe_intermediate_size, t.n_routed_experts, t.num_experts_per_tok) == (4096, 1280, 288, 8)
    assert (t.share_expert_dim, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (1280, 64, 8, 128)
    assert t.mlp_layer_types == ["sparse"] * 4 and t.vocab_size == 32000
    assert t.swiglu_limits == [0.0, 0.0, 0.0, 7.0] and t.swiglu_limits_shared == [0.0, 0.0, 0.0, 16.0]
    model = _meta_model("step-3.7", 4)
    layers = model.model.language_model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["Step3p7SparseMoeBlock"] * 4
    limits = [layer.mlp.experts.limit for layer in layers]  # no clamp: None (transformers 5.17: inf)
    assert all(limit in (None, math.inf) for limit in limits[:3]) and limits[3] == 7.0
    assert len(model.model.vision_model.layers) == 1  # the tower that never runs, cut to one layer


@pytest.mark.parametrize("name", ["deepseek-v4", "step-3.7"])
def test_default_layers_fit_one_h100(name):
    """The bf16 model at the GPU default leaves >= 30 GB of an 80 GB card to activations, graphs and the float64
    pass's streamed chunks."""
    size = sum(p.numel() * p.element_size() for p in _meta_model(name, MODELS[name].default_layers).parameters())
    assert size < CARD_BYTES - 30e9


def test_hash_table_drawn_distinct_experts_a_token():
    model = build_model(hf_config("deepseek-v4", 2, tiny=True), torch.float32, CPU)
    table = model.model.layers[0].mlp.gate.tid2eid  # [V, k]
    experts = model.model.layers[0].mlp.gate.num_experts
    assert table.shape == (256, 4) and int(table.min()) >= 0 and int(table.max()) < experts
    assert all(len(set(row)) == 4 for row in table.tolist())  # zeros at init: every token on expert 0
    assert len(set(table.flatten().tolist())) == experts  # every expert some token's
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0


def _rel_err_f64(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _dispatched(model) -> bool:
    from moekit.hf.set_check import is_interface_experts

    return any(is_interface_experts(m) for m in model.modules())


def _unclamped(config):
    """``config`` with every SwiGLU clamp off (Step-3.7: limits 0; DeepSeek-V4's must be a float: one never reached)."""
    text = config.get_text_config()
    if hasattr(text, "swiglu_limits"):
        text.swiglu_limits = text.swiglu_limits_shared = [0.0] * text.num_hidden_layers
    else:
        text.swiglu_limit = 1e30
    return config


@pytest.mark.parametrize("name", ["deepseek-v4", "step-3.7"])
def test_tiny_cli_run_and_its_logits_against_float64_here(name, tmp_path, capsys):
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", name, "--hf-impls", "moekit,moekit_blocks",
            "--repeats", "1", "--decode-tokens", "3", "--out", str(tmp_path)]
    assert main(argv) == 0
    log = capsys.readouterr().out  # the run log and the report, on stdout
    # a compiled repeat is logged for each implementation whose warm-up decoded, none for one skipped or failed there
    # (DeepSeek-V4's: each repeat said "nothing to time" before, 9 lines at the default 3 repeats of 3 rows)
    assert ("compiled repeat 1/1 moekit_blocks: decode" in log) == (name == "step-3.7")
    assert "nothing to time" not in log
    (path,) = tmp_path.glob("cpu-hf-*.json")
    doc = json.loads(path.read_text())
    assert doc["model"]["name"] == name and doc["layers"] == 2 and doc["model"]["vocab_size"] == 256
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {("eager", "eager"), ("moekit", "eager"), ("moekit_blocks", "eager"), ("moekit", "compiled"),
                         ("moekit_blocks", "compiled")}
    # the same model and batch, made again here, and its float64 twin converted whole (not the run's functional_call)
    opts = default_options(name, CPU, tiny=True)
    model = build_model(hf_config(name, 2, tiny=True), torch.float32, CPU)
    batch = make_inputs(256, opts, CPU).batch  # [B, L]
    twin = copy.deepcopy(model).double()
    twin.set_experts_implementation("eager")
    with torch.no_grad():
        truth = twin(batch, use_cache=False).logits  # [B, L, V]
        model.set_experts_implementation("eager")
        expected = _rel_err_f64(model(batch, use_cache=False).logits, truth)
        loose = build_model(_unclamped(hf_config(name, 2, tiny=True)), torch.float64, CPU)
        loose.set_experts_implementation("eager")
        unclamped = _rel_err_f64(loose(batch, use_cache=False).logits, truth)
    assert truth.dtype == torch.float64 and 0 < expected < FP32_TOL
    assert math.isclose(rows[("eager", "eager")]["logits_rel_err_vs_fp64"], expected, rel_tol=1e-6)
    assert unclamped > 1e-2  # the tiny clamp bites: a row that skipped it would be this far off
    # transformers 5.17's Step-3.7 experts are not dispatched: its "moekit" rows say so, moekit_blocks runs moekit
    ran = ("moekit", "moekit_blocks") if _dispatched(model) else ("moekit_blocks",)
    for impl in ran:
        row = rows[(impl, "eager")]
        assert not row["errors"] and row["decode_tok_s"] > 0 and row["prefill_ms"] > 0, row
        assert row["logits_rel_err_vs_fp64"] < FP32_TOL and row["logits_rel_err_vs_eager"] < FP32_TOL
    if "moekit" not in ran:
        assert rows[("moekit", "eager")]["errors"]["decode_tok_s"].startswith("Skipped: no experts module")
    for impl in ran:
        row = rows[(impl, "compiled")]
        if name == "deepseek-v4":  # generate's static cache has no compressed-attention layer
            assert row["decode_tok_s"] is None and row["logits_rel_err_vs_fp64"] is None
            assert row["errors"]["decode_tok_s"].startswith("Skipped: transformers' static cache")
            assert "'heavily_compressed_attention'" in row["errors"]["decode_tok_s"]
        else:
            assert not row["errors"] and row["decode_tok_s"] > 0 and row["logits_rel_err_vs_fp64"] < FP32_TOL


def test_experts_rows_not_attempted_where_no_experts_module_is_dispatched(monkeypatch):
    """transformers 5.17's Step-3.7 experts class has no ``use_experts_implementation``: set_experts_implementation
    changes nothing there, so an experts implementation's row is not attempted (it would time eager's loop); the
    rows that swap the blocks, and eager, still run."""
    from moekit.hf import set_check

    model = build_model(hf_config("step-3.7", 1, tiny=True), torch.float32, CPU)
    if _dispatched(model):  # transformers >= 5.18
        assert all(not_run(model, impl, None, CPU, compiled=False) is None for impl in ("eager", "moekit",
                                                                                        "no_experts"))
    monkeypatch.setattr(set_check, "is_interface_experts", lambda module: False)  # the 5.17 class, undecorated
    for impl in ("moekit", "grouped_mm", "no_experts"):
        reason = not_run(model, impl, None, CPU, compiled=False)
        assert reason.startswith("Skipped: no experts module of Step3p7ForConditionalGeneration") and impl in reason
    assert all(not_run(model, impl, None, CPU, compiled=True) is None for impl in ("eager", "moekit_blocks"))


@pytest.mark.parametrize("name,model_type", [("step-3.7", "step3p7"), ("deepseek-v4", "deepseek_v4")])
def test_a_family_the_installed_transformers_lacks(name, model_type, monkeypatch, capsys):
    """Named: a usage error naming --hf-model and the transformers version, before any model is built; --hf-model
    all: the families it has."""
    from transformers import CONFIG_MAPPING

    monkeypatch.delitem(CONFIG_MAPPING._mapping, model_type)
    line = cli_error(capsys, ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", f"qwen3,{name}"])
    assert f"--hf-model {name} needs transformers' {model_type!r} models" in line
    assert transformers.__version__ in line
    assert name not in hf_models.available_models() and "qwen3" in hf_models.available_models()
    with pytest.raises(ValueError, match=f"hf-model {name} needs"):
        hf_config(name, 2, tiny=True)


def test_the_help_names_every_model_and_its_gpu_layers():
    import argparse
    import re

    from moekit.cli import build_parser

    bench = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    helps = {a.dest: a.help for a in bench._actions}
    gpu = helps["layers"].split("default on GPU:")[1].split(";")[0]
    assert dict((name, int(n)) for n, name in re.findall(r"(\d+) ([\w.-]+)", gpu)) == {
        name: spec.default_layers for name, spec in MODELS.items()}
    assert all(name in helps["hf_model"] for name in MODELS)
