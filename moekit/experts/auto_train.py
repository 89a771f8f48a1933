"""``backend="auto"`` by what a call does: inference on the device's best forward, training on the backend whose
training step measured fastest for the call's kind.

    backend_fn("auto", cuda) -> experts_auto (a dispatcher around the inference pick, "triton")
      a call that records no gradient (grad mode off, or none of x, w13, w2, topk_weights, b13, b2 requires grad)
        -> the inference pick, as before; its fast path and keeper serve the dispatcher too (the layer's decode
           fast path keeps and serves no-grad calls only; ``ExpertsCallCache``'s fast path lookup is the pick's,
           behind one grad-mode test)
      a call that records gradients -> ``training_backend(kind, M, N, rules)``: the last of ``rules`` of the call's
        kind that M and N fit (a plain rule with ``keep``: triton keeping the gate-up product for the backward,
        ``experts_triton_kept``), else the inference pick. Kinds: "plain" (the fused Triton backward takes it: a
        gated silu / gelu / relu without biases or clamps), "variant" (biases, gpt-oss's clamped SwiGLU, the clamp
        after the activation, ungated or other activations: Triton's recomputing backward), "quantized"
        (moekit.quant weights)

Where the choice lives: in the resolved function, so ``MoE``, ``EPMoE``, the offloaded layer and ``moekit.hf`` all
take it without a check of their own. The test reads grad mode and ``requires_grad``, which torch.compile guards on
already (the triton op it picks between reads them too), so a compiled training step is traced once and replays
step after step; CUDA graphs capture no-grad calls only, which take the inference pick unchanged.

``backend_options`` with "auto" bind to the inference pick (``bind_options``): every call runs there, as before.

Shapes: M tokens, K hidden, E experts, k slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moekit.activations import ActivationSpec
from moekit.experts import (ExpertsFn, call_backend, fast_path_of, get_backend, keeper_of, register_fast_path,
                            register_keeper, register_traced_path, traced_path_of)

KINDS = ("plain", "variant", "quantized")


@dataclass(frozen=True)
class TrainingRule:
    """A call of ``kind`` with at least ``from_tokens`` tokens (M) over experts at most ``max_width`` wide (N, w2's
    last dim; None: any width) that records gradients trains on ``backend``; of the rules that match a call, the
    last one applies."""

    kind: str  # one of KINDS
    backend: str  # a backend name available where "auto" takes its inference pick
    from_tokens: int = 0
    max_width: int | None = None
    keep: bool = False  # backend "triton", kind "plain": the forward keeps the gate-up product for the backward
    # (``triton_backward.experts_triton_kept``; its memory: ``triton_train_forward``), picked by the name KEPT

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.keep and (self.backend, self.kind) != ("triton", "plain"):
            raise ValueError(f"keep=True applies to backend 'triton' with kind 'plain' (the fused backward's), got "
                             f"backend={self.backend!r}, kind={self.kind!r}")
        if not isinstance(self.from_tokens, int) or self.from_tokens < 0:
            raise ValueError(f"from_tokens must be an int >= 0, got {self.from_tokens!r}")
        if self.max_width is not None and (not isinstance(self.max_width, int) or self.max_width < 1):
            raise ValueError(f"max_width must be an int >= 1 or None, got {self.max_width!r}")


# The training choice of "auto" on CUDA (a kind without a rule trains on the inference pick, triton). From one eager
# training step (forward + the gradients of every input), bf16, on an H100 80GB HBM3 (torch 2.11, Triton 3.6),
# benchmarks/auto49_device_check.py (ck1 at a678399c, ck2 --ck2 at 858d075e), medians of 5 interleaved rounds,
# grouped_mm µs / triton µs (> 1: triton faster) at M = 256 / 512 / 1024 / 4096 / 16384:
#   variant (Triton's recomputing backward): gpt-oss-20b (E 32) 0.64 / - / 0.82 / 0.86 / 0.90, Step-3.7 (E 96)
#     0.78 / - / 0.80 / 0.90 / 0.92: grouped_mm at every M
#   plain (the fused backward), by expert width N (auto49's cells; M = 1024 / 4096 / 16384 from
#   benchmarks/trn50_device_check.py, trn50-ck1 at a7e00a0e, same H100 kind; "*": the class's tiles before session 50's
#   "wide/few" / "mid/many" entries in triton_backward_launch.TUNED, which made those steps 1.66x / 1.51x faster):
#     N 768 (Qwen3-30B-A3B, K 2048): E 128 0.91 / 0.97 / 1.03 / 1.54 / 2.74; E 32 - / - / 1.02 / 1.49; E 16 - / - / 0.99
#       / 1.21
#     N 1408 (DeepSeek-V2-Lite, E 64, top-6, K 2048): - / - / 0.87 / 1.21 / 1.37* (2.05 with "mid/many"'s tiles)
#     N 2048 (DeepSeek-V3, K 7168): E 64 0.91 / 0.97 / 1.13 / 2.85 / 2.02*; E 32 - / - / 1.17 / 2.07; E 16 - / - / 1.21
#       / 0.95*
#     N 3072 (Hunyuan-A13B, E 64, top-8, K 4096): - / - / 1.09 / 1.61
#     N 4096 (Phi-3.5-MoE's E 16, top-2, K 4096): - / - / 0.99 / 1.09
#     N 6400 (Phi-3.5-MoE): - / - / 0.82* / 1.06
#     N 14336 (Mixtral-8x7B, K 4096): E 8 0.75 / - / 0.55* (0.92 with "wide/few"'s tiles) / 0.88 (trn50: 0.94) /
#       1.07; E 32 - / - / 0.76* / 0.48*
#   so (session 50) triton from 1024 tokens up to N 3072, from 4096 up to N 6400, and from 16384 at any width.
#   trn50-ck2 (c972344b, those rules and tiles, on an H200) at 16384: N 1408 1.94, 2048 2.95, 3072 1.78, 4096 1.21,
#   6400 1.19, 14336 1.10; at 1024: N 6400 1.03, 14336 0.94
#   plain, the gate-up product kept (``keep``: ``BackwardOptions(recompute=False)``) against recomputing it and against
#   grouped_mm, benchmarks/trn51_device_check.py (trn51-ck1 at 1921791f, same H100 kind), step µs kept / recompute /
#   grouped_mm (gmm / kept): Mixtral M = 1024 6598 / 7368 / 7484 (1.13), 4096 17464 / 19699 / 18430 (1.06), 8192
#   34351 / 37582 / 39831 (1.16); DeepSeek-V2-Lite 1024 3092 / 3353 / 3268 (1.06), 4096 4728 / 5021 / 6228 (1.32);
#   Qwen3 4096 4510 / 4859 / 6639 (1.47); trn51-ck2 (4ac03a77) at 1024: Phi-3.5-MoE 4729 / 5451 / 5674 (1.20), N 4096
#   3639 / 4122 / 4242 (1.17), Hunyuan 8725 / 9707 / 10204 (1.17), DeepSeek-V3 E 64 9692 / 10494 / 12331 (1.27), Qwen3
#   3386 / 3577 / 3725 (1.10); at 16384: Mixtral 65945 / 70403 / 79757 (1.21), DeepSeek-V2-Lite 12373 / 13261 / 27244
#   (2.20), Qwen3 9787 / 10190 / 27692 (2.83). Kept the fastest in all 14 cells (4-15% faster than recomputing), so
#   triton keeping the gate-up product from 1024 tokens at any width; from 16384 recomputing, 4-7% slower there but
#   holding nothing between forward and backward where kept holds h_p + x_p (4N + 2K bytes a layout row: Mixtral at
#   16384 2.2 GiB a layer, at 8192 1.1). Below 16384 kept holds less after the forward than grouped_mm, the previous
#   pick at wide experts (trn51-ck1, MiB: Mixtral 8192 1152 against 2496, Qwen3 4096 352 against 849)
#   quantized: the Triton backend's quantized kernels have no backward at all (torch's "no autograd formula" error
#     at backward()); grouped_mm dequantizes in differentiable ops
TRAINING_RULES: tuple[TrainingRule, ...] = (
    TrainingRule("quantized", "grouped_mm"),
    TrainingRule("variant", "grouped_mm"),
    TrainingRule("plain", "grouped_mm"),
    TrainingRule("plain", "triton", from_tokens=1024, keep=True),
    TrainingRule("plain", "triton", from_tokens=16384),
)


def records_grad(x: torch.Tensor | None, w13, w2, topk_weights: torch.Tensor, b13, b2) -> bool:
    """Whether a call records gradients: grad mode on and x (None: not asked), w13, w2, topk_weights or a bias
    requires grad (a quantized weight never does)."""
    if not torch.is_grad_enabled():
        return False
    return ((x is not None and x.requires_grad) or getattr(w13, "requires_grad", False)
            or getattr(w2, "requires_grad", False) or topk_weights.requires_grad
            or (b13 is not None and b13.requires_grad) or (b2 is not None and b2.requires_grad))


def call_kind(activation: str | ActivationSpec, w13, b13, b2) -> str:
    """The call's kind for the training rules (module docstring). Imports the Triton backward's rule (where the
    dispatcher exists, Triton does): a caller that traces uses ``AutoChoice.kind``, bound when it was built."""
    from moekit.experts.triton_backward import fused_backward_takes

    return _kind(fused_backward_takes, activation, w13, b13, b2)


def _kind(fused_takes: Callable, activation, w13, b13, b2) -> str:
    if not isinstance(w13, torch.Tensor):
        return "quantized"
    return "plain" if fused_takes(activation, b13, b2) else "variant"


KEPT = "triton+kept"  # what a rule with ``keep`` picks: backend "triton" with the gate-up product kept


def training_backend(kind: str, tokens: int, width: int, rules: tuple[TrainingRule, ...]) -> str | None:
    """The backend a call of ``kind`` with ``tokens`` rows over experts ``width`` (N) wide that records gradients
    trains on under ``rules`` (KEPT: triton keeping the gate-up product), or None (the inference pick)."""
    chosen = None
    for rule in rules:
        if rule.kind == kind and tokens >= rule.from_tokens and (rule.max_width is None or width <= rule.max_width):
            chosen = KEPT if rule.keep else rule.backend
    return chosen


@dataclass(frozen=True)
class AutoChoice:
    """What one "auto" dispatcher chooses between: the inference pick and the training backends, resolved."""

    inference: str  # the backend name of the inference pick
    fns: dict  # backend name -> its experts function, for the inference pick and every rule's backend
    rules: tuple[TrainingRule, ...]
    fused_takes: Callable  # triton_backward.fused_backward_takes: (activation, b13, b2) -> the fused backward's call

    def kind(self, activation, w13, b13, b2) -> str:
        return _kind(self.fused_takes, activation, w13, b13, b2)

    def pick(self, x, w13, w2, topk_weights, activation, b13, b2, tokens: int) -> str:
        """The backend name a call runs on: the training rule's where it records gradients, else the inference pick."""
        if records_grad(x, w13, w2, topk_weights, b13, b2):
            chosen = training_backend(self.kind(activation, w13, b13, b2), tokens, w2.shape[2], self.rules)
            if chosen is not None:
                return chosen
        return self.inference


_DISPATCHERS: dict[tuple, ExpertsFn] = {}  # (inference fn, rules) -> its dispatcher: one per pick, registered once


def auto_dispatcher(inference: str, rules: tuple[TrainingRule, ...] | None = None) -> ExpertsFn:
    """The experts function of "auto" whose inference pick is backend ``inference`` (module docstring), with the
    training ``rules`` (None: ``TRAINING_RULES``); the inference pick's own function where no rule names another."""
    rules = TRAINING_RULES if rules is None else tuple(rules)
    infer_fn = get_backend(inference)
    if all(rule.backend == inference and not rule.keep for rule in rules):
        return infer_fn
    key = (infer_fn, rules)
    fn = _DISPATCHERS.get(key)
    if fn is None:
        from moekit.experts.triton_backward import experts_triton_kept, fused_backward_takes

        fns = {name: get_backend(name) for name in {inference, *(r.backend for r in rules)}}
        if any(rule.keep for rule in rules):
            fns[KEPT] = experts_triton_kept
        choice = AutoChoice(inference, fns, rules, fused_backward_takes)
        fn = _DISPATCHERS[key] = _dispatcher(choice, infer_fn)
    return fn


def _dispatcher(choice: AutoChoice, infer_fn: ExpertsFn) -> ExpertsFn:
    fns, pick = choice.fns, choice.pick

    def experts_auto(x, w13, w2, topk_ids, topk_weights, *, activation="silu", expert_map=None, b13=None, b2=None):
        """"auto": the inference pick, or for a call that records gradients its training backend."""
        fn = infer_fn
        if torch.is_grad_enabled():  # the common inference call: one test
            fn = fns[pick(x, w13, w2, topk_weights, activation, b13, b2, x.shape[0])]
        return fn(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map, b13=b13, b2=b2)

    infer_traced = traced_path_of(infer_fn)

    def traced_auto(x, w13, w2, topk_ids, topk_weights, activation, b13=None, b2=None):
        """The traced entry: decided at trace time (dynamo guards grad mode and requires_grad)."""
        name = pick(x, w13, w2, topk_weights, activation, b13, b2, x.shape[0])
        if name == choice.inference and infer_traced is not None:
            return infer_traced(x, w13, w2, topk_ids, topk_weights, activation, b13, b2)
        return call_backend(fns[name], x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)

    experts_auto.auto_choice, experts_auto.inference_fn = choice, infer_fn  # bind_options binds the latter
    _register(experts_auto, choice, infer_fn, traced_auto)
    return experts_auto


def _register(fn: ExpertsFn, choice: AutoChoice, infer_fn: ExpertsFn, traced: Callable) -> None:
    """The inference pick's fast path serves the dispatcher's calls that stay on it; its keeper (the layer's decode
    fast path, which keeps and serves calls in no-grad mode only) the same."""
    fast, keep = fast_path_of(infer_fn), keeper_of(infer_fn)
    if fast is not None:
        def fast_auto(x, w13, w2, topk_ids, topk_weights, activation, *, b13=None, b2=None):
            if torch.is_grad_enabled() and choice.pick(x, w13, w2, topk_weights, activation, b13, b2,
                                                       x.shape[0]) != choice.inference:
                return None  # a miss: ExpertsCallCache runs the dispatcher
            return fast(x, w13, w2, topk_ids, topk_weights, activation, b13=b13, b2=b2)

        register_fast_path(fn, fast_auto)
    if keep is not None:
        register_keeper(fn, keep)
    register_traced_path(fn, traced)


def auto_choice_of(fn: ExpertsFn) -> AutoChoice | None:
    """The ``AutoChoice`` of an "auto" dispatcher, or None for any other experts function."""
    return getattr(fn, "auto_choice", None)


def running_backend(fn: ExpertsFn, resolved: str, w13, w2, topk_weights: torch.Tensor, activation, b13, b2,
                    tokens: int) -> str:
    """The backend a call through experts function ``fn`` (resolved as backend ``resolved``) runs on in the grad mode
    of now, x aside: ``resolved``, or what an "auto" dispatcher picks (``MoE``'s stats name its layout)."""
    choice = auto_choice_of(fn)
    name = resolved if choice is None else choice.pick(None, w13, w2, topk_weights, activation, b13, b2, tokens)
    return "triton" if name == KEPT else name

