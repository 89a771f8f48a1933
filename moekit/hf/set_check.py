"""``model.set_experts_implementation("moekit")`` on a model moekit would never serve says so.

transformers dispatches only modules of an experts class it decorated (``use_experts_implementation``) through its
experts interface, where moekit registered itself. A dense model (Llama), or one whose MoE blocks hold a list of
expert MLPs, accepted ``"moekit"`` in silence and ran its own forward: moekit was never called. Importing
``moekit.hf`` wraps ``PreTrainedModel.set_experts_implementation`` once: transformers' method runs as before, then a
``UserWarning`` names the model class when ``"moekit"`` was asked for and the model has no such experts module.
A warning, not an error: the model still computes its own function, as transformers chose to let it. On a model
with such modules the call builds their plans (``ExpertsPlan``) at once (``prepare``'s work), so that ``torch.compile``
right after it traces the fused path (session 51: it traced the composed one, silently); so does
``from_pretrained(..., experts_implementation="moekit")``, which sets it through the config (``wrap_from_pretrained``),
and building a model from a config that names it (``Config(experts_implementation="moekit")`` then the model class,
``from_config(config, experts_implementation="moekit")``: ``wrap_post_init``).
"""

from __future__ import annotations

import functools
import warnings

from torch import nn

IMPLEMENTATION = "moekit"  # the name moekit registers in transformers' experts interfaces
_WRAPPED = "_moekit_checks_servable"  # set on the wrapper: a second import wraps nothing
# why moekit would never be called on a model without such a module (the warnings of set_experts_implementation and
# prepare)
NOT_SERVED = ("has no experts module that transformers dispatches through its experts interface (a dense model, or "
              "MoE blocks holding a list of expert MLPs)")


def is_interface_experts(module: nn.Module) -> bool:
    """``module`` is an experts module transformers dispatches through its experts interface (its decorator sets
    ``has_gate``; ``FP8Experts`` too) with the weights moekit reads."""
    return hasattr(module, "has_gate") and hasattr(module, "down_proj")


def wrap_set_experts_implementation() -> None:
    from transformers import PreTrainedModel

    original = getattr(PreTrainedModel, "set_experts_implementation", None)
    if original is None or getattr(original, _WRAPPED, False):  # a transformers without the method: nothing to say
        return

    @functools.wraps(original)
    def set_experts_implementation(self, experts_implementation):
        result = original(self, experts_implementation)
        asked = experts_implementation.values() if isinstance(experts_implementation, dict) else (
            experts_implementation,)
        experts = [m for m in self.modules() if is_interface_experts(m)] if IMPLEMENTATION in asked else []
        if experts:
            _build_plans(experts)
        elif IMPLEMENTATION in asked:
            warnings.warn(f"set_experts_implementation({IMPLEMENTATION!r}): {type(self).__name__} {NOT_SERVED}: "
                          "moekit is never called, the model's own forward runs", UserWarning, stacklevel=2)
        return result

    setattr(set_experts_implementation, _WRAPPED, True)
    PreTrainedModel.set_experts_implementation = set_experts_implementation


def wrap_from_pretrained() -> None:
    """``from_pretrained(..., experts_implementation="moekit")`` sets the implementation through the config, not
    ``set_experts_implementation``: the loaded model's plans are built here, as that call builds them. A checkpoint
    with moekit's quantized experts beside it (``saving``) gets its swapped blocks back first (``loading``: a folder's
    file or a hub repository's, whatever implementation is named; transformers' loading info is asked for always, to
    see what is missing, and returned where the caller asked)."""
    from transformers import PreTrainedModel

    load = PreTrainedModel.__dict__["from_pretrained"].__func__  # a classmethod: the function under it
    if getattr(load, _WRAPPED, False):
        return

    @functools.wraps(load)
    def from_pretrained(cls, *args, **kwargs):
        from moekit.hf.loading import (expecting_saved_experts, find_saved_experts, load_saved_experts,
                                       refuse_before_reading)

        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        file = find_saved_experts(source, kwargs)  # before the load: its experts not reported missing (post_init)
        if file is None:
            refuse_before_reading(source, kwargs)  # a freed save without its experts file, where that is plain
        with expecting_saved_experts(file):
            model, info = load(cls, *args, **{**kwargs, "output_loading_info": True})
        load_saved_experts(model, file, info, source, kwargs)  # or refused: never random experts of such a file
        _plans_if_named(model)
        return (model, info) if kwargs.get("output_loading_info") else model

    setattr(from_pretrained, _WRAPPED, True)
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def wrap_post_init() -> None:
    """A model built from a config that names ``"moekit"`` (by hand, ``from_config``) sets it in its ``__init__``,
    neither by ``set_experts_implementation`` nor ``from_pretrained``: transformers' ``post_init`` (the end of every
    model's ``__init__``, its weights initialised) builds the plans then. Built on the meta device (``from_pretrained``
    builds it there), a module is left to ``wrap_from_pretrained`` or its first call. Built by ``from_pretrained`` of
    a checkpoint with moekit's quantized experts, the float experts of those blocks are told to transformers as not
    missing (``loading.ignore_saved_experts_missing``): its load report listed them MISSING, "newly initialized"."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def post_init(self):
        from moekit.hf.loading import ignore_saved_experts_missing

        result = original(self)
        ignore_saved_experts_missing(self)
        _plans_if_named(self)
        return result

    setattr(post_init, _WRAPPED, True)
    PreTrainedModel.post_init = post_init


def _plans_if_named(model: nn.Module) -> None:
    """The plans of ``model``'s experts modules where its config names ``"moekit"`` for any of them."""
    read = getattr(model, "get_experts_implementation", None)  # transformers >= 5.x
    if read is not None and IMPLEMENTATION in read().values():
        _build_plans([m for m in model.modules() if is_interface_experts(m)])


def _build_plans(experts: list[nn.Module]) -> None:
    """Each module's ``ExpertsPlan`` now (``variants.experts_plan``: probing, which ``torch.compile`` cannot trace), so
    that a model compiled right after ``set_experts_implementation("moekit")`` traces the fused path, as after
    ``prepare(model)``; a module on the meta device is left to its first call (its probe would run on meta)."""
    from moekit.hf.variants import experts_plan

    for module in experts:
        if module.down_proj.device.type != "meta":
            experts_plan(module)
