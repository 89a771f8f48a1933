"""``moekit bench --hf --hf-model deepseek-v3`` on the CPU: the published widths with every layer an MoE layer, the
default layer count against an 80 GB card (the bf16 model while its fp8 copy is made), the routers' drawn correction
bias, the tiny model's rows against eager and float64 (bf16 experts, and transformers' fine-grained fp8 ones run by
moekit as they are), transformers' quantize op applied a few experts at a time, and the float64 columns' reason at
the real widths.

Shapes: E experts, N expert width, K hidden width, V vocabulary."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers.integrations.finegrained_fp8", reason="transformers >= 5 is part of the test extras")

from moekit.bench import hf_fp64, hf_fp64_stream, hf_measure, hf_quant, hf_run  # noqa: E402
from moekit.bench.hf_models import CORRECTION_BIAS_STD, MODELS, build_model, hf_config  # noqa: E402
from moekit.bench.hf_fp64_stream import streamed_bytes  # noqa: E402
from moekit.bench.hf_quant import QUANTIZE_EXPERTS, quant_models  # noqa: E402
from moekit.cli import main  # noqa: E402

NAME = "deepseek-v3"
FP32_TOL = 1e-5  # design.md: an fp32 backend within 1e-5 relative L2 of a float64 reference
CARD_BYTES = 80e9  # one H100's memory


def _meta_model(layers: int, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(NAME, layers), dtype=dtype)


def test_real_widths_every_layer_moe():
    c = hf_config(NAME, MODELS[NAME].default_layers)
    assert (c.hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok) == (7168, 2048, 256, 8)
    assert (c.n_group, c.topk_group, c.n_shared_experts, c.routed_scaling_factor) == (8, 4, 1, 2.5)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (1536, 512, 128,
                                                                                                       64, 128)
    assert (c.num_attention_heads, c.first_k_dense_replace, c.vocab_size, c.eos_token_id) == (128, 0, 32000, None)
    model = _meta_model(3)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["DeepseekV3MoE"] * 3
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (256, 2 * 2048, 7168) and experts.down_proj.shape == (256, 7168, 2048)


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_default_layers_fit_one_h100_while_the_fp8_copy_is_made():
    """``quantize_experts_fp8``'s peak: the whole bf16 model (its float experts are freed a layer at a time, after
    that layer's e4m3 copy is filled) plus one layer of e4m3 experts. The default leaves >= 15 GB of an 80 GB card
    to activations and compiled graphs; one layer more would not fit at all."""
    fp8_layer = 256 * 3 * 2048 * 7168  # bytes: e4m3 experts of one layer (scales: 2.8 MB more)
    default = MODELS[NAME].default_layers
    peak = {layers: _bytes(_meta_model(layers)) + fp8_layer for layers in (default, default + 1)}
    assert peak[default] < CARD_BYTES - 15e9 and peak[default + 1] > CARD_BYTES
    assert 22.5e9 < _bytes(_meta_model(default + 1)) - _bytes(_meta_model(default)) < 23.5e9  # a layer in bf16


def test_float64_columns_at_real_widths_stream_the_experts_or_say_why_not(monkeypatch):
    """On an 80 GB card holding the bf16 model (the fp8 model's whole float64 copy is as large: 8 bytes a value
    either way) the whole copy cannot fit and the float64 pass streams the experts (its copies outside them: 7.4 GB
    and a chunk); with less free memory than that, the pass is skipped with both sizes, not attempted."""
    model = _meta_model(MODELS[NAME].default_layers)
    free = CARD_BYTES - _bytes(model)
    monkeypatch.setattr(hf_fp64, "free_memory_bytes", lambda device: free)
    whole = hf_fp64.float64_bytes(model)
    assert 0 <= whole - 8 * sum(p.numel() for p in model.parameters()) < 1e4 and whole > 2 * CARD_BYTES  # + buffers
    fp64 = hf_fp64.Float64Model(model)
    assert fp64.streamed and not any(".experts." in name for name in fp64.tensors)
    lean = streamed_bytes(model)
    assert 7e9 < lean < 11e9 and lean < hf_fp64.FIT_FRACTION * free
    monkeypatch.setattr(hf_fp64, "free_memory_bytes", lambda device: lean)
    with pytest.raises(hf_measure.Skipped, match=rf"needs {whole / 2**30:.1f} GiB, "
                                                 rf"{lean / 2**30:.1f} GiB with its experts streamed \("):
        hf_fp64.Float64Model(model)
    batch = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    result = hf_fp64.float64_prefill(model, batch)
    assert result.logits is None and result.error.startswith("Skipped: the float64 pass needs")


@pytest.mark.parametrize("name,quant", [(NAME, None), (NAME, "fp8"), ("qwen3", None), ("gpt-oss-20b", None)])
def test_streamed_experts_give_the_whole_copys_logits(monkeypatch, name, quant):
    """The float64 pass with its experts streamed (room for the rest, not for the whole copy) against the whole copy:
    the same numbers (float experts: the same sums; fp8: ``FP8Experts``' loop sums a token's experts in float32 in
    the whole copy, once per expert here); gpt-oss's biases and transposed experts included. Chunks of 3 experts:
    several a layer, the last one short."""
    monkeypatch.setattr(hf_fp64_stream, "STREAM_EXPERTS", 3)
    config = hf_config(name, 2, tiny=True)
    if quant:
        config.update(hf_quant.FP8_TINY[name])
    model = build_model(config, torch.float32, torch.device("cpu"))
    if quant:
        hf_quant.quantize_experts_fp8(model)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    whole = hf_fp64.Float64Model(model)
    assert not whole.streamed
    want = whole.logits(ids)
    del whole
    need, lean = hf_fp64.float64_bytes(model), streamed_bytes(model)
    monkeypatch.setattr(hf_fp64, "free_memory_bytes", lambda device: (need + lean) / 2 / hf_fp64.FIT_FRACTION)
    streamed = hf_fp64.Float64Model(model)
    assert streamed.streamed and lean < need
    got = streamed.logits(ids)
    assert got.dtype == torch.float64 and (got - want).norm() / want.norm() < (1e-6 if quant else 1e-13)
    assert all("forward" not in m.__dict__ for m in model.modules())  # the experts' own forward is back


def test_correction_bias_is_drawn_and_steers_the_routing():
    """transformers initialises ``e_score_correction_bias`` to zeros; the bench draws it: every row routes with it."""
    model = build_model(hf_config(NAME, 2, tiny=True), torch.float32, torch.device("cpu"))
    biases = torch.cat([layer.mlp.gate.e_score_correction_bias for layer in model.model.layers])
    assert biases.dtype == torch.float32 and bool((biases != 0).all())
    assert 0.5 * CORRECTION_BIAS_STD < biases.std() < 2 * CORRECTION_BIAS_STD
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        drawn = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.zero_()
        zero = model(ids).logits
    assert (drawn - zero).norm() / zero.norm() > 1e-3  # the bias changed which experts ran


def _rows(doc: dict) -> dict:
    return {(r["impl"], r["mode"]): r for r in doc["rows"]}


def test_tiny_rows_match_eager_and_float64():
    """Every implementation, eager and compiled (the CPU's eager backend: the graphs traced), against transformers'
    eager experts and against the float64 model: float32's rounding only. The ceiling (zeros) is far off."""
    impls = ("moekit", "moekit_blocks", "grouped_mm", "batched_mm", "no_experts")
    opts = hf_run.default_options(NAME, torch.device("cpu"), tiny=True, impls=impls, repeats=1, decode_tokens=3,
                                  prefill_len=8)
    rows = _rows(hf_run.run_hf_bench(torch.device("cpu"), opts))
    assert set(rows) == {(i, m) for i in impls for m in ("eager", "compiled")} | {("eager", "eager")}
    for (impl, mode), row in rows.items():
        assert not row["errors"] and row["decode_tok_s"] > 0, (impl, mode)
        if impl == "no_experts":
            assert row["logits_rel_err_vs_fp64"] > 1e-2  # the experts matter in this model
        else:
            assert row["logits_rel_err_vs_eager"] < FP32_TOL and 0 < row["logits_rel_err_vs_fp64"] < FP32_TOL, impl


def test_rows_against_the_streamed_float64_model(monkeypatch):
    """The bench with room for the streamed float64 pass only: every row's error against float64 (the prefill's and
    the compiled decode steps', moekit_blocks' swapped blocks in place) is the whole copy's."""
    impls = ("moekit", "moekit_blocks")
    opts = hf_run.default_options(NAME, torch.device("cpu"), tiny=True, impls=impls, repeats=1, decode_tokens=3,
                                  prefill_len=8)
    lines = []
    whole = _rows(hf_run.run_hf_bench(torch.device("cpu"), opts, lines.append))
    model = build_model(hf_config(NAME, opts.layers, tiny=True), torch.float32, torch.device("cpu"))
    room = (hf_fp64.float64_bytes(model) + streamed_bytes(model)) / 2 / hf_fp64.FIT_FRACTION
    monkeypatch.setattr(hf_fp64, "free_memory_bytes", lambda device: room)
    made = []
    monkeypatch.setattr(hf_fp64, "streamed_experts", lambda m: made.append(m) or hf_fp64_stream.streamed_experts(m))
    streamed = _rows(hf_run.run_hf_bench(torch.device("cpu"), opts, lines.append))
    assert [line for line in lines if line.startswith("float64 prefill")] == [
        "float64 prefill (eager experts): done", "float64 prefill (eager experts, streamed): done"]
    assert len(made) == 3  # the prefill's pass, each compiled row's decode steps
    for key, row in streamed.items():
        assert not row["errors"] and row["logits_rel_err_vs_fp64"] < FP32_TOL, key
        assert row["logits_rel_err_vs_fp64"] == pytest.approx(whole[key]["logits_rel_err_vs_fp64"], rel=1e-6), key


def test_fp8_rows_run_on_the_fp8_experts(monkeypatch):
    """``--hf-quant fp8``: the experts are transformers' FP8Experts (e4m3, a float32 scale per 128 x 128 block);
    moekit's rows read those tensors (moekit_blocks' MoE holds the module's own e4m3 weight, no copy), nothing warns of
    a dequantizing path, and their logits are the recipe's activation rounding away from the stored weights in
    float64 (a wrong layout or scale would be ~1). transformers' own fp8 rows are not run on the CPU."""
    from moekit.hf.swap import SWAP_ATTR
    from moekit.quant.fp8_block import FP8_DTYPE, Fp8BlockWeight

    models = []

    def quantize(model):
        models.append(model)
        return hf_quant.quantize_experts_fp8(model)

    monkeypatch.setattr(hf_run, "quantize_experts_fp8", quantize)
    impls = ("moekit", "moekit_blocks", "no_experts")
    opts = hf_run.default_options(NAME, torch.device("cpu"), tiny=True, impls=impls, repeats=1, decode_tokens=2,
                                  prefill_len=8, quant="fp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = _rows(hf_run.run_hf_bench(torch.device("cpu"), opts))
    assert not [w for w in caught if "dequantiz" in str(w.message)]
    for layer in models[0].model.layers:
        experts = layer.mlp.experts
        assert type(experts).__name__ == "FP8Experts" and experts.gate_up_proj.dtype == FP8_DTYPE
        moe = layer.mlp.__dict__[SWAP_ATTR].moe
        assert isinstance(moe.w13, Fp8BlockWeight) and moe.w13.q.data_ptr() == experts.gate_up_proj.data_ptr()
    assert rows[("eager", "eager")]["errors"]["decode_tok_s"] == hf_quant.NOT_ON_CPU
    for impl in ("moekit", "moekit_blocks"):
        for mode in ("eager", "compiled"):
            row = rows[(impl, mode)]
            assert row["decode_tok_s"] > 0 and set(row["errors"]) == {"logits_rel_err_vs_eager"}
            assert 1e-4 < row["logits_rel_err_vs_fp64"] < 0.1, (impl, mode)


def test_fp8_cli_names_deepseek_v3(tmp_path):
    assert NAME in quant_models("fp8", list(MODELS)) and "gpt-oss-20b" not in quant_models("fp8", list(MODELS))
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", NAME, "--hf-quant", "fp8", "--hf-impls",
            "moekit", "--layers", "1", "--decode-tokens", "2", "--repeats", "1", "--prefill-len", "8", "--no-compile",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-fp8-*.json")
    doc = json.loads(path.read_text())
    assert doc["model"]["name"] == NAME and doc["model"]["preset"] == NAME and doc["model"]["quant"] == "fp8"
    assert doc["model"]["config"]["first_k_dense_replace"] == 0
    assert _rows(doc)[("moekit", "eager")]["decode_tok_s"] > 0


def test_quantize_a_few_experts_at_a_time_equals_the_whole_weight(monkeypatch):
    """transformers' quantize op block by block: over chunks of experts (19: two full chunks and a tail) it gives the
    whole weight's bytes and scales, and it is never handed more than ``QUANTIZE_EXPERTS`` experts."""
    import types

    import transformers
    from transformers.integrations import finegrained_fp8 as fp8

    config = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    op = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    value = torch.randn(19, 256, 384, generator=torch.Generator().manual_seed(2)) * torch.rand(19, 1, 1) * 3
    whole = op.convert({"gate_up_proj": value})
    experts = torch.nn.Module()
    experts.gate_up_proj = torch.nn.Parameter(torch.empty(19, 256, 384, dtype=torch.float8_e4m3fn),
                                              requires_grad=False)
    experts.gate_up_proj_scale_inv = torch.nn.Parameter(torch.empty(19, 2, 3), requires_grad=False)
    sizes = []
    convert = op.convert

    def spy(values):
        sizes.append(values["gate_up_proj"].shape[0])
        return convert(values)

    monkeypatch.setattr(op, "convert", spy)
    hf_quant._quantize_into(experts, op, "gate_up_proj", value)
    assert sizes == [QUANTIZE_EXPERTS, QUANTIZE_EXPERTS, 19 - 2 * QUANTIZE_EXPERTS]
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), whole["gate_up_proj"].view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv, whole["gate_up_proj_scale_inv"])
