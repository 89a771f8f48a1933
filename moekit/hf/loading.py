"""``from_pretrained`` of a checkpoint with moekit's quantized experts beside it (``saving.EXPERTS_FILE``): the file
found before transformers loads (a folder's, or a hub repository's through transformers' ``cached_file``, whatever
experts implementation is named), its blocks' float experts told to transformers as not missing, the file loaded after
the load; a checkpoint whose config names ``"moekit"`` with experts left missing and no file at hand is refused.

Session 52 fetched a hub repository's file after the load and only where the loaded config named ``"moekit"``:
``experts_implementation="eager"`` got random experts (transformers' load report the only word), and every hub load
printed that report. ``set_check.wrap_from_pretrained`` calls these, in order: ``find_saved_experts``,
``expecting_saved_experts`` around transformers' load, ``load_saved_experts`` after it. Within the load the file's
float experts stay on the meta device (``wrap_missing_keys_move``); the blocks are built from the file
(``swap_load``); until session 53 ``from_pretrained``'s random float experts were quantized first, for nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import re
from pathlib import Path

from torch import nn

from moekit._checks import check_module
from moekit.hf.progress import Progress
from moekit.hf.saving import EXPERTS_FILE, load_saved_file, saved_blocks
from moekit.hf.set_check import IMPLEMENTATION, is_interface_experts
from moekit.hf.swap_free import FLOAT_NAMES
from moekit.hf.swap_offload import hidden as hidden_tensors

# from_pretrained's keywords that say where a checkpoint's files are (transformers' cached_file takes them)
_WHERE = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
_WRAPPED = "_moekit_keeps_saved_experts_on_meta"  # set on the wrapper: a second import wraps nothing


def _fetch(source, filename: str, kwargs: dict) -> Path | None:
    """``filename`` of ``from_pretrained(source, **kwargs)``'s checkpoint, local: a folder's own (``subfolder=``
    within it), a hub repository's through transformers' ``cached_file`` (its cache, or a download); None where
    it has none, or it cannot be had (offline, a bad id: transformers' own load says what is wrong with the id)."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    where = {k: kwargs[k] for k in _WHERE if kwargs.get(k) is not None}
    if Path(source).is_dir():
        return _at_hand(source, filename, kwargs)
    from transformers.utils.hub import cached_file

    try:
        found = cached_file(str(source), filename, _raise_exceptions_for_missing_entries=False,
                            _raise_exceptions_for_connection_errors=False, **where)
    except (OSError, ValueError):  # a malformed id (HFValidationError is a ValueError), a gated repository
        return None
    return Path(found) if found else None


def find_saved_experts(source, kwargs: dict) -> Path | None:
    """The ``EXPERTS_FILE`` of ``from_pretrained(source, **kwargs)``'s checkpoint, local; None where it has none."""
    return _fetch(source, EXPERTS_FILE, kwargs)


def load_quantized_experts(model: nn.Module, path: str | os.PathLike, *, progress: Progress = None, **where):
    """Give ``model`` (built from a checkpoint ``save_pretrained`` wrote from a model whose swapped blocks freed
    their float experts, without ``from_pretrained``'s own load of them: ``from_config``, a load before ``moekit.hf``
    was imported) those blocks back: each named in ``EXPERTS_FILE`` swapped with the options it was saved with
    (``use_moekit_blocks(..., keep_float=False)``), then its quantized experts loaded; returns the swap's
    ``BlockSwapReport``. ``path``: a folder, or a hub repository id (``where``: ``from_pretrained``'s keywords that
    say where its files are, ``revision=``, ``token=``, ``cache_dir=``, ``local_files_only=`` ...). FileNotFoundError
    where it has no such file; ValueError where the model lacks a block the file holds, or the file's blocks were
    swapped with different options. The blocks are built from the file's tensors, their float experts never
    quantized (``swap_load``); ``progress`` as ``use_moekit_blocks`` takes it (a line a block on a terminal)."""
    check_module("model", model)
    unknown = sorted(set(where) - set(_WHERE))
    if unknown:
        raise TypeError(f"load_quantized_experts: unexpected keyword {unknown[0]!r}; it takes {', '.join(_WHERE)}")
    file = find_saved_experts(path, where)
    if file is None:
        raise FileNotFoundError(f"{Path(path, where.get('subfolder', ''), EXPERTS_FILE)}: no such file (a folder's, or "
                                "a hub repository's); save_pretrained writes it for a model whose swapped blocks "
                                "freed their float experts (use_moekit_blocks(..., keep_float=False))")
    return load_saved_file(model, file, progress)


_SAVED_BLOCKS: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("moekit_saved_blocks", default=())


@contextlib.contextmanager
def expecting_saved_experts(file: Path | None):
    """While ``from_pretrained`` loads: the block paths ``file`` holds (its metadata), for
    ``ignore_saved_experts_missing``."""
    token = _SAVED_BLOCKS.set(saved_blocks(file) if file is not None else ())
    try:
        yield
    finally:
        _SAVED_BLOCKS.reset(token)


def ignore_saved_experts_missing(model: nn.Module) -> None:
    """``post_init`` of a model ``from_pretrained`` builds within ``expecting_saved_experts``: the float experts of the
    file's blocks join transformers' ``_keys_to_ignore_on_load_missing`` (patterns on the model's own names), so its
    load report does not call them missing and "newly initialized": ``load_saved_experts`` loads them next."""
    blocks = _experts_of_saved_blocks(model)
    if blocks is not None and isinstance(getattr(model, "_keys_to_ignore_on_load_missing", None), set):
        model._keys_to_ignore_on_load_missing.add(blocks)


def _experts_of_saved_blocks(model: nn.Module) -> str | None:
    """A pattern on the model's own names, ``<block>.experts.``, for the blocks ``expecting_saved_experts`` holds
    (None where it holds none); their paths with the model's ``base_model_prefix`` or without (``saving._rebased``)."""
    blocks = _SAVED_BLOCKS.get()
    if not blocks:
        return None
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    paths = "|".join(re.escape(path.removeprefix(prefix)) for path in blocks)
    return rf"^({re.escape(prefix)})?({paths})\.experts\."


def _saved_float_experts(model: nn.Module):
    """A pattern matching the float experts' names (the model's own) of the blocks ``expecting_saved_experts``
    holds, or None where it holds none."""
    blocks = _experts_of_saved_blocks(model)
    return None if blocks is None else re.compile(rf"{blocks}({'|'.join(FLOAT_NAMES)})$")


def wrap_missing_keys_move() -> None:
    """Within ``expecting_saved_experts``, transformers' ``_move_missing_keys_from_meta_to_device`` (the missing
    weights made real, then initialised at random) passes the file's blocks' float experts by: they stay on the
    meta device (no memory, no init) until ``load_saved_experts`` replaces them by the file's quantized tensors, under
    any ``device_map`` (one of several places: ``wrap_dispatch`` hides them from accelerate's dispatch).
    Until session 53 they were materialised and initialised (1.2 s of a 4-layer Qwen3-MoE's load here; a
    DeepSeek-V3's whole float experts in memory), then quantized for nothing; until session 54 under a map of several
    places too, and a block offloaded to "disk" was then refused."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_move_missing_keys_from_meta_to_device", None)
    if original is None or getattr(original, _WRAPPED, False):  # another transformers: they are made real, unread
        return

    @functools.wraps(original)
    def move(self, missing_keys, *args, **kwargs):
        saved = _saved_float_experts(self)
        device_map = args[0] if args else kwargs.get("device_map")  # transformers' second argument
        places = {str(v) for v in device_map.values()} if isinstance(device_map, dict) else set()
        if saved is not None and (_dispatch_wrapped() or (len(places) <= 1 and "disk" not in places)):
            missing_keys = type(missing_keys)(k for k in missing_keys if saved.search(k) is None)
        return original(self, missing_keys, *args, **kwargs)

    setattr(move, _WRAPPED, True)
    PreTrainedModel._move_missing_keys_from_meta_to_device = move


def wrap_dispatch() -> None:
    """Within ``expecting_saved_experts``, transformers' ``accelerate_dispatch`` (a ``device_map`` of several places:
    accelerate's hooks on the layers) runs without the file's blocks' float experts, which are on the meta device: a
    hook that puts a layer on a device moves each tensor there and has no value for a meta one ("gate_up_proj is on
    the meta device, we need a `value`"). They are put back after (their shape and dtype, read by the load)."""
    from transformers import modeling_utils

    original = getattr(modeling_utils, "accelerate_dispatch", None)
    if original is None or getattr(original, _WRAPPED, False):  # another transformers: they are made real, unread
        return

    @functools.wraps(original)
    def dispatch(model, *args, **kwargs):
        saved = _saved_float_experts(model)
        experts = [] if saved is None else [m for path, m in model.named_modules() if any(
            p.is_meta and saved.search(f"{path}.{name}") for name, p in m._parameters.items() if p is not None)]
        with contextlib.ExitStack() as hidden:
            for module in experts:
                hidden.enter_context(hidden_tensors(module._parameters, FLOAT_NAMES))
            return original(model, *args, **kwargs)

    setattr(dispatch, _WRAPPED, True)
    modeling_utils.accelerate_dispatch = dispatch


def wrap_stubs_missing() -> None:
    """transformers' ``_adjust_missing_and_unexpected_keys`` (before its load report) takes a checkpoint's zero-size
    stand-in of an experts module's float weight (``saving._stubs_kept``: a freed save writes them, so that a process
    without ``moekit.hf`` stops on their size) for missing, not mismatched: ``load_saved_experts`` loads the file's
    blocks over them, or refuses where the file is not at hand. Older checkpoints hold none."""
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "_adjust_missing_and_unexpected_keys", None)
    if original is None or getattr(original, _WRAPPED, False):  # another transformers: its report refuses them
        return

    @functools.wraps(original)
    def adjust(self, loading_info, *args, **kwargs):
        modules = dict(self.named_modules())
        stubs = {entry for entry in getattr(loading_info, "mismatched_keys", ()) if math.prod(entry[1]) == 0
                 and entry[0].rpartition(".")[2] in FLOAT_NAMES
                 and is_interface_experts(modules.get(entry[0].rpartition(".")[0]))}
        if stubs:
            loading_info.mismatched_keys -= stubs
            loading_info.missing_keys |= {name for name, _, _ in stubs}
        return original(self, loading_info, *args, **kwargs)

    setattr(adjust, _WRAPPED, True)
    PreTrainedModel._adjust_missing_and_unexpected_keys = adjust


def _dispatch_wrapped() -> bool:
    from transformers import modeling_utils

    return getattr(getattr(modeling_utils, "accelerate_dispatch", None), _WRAPPED, False)


def load_saved_experts(model: nn.Module, file: Path | None, info: dict, source, kwargs: dict) -> None:
    """After transformers' load (``info``: its loading info): ``file``'s blocks swapped and loaded as saved, their
    float experts dropped from ``info["missing_keys"]`` (loaded now, not missing). FileNotFoundError where experts
    weights are still missing and the checkpoint's config.json names ``"moekit"`` (a freed model's: its experts file
    is not at hand), whatever implementation the load named: those experts would be random."""
    if file is not None:
        blocks = tuple(f"{b.path}." for b in load_saved_file(model, file).swapped)
        info["missing_keys"] = type(info["missing_keys"])(k for k in info["missing_keys"] if not k.startswith(blocks))
    modules = dict(model.named_modules())
    random = sorted(k for k in info["missing_keys"] if is_interface_experts(modules.get(k.rpartition(".")[0])))
    if random and _names_moekit(source, kwargs):
        raise _not_at_hand(source, f"{random[0]}, ... would be random")


def refuse_before_reading(source, kwargs: dict) -> None:
    """Before transformers reads the checkpoint (no experts file found): FileNotFoundError where its config.json
    names ``"moekit"`` and its weights hold the freed save's zero-size stand-ins and no experts weight, both read
    from files at hand (a folder's; a hub repository's in the local cache: no request). Else ``load_saved_experts``
    decides after the load (a checkpoint with some float experts, one saved before session 54, one whose files are
    not cached yet). Until session 54 the refusal came only after transformers had read the whole checkpoint (and
    printed its report)."""
    if _names_moekit(source, kwargs) and _stand_ins_alone(source, kwargs):  # config.json first: one small file
        raise _not_at_hand(source, "every MoE block's experts would be random (its weights hold none)")


def _not_at_hand(source, why: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"from_pretrained({str(source)!r}): its config.json names experts_implementation {IMPLEMENTATION!r} (a "
        f"checkpoint of moekit's quantized experts, use_moekit_blocks(..., keep_float=False)) but {EXPERTS_FILE} "
        f"is not at hand (offline, or a download without it), so {why}. Download it "
        f"(huggingface_hub.hf_hub_download({str(source)!r}, {EXPERTS_FILE!r}), or load online), then load again")


_EXPERTS_WEIGHT = re.compile(r"(^|\.)experts\.")  # routed experts' weights, in most families (not "shared_experts.")


def _stand_ins_alone(source, kwargs: dict) -> bool:
    """Whether the checkpoint's safetensors headers at hand (no data, no request) hold a freed save's zero-size
    stand-ins of experts weights and no experts weight of any size: a freed save by moekit, which its experts file
    must complete. False where they are not all at hand (the load then decides)."""
    from safetensors import safe_open

    index = _at_hand(source, "model.safetensors.index.json", kwargs)
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())) if index else [
        "model.safetensors"]
    files = [_at_hand(source, shard, kwargs) for shard in shards]
    if not files or None in files:
        return False
    sizes = []
    for file in files:
        with safe_open(str(file), "pt") as f:
            sizes += [math.prod(f.get_slice(k).get_shape()) for k in f.keys() if _EXPERTS_WEIGHT.search(k)]
    return bool(sizes) and not any(sizes)


def _names_moekit(source, kwargs: dict) -> bool:
    """The checkpoint's own config.json (at hand: transformers' load fetched it) names ``"moekit"`` as its experts
    implementation (what ``save_pretrained`` of a freed model writes; the loaded config holds what the load named
    instead, where it named one)."""
    file = _at_hand(source, "config.json", kwargs)
    named = json.loads(file.read_text()).get("experts_implementation") if file is not None else None
    return named == IMPLEMENTATION or (isinstance(named, dict) and IMPLEMENTATION in named.values())


def _at_hand(source, filename: str, kwargs: dict) -> Path | None:
    """``filename`` of ``from_pretrained(source, **kwargs)``'s checkpoint where it is at hand without a request: a
    folder's own (``subfolder=`` within it), a hub repository's in the local cache (huggingface_hub's
    ``try_to_load_from_cache``, at the load's ``revision=`` and ``cache_dir=``); else None."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    subfolder = kwargs.get("subfolder") or ""
    if Path(source).is_dir():
        file = Path(source, subfolder, filename)
        return file if file.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(str(source), f"{subfolder}/{filename}" if subfolder else filename,
                                       cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
    except ValueError:  # not a repository id (HFValidationError)
        return None
    return Path(found) if isinstance(found, str) else None  # else None, or its "known not to exist" sentinel
