"""The float64 truth of ``moekit bench --hf``: the benchmark's model, its very weights, run in float64
with transformers' ``eager`` experts, so every implementation's logits (``eager``'s included) are measured
against one reference far more precise than any of them (a bf16 ``eager`` reference rewards an
implementation that rounds where ``eager`` rounds).

The float64 weights are a copy made for a pass and dropped right after it (Qwen3-30B-A3B widths, 8 layers:
5.1e9 parameters, 41 GB in float64 against 10 GB in bf16; Mixtral-8x7B widths, 2 layers: 25 GB), applied
with ``torch.func.functional_call`` so the benchmark's module itself is never converted. The pass is
float64 except where transformers' modeling code casts to float32 on purpose (RMSNorm's statistics, the
router's softmax, the rotary cos/sin): their rounding (~1e-7 relative; RMSNorm's alone 9e-8 on the tiny
Qwen3) is this reference's floor, far below the ~1e-2 of bf16 logits. An fp8 model (``--hf-quant fp8``) runs
its stored weights dequantized exactly, without the recipe's activation rounding; ``FP8Experts``' loop sums
the experts in float32 (~1e-7 more). A weight-only run's quantized row (``hf_wo``) has a float64 model of its own:
the block's experts replaced by the swapped layer's quantized ones, dequantized in float64. Where the whole copy
does not fit (DeepSeek-V3, 2 layers: 188 GB) the experts are streamed, float64 a chunk of experts at a time
(``hf_fp64_stream``: 10 GB there); where that does not fit either, the columns say so ("Skipped: ...").

Shapes: B x L = the prefill batch, P = prompt tokens, T = generated tokens, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch

from moekit.bench import hf_measure as hm
from moekit.bench.hf_fp64_stream import float64_outside_experts, streamed_bytes, streamed_experts
from moekit.bench.hf_models import REFERENCE_IMPL, free_memory_bytes
from moekit.bench.hf_quant import dequantized_float64
from moekit.bench.hf_wo import dequantized_blocks_float64

FIT_FRACTION = 0.8  # of the free memory: room for the activations (fp64 attention scores, 1 GB a layer at 4 x 1024)


def _float64_tensors(model, blocks_quant: str | None) -> dict[str, torch.Tensor]:
    """Every floating parameter and buffer of ``model`` as a float64 copy on its device, by name (tied
    weights once: ``functional_call`` ties them back); fp8 weights with block scales as their exact value
    (``hf_quant.dequantized_float64``: ``FP8Experts``' loop runs a float weight as a plain linear); with
    ``blocks_quant``, the experts of the blocks quantized with it dequantized (``hf_wo``) instead of the block's."""
    tensors = dequantized_float64(model)
    if blocks_quant is not None:
        tensors.update(dequantized_blocks_float64(model, blocks_quant))
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    tensors.update({name: t.detach().to(torch.float64) for name, t in named
                    if t.is_floating_point() and name not in tensors})
    return tensors


def float64_bytes(model) -> int:
    """Bytes of the float64 copy of ``model``'s floating parameters and buffers."""
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return sum(8 * t.numel() for _, t in named if t.is_floating_point())


class Float64Model:
    """``model`` run with float64 copies of its weights and the ``eager`` experts; the copies live as long
    as this object (``blocks_quant``: the experts its blocks hold quantized with that scheme, dequantized:
    ``hf_wo``). Where the whole copy and ``extra_bytes`` would not fit in the free memory of the model's device, the
    experts are streamed (``hf_fp64_stream``: float64 a chunk of experts at a time; not with ``blocks_quant``); raises
    ``hm.Skipped`` where that would not fit either, and whatever the device raises where float64 is not supported."""

    def __init__(self, model, extra_bytes: int = 0, blocks_quant: str | None = None):
        device = next(model.parameters()).device
        if device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached by earlier passes count as free
        need, free = float64_bytes(model) + extra_bytes, free_memory_bytes(device)
        lean = streamed_bytes(model) + extra_bytes if need > FIT_FRACTION * free and blocks_quant is None else None
        if need > FIT_FRACTION * free and (lean is None or lean > FIT_FRACTION * free):
            streamed = "" if lean is None else f", {lean / 2**30:.1f} GiB with its experts streamed"
            raise hm.Skipped(f"the float64 pass needs {need / 2**30:.1f} GiB{streamed} "
                             f"({free / 2**30:.1f} GiB free on {device})")
        self.model = model
        self.streamed = lean is not None  # the experts as stored, a chunk at a time in float64 (hf_fp64_stream)
        self.tensors = float64_outside_experts(model) if self.streamed else _float64_tensors(model, blocks_quant)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L, V] float64 logits of every position of ``ids`` [B, L] (no cache)."""
        saved = self.model.get_experts_implementation()
        self.model.set_experts_implementation(REFERENCE_IMPL)
        streaming = streamed_experts(self.model) if self.streamed else contextlib.nullcontext()
        try:
            with torch.no_grad(), streaming:
                out = torch.func.functional_call(self.model, self.tensors, (ids,),
                                                 {"use_cache": False, "logits_to_keep": 0})
        finally:
            self.model.set_experts_implementation(saved)
        if out.logits.dtype != torch.float64:
            raise TypeError(f"the float64 pass returned {out.logits.dtype} logits, expected torch.float64")
        return out.logits

    def step_logits(self, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[T, V] float64: the logits a greedy decode from ``prompt`` [1, P] saw at each step while it
        generated ``tokens`` [T] (step t saw the prompt and tokens[:t]), from one teacher-forced forward."""
        ids = torch.cat([prompt[0], tokens[:-1]])[None]  # [1, P + T - 1]
        return self.logits(ids)[0, prompt.shape[1] - 1:]  # [T, V]


@dataclass
class Float64Prefill:
    logits: torch.Tensor | None  # [B, L, V] float64 logits of the prefill batch; None where the pass failed
    error: str | None  # "Type: first line" where it failed or was skipped, else None
    streamed: bool = False  # the experts streamed (hf_fp64_stream): the whole float64 copy did not fit


def float64_prefill(model, batch: torch.Tensor, blocks_quant: str | None = None) -> Float64Prefill:
    """The float64 logits of ``batch`` [B, L] (``blocks_quant``: as ``Float64Model``); a failure (no float64 on
    the device, no room) is returned as its text, never raised. The float64 weights are freed before this returns."""
    logits_bytes = 8 * batch.numel() * model.config.get_text_config().vocab_size
    try:
        fp64 = Float64Model(model, 3 * logits_bytes, blocks_quant)  # room for the logits, error's cast, difference
        logits, streamed = fp64.logits(batch), fp64.streamed
        del fp64  # its float64 copies freed before the cache is emptied
    except Exception as err:  # noqa: BLE001  (a reference that cannot be computed is a result, not a crash)
        return Float64Prefill(None, hm.error_text(err))
    finally:
        if batch.device.type == "cuda":
            torch.cuda.empty_cache()
    return Float64Prefill(logits, None, streamed)
