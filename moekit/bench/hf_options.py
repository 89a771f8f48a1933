"""``moekit bench --hf``'s settings: what one run measures (``HFBenchOptions``, the defaults of the GPU, the CPU and
the tiny CI run), the dtype it builds the model in, and its random inputs."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moekit.bench.hf_models import MODELS


@dataclass(frozen=True)
class HFBenchOptions:
    model: str  # a key of hf_models.MODELS
    layers: int  # decoder layers
    decode_tokens: int  # new tokens per generate call
    prompt_len: int  # the decode prompt's tokens (batch 1)
    prefill_batch: int  # B sequences ...
    prefill_len: int  # ... of L tokens in the prefill batch
    repeats: int  # timed passes (round-robin in eager mode); numbers are medians over them
    compile: bool  # also measure transformers' compiled decode
    compile_backend: str = "inductor"  # "eager" traces without code generation (the CPU tests)
    impls: tuple[str, ...] | None = None  # None: every registered one; eager always runs in eager mode
    tiny: bool = False  # tiny widths instead of the published ones
    dtype: str | None = None  # the model's dtype, one of HF_DTYPES; None: bfloat16 on CUDA, float32 on the CPU
    # None: float experts; "fp8": transformers' fine-grained fp8 experts (hf_quant); one of hf_wo.BLOCK_QUANTS: the
    # float model, and its blocks swapped to moekit's layer and quantized with it (the QUANT_BLOCKS_IMPL row)
    quant: str | None = None
    # a BLOCK_QUANTS scheme's quantizer options (--hf-quant-options) as use_moekit_blocks keeps them: sorted pairs
    quant_options: tuple[tuple[str, object], ...] = ()


HF_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(opts: HFBenchOptions, device: torch.device) -> torch.dtype:
    """The dtype the model is built in (``opts.dtype``, or the device's default); ValueError naming ``hf-dtype``."""
    if opts.dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if opts.dtype not in HF_DTYPES:
        raise ValueError(f"hf-dtype must be one of {HF_DTYPES}, got {opts.dtype!r}")
    return getattr(torch, opts.dtype)


def default_options(model: str, device: torch.device, tiny: bool = False, **overrides) -> HFBenchOptions:
    """The GPU run (bf16, real widths), a CPU run of a minute or two (one layer, short sequences, no
    compilation: transformers compiles generate only on accelerators), or the tiny CI run."""
    if tiny:
        base = HFBenchOptions(model, 2, 4, 8, 2, 16, 3, compile=True, compile_backend="eager", tiny=True)
    elif device.type == "cuda":
        base = HFBenchOptions(model, MODELS[model].default_layers, 64, 16, 4, 1024, 3, compile=True)
    else:
        base = HFBenchOptions(model, 1, 8, 8, 1, 64, 3, compile=False)
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class Inputs:
    prompt: torch.Tensor  # [1, P] random ids: the decode prompt
    batch: torch.Tensor  # [B, L] random ids: the prefill batch


def make_inputs(vocab_size: int, opts: HFBenchOptions, device: torch.device, seed: int = 1) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (1, opts.prompt_len), generator=g)
    batch = torch.randint(0, vocab_size, (opts.prefill_batch, opts.prefill_len), generator=g)
    return Inputs(prompt.to(device), batch.to(device))
