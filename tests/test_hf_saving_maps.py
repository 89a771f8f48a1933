"""A freed checkpoint (``use_moekit_blocks(..., quant=..., keep_float=False)`` then ``save_pretrained``) loaded under a
``device_map`` of several places, as the user whose float model does not fit loads it: accelerate's dispatch over
"cpu" and "disk" (no GPU here: ``benchmarks/load54_device_check.py`` runs a GPU + "cpu" map). Session 53 made the float
experts real and initialised them on the CPU (the whole float model's memory), then refused the block offloaded to
"disk". Tiny models built offline (random weights): DeepSeek-V3 with a shared expert and a router buffer in the
offloaded layer, gpt-oss with transposed experts and their biases. The reference is the saved model's own logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # no dependency of moekit's; the test extras install it

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import restore_blocks  # noqa: E402
from moekit.hf.saving import EXPERTS_FILE  # noqa: E402

from _swap_helpers import float_experts_devices, saved_freed, swaps, tiny_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", f"ignore:save_pretrained.*{EXPERTS_FILE}",
                                        "ignore:gpu_budget_bytes:UserWarning")
CASES = [("qwen3", "int4_w4a16", {"group_size": 32}), ("deepseek-v3", "fp8_block", None),
         ("gpt-oss-20b", "mxfp4", None)]


def _over_cpu_and_disk(disk: tuple[int, ...] = (1,)) -> dict:
    """A hand map of a tiny 2-layer model: everything on "cpu" but the decoder layers in ``disk``."""
    cpu = dict.fromkeys(("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"), "cpu")
    return {**cpu, **{f"model.layers.{i}": "disk" if i in disk else "cpu" for i in range(2)}}


@pytest.mark.parametrize(("name", "quant", "options"), CASES)
def test_a_freed_load_over_cpu_and_disk_makes_no_float_expert(name, quant, options, tmp_path, monkeypatch):
    saved_freed(name, quant, options, tmp_path)
    experts_devices = float_experts_devices(monkeypatch)  # as transformers initialises the missing weights
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, device_map=_over_cpu_and_disk(), offload_folder=str(tmp_path / "offload"), output_loading_info=True)
    assert experts_devices and set(experts_devices) == {"meta"}  # was: "cpu", made real and initialised at random
    assert not info["missing_keys"] and loaded.hf_device_map["model.layers.1"] == "disk"
    saved = torch.load(tmp_path / "saved.pt")[1]
    assert torch.equal(tiny_logits(loaded), saved)  # was: ValueError, model.layers.1.mlp ... on the meta device
    assert torch.equal(tiny_logits(loaded), saved)  # each call reads the disk layer's experts again
    assert not [n for n, _ in loaded.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    # where the quantized tensors live between calls: layer 0's on the CPU as the file holds them, layer 1's nowhere
    # in memory (meta: read from the experts file at each call), nor in accelerate's offload folder
    from safetensors.torch import load_file

    stored = load_file(tmp_path / EXPERTS_FILE)
    quantized = {n: t for n, t in loaded.named_buffers() if n in stored}
    assert len(quantized) == len(stored)
    assert all(torch.equal(t, stored[n]) for n, t in quantized.items() if n.startswith("model.layers.0."))
    assert {t.device.type for n, t in quantized.items() if n.startswith("model.layers.1.")} == {"meta"}
    offloaded = swaps(loaded)[1]
    assert {t.device.type for t in (*offloaded.moe.parameters(), *offloaded.moe.buffers())} == {"meta"}
    assert not [f for f in (tmp_path / "offload").iterdir() if any(n in f.name for n in stored)]


def test_accelerate_keeps_a_disk_layer_s_buffers_in_memory_and_moekit_does_not(tmp_path):
    """What accelerate does with the buffers of a layer on "disk": with ``offload_buffers=False`` (its default) the
    router's ``e_score_correction_bias`` stays real on the execution device, with ``True`` it is offloaded. moekit's
    quantized experts (buffers too) are offloaded under both, and the logits are the saved model's under both."""
    model = build_model(hf_config("deepseek-v3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=7)
    model.save_pretrained(tmp_path / "float")
    saved_freed("deepseek-v3", "int8_w8a16", None, tmp_path)
    saved = torch.load(tmp_path / "saved.pt")[1]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    for offload_buffers, where in ((False, "cpu"), (True, "meta")):
        load = {"device_map": _over_cpu_and_disk(), "offload_folder": str(tmp_path / f"offload-{offload_buffers}"),
                "offload_buffers": offload_buffers}
        floats = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", **load)
        assert dict(floats.named_buffers())[bias].device.type == where
        freed = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, **load)
        assert torch.equal(tiny_logits(freed), saved)
        assert {t.device.type for n, t in freed.named_buffers() if "layers.1.mlp.experts" in n} == {"meta"}


def test_device_map_auto_over_cpu_and_disk(tmp_path):
    saved_freed("qwen3", "int8_w8a16", None, tmp_path)
    floats = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    # half the float model's bytes on the CPU: transformers plans the map for the float experts (on meta, their
    # bytes counted), so the embedding and layer 0 fit, the rest goes to "disk"
    memory = {"cpu": sum(p.numel() * p.element_size() for p in floats.parameters()) // 2}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map="auto", max_memory=memory,
                                                               offload_folder=str(tmp_path / "offload"))
    assert set(loaded.hf_device_map.values()) == {"cpu", "disk"}
    assert torch.equal(tiny_logits(loaded), torch.load(tmp_path / "saved.pt")[1])


def test_an_offloaded_freed_model_saves_but_does_not_restore(tmp_path):
    (tmp_path / "first").mkdir()
    saved_freed("qwen3", "int8_w8a16", None, tmp_path / "first")
    saved = torch.load(tmp_path / "first" / "saved.pt")[1]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "first", device_map=_over_cpu_and_disk(),
                                                               offload_folder=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match=r"restore_blocks: model.layers.1.mlp's quantized experts are offloaded with "
                                         r"its layer \(device_map 'disk'"):
        restore_blocks(loaded)
    assert len(swaps(loaded)) == 2 and torch.equal(tiny_logits(loaded), saved)  # left as it was
    loaded.save_pretrained(tmp_path / "again")  # was: "Cannot copy out of meta tensor" (the disk layer's experts)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(tiny_logits(again), saved)


# run in a fresh interpreter: argv[1] the checkpoint; every quantizer refuses to run; a hand map, then "auto"
LOAD = """
import sys, torch
import moekit.hf
from moekit.quant import schemes
from transformers import AutoModelForCausalLM

def refuse(w, *args, **kwargs):
    raise AssertionError(f"quantized a {tuple(w.shape)} weight during a freed load")

for scheme in list(schemes._QUANTIZERS):
    schemes._QUANTIZERS[scheme] = refuse
path = sys.argv[1]
ids, saved = torch.load(f"{path}/saved.pt")
cpu = dict.fromkeys(("model.embed_tokens", "model.layers.0", "model.norm", "model.rotary_emb", "lm_head"), "cpu")
for where in ({"device_map": {**cpu, "model.layers.1": "disk"}}, {"device_map": "auto", "max_memory": {"cpu": 10**5}}):
    model = AutoModelForCausalLM.from_pretrained(path, offload_folder=f"{path}/offload", **where)
    with torch.no_grad():
        print("PLACES", "+".join(sorted(set(map(str, model.hf_device_map.values())))), "MAXDIFF",
              (model(ids).logits - saved).abs().max().item())
"""


def test_a_fresh_process_loads_over_cpu_and_disk_bit_equal_without_quantizing(tmp_path):
    saved_freed("qwen3", "int4_w4a16", None, tmp_path)
    done = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # was: ValueError, ... model.layers.1.mlp ... meta device
    assert done.stdout.split() == ["PLACES", "cpu+disk", "MAXDIFF", "0.0", "PLACES", "disk", "MAXDIFF", "0.0"]
    assert "MISSING" not in done.stderr
