"""A freed model's checkpoint (``use_moekit_blocks(..., quant=..., keep_float=False)`` then ``save_pretrained``) as
a user takes it back. Session 52: ``from_pretrained(path, experts_implementation="moekit")`` in a fresh process
returned random experts (transformers' load report the only word; ``load_quantized_experts`` was a step the user had
to know; transformers' load report called those experts MISSING, "newly initialized"); a process without
``moekit.hf`` did the same; ``save_pretrained(..., push_to_hub=True)`` pushed before the
experts file was written; a float model saved into the folder of an earlier freed save left that file beside it.
Tiny Qwen3-MoE models built offline; the reference is the saved model's own logits before saving."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import use_moekit_blocks  # noqa: E402
from moekit.hf.saving import EXPERTS_FILE  # noqa: E402

from _swap_helpers import TINY_IDS, tiny_logits  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", f"ignore:save_pretrained.*{EXPERTS_FILE}")


def _freed(seed: int = 3, quant: str = "int8_w8a16"):
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=seed)
    use_moekit_blocks(model, quant=quant, keep_float=False)
    return model


# run in a fresh interpreter: argv[1] the checkpoint, argv[2] the ids' and logits' file, argv[3] how to load
LOAD = """
import sys, torch
if sys.argv[3] != "without moekit.hf":
    import moekit.hf
from transformers import AutoModelForCausalLM
kwargs = {"experts_implementation": "moekit"} if sys.argv[3] == "moekit asked" else {}
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs)
except ValueError as err:
    print("REFUSED", err)
    raise SystemExit(0)
ids, saved = torch.load(sys.argv[2])
with torch.no_grad():
    print("MAXDIFF", (model(ids).logits - saved).abs().max().item())
"""


def _load_in_a_fresh_process(path: Path, how: str) -> str:
    done = subprocess.run([sys.executable, "-c", LOAD, str(path), str(path / "saved.pt"), how], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MISSING" not in done.stderr  # transformers' load report: the experts were "newly initialized"
    return done.stdout.strip().splitlines()[-1]


def test_a_fresh_process_loads_the_saved_model_back(tmp_path):
    model = _freed()
    torch.save((TINY_IDS, tiny_logits(model)), tmp_path / "saved.pt")
    model.save_pretrained(tmp_path)
    assert _load_in_a_fresh_process(tmp_path, "moekit asked") == "MAXDIFF 0.0"
    assert _load_in_a_fresh_process(tmp_path, "moekit imported") == "MAXDIFF 0.0"  # config.json names moekit
    refused = _load_in_a_fresh_process(tmp_path, "without moekit.hf")  # was: random experts, silently
    assert refused.startswith("REFUSED") and 'experts_implementation="moekit"' in refused


def test_save_then_quantize_and_quantize_then_save_into_one_folder(tmp_path):
    """A float checkpoint loaded, swapped and freed, saved over the float one; then a float model saved over that:
    each folder loads back as its last save (the earlier freed save's file is not left to load over the float one)."""
    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=5)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert torch.equal(tiny_logits(loaded), tiny_logits(model))
    use_moekit_blocks(loaded, quant="int4_w4a16", keep_float=False)
    quantized = tiny_logits(loaded)
    loaded.save_pretrained(tmp_path)
    again, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert torch.equal(tiny_logits(again.eval()), quantized)
    assert not info["missing_keys"]  # the experts loaded from the file are not reported missing
    model.save_pretrained(tmp_path)  # the float model again, into the same folder
    assert not (tmp_path / EXPERTS_FILE).exists()
    assert "experts_implementation" not in json.loads((tmp_path / "config.json").read_text())
    assert torch.equal(tiny_logits(type(model).from_pretrained(tmp_path).eval()), tiny_logits(model))


class _Hub:
    """huggingface_hub's API as transformers calls it to push, offline: each commit's files copied into ``folder``
    (the repository)."""

    def __init__(self, folder: Path):
        self.folder, self.commits = folder, []

    def create_repo(self, repo_id, **kwargs):
        return types.SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        self.commits.append(sorted(op.path_in_repo for op in operations))
        for op in operations:
            target = self.folder / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(Path(op.path_or_fileobj).read_bytes())


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import transformers.modeling_utils as modeling
    import transformers.utils.hub as hub_utils

    fake = _Hub(tmp_path / "hub")
    card = types.SimpleNamespace(save=lambda path: Path(path).write_text("card\n"))
    monkeypatch.setattr(hub_utils, "hf_api", lambda: fake)
    monkeypatch.setattr(modeling, "hf_api", lambda: fake, raising=False)
    monkeypatch.setattr(hub_utils, "create_and_tag_model_card", lambda *a, **k: card)
    monkeypatch.setattr(modeling, "create_and_tag_model_card", lambda *a, **k: card, raising=False)
    return fake


@pytest.mark.parametrize("how", ["save_pretrained(push_to_hub=True)", "push_to_hub"])
def test_a_pushed_repository_holds_the_experts_and_loads_back(how, tmp_path, hub):
    model = _freed()
    saved = tiny_logits(model)
    if how == "push_to_hub":
        model.push_to_hub("me/tiny")
    else:  # transformers pushes inside the call: the file was written after the upload
        model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/tiny")
        assert (tmp_path / "local" / EXPERTS_FILE).is_file()
    assert len(hub.commits) == 1 and EXPERTS_FILE in hub.commits[0] and "config.json" in hub.commits[0]
    assert not hasattr(model.config, "experts_implementation") and "_upload_modified_files" not in vars(model)
    assert torch.equal(tiny_logits(type(model).from_pretrained(hub.folder).eval()), saved)


def test_a_file_of_that_name_not_written_by_moekit_is_named(tmp_path):
    from safetensors.torch import save_file

    model = build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=3)
    model.save_pretrained(tmp_path)
    save_file({"x": torch.zeros(2)}, str(tmp_path / EXPERTS_FILE))  # someone else's file, no metadata
    with pytest.raises(ValueError, match=rf"{EXPERTS_FILE} has no 'moekit_swap' metadata.*not written by"):
        type(model).from_pretrained(tmp_path)


def test_the_base_model_loads_the_experts_of_a_checkpoint_with_its_head(tmp_path):
    """``AutoModel.from_pretrained`` of a ``...ForCausalLM`` checkpoint (transformers drops the ``model.`` prefix of
    the rest): the file's blocks are the base model's own (was: "holds blocks [...] not in model")."""
    model = _freed()
    with torch.no_grad():
        saved = model.model(TINY_IDS).last_hidden_state
    model.save_pretrained(tmp_path)
    base, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(base).__name__ == "Qwen3MoeModel" and not info["missing_keys"]
    with torch.no_grad():
        assert torch.equal(base.eval()(TINY_IDS).last_hidden_state, saved)
