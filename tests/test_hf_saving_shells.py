"""A freed checkpoint (``use_moekit_blocks(..., quant=..., keep_float=False)`` then ``save_pretrained``) loads its
blocks from the file's quantized tensors, never from float experts. Session 53: the load swapped the blocks with
``use_moekit_blocks(quant=...)``, which materialised and initialised ``from_pretrained``'s random float experts and
quantized them, before the file's were loaded over them (a 4-layer mxfp4 Qwen3-MoE: 50 s of a load; 0.4 s now).
Tiny models of four families built offline (random weights), one per scheme (gpt-oss: transposed experts); the
reference is the saved model's own logits before saving."""

from __future__ import annotations

import functools
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import load_quantized_experts, restore_blocks, use_moekit_blocks  # noqa: E402
from moekit.hf.saving import EXPERTS_FILE  # noqa: E402
from moekit.quant import schemes  # noqa: E402

from _swap_helpers import float_experts_devices, saved_freed, tiny_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", f"ignore:save_pretrained.*{EXPERTS_FILE}",
                                        "ignore:gpu_budget_bytes:UserWarning")
CASES = [("qwen3", "int4_w4a16", {"group_size": 32, "symmetric": True}), ("mixtral", "int8_w8a16", None),
         ("gpt-oss-20b", "mxfp4", None), ("deepseek-v3", "fp8_block", None)]


@pytest.fixture
def quantizer_calls(monkeypatch):
    """Every call of a moekit quantizer from now on: the shape of the weight it was handed."""
    calls = []
    for scheme, fn in list(schemes._QUANTIZERS.items()):
        monkeypatch.setitem(schemes._QUANTIZERS, scheme, functools.wraps(fn)(  # its signature: scheme_options reads it
            lambda w, *a, _fn=fn, **k: calls.append(tuple(w.shape)) or _fn(w, *a, **k)))
    return calls


@pytest.mark.parametrize(("name", "quant", "options"), CASES)
def test_a_freed_load_quantizes_nothing_and_leaves_the_float_experts_unmade(name, quant, options, tmp_path,
                                                                            quantizer_calls, monkeypatch):
    saved = saved_freed(name, quant, options, tmp_path)
    quantizer_calls.clear()
    experts_devices = float_experts_devices(monkeypatch)  # as transformers initialises the missing weights
    loaded, info = type(saved).from_pretrained(tmp_path, output_loading_info=True)
    assert quantizer_calls == []  # was: every block's random float experts quantized, w13 then w2
    assert experts_devices and set(experts_devices) == {"meta"}  # was: "cpu", made and initialised at random
    assert not info["missing_keys"]
    assert torch.equal(tiny_logits(loaded.eval()), torch.load(tmp_path / "saved.pt")[1])
    assert not [n for n, _ in loaded.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))]
    # restore_blocks dequantizes the loaded blocks as it does the saved model's: the same float experts, in order
    restore_blocks(saved), restore_blocks(loaded)
    loaded_floats, saved_floats = dict(loaded.named_parameters()), dict(saved.named_parameters())
    assert list(loaded_floats) == list(saved_floats)
    assert all(torch.equal(p, saved_floats[n]) and p.requires_grad == saved_floats[n].requires_grad
               for n, p in loaded_floats.items())


# run in a fresh interpreter: argv[1:] the checkpoints; every quantizer refuses to run
LOAD = """
import sys, torch
import moekit.hf
from moekit.quant import schemes
from transformers import AutoModelForCausalLM

def refuse(w, *args, **kwargs):
    raise AssertionError(f"quantized a {tuple(w.shape)} weight during a freed load")

for scheme in list(schemes._QUANTIZERS):
    schemes._QUANTIZERS[scheme] = refuse
for path in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(path)
    ids, saved = torch.load(f"{path}/saved.pt")
    with torch.no_grad():
        print("MAXDIFF", (model(ids).logits - saved).abs().max().item())
"""


def test_a_fresh_process_loads_every_scheme_bit_equal_without_quantizing(tmp_path):
    folders = []
    for name, quant, options in CASES:
        folders.append(tmp_path / quant)
        folders[-1].mkdir()
        saved_freed(name, quant, options, folders[-1])
    done = subprocess.run([sys.executable, "-c", LOAD, *map(str, folders)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # was: "quantized a (1, 1, 1) weight during a freed load"
    assert done.stdout.split() == ["MAXDIFF", "0.0"] * len(CASES)
    assert "MISSING" not in done.stderr and "moekit: loading" not in done.stderr  # a pipe: no progress line


def test_loading_many_blocks_reports_progress(tmp_path, capsys, monkeypatch):
    saved_freed("qwen3", "int8_w8a16", None, tmp_path)
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    seen = []
    load_quantized_experts(model, tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 2), (2, 2)]
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    load_quantized_experts(model, tmp_path, progress=True)
    lines = capsys.readouterr().err.splitlines()[-2:]
    assert [re.fullmatch(r"moekit: loading quantized experts: block (\d)/2 \(\d+ s\)", line)[1] for line in lines] \
        == ["1", "2"]
    with pytest.raises(TypeError, match="progress must be None"):
        load_quantized_experts(model, tmp_path, progress="yes")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())  # from_pretrained: the line on a terminal, rewritten in place
    type(model).from_pretrained(tmp_path)
    assert re.search(r"\rmoekit: loading quantized experts: block 2/2 \(\d+ s\)\n$", sys.stderr.getvalue())


def test_a_file_that_does_not_fit_the_model_is_named(tmp_path):
    saved_freed("qwen3", "int8_w8a16", None, tmp_path)
    config = hf_config("qwen3", 2, tiny=True)
    config.moe_intermediate_size *= 2
    wider = build_model(config, torch.float32, torch.device("cpu"))
    floats = [p for n, p in wider.named_parameters() if n.endswith("experts.down_proj")]
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj: the file's int8_w8a16 weight is "
                                         r"\[16, 64, 64\] \[E, R, C\], the model.s experts \[16, 128, 64\]"):
        load_quantized_experts(wider, tmp_path)
    assert [p for n, p in wider.named_parameters() if n.endswith("experts.down_proj")] == floats  # left as it was
    other = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"))
    use_moekit_blocks(other, quant="int4_w4a16", keep_float=False)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp is swapped already .*int4_w4a16.*restore_blocks"):
        load_quantized_experts(other, tmp_path)
