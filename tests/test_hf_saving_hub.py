"""A freed model's checkpoint (``use_moekit_blocks(..., keep_float=False)`` then ``save_pretrained``) loaded from a hub
repository, offline: a fake hub in huggingface_hub's own cache layout (``models--me--tiny/refs/main`` naming a
snapshot folder), read by transformers' real ``cached_file`` with ``local_files_only=True``. Session 52 fetched the
experts file only where the loaded config named ``"moekit"``: ``experts_implementation="eager"`` got random experts
(logits 3e-2 off) and transformers' report, and every hub load printed that report (MISSING, "newly initialized").
Tiny Qwen3-MoE models built offline; the reference is the saved model's own logits before saving."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import use_moekit_blocks  # noqa: E402
from moekit.hf.loading import find_saved_experts, load_quantized_experts  # noqa: E402
from moekit.hf.saving import EXPERTS_FILE  # noqa: E402

from _swap_helpers import tiny_logits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*rope.*:UserWarning", f"ignore:save_pretrained.*{EXPERTS_FILE}")
REPO = "me/tiny"


def _tiny(seed: int = 3):
    return build_model(hf_config("qwen3", 2, tiny=True), torch.float32, torch.device("cpu"), seed=seed)


def _publish(folder: Path, cache: Path, leave_out: str | None = None) -> Path:
    """``folder``'s files as the hub cache holds ``REPO`` after a download (but ``leave_out``); returns ``cache``."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        if file.name != leave_out:
            shutil.copy(file, snapshot / file.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return cache


@pytest.fixture
def reports():
    """What transformers logs while the test runs (its load report among it)."""
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield logged
    logger.removeHandler(handler)


@pytest.fixture(scope="module")
def freed_hub(tmp_path_factory):
    """A freed int8 model's logits, and the hub cache holding its checkpoint."""
    model = _tiny()
    use_moekit_blocks(model, quant="int8_w8a16", keep_float=False)
    folder = tmp_path_factory.mktemp("saved")
    model.save_pretrained(folder)
    return tiny_logits(model), _publish(folder, tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("implementation", [None, "eager", "grouped_mm", "moekit"])
def test_a_hub_repository_loads_its_experts_whatever_implementation_is_named(implementation, freed_hub, reports):
    saved, cache = freed_hub
    named = {"experts_implementation": implementation} if implementation else {}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        REPO, cache_dir=cache, local_files_only=True, output_loading_info=True, **named)
    assert torch.equal(tiny_logits(model.eval()), saved)  # was (eager, grouped_mm): 3e-2 off, random experts
    assert not info["missing_keys"]
    assert not [r for r in reports if "MISSING" in r]  # was: transformers' load report for every hub load


def test_the_plain_return_of_a_hub_load_is_the_model(freed_hub):
    saved, cache = freed_hub
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache, local_files_only=True)
    assert isinstance(model, transformers.PreTrainedModel)
    assert torch.equal(tiny_logits(model.eval()), saved)


@pytest.mark.parametrize("implementation", [None, "eager"])
@pytest.mark.parametrize("where", ["hub", "folder"])
def test_a_checkpoint_whose_experts_file_is_not_at_hand_is_refused(where, implementation, tmp_path, monkeypatch,
                                                                   reports):
    """The cache (or a folder copied without it) holds the checkpoint but not its experts file (a partial download,
    offline): a load would get random experts (was: it did, with transformers' report); it stops naming the file,
    before transformers reads the checkpoint (was, session 53: after it, its report printed), asking the hub for
    nothing but the experts file (its config.json and weight names read from the cache)."""
    import transformers.utils.hub as hub_utils

    model = _tiny()
    use_moekit_blocks(model, quant="int4_w4a16", keep_float=False)
    model.save_pretrained(tmp_path / "saved")
    cache = _publish(tmp_path / "saved", tmp_path / "cache", leave_out=EXPERTS_FILE)
    (tmp_path / "saved" / EXPERTS_FILE).unlink()
    source, kwargs = (REPO, {"cache_dir": cache, "local_files_only": True}) if where == "hub" else (
        tmp_path / "saved", {})
    named = {"experts_implementation": implementation} if implementation else {}
    asked = []

    def read(*args, **kw):
        raise AssertionError("transformers read the checkpoint")  # was, session 53 (then refused after the read)

    monkeypatch.setattr(transformers.PreTrainedModel, "_load_pretrained_model", staticmethod(read))
    cached_file = hub_utils.cached_file
    monkeypatch.setattr(hub_utils, "cached_file", lambda repo, name, **kw: asked.append(name) or cached_file(
        repo, name, **kw))
    with pytest.raises(FileNotFoundError, match=rf"{source}.*{EXPERTS_FILE}.*random"):
        transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs, **named)
    assert not [r for r in reports if "MISSING" in r]
    assert asked == ([EXPERTS_FILE] if where == "hub" else [])


def test_a_float_checkpoint_whose_config_names_moekit_loads(tmp_path):
    """A float checkpoint whose config.json names ``"moekit"`` by hand (``config.experts_implementation``), no experts
    file beside it: its weights hold the experts, so it is not refused before the load, and loads them."""
    model = _tiny(seed=5)
    model.config.experts_implementation = "moekit"
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["experts_implementation"] == "moekit"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    model.set_experts_implementation("eager")
    assert torch.equal(tiny_logits(loaded.eval()), tiny_logits(model))


def test_a_float_hub_checkpoint_loads_as_before(tmp_path, reports):
    """No experts file in the repository, its config naming no moekit: transformers' load, bit-equal to the model."""
    model = _tiny(seed=4)
    model.set_experts_implementation("eager")
    model.save_pretrained(tmp_path / "saved")
    assert "experts_implementation" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    cache = _publish(tmp_path / "saved", tmp_path / "cache")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache, local_files_only=True,
                                                               experts_implementation="eager")
    assert torch.equal(tiny_logits(loaded.eval()), tiny_logits(model))
    assert not [r for r in reports if "MISSING" in r]


def test_the_load_keywords_say_where_the_file_is_fetched_from(tmp_path, monkeypatch):
    """A repository id: transformers' ``cached_file`` asked for the file with the load's keywords that say where
    (``revision=``, ``token=``, ...), whatever its config names; a folder's file is its own (``subfolder=``)."""
    import transformers.utils.hub as hub_utils

    asked = []

    def cached_file(repo, filename, **kwargs):
        asked.append((repo, filename, kwargs.get("revision"), kwargs.get("token"), "dtype" in kwargs))
        return str(tmp_path / filename)

    monkeypatch.setattr(hub_utils, "cached_file", cached_file)
    kwargs = {"revision": "v1", "token": "t", "dtype": torch.float32, "experts_implementation": "eager"}
    assert find_saved_experts(REPO, kwargs) == tmp_path / EXPERTS_FILE
    assert asked == [(REPO, EXPERTS_FILE, "v1", "t", False)]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / EXPERTS_FILE).write_bytes(b"")
    assert find_saved_experts(tmp_path, {"subfolder": "sub"}) == tmp_path / "sub" / EXPERTS_FILE
    assert find_saved_experts(tmp_path, {}) is None and len(asked) == 1  # a folder: no hub request


def test_load_quantized_experts_takes_a_repository_id(freed_hub):
    """By hand, for a model built otherwise (``from_config``): a repository id, with the hub's keywords, as
    ``from_pretrained`` takes it (was: ``FileNotFoundError: me/tiny/moekit_quantized_experts.safetensors``)."""
    from safetensors.torch import load_file

    _, cache = freed_hub
    where = {"cache_dir": cache, "local_files_only": True}
    config = transformers.AutoConfig.from_pretrained(REPO, **where)
    model = transformers.AutoModelForCausalLM.from_config(config)  # random weights throughout
    report = load_quantized_experts(model, REPO, **where)
    assert [b.path for b in report.swapped] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    file = load_file(transformers.utils.hub.cached_file(REPO, EXPERTS_FILE, **where))
    state = model.state_dict()
    assert file and all(torch.equal(state[name], t) for name, t in file.items())
    with pytest.raises(TypeError, match=r"load_quantized_experts: unexpected keyword 'dtype'; it takes .*revision"):
        load_quantized_experts(model, REPO, dtype=torch.float32)
