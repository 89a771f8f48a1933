"""A freed checkpoint (``use_moekit_blocks(..., quant=..., keep_float=False)`` then ``save_pretrained``) holds a
zero-size stand-in under each freed block's float experts' names, so that a process without ``moekit.hf`` that names
another experts implementation (``from_pretrained(path, experts_implementation="eager")``) stops on their size
instead of running random experts (session 53: it loaded them, transformers' MISSING report the only word).
moekit's load takes them for missing and loads the file's blocks; a folder saved before (no stand-ins) still loads.
Tiny models built offline: Qwen3-MoE (its checkpoint splits the fused experts per expert) and gpt-oss (fused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf.saving import EXPERTS_FILE  # noqa: E402

from _swap_helpers import saved_freed, tiny_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", f"ignore:save_pretrained.*{EXPERTS_FILE}")
CASES = [("qwen3", "int8_w8a16"), ("gpt-oss-20b", "mxfp4")]

# run in a fresh interpreter that never imports moekit: argv[1] the checkpoint, argv[2] ignore_mismatched_sizes
PLAIN = """
import sys, torch
from transformers import AutoModelForCausalLM

path, ignore = sys.argv[1], sys.argv[2] == "1"
ids, saved = torch.load(f"{path}/saved.pt")
try:
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", ignore_mismatched_sizes=ignore)
except RuntimeError as err:
    print("REFUSED", str(err)[:80])
else:
    with torch.no_grad():
        print("MAXDIFF", (model(ids).logits - saved).abs().max().item())
"""


def _stand_ins(folder: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys() if k.endswith(("experts.gate_up_proj",
                                                                                  "experts.down_proj"))}


@pytest.mark.parametrize(("name", "quant"), CASES)
def test_a_process_without_moekit_stops_on_a_freed_checkpoint(name, quant, tmp_path):
    saved_freed(name, quant, None, tmp_path)
    assert _stand_ins(tmp_path) == {f"model.layers.{i}.mlp.experts.{w}": [0] for i in range(2)
                                    for w in ("gate_up_proj", "down_proj")}
    run = [sys.executable, "-c", PLAIN, str(tmp_path)]
    done = subprocess.run([*run, "0"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # was: MAXDIFF 0.03 (random experts), transformers' MISSING report the only word
    assert done.stdout.startswith("REFUSED You set `ignore_mismatched_sizes` to `False`"), done.stdout
    assert "model.layers.{0, 1}.mlp.experts.gate_up_proj" in done.stderr and "MISMATCH" in done.stderr
    forced = subprocess.run([*run, "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert forced.stdout.startswith("MAXDIFF") and float(forced.stdout.split()[1]) > 1e-3  # asked for: random
    assert "MISMATCH" in forced.stderr  # and said in transformers' report


def test_moekit_loads_the_stand_ins_and_an_older_folder_without_them(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    saved_freed("qwen3", "int4_w4a16", None, tmp_path)
    saved = torch.load(tmp_path / "saved.pt")[1]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert torch.equal(tiny_logits(model), saved)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # a folder saved before session 54: the same checkpoint without the stand-ins
    stand_ins = _stand_ins(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        rest = {k: f.get_tensor(k) for k in f.keys() if k not in stand_ins}
        metadata = f.metadata()
    size = (tmp_path / "model.safetensors").stat().st_size
    save_file(rest, str(tmp_path / "model.safetensors"), metadata=metadata)
    assert 0 < size - (tmp_path / "model.safetensors").stat().st_size < 200 * len(stand_ins)  # their header alone
    older = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(tiny_logits(older), saved)
    (tmp_path / EXPERTS_FILE).unlink()  # without its file: refused after the read (no stand-ins to say so before)
    with pytest.raises(FileNotFoundError, match=rf"{EXPERTS_FILE} is not at hand.*experts.down_proj, ... would be"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_the_stand_ins_without_the_experts_file_are_refused_naming_it(tmp_path):
    saved_freed("qwen3", "int8_w8a16", None, tmp_path)
    (tmp_path / EXPERTS_FILE).unlink()
    assert json.loads((tmp_path / "config.json").read_text())["experts_implementation"] == "moekit"
    with pytest.raises(FileNotFoundError, match=rf"{EXPERTS_FILE} is not at hand.*random"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
