"""``moekit bench --hf --hf-quant int8_w8a16|int4_w4a16|mxfp4|fp8_block``: the model's MoE blocks run as moekit's
layer with their experts quantized by moekit (the weight-only schemes, or fp8_block: DeepSeek-V3's recipe, for every
model, gpt-oss's biases too), beside the same blocks unquantized.

    float model ──use_moekit_blocks───────────────▶ moekit_blocks        (the float experts)
                ──use_moekit_blocks(quant=scheme)─▶ moekit_blocks_quant  (MoE.quantize_(scheme))

transformers has no form of the weight-only schemes for its experts (nor fp8 experts with biases: gpt-oss), so the
quantized row is moekit's whole layer over the
block's router with its experts quantized from the block's weights, as a user gets it with
``use_moekit_blocks(model, quant=scheme)``. Both sets of swapped blocks are made once and kept on the model; a row
puts its set in place (``use_blocks``), so a compiled graph meets the same modules every pass, and every other row
(eager, the float implementations, moekit_blocks, no_experts) runs the very float model the quantized one was
quantized from: its decode over moekit_blocks' is what quantizing buys.

After every row has run, the quantized blocks free their float experts (``use_moekit_blocks(model, quant=scheme,
keep_float=False)``, ``freed_memory``): the document's ``quant.memory`` is the model's parameter + buffer bytes as
the float rows ran it and as a user who quantizes to fit the model holds it (on CUDA ``memory_allocated`` too).

The quantized row's float64 reference is the model with each block's experts replaced by their
``QuantizedWeight.dequantize`` in float64 (``dequantized_blocks_float64``): its error is the run's rounding alone;
the float rows keep the float model's. The document's ``quant.fp64_logits_rel_err`` is the two float64 models'
prefill logits against each other: what the quantization itself costs, no rounding of the run.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from moekit.bench.hf_measure import error_text

# the --hf-quant values run by moekit's blocks (their experts quantized by MoE.quantize_)
BLOCK_QUANTS = ("int8_w8a16", "int4_w4a16", "mxfp4", "fp8_block")
QUANT_BLOCKS_IMPL = "moekit_blocks_quant"  # the row of the blocks whose experts are quantized
_SETS_ATTR = "_moekit_bench_block_sets"  # on the model: {quant or None: {block: its BlockSwap}}
_WO_METHOD = ("; {quant} (--hf-quant): moekit_blocks_quant is every MoE block swapped by "
              "moekit.hf.use_moekit_blocks(model, quant='{quant}'{options}), its experts quantized from the model's "
              "random float weights by MoE.quantize_ (router, attention, head in dtype); every other row runs the same "
              "model unquantized; its float64 reference is the model with those experts dequantized "
              "(QuantizedWeight.dequantize) in float64; quant.fp64_logits_rel_err: that float64 model's prefill "
              "logits against the float model's in float64 (the quantization's own cost)")


def wo_method(quant: str, quant_options: tuple) -> str:
    """The document's method sentence of a ``BLOCK_QUANTS`` run, its quantizer options named where any are set."""
    options = f", quant_options={dict(quant_options)!r}" if quant_options else ""
    return _WO_METHOD.format(quant=quant, options=options)


def use_blocks(model: nn.Module, quant: str | None, quant_options: tuple = ()) -> None:
    """Every MoE block of ``model`` runs moekit's layer, its experts quantized with ``quant`` (None: the float ones)
    and ``quant_options`` ((name, value) pairs, ``--hf-quant-options``): that set of swapped blocks made on first use
    and kept, put back in place (and switched on) on later ones. RuntimeError where a block is left with a ``quant``
    (its float forward would pass for quantized)."""
    from moekit.hf.swap import SWAP_ATTR, use_moekit_blocks

    sets = model.__dict__.setdefault(_SETS_ATTR, {})
    if quant not in sets:
        report = use_moekit_blocks(model, quant=quant, quant_options=dict(quant_options) or None)
        if quant is not None and report.left:
            raise RuntimeError(f"{quant}: {len(report.left)} MoE blocks stay float ({report.left[0].path}: "
                               f"{report.left[0].reason})")
        sets[quant] = {m: m.__dict__[SWAP_ATTR] for m in model.modules() if SWAP_ATTR in m.__dict__}
    for block, swap in sets[quant].items():
        block.__dict__[SWAP_ATTR] = swap
        swap.active = True


def dequantized_blocks_float64(model: nn.Module, quant: str) -> dict[str, torch.Tensor]:
    """The experts of ``model``'s blocks quantized with ``quant`` (``use_blocks``), by the block's parameter names
    (``<block>.experts.gate_up_proj`` / ``down_proj``), as ``QuantizedWeight.dequantize(float64)`` in the block's own
    layout ([E, 2N, K] / [E, K, N]; gpt-oss's transposed [E, K, 2N] / [E, N, K]), an expert at a time
    (``dequantize_expert``, bit-identical to ``dequantize``'s slice): ``dequantize`` of a whole weight holds several
    float64 temporaries of its size (Qwen3-30B-A3B's w13: 3.2 GB each). KeyError where that set was not made."""
    from moekit.hf.variants import build_plan

    paths = {id(m): path for path, m in model.named_modules()}
    out = {}
    for block, swap in model.__dict__[_SETS_ATTR][quant].items():
        transposed = build_plan(block.experts).transposed
        for key, w in (("gate_up_proj", swap.moe.w13), ("down_proj", swap.moe.w2)):
            value = torch.empty(w.shape, dtype=torch.float64, device=w.device)  # [E, 2N, K] / [E, K, N]
            for expert in range(w.num_experts):
                value[expert] = w.dequantize_expert(expert, torch.float64)
            out[f"{paths[id(block)]}.experts.{key}"] = value.transpose(1, 2) if transposed else value
    return out


def freed_memory(model: nn.Module, quant: str, quant_options: tuple, log) -> dict | str:
    """``_freed_memory``'s figures (logged), or its failure as text (the rows stand)."""
    try:
        memory = _freed_memory(model, quant, quant_options)
    except Exception as err:  # noqa: BLE001  (recorded in the document)
        memory = error_text(err)
    log(f"{QUANT_BLOCKS_IMPL} with keep_float=False: {memory}")
    return memory


def _freed_memory(model: nn.Module, quant: str, quant_options: tuple) -> dict:
    """The model's parameter + buffer bytes (``model_bytes``) before and after its blocks quantized with ``quant``
    (``use_blocks``) free their float experts (``keep_float=False``: no requantization), the float experts' bytes
    freed and the quantized ones' (the report's), and on CUDA ``torch.cuda.memory_allocated`` before and after.
    The last step of a run: the unquantized set of blocks is dropped (its MoEs read the float experts)."""
    from moekit.hf.swap import use_moekit_blocks

    use_blocks(model, quant, quant_options)
    del model.__dict__[_SETS_ATTR]  # the float set's MoEs hold the float experts
    gc.collect()
    cuda = next(model.parameters()).device.type == "cuda"
    memory = {"model_bytes_before": model_bytes(model)}
    if cuda:
        memory["allocated_before"] = torch.cuda.memory_allocated()
    report = use_moekit_blocks(model, quant=quant, keep_float=False, quant_options=dict(quant_options) or None)
    gc.collect()
    memory.update(model_bytes_after=model_bytes(model), experts_float_bytes=report.freed_bytes,
                  experts_quant_bytes=report.quant_bytes)
    if cuda:
        torch.cuda.empty_cache()
        memory["allocated_after"] = torch.cuda.memory_allocated()
    return memory


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def memory_line(quant: dict) -> str | None:
    """The table's line of ``freed_memory``'s figures (None where the run has none)."""
    memory = quant.get("memory")
    if not isinstance(memory, dict):
        return memory and f"{quant['impl']} with keep_float=False: {memory}"
    mib = 2.0 ** 20
    line = (f"{quant['impl']} with keep_float=False: parameters + buffers {memory['model_bytes_before'] / mib:.1f} -> "
            f"{memory['model_bytes_after'] / mib:.1f} MiB (float experts {memory['experts_float_bytes'] / mib:.1f} "
            f"MiB freed, quantized {memory['experts_quant_bytes'] / mib:.1f} MiB)")
    if "allocated_after" in memory:
        line += (f"; memory_allocated {memory['allocated_before'] / mib:.1f} -> "
                 f"{memory['allocated_after'] / mib:.1f} MiB")
    return line
