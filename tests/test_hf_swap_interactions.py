"""Session 54's merged branches against each other (rev54's review): gen54's move to the meta device with the hash
blocks that DeepSeek-V4's decoder layers call with ``input_ids``; ft54's check for a router wrapped since the swap and
its router recording in a checkpoint's recomputation with load54's blocks offloaded by accelerate; ft54's peft
wrappers with a move of the model; copies of a model on the meta device or wrapped by peft. Tiny models built offline
(random weights); the references are a swap of the same weights made now, the layers' own call counts, the saved
model's logits and the same adapter on transformers' eager experts.

Shapes: B batch, L tokens, V vocabulary."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from moekit.hf import FloatExpertsFreedError, use_moekit_blocks  # noqa: E402
from moekit.layer import MoE  # noqa: E402
from moekit.layer_hash import HashMoE  # noqa: E402

from _hf_fuzz_models import build_model, family_keys, family_of, tiny_config  # noqa: E402
from _swap_helpers import TINY_IDS, saved_freed, swaps, tiny_logits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
IDS = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))  # [B, L]


def _deepseek_v4(seed: int, quant: str | None, keep_float: bool):
    """A tiny DeepSeek-V4 (layer 0 hash-routed, layers 1 and 2 top-k), swapped."""
    fam = family_of(next(k for k in family_keys() if k.startswith("deepseek_v4:")))
    model = build_model(fam, tiny_config(fam, {"mlp_layer_types": ["hash_moe", "moe", "moe"]}), seed, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        use_moekit_blocks(model, quant=quant, keep_float=keep_float)
    return model


@pytest.mark.parametrize(("quant", "keep_float"), [(None, True), ("int8_w8a16", False)])
def test_a_hash_block_back_from_the_meta_device_runs_on_moekit_again(quant, keep_float, monkeypatch):
    """Before rev54 the hash block's first call after ``to("meta")`` and ``to_empty`` raised HashMoE's "token_ids is
    required" (float and freed): with no MoE yet to say it routes by them, the call's ``input_ids`` were dropped, and
    ``own_forward_needed`` then built the HashMoE and ran it without them."""
    model = _deepseek_v4(0, quant, keep_float)
    fresh = _deepseek_v4(7, quant, keep_float)
    model.to("meta")
    model.to_empty(device="cpu")
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():  # every tensor, non-persistent buffers (rotary tables) included, from the fresh model
        for name, tensor in (*fresh.named_parameters(), *fresh.named_buffers()):
            held[name].copy_(tensor)
    calls, forward, hashed = [], MoE.forward, HashMoE.forward
    monkeypatch.setattr(MoE, "forward", lambda self, *a, **k: calls.append("top-k") or forward(self, *a, **k))
    monkeypatch.setattr(HashMoE, "forward", lambda self, *a, **k: calls.append("hash") or hashed(self, *a, **k))
    with torch.no_grad():
        got = model(IDS).logits  # [B, L, V]
    assert calls == ["hash", "top-k", "top-k"]  # every block on moekit, the hash block routed by the input ids
    assert all(swap.moe is not None for swap in swaps(model))
    with torch.no_grad():
        want = fresh(IDS).logits
    assert torch.equal(got, want)  # the same as a swap of those weights made now, bit for bit


class _Wrapped(nn.Module):
    """A module in the router's place that holds it (as peft's LoRA layer does, its attributes read through it)."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_layer, name)

    def forward(self, x):
        return self.base_layer(x)


def _saved_and_offloaded(folder):
    """A tiny freed Qwen3-MoE (int4) saved into ``folder`` and loaded again with layer 1 on "disk" (its quantized
    experts read from the file at each call): (the model as saved, the loaded one)."""
    pytest.importorskip("accelerate")
    saved = saved_freed("qwen3", "int4_w4a16", {"group_size": 32}, folder)
    where = {**dict.fromkeys(("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"), "cpu"),
             "model.layers.0": "cpu", "model.layers.1": "disk"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return saved, transformers.AutoModelForCausalLM.from_pretrained(folder, device_map=where,
                                                                        offload_folder=str(folder / "offload"))


def _checkpointed_grad(model) -> torch.Tensor:
    """Layer 0's q_proj gradient of the LM loss with the router's aux loss (``output_router_logits``), the decoder
    layers gradient-checkpointed (non-reentrant); the rest frozen (an offloaded layer holds no gradient)."""
    for name, p in model.named_parameters():
        p.requires_grad_(name == "model.layers.0.self_attn.q_proj.weight")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(TINY_IDS, labels=TINY_IDS, output_router_logits=True).loss.backward()
    return model.model.layers[0].self_attn.q_proj.weight.grad


def test_an_offloaded_freed_block_trains_checkpointed_with_router_logits(tmp_path):
    """ft54's router recording inside a checkpoint's recomputation (``recording_router``) through load54's call of
    an offloaded block (``run_offloaded``: its MoE built again in the recomputation): the gradient through the
    offloaded layer is the in-memory model's, bit for bit (it was at rev54's review: kept as a regression test)."""
    saved, loaded = _saved_and_offloaded(tmp_path)
    assert swaps(loaded)[1].offload is not None
    assert torch.equal(_checkpointed_grad(loaded), _checkpointed_grad(saved))


def test_an_offloaded_freed_block_whose_router_is_wrapped_says_so(tmp_path):
    """load54's offloaded block builds its MoE at each call and tracked it again, ft54's module check included: a
    router wrapped after the load passed as the tracked one, and the wrapper was left out, silently (rev54)."""
    _, loaded = _saved_and_offloaded(tmp_path)
    assert torch.equal(tiny_logits(loaded), torch.load(tmp_path / "saved.pt")[1])  # read from the file at each call
    block = loaded.model.layers[1].mlp
    assert swaps(loaded)[1].offload is not None and swaps(loaded)[1].offload.file is not None
    block.gate = _Wrapped(block.gate)
    with pytest.raises(FloatExpertsFreedError, match="wrapped since the swap"):
        tiny_logits(loaded)


def test_a_block_whose_experts_peft_wrapped_after_the_swap_moves_and_keeps_its_adapter():
    """ft54's LoRA on the experts' Parameters of swapped blocks (the block's own forward applies it) and a move of the
    model (``model.to``, as Trainer places it): the move rebuilt the MoE over peft's wrapper and raised block_config's
    TypeError (rev54). Now the MoE waits for the wrapper to go (``merge_and_unload``), then is built over the merged
    weights. References: the same adapter on transformers' eager experts."""
    import peft

    from _finetune_models import build, grads, weights

    state = weights("qwen3_moe")

    def run(swap: bool) -> tuple:
        model = build("qwen3_moe", "eager", state)
        if swap:
            use_moekit_blocks(model)
        torch.manual_seed(5)
        tuned = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                           target_parameters=["mlp.experts.gate_up_proj",
                                                                              "mlp.experts.down_proj"]))
        tuned.to("cpu")
        out = tuned(input_ids=IDS, labels=IDS)
        out.loss.backward()
        adapter_grads = grads(tuned)
        merged = tuned.merge_and_unload()
        with torch.no_grad():
            return out.loss.detach(), adapter_grads, merged(IDS).logits, merged

    want_loss, want, want_merged, _ = run(False)
    loss, got, merged_logits, merged = run(True)
    assert want and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(loss, want_loss)
    assert all(swap.moe is not None for swap in swaps(merged))  # back on moekit once the wrapper is gone
    assert (merged_logits - want_merged).norm() / want_merged.norm() < 1e-5


def test_copies_of_a_model_on_the_meta_device_and_of_a_peft_wrapped_one():
    """``copy.deepcopy`` (and pickling) swapped each block again at once: on the meta device (gen54's state) that
    raised block_moe's meta-device error; under peft's wrapper of the experts (ft54's state) block_config's TypeError
    (rev54). A copy now waits for its MoE as the original does. References: a swap of the same weights made now;
    the original peft model's loss and adapter gradients."""
    import copy

    import peft

    from _finetune_models import build, grads, weights

    model = _deepseek_v4(0, "int8_w8a16", False).to("meta")
    fresh = _deepseek_v4(7, "int8_w8a16", False)
    copied = copy.deepcopy(model).to_empty(device="cpu")
    held = {**dict(copied.named_parameters()), **dict(copied.named_buffers())}
    with torch.no_grad():
        for name, tensor in (*fresh.named_parameters(), *fresh.named_buffers()):
            held[name].copy_(tensor)
        assert torch.equal(copied(IDS).logits, fresh(IDS).logits)
    tuned = build("qwen3_moe", "eager", weights("qwen3_moe"))
    use_moekit_blocks(tuned)
    torch.manual_seed(5)
    tuned = peft.get_peft_model(tuned, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                       target_parameters=["mlp.experts.gate_up_proj"]))
    twin = copy.deepcopy(tuned)
    losses = []
    for model in (tuned, twin):
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
        losses.append((out.loss.detach(), grads(model)))
    (want, want_grads), (got, got_grads) = losses
    assert want_grads and torch.equal(got, want) and all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)
