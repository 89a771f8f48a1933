"""``moekit bench --hf --hf-quant int8_w8a16|int4_w4a16|mxfp4|fp8_block`` on the CPU: the CLI's JSON and table carry the
scheme and a row of the float model's blocks quantized by moekit (``moekit_blocks_quant``) beside the unquantized
blocks and the ceiling; that row is measured against the float64 model of its dequantized experts (the run's
rounding alone), the float rows against the float model's; the dequantized experts lie in each block's own layout;
what cannot run is refused naming the flag. The quantized blocks against a float64 loop of their own:
tests/test_hf_swap_quant.py.

Shapes: E experts, N expert width, K hidden width."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config, model_names, select_impls, use_impl  # noqa: E402
from moekit.bench.hf_quant import quant_models  # noqa: E402
from moekit.bench.hf_wo import QUANT_BLOCKS_IMPL, dequantized_blocks_float64  # noqa: E402
from moekit.cli import main  # noqa: E402

from _helpers import cli_error, rel_l2  # noqa: E402

SMALL = ["--layers", "1", "--decode-tokens", "2", "--repeats", "1", "--prefill-len", "8"]


def test_bench_hf_int4_tiny_cli(tmp_path, capsys):
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--hf-quant", "int4_w4a16",
            *SMALL, "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-int4_w4a16-*.json")
    doc = json.loads(path.read_text())
    assert doc["model"]["quant"] == doc["settings"]["quant"] == doc["quant"]["scheme"] == "int4_w4a16"
    assert doc["quant"]["impl"] == QUANT_BLOCKS_IMPL and "quant='int4_w4a16'" in doc["method"]
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    impls = ("eager", "moekit_blocks", QUANT_BLOCKS_IMPL, "no_experts")  # the default beside the quantized row
    assert set(rows) == {(i, m) for i in impls for m in ("eager", "compiled")}
    cost = doc["quant"]["fp64_logits_rel_err"]
    assert 1e-3 < cost < 5e-2  # int4's rounding of the experts, in float64: there, and not a scrambled layout (~1)
    for mode in ("eager", "compiled"):
        quantized, blocks = rows[(QUANT_BLOCKS_IMPL, mode)], rows[("moekit_blocks", mode)]
        assert quantized["decode_tok_s"] > 0 and not quantized["errors"]
        # against the float64 model of its own dequantized experts: float32's rounding alone
        assert quantized["logits_rel_err_vs_fp64"] < 1e-5 and blocks["logits_rel_err_vs_fp64"] < 1e-5
        assert quantized["logits_rel_err_vs_eager"] > 1e-3  # the float model's eager row: the quantization shows
    assert rows[(QUANT_BLOCKS_IMPL, "eager")]["logits_rel_err_vs_eager"] == pytest.approx(cost, rel=1e-2)
    memory = doc["quant"]["memory"]  # the quantized blocks with keep_float=False, after every row ran
    cfg = hf_config("qwen3", 1, tiny=True)  # the run's config
    e, k, n = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert memory["experts_float_bytes"] == e * 3 * n * k * 4  # the one layer's float32 w13 + w2
    assert 0 < memory["experts_quant_bytes"] < memory["experts_float_bytes"] / 4
    assert memory["model_bytes_before"] - memory["model_bytes_after"] == (memory["experts_float_bytes"]
                                                                          - memory["experts_quant_bytes"])
    out = capsys.readouterr().out
    assert "moekit_blocks_quant with keep_float=False: parameters + buffers" in out
    assert "moekit_blocks_quant: its blocks' experts int4_w4a16" in out
    assert "moekit_blocks_quant (compiled): decode_tok_s x" in out and "moekit_blocks" in out


def test_bench_hf_mxfp4_gpt_oss_transposed_experts(tmp_path):
    """gpt-oss keeps its experts transposed ([E, K, 2N]): its float64 reference puts the dequantized weights back in
    that layout, so the quantized row matches it to float32's rounding."""
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "gpt-oss-20b", "--hf-quant", "mxfp4",
            "--hf-impls", "moekit_blocks", "--no-compile", *SMALL, "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-mxfp4-*.json")
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"eager", "moekit_blocks", QUANT_BLOCKS_IMPL}
    assert rows[QUANT_BLOCKS_IMPL]["logits_rel_err_vs_fp64"] < 1e-5 < rows[QUANT_BLOCKS_IMPL]["logits_rel_err_vs_eager"]


def test_bench_hf_fp8_block_gpt_oss(tmp_path):
    """fp8_block through moekit's blocks runs gpt-oss (biases, its activation), which transformers' FP8Experts
    cannot: the row's float64 reference is its dequantized experts, so what remains is the recipe's activation
    rounding (per token per 128 columns through e4m3), well under the weights' own cost against the float model."""
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "gpt-oss-20b", "--hf-quant", "fp8_block",
            "--hf-impls", "moekit_blocks", "--no-compile", *SMALL, "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-fp8_block-*.json")
    doc = json.loads(path.read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert set(rows) == {"eager", "moekit_blocks", QUANT_BLOCKS_IMPL}
    assert doc["quant"]["scheme"] == "fp8_block"
    quantized = rows[QUANT_BLOCKS_IMPL]
    assert 1e-4 < quantized["logits_rel_err_vs_fp64"] < 0.05  # e4m3 activations: 2^-4 relative steps, averaged
    assert quantized["logits_rel_err_vs_fp64"] < quantized["logits_rel_err_vs_eager"]
    memory = doc["quant"]["memory"]
    assert memory["experts_quant_bytes"] < memory["experts_float_bytes"] / 3  # 1-byte e4m3 + scales vs float32


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss-20b"])
def test_dequantized_experts_in_the_blocks_layout(name):
    model = build_model(hf_config(name, 1, tiny=True), torch.float32, torch.device("cpu"))
    use_impl(model, QUANT_BLOCKS_IMPL, "int8_w8a16")
    weights = dequantized_blocks_float64(model, "int8_w8a16")
    params = dict(model.named_parameters())
    assert len(weights) == 2
    swap = next(m for m in model.modules() if "_moekit_swap" in m.__dict__).__dict__["_moekit_swap"]
    w13 = weights[next(k for k in weights if k.endswith("gate_up_proj"))]  # [E, 2N, K], or gpt-oss's [E, K, 2N]
    whole = swap.moe.w13.dequantize(torch.float64)  # [E, 2N, K]
    assert torch.equal(w13.transpose(1, 2) if name == "gpt-oss-20b" else w13, whole)  # the reference: dequantize()
    for key, value in weights.items():
        assert value.dtype == torch.float64 and value.shape == params[key].shape
        assert 1e-5 < rel_l2(value, params[key]) < 1e-2  # int8's rounding of that very weight, element by element


def test_weight_only_impls_and_models():
    assert select_impls(None, "mxfp4") == ["eager", "moekit_blocks", QUANT_BLOCKS_IMPL, "no_experts"]
    assert select_impls(["moekit", "grouped_mm"], "int8_w8a16") == ["eager", "moekit", QUANT_BLOCKS_IMPL,
                                                                     "grouped_mm"]
    assert quant_models("int4_w4a16", model_names()) == model_names()  # every model, gpt-oss-20b too


@pytest.mark.parametrize(("argv", "flag"), [
    (["--hf-impls", QUANT_BLOCKS_IMPL], "--hf-impls moekit_blocks_quant runs with hf-quant one of"),
    (["--hf-impls", QUANT_BLOCKS_IMPL, "--hf-quant", "fp8"], "got hf-quant 'fp8'"),
    (["--hf-quant", "int4"], "--hf-quant must be one of .*int4_w4a16"),
])
def test_bench_hf_weight_only_refusals_name_the_flag(argv, flag, capsys):
    line = cli_error(capsys, ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3"] + argv)
    assert re.search(flag, line)
