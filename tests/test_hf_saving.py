"""``save_pretrained`` of a model whose swapped blocks freed their float experts (``use_moekit_blocks(model,
quant=..., keep_float=False)``), and ``moekit.hf.load_quantized_experts`` after ``from_pretrained``. Session 51: the
checkpoint held the quantized buffers under moekit's names (Mixtral's renamed by transformers' conversion), and
``from_pretrained`` initialised the experts at random with a load report only: logits 1e-2 to 4e-2 off. Tiny
Qwen3-MoE / Mixtral / gpt-oss / DeepSeek-V3 models built offline (random weights): the reloaded model's logits are
bit-equal to the saved model's, which ran before saving. Session 52: ``from_pretrained`` of such a checkpoint loads the
file itself (``test_hf_saving_reload.py``: in a fresh process, the orders of operations, ``push_to_hub``)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import load_quantized_experts, offload_experts, use_moekit_blocks  # noqa: E402
from moekit.hf.saving import EXPERTS_FILE  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _swap_helpers import tiny_logits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", "ignore:gpu_budget_bytes:UserWarning")


@pytest.mark.parametrize(("name", "quant", "options"), [
    ("qwen3", "int4_w4a16", {"group_size": 32, "symmetric": True}), ("mixtral", "int8_w8a16", None),
    ("gpt-oss-20b", "mxfp4", None), ("deepseek-v3", "fp8_block", None)])
def test_a_freed_model_saved_by_transformers_loads_back_bit_equal(name, quant, options, tmp_path):
    model = build_model(hf_config(name, 2, tiny=True), torch.float32, torch.device("cpu"), seed=3)
    use_moekit_blocks(model, quant=quant, quant_options=options, keep_float=False)
    saved = tiny_logits(model)
    with pytest.warns(UserWarning, match=rf"{EXPERTS_FILE}.*experts_implementation .moekit.*from_pretrained"):
        model.save_pretrained(tmp_path)
    checkpoint = set().union(*(safe_open(str(f), "pt").keys() for f in tmp_path.glob("model*.safetensors")))
    quantized = set(safe_open(str(tmp_path / EXPERTS_FILE), "pt").keys())
    assert quantized and not checkpoint & quantized and not [k for k in checkpoint if k.endswith("_q")]  # once
    assert json.loads((tmp_path / "config.json").read_text())["experts_implementation"] == "moekit"
    plain = type(model).from_pretrained(tmp_path).eval()  # the file loaded by moekit.hf's from_pretrained
    assert torch.equal(tiny_logits(plain), saved)
    report = load_quantized_experts(plain, tmp_path)  # again, by hand: the blocks kept, the same tensors
    assert len(report.swapped) == 2 and not report.left
    assert torch.equal(tiny_logits(plain), saved)
    assert {b.path for b in report.swapped} == {p for p, m in plain.named_modules() if "_moekit_swap" in vars(m)}
    kinds = {n.rsplit(".", 1)[-1] for n, _ in plain.named_parameters()}
    assert not {"gate_up_proj", "down_proj"} & kinds  # freed again: the model holds each expert once, quantized


def test_loading_says_what_is_missing(tmp_path):
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match=rf"{EXPERTS_FILE}.*keep_float=False"):
        load_quantized_experts(model, tmp_path)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        load_quantized_experts(str(tmp_path), tmp_path)
    use_moekit_blocks(model, quant="int8_w8a16", keep_float=False)
    with pytest.warns(UserWarning):
        model.save_pretrained(tmp_path)
    other = build_model(hf_config("qwen3", 1, tiny=True), torch.float32, torch.device("cpu"))  # one layer fewer
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.*not in"):
        load_quantized_experts(other, tmp_path)
    part = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    use_moekit_blocks(part.model.layers[0], quant="int8_w8a16", keep_float=False)  # one block on its own
    with pytest.warns(UserWarning):
        part.save_pretrained(tmp_path / "part")
    # session 53: the load swapped every block (layer 1's from its checkpoint floats too), so this was refused; the
    # file's blocks alone are built now: layer 1 keeps the float experts the checkpoint holds, as saved
    loaded = type(part).from_pretrained(tmp_path / "part").eval()
    assert [p for p, m in loaded.named_modules() if "_moekit_swap" in vars(m)] == ["model.layers.0.mlp"]
    part.set_experts_implementation("moekit")  # what the saved config.json names: layer 1 runs it, loaded
    assert torch.equal(tiny_logits(loaded), tiny_logits(part))


def test_a_float_or_kept_swap_saves_as_before(tmp_path):
    """No file beside and no warning where transformers reads the checkpoint whole (the float experts kept)."""
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    use_moekit_blocks(model, quant="int8_w8a16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_pretrained(tmp_path)
    assert not (tmp_path / EXPERTS_FILE).exists()
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_moe"



def test_an_offloaded_model_saved_by_transformers_says_what_to_keep(tmp_path):
    """``offload_experts`` replaced the blocks (``OffloadedBlock``): save_pretrained wrote their experts and router
    under moekit's names, and from_pretrained initialised those blocks at random (logits 1e-2 off, a load report the
    only word). It now warns, naming the checkpoint to keep instead (torch.save of the state_dict, docs/offload.md)."""
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=3)
    offload_experts(model, gpu_budget_bytes=10**6, device="cpu", progress=False)
    offloaded = tiny_logits(model)
    with pytest.warns(UserWarning, match=r"offload_experts replaced 2 MoE blocks.*from_pretrained.*at random.*"
                                         r"torch.save\(model.state_dict\(\)\)"):
        model.save_pretrained(tmp_path)
    assert rel_l2(tiny_logits(type(model).from_pretrained(tmp_path).eval()), offloaded) > 1e-3  # what the warning says
