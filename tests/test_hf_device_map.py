"""moekit under ``from_pretrained(..., device_map=...)`` and transformers' fine-grained fp8 checkpoints, as a user
loads them. Session 52: a device_map that offloads a block (accelerate keeps its weights on the meta device between
forwards) failed ``use_moekit_blocks`` deep inside a probe ("Tensor.item() cannot be called on meta tensors"); a block
accelerate hooked (a device_map over several devices) was reported swapped while the hook kept calling its own
forward; an fp8 checkpoint loaded without ``FP8Experts`` (no GPU) failed with "x, w13 and w2 must share a dtype".
accelerate is not a dependency of moekit (the test extras install it): the first tests write its hook as it sets one
(``_old_forward`` and a forward on the instance) and let the meta device stand for its offload; the last runs
accelerate itself."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import load_quantized_experts, moe_from_hf, restore_blocks, use_moekit_blocks  # noqa: E402

from _swap_helpers import tiny_logits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", "ignore:save_pretrained:UserWarning")


def _model(seed: int = 3):
    return build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=seed)


def _hook_like_accelerate(module: torch.nn.Module) -> None:
    """accelerate's ``add_hook_to_module``: the forward of that moment kept as ``_old_forward``, and a forward set on
    the instance that calls it (around its device moves)."""
    module._old_forward = module.forward
    module.forward = functools.partial(lambda m, *args, **kwargs: m._old_forward(*args, **kwargs), module)


def test_a_hooked_block_runs_the_swap_and_its_own_forward_after_restore():
    plain, hooked = _model(), _model()
    floats = tiny_logits(plain)
    for layer in hooked.model.layers:
        _hook_like_accelerate(layer.mlp)
    assert torch.equal(tiny_logits(hooked), floats)
    use_moekit_blocks(plain, quant="int8_w8a16")
    report = use_moekit_blocks(hooked, quant="int8_w8a16")
    assert len(report.swapped) == 2
    swapped = tiny_logits(plain)
    assert (swapped - floats).abs().max() > 1e-5  # int8 experts: the swap is seen in the logits
    assert torch.equal(tiny_logits(hooked), swapped)  # was: equal to floats, the hook calling the own forward
    assert restore_blocks(hooked) == 2 and torch.equal(tiny_logits(hooked), floats)


def test_a_block_on_the_meta_device_is_left_naming_why(tmp_path):
    model = _model()
    block = model.model.layers[1].mlp.to("meta")  # what accelerate leaves of a block it offloads to 'cpu' / 'disk'
    with pytest.raises(ValueError, match=r"experts.gate_up_proj is on the meta device .*device_map"):
        moe_from_hf(block)
    with pytest.warns(UserWarning, match=r"1 of 2 MoE blocks left.*meta device"):
        report = use_moekit_blocks(model, quant="int8_w8a16")
    assert [b.path for b in report.swapped] == ["model.layers.0.mlp"]
    assert [b.path for b in report.left] == ["model.layers.1.mlp"] and "meta device" in report.left[0].reason
    saved = _model()
    use_moekit_blocks(saved, quant="int8_w8a16", keep_float=False)
    saved.save_pretrained(tmp_path)
    target = _model()
    target.model.layers[1].mlp.to("meta")
    with pytest.raises(ValueError, match=r"holds the experts of \['model.layers.1.mlp'\].*could not swap.*meta"):
        load_quantized_experts(target, tmp_path)


def test_fp8_experts_without_their_scales_say_what_happened():
    """transformers 5.25 on a machine without a GPU (or ``dequantize=True``) leaves a fine-grained fp8 checkpoint's
    experts e4m3 and drops their scales; its own eager fails on the dtypes too."""
    import moekit.hf  # noqa: F401  (registers "moekit")

    model = _model()
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj.data = experts.gate_up_proj.data.to(torch.float8_e4m3fn)
    message = r"Qwen3MoeExperts.gate_up_proj is torch.float8_e4m3fn without its gate_up_proj_scale_inv.*on a GPU"
    with pytest.raises(TypeError, match=message):  # the plans are built here (from_pretrained's wrapper too)
        model.set_experts_implementation("moekit")
    with pytest.raises(TypeError, match=message):  # and at a call
        tiny_logits(model)


def test_accelerate_device_maps_through_moekit(tmp_path):
    """Where accelerate is installed (it is no dependency of moekit's tests): a float checkpoint under a device_map
    that offloads a layer to disk runs the experts implementation and the blocks (the offloaded one left, naming
    why); a freed checkpoint loads under a one-device map and under an offloading one (session 53: refused naming the
    offloaded block; test_hf_saving_maps.py holds the offloading maps)."""
    pytest.importorskip("accelerate")
    model = _model()
    floats = tiny_logits(model)
    model.save_pretrained(tmp_path / "float")
    use_moekit_blocks(model, quant="int8_w8a16", keep_float=False)
    freed = tiny_logits(model)
    model.save_pretrained(tmp_path / "freed")
    offloaded = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                 "model.rotary_emb": "cpu", "lm_head": "cpu"}
    load = functools.partial(type(model).from_pretrained, offload_folder=str(tmp_path / "offload"))
    on_disk = load(tmp_path / "float", device_map=offloaded, experts_implementation="moekit").eval()
    assert (tiny_logits(on_disk) - floats).abs().max() < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = use_moekit_blocks(on_disk)
    assert [b.path for b in report.swapped] == ["model.layers.0.mlp"] and "meta device" in report.left[0].reason
    assert (tiny_logits(on_disk) - floats).abs().max() < 1e-5
    assert torch.equal(tiny_logits(load(tmp_path / "freed", device_map="cpu").eval()), freed)
    assert torch.equal(tiny_logits(load(tmp_path / "freed", device_map=offloaded).eval()), freed)
