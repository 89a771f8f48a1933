"""One measurement of a transformers model: a greedy ``generate`` (decode) or a forward over a batch
(prefill), timed by the wall clock between device synchronisations, and the errors between logits.

Shapes: P = prompt tokens, T = new tokens, V = vocabulary, B x L = the prefill batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.bench.timing import wall_time


class Skipped(Exception):
    """A measurement not attempted (it would not fit); recorded as ``"Skipped: why"``."""


@dataclass
class Decode:
    tokens: torch.Tensor  # [T] the greedy ids generated after the prompt
    logits: torch.Tensor | None  # [T, V] float32 raw logits of each step (when asked for); step t saw tokens[:t]
    seconds: float  # the whole generate call: the prompt's prefill and T steps


def compile_config(device: torch.device, backend: str = "inductor"):
    """transformers' ``CompileConfig`` (its defaults: inductor, "reduce-overhead", i.e. CUDA graphs) for
    ``generate(..., cache_implementation="static")``. generate compiles only on accelerators; on the CPU the
    config's ``_compile_all_devices`` flag (what transformers' own tests set) asks for it anyway. The mode is an
    inductor one: another backend (``--tiny``'s "eager") gets none, or torch logs that it ignores it, once a graph."""
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
    if device.type != "cuda":
        config._compile_all_devices = True
    return config


def decode(model, prompt: torch.Tensor, new_tokens: int, *, compiled=None, keep_logits: bool = False) -> Decode:
    """Greedy ``generate`` from ``prompt`` [1, P] for exactly ``new_tokens`` tokens (the model has no EOS).

    ``compiled=None``: a dynamic cache and no compilation (``disable_compile``); otherwise ``compiled`` is a
    ``CompileConfig`` and the static cache makes generate run its decode steps through ``torch.compile``.
    """
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=keep_logits)
    if compiled is None:
        kwargs.update(disable_compile=True)
    else:
        kwargs.update(cache_implementation="static", compile_config=compiled)
    with torch.no_grad():
        timed = wall_time(lambda: model.generate(prompt, **kwargs), prompt.device)
    out = timed.result
    tokens = out.sequences[0, prompt.shape[1]:]  # [T]
    logits = torch.stack([step[0].float() for step in out.logits]) if keep_logits else None  # [T, V]
    return Decode(tokens, logits, timed.seconds)


@dataclass
class Prefill:
    logits: torch.Tensor  # [B, L, V] with all_logits, else [B, 1, V]: the last position's
    seconds: float  # the forward, the device synchronised before and after


def prefill(model, ids: torch.Tensor, *, all_logits: bool = False) -> Prefill:
    """One forward over ``ids`` [B, L] without a cache. With ``all_logits=False`` only the last position's
    logits are computed, as generate's prefill does; ``True`` gives [B, L, V] for the check."""
    with torch.no_grad():
        timed = wall_time(lambda: model(ids, use_cache=False, logits_to_keep=0 if all_logits else 1), ids.device)
    return Prefill(logits=timed.result.logits, seconds=timed.seconds)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32, or in float64 where either is float64 (a float64 reference)."""
    dtype = torch.promote_types(torch.promote_types(out.dtype, ref.dtype), torch.float32)
    out, ref = out.to(dtype), ref.to(dtype)
    return ((out - ref).norm() / ref.norm()).item()


def decode_rel_err(out: Decode, ref: Decode) -> float:
    """Relative error of ``out``'s step logits against ``ref``'s over the steps whose inputs agree: step t
    saw tokens[:t], so it is comparable while both generated the same tokens before it (step 0 always)."""
    same = (out.tokens == ref.tokens).int()  # [T]
    comparable = min(int(same.cumprod(0).sum()) + 1, len(same))  # leading agreeing tokens, plus the next step
    return rel_err(out.logits[:comparable], ref.logits[:comparable])


def error_text(err: BaseException) -> str:
    """``"Type: first line of the message"``: what a row records where a measurement failed. Dynamo's
    errors say little in their first line, so their ``Explanation:`` line (the failing op) follows."""
    lines = [line.strip() for line in str(err).strip().splitlines()]
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{text} ({explanation})" if explanation else text
