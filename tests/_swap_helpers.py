"""What the ``use_moekit_blocks`` tests read of a swapped model: its blocks' swaps, a count of their MoE calls, a
float64 loop of a softmax-routed SwiGLU block (Qwen3, Mixtral) to hold a swapped block against, a quantized swapped
model's float64 twin over its dequantized weights, a swapped MoE's
eager and compiled-whole calls, and the logits of a tiny model on fixed ids (the saving and loading tests)."""

from __future__ import annotations

import torch

from moekit.hf.swap import SWAP_ATTR
from moekit.hf.variants import build_plan


TINY_IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))  # [B, L]: in every vocabulary


def saved_freed(name: str, quant: str, options, folder, seed: int = 7):
    """A tiny 2-layer ``name`` model (``moekit.bench.hf_models``, random weights) swapped and freed with ``quant``
    (``quant_options=options``), its logits on ``TINY_IDS`` saved as ``folder/saved.pt``, then ``save_pretrained``
    into ``folder``; returns the model."""
    from moekit.bench.hf_models import build_model, hf_config
    from moekit.hf import use_moekit_blocks

    model = build_model(hf_config(name, 2, tiny=True), torch.float32, torch.device("cpu"), seed=seed)
    use_moekit_blocks(model, quant=quant, quant_options=options, keep_float=False)
    torch.save((TINY_IDS, tiny_logits(model)), folder / "saved.pt")
    model.save_pretrained(folder)
    return model


def float_experts_devices(monkeypatch) -> list[str]:
    """A list that gets the device type of every experts module's float ``down_proj`` each time transformers
    initialises a loaded model's missing weights (a freed load keeps them on "meta": never made)."""
    import transformers

    from moekit.hf.set_check import is_interface_experts

    devices = []
    initialize = transformers.PreTrainedModel._initialize_missing_keys

    def recording(self, *args, **kwargs):
        devices.extend(m.down_proj.device.type for m in self.modules() if is_interface_experts(m))
        return initialize(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedModel, "_initialize_missing_keys", recording)
    return devices


def tiny_logits(model) -> torch.Tensor:
    """[B, L, V] ``model``'s logits on ``TINY_IDS``, without autograd."""
    with torch.no_grad():
        return model(TINY_IDS).logits


def swaps(model) -> list:
    """Every swapped block's ``BlockSwap``, in module order."""
    return [m.__dict__[SWAP_ATTR] for m in model.modules() if SWAP_ATTR in m.__dict__]


def count_moe_calls(model) -> list:
    """A list that grows by one per swapped block's MoE call (its forward and traced_forward, a compiled block's
    call, wrapped on the instance)."""
    calls = []
    for swap in swaps(model):
        for name in ("forward", "traced_forward"):
            fn = getattr(swap.moe, name)
            setattr(swap.moe, name, lambda x, *a, _f=fn, **k: calls.append(1) or _f(x, *a, **k))
    return calls


def dequantized_float64_logits(model, inputs: dict) -> torch.Tensor:
    """[B, L, V] (a text model: its last hidden state): ``model`` run in float64 on ``inputs`` with transformers'
    eager experts, every swapped block's experts replaced by its MoE's dequantized weights in the block's own layout
    (gpt-oss's [E, K, 2N] / [E, N, K])."""
    tensors = {n: t.detach().double() for n, t in model.named_parameters()}
    tensors.update({n: t.double() for n, t in model.named_buffers() if t.is_floating_point()})
    for path, module in model.named_modules():
        swap = module.__dict__.get(SWAP_ATTR)
        if swap is None:
            continue
        transposed = build_plan(module.experts).transposed
        for key, w in (("gate_up_proj", swap.moe.w13), ("down_proj", swap.moe.w2)):
            value = w.dequantize(torch.float64)  # [E, 2N, K] / [E, K, N]
            tensors[f"{path}.experts.{key}"] = value.transpose(1, 2) if transposed else value
    model.set_experts_implementation("eager")
    with torch.no_grad():
        out = torch.func.functional_call(model, tensors, (), {**inputs, "use_cache": False})
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def block_loop64(x: torch.Tensor, router_w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int):
    """x [T, K] float64 -> [T, K]: softmax over E, the top-k renormalised, sum_j p_j * w2_j (silu(g) * u) with
    gate rows first in w13 [E, 2N, K], w2 [E, K, N]; one token, one expert at a time."""
    out = torch.zeros_like(x)
    n = w13.shape[1] // 2
    for t in range(x.shape[0]):
        probs = torch.softmax(router_w @ x[t], dim=0)  # [E]
        weights, experts = probs.topk(top_k)
        weights = weights / weights.sum()
        for p, e in zip(weights.tolist(), experts.tolist()):
            h = w13[e] @ x[t]  # [2N]
            out[t] += p * (w2[e] @ (torch.nn.functional.silu(h[:n]) * h[n:]))
    return out


def eager_and_compiled(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A swapped block's MoE on x [T, K] (no grad): its eager call, and its ``traced_forward`` (what a compiled block
    calls) compiled with ``fullgraph=True`` (aot_eager: no graph break anywhere in it); dynamo reset after."""
    with torch.no_grad():
        eager = moe(x)
        compiled = torch.compile(moe.traced_forward, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    return eager, compiled
