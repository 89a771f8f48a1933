"""``moekit bench --hf --hf-quant fp8`` on the CPU: the model's experts really are transformers' fp8 experts,
moekit's logits on them match a float64 emulation of DeepSeek-V3's recipe written here, the CLI's JSON has
the fp8 rows (transformers' own fp8 experts recorded as not run on the CPU), and bad values name the flag.

Shapes: E experts, N expert width, K hidden width, T tokens, k experts a token, V vocabulary."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers.integrations.finegrained_fp8", reason="transformers >= 5 is part of the test extras")

from moekit.bench.hf_models import build_model, hf_config, model_names, select_impls  # noqa: E402
from moekit.bench.hf_quant import (  # noqa: E402
    FP8_TINY, NOT_ON_CPU, dequantized_float64, quant_models, quantize_experts_fp8,
)
from moekit.cli import main  # noqa: E402

from _helpers import cli_error  # noqa: E402

E4M3_MAX = 448.0
BLOCK = 128


def _fp8_model(name: str, layers: int = 1):
    """(the tiny fp8 model, its experts' float weights before quantization: path -> name -> tensor)."""
    config = hf_config(name, layers, tiny=True)
    config.update(FP8_TINY[name])
    model = build_model(config, torch.float32, torch.device("cpu"))
    original = {path: {k: p.detach().clone() for k, p in m.named_parameters()}
                for path, m in model.named_modules() if path.endswith(".experts")}
    assert quantize_experts_fp8(model) == layers
    return model, original


def _blockwise(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[E, R, C] e4m3 x one scale per 128 x 128 block, element by block in float64 (a loop, not a broadcast)."""
    out = torch.empty(w_fp8.shape, dtype=torch.float64)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[:, rows, cols] = w_fp8[:, rows, cols].double() * scale[:, i, j, None, None].double()
    return out


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek-v3"])
def test_fp8_model_experts_are_transformers_fp8_experts(name):
    from moekit.quant.hf import fp8_experts_weights

    model, original = _fp8_model(name)
    for path, weights in original.items():
        experts = model.get_submodule(path)
        assert type(experts).__name__ == "FP8Experts"
        e, two_n, k = experts.gate_up_proj.shape
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
        assert experts.gate_up_proj_scale_inv.dtype == torch.float32
        assert experts.gate_up_proj_scale_inv.shape == (e, two_n // BLOCK, k // BLOCK)
        assert experts.down_proj_scale_inv.shape == (e, k // BLOCK, two_n // 2 // BLOCK)
        w13, w2 = fp8_experts_weights(experts)  # what moekit reads: the module's own tensors, no copy
        assert w13.q.data_ptr() == experts.gate_up_proj.data_ptr() and w2.scale.data_ptr() == \
            experts.down_proj_scale_inv.data_ptr()
        for key in ("gate_up_proj", "down_proj"):
            value = _blockwise(getattr(experts, key), getattr(experts, key + "_scale_inv"))
            err = (value - weights[key].double()).norm() / weights[key].double().norm()
            assert 1e-3 < err < 0.04  # e4m3's rounding of these weights: quantized, and not a layout mistake (~1)
            assert torch.equal(dequantized_float64(model)[f"{path}.{key}"], value)
    others = [m for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert others and all(m.weight.dtype == torch.float32 for m in others)  # attention, LM head: float


def test_dequantized_float64_block_tails():
    """Weights whose rows and columns are not multiples of the block: the tail blocks take their own scale."""
    module = torch.nn.Module()
    module.block_size = (BLOCK, BLOCK)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 200, 300, generator=g).to(torch.float8_e4m3fn)  # [E, R, C]: 2 x 3 blocks, both tails short
    module.weight = torch.nn.Parameter(w, requires_grad=False)
    module.weight_scale_inv = torch.rand(2, 2, 3, generator=g) + 0.5
    (value,) = dequantized_float64(module).values()
    assert torch.equal(value, _blockwise(w, module.weight_scale_inv))


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, C] float64 -> the values an fp8 GEMM sees: each token's 128-column block scaled to amax 448,
    rounded to e4m3, scaled back."""
    t, c = x.shape
    blocks = x.view(t, c // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return ((blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() * scale).view(t, c)


def _float64_recipe(self, hidden_states, top_k_index, top_k_weights):
    """The recipe token by token in float64: x [T, K], top_k_index / top_k_weights [T, k] -> [T, K]."""
    w13 = _blockwise(self.gate_up_proj, self.gate_up_proj_scale_inv)  # [E, 2N, K]
    w2 = _blockwise(self.down_proj, self.down_proj_scale_inv)  # [E, K, N]
    x = hidden_states.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(top_k_index.shape[1]):
            e = int(top_k_index[t, slot])
            gate, up = (_e4m3_rows(x[t:t + 1]) @ w13[e].T).chunk(2, dim=-1)  # [1, N] each
            h = torch.nn.functional.silu(gate) * up
            out[t] += top_k_weights[t, slot].double() * (_e4m3_rows(h) @ w2[e].T)[0]
    return out.to(hidden_states.dtype)


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek-v3"])
def test_moekit_logits_match_a_float64_emulation_of_the_recipe(name, monkeypatch):
    """Through transformers' FP8ExpertsInterface, "moekit" on the fp8 model gives the logits of the recipe
    run in float64 here (its float32 scales round a rare element the other way), far closer than the
    stored weights without activation rounding (the float64 reference of the bench)."""
    import moekit.hf  # noqa: F401  (registers "moekit")
    from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface

    # registered for this test only (FP8ExpertsInterface.register would keep it for the session)
    monkeypatch.setitem(FP8ExpertsInterface._global_mapping, "test_float64_recipe", _float64_recipe)
    model, _ = _fp8_model(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    logits = {}
    with torch.no_grad():
        for impl in ("moekit", "test_float64_recipe"):
            model.set_experts_implementation(impl)
            logits[impl] = model(ids).logits.double()
        model.set_experts_implementation("eager")  # FP8Experts' loop takes a float weight as a plain linear
        tensors = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
        tensors.update(dequantized_float64(model))
        no_activation_rounding = torch.func.functional_call(model, tensors, (ids,)).logits
    ref = logits["test_float64_recipe"]
    err = ((logits["moekit"] - ref).norm() / ref.norm()).item()
    far = ((no_activation_rounding - ref).norm() / ref.norm()).item()
    print(f"{name}: moekit vs the float64 recipe {err:.2e}; stored weights without activation rounding {far:.2e}")
    assert err < 1e-5 and far > 100 * err


def test_fp8_implementations_and_models():
    impls = select_impls(None, "fp8")
    assert impls[0] == "eager" and {"moekit", "grouped_mm", "batched_mm"} <= set(impls)
    assert "deepgemm_megamoe" not in impls and "sonicmoe" not in impls  # load-time only; no fp8 form
    assert "moekit_blocks" in select_impls(["moekit_blocks"], "fp8")
    assert quant_models("fp8", model_names()) == ["qwen3", "mixtral", "deepseek-v3"]
    assert quant_models(None, ["x"]) == ["x"]
    with pytest.raises(ValueError, match="hf-impls"):
        select_impls(["sonicmoe"], "fp8")


def test_bench_hf_fp8_tiny_cli(tmp_path, capsys):
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--hf-quant", "fp8", "--hf-impls",
            "moekit,grouped_mm", "--layers", "1", "--decode-tokens", "2", "--repeats", "1", "--prefill-len", "8",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-fp8-*.json")
    doc = json.loads(path.read_text())
    assert doc["model"]["quant"] == doc["settings"]["quant"] == "fp8" and "FP8Experts" in doc["method"]
    rows = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {("eager", "eager"), ("moekit", "eager"), ("grouped_mm", "eager"), ("moekit", "compiled"),
                         ("grouped_mm", "compiled")}
    for key in (("eager", "eager"), ("grouped_mm", "eager"), ("grouped_mm", "compiled")):  # not passing: not run
        row = rows[key]
        assert row["decode_tok_s"] is None and row["logits_rel_err_vs_fp64"] is None
        assert row["errors"]["decode_tok_s"] == row["errors"]["logits_rel_err_vs_fp64"] == NOT_ON_CPU
    for mode in ("eager", "compiled"):
        row = rows[("moekit", mode)]
        assert row["decode_tok_s"] > 0 and set(row["errors"]) == {"logits_rel_err_vs_eager"}
        assert row["errors"]["logits_rel_err_vs_eager"].startswith("NoReference")  # eager: not on the CPU
        # the recipe's activation rounding against the stored weights in float64: above float32's 1e-5, far
        # below a wrong layout or unscaled weights (~1)
        assert 1e-4 < row["logits_rel_err_vs_fp64"] < 3e-2
    assert rows[("moekit", "eager")]["prefill_ms"] > 0
    out = capsys.readouterr().out
    assert "fp8 experts" in out and "not on CPU" in out and "no reference" in out


def test_moekit_blocks_keep_the_fp8_experts():
    """use_moekit_blocks on the fp8 model: moe_from_hf keeps the experts fp8, so the row carries the recipe's
    activation rounding against the float64 reference (a float MoE of the dequantized weights would be ~1e-7)."""
    from moekit.bench.hf_run import default_options, run_hf_bench

    opts = default_options("qwen3", torch.device("cpu"), tiny=True, layers=1, impls=("moekit", "moekit_blocks"),
                           compile=False, repeats=1, decode_tokens=2, prefill_len=8, quant="fp8")
    rows = {r["impl"]: r for r in run_hf_bench(torch.device("cpu"), opts)["rows"]}
    for impl in ("moekit", "moekit_blocks"):
        assert rows[impl]["decode_tok_s"] > 0 and 1e-4 < rows[impl]["logits_rel_err_vs_fp64"] < 3e-2


@pytest.mark.parametrize("argv", [
    ["--hf-quant", "int4"],
    ["--hf-quant", "fp8", "--hf-model", "gpt-oss-20b"],
])
def test_bench_hf_bad_quant_names_the_flag(argv, capsys):
    assert "--hf-quant" in cli_error(capsys, ["bench", "--hf", "--tiny", "--device", "cpu"] + argv)
