"""peft's LoRA on tiny transformers MoE models (random weights, built offline) with moekit serving the experts
(``experts_implementation="moekit"``) or the whole blocks (``use_moekit_blocks``, float or quantized frozen experts),
each against the same adapter on transformers' own eager experts: gradients, where the optimizer's state lands,
``merge_and_unload`` and ``save_pretrained`` round trips, and LoRA on the experts' own Parameters
(``LoraConfig(target_parameters=...)``). peft is a test dependency (pyproject's ``test`` extra): never skipped."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
import peft  # noqa: E402  (the test extra: a missing peft fails here, it is not skipped)

import moekit.hf  # noqa: E402

from _finetune_models import build, grads, rel, trainer, weights  # noqa: E402

IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora(model: torch.nn.Module, **targets) -> peft.PeftModel:
    """A rank-4 LoRA whose B is random too (``init_lora_weights=False``: the adapter changes the function from the
    first step), drawn from seed 5."""
    torch.manual_seed(5)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets))


def swapped(model: torch.nn.Module, quant: str | None = None) -> torch.nn.Module:
    report = moekit.hf.use_moekit_blocks(model, quant=quant)
    assert report.swapped and not report.left, report
    return model


@pytest.mark.parametrize("how,quant", [("moekit", None), ("blocks", None), ("blocks", "int8_w8a16")])
def test_lora_on_attention_trains_the_adapter_alone(how, quant, tmp_path):
    """LoRA on q_proj / v_proj, two ``Trainer`` steps: the base model's weights (the experts included) stay bit-equal,
    AdamW holds state for the adapter's Parameters alone, and the adapter ends within 1e-5 of eager's (float experts)
    or 1e-2 (int8 weight-only experts, frozen: the quantization's own error)."""
    state = weights("qwen3_moe")
    runs = {}
    for name in ("eager", how):
        model = build("qwen3_moe", "eager" if name == "blocks" else name, state)
        model = swapped(model, quant) if name == "blocks" else model
        tuned = lora(model, target_modules=["q_proj", "v_proj"])
        run, _ = trainer(tuned, tmp_path / name, steps=2)
        run.train()
        adapter = {n for n, p in tuned.named_parameters() if p.requires_grad}
        held = {n for n, p in tuned.named_parameters() if p in run.optimizer.state}
        assert adapter and held == adapter and all("lora_" in n for n in adapter)
        runs[name] = tuned.state_dict()
    want, got = runs["eager"], runs[how]
    base = [k for k in want if "lora_" not in k]
    assert all(torch.equal(got[k], state[k.replace("base_model.model.", "").replace(".base_layer", "")])
               for k in base)
    tolerance = 1e-5 if quant is None else 1e-2
    assert max(rel(got[k], want[k]) for k in want if "lora_" in k) < tolerance


def test_merge_and_unload_and_save_pretrained_round_trip(tmp_path):
    """On swapped blocks: the adapter saved and loaded onto a fresh swapped model gives bit-equal logits; merged
    (``merge_and_unload``) within 1e-5 of the adapter's; the merged model saved and loaded with
    ``experts_implementation="moekit"``, then swapped, bit-equal to the merged one."""
    state = weights("qwen3_moe")
    tuned = lora(swapped(build("qwen3_moe", "eager", state)), target_modules=["q_proj", "v_proj"]).eval()
    tuned.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(swapped(build("qwen3_moe", "eager", state)), tmp_path / "adapter").eval()
    with torch.no_grad():
        want = tuned(IDS).logits
        assert torch.equal(loaded(IDS).logits, want)
        merged = loaded.merge_and_unload()
        assert rel(merged(IDS).logits, want) < 1e-5
        merged.save_pretrained(tmp_path / "merged")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", experts_implementation="moekit")
        assert torch.equal(swapped(again).eval()(IDS).logits, merged(IDS).logits)


@pytest.mark.parametrize("how", ["moekit", "swap_then_lora", "lora_then_swap"])
def test_lora_on_the_experts_parameters(how):
    """``LoraConfig(target_parameters=...)`` (peft's ``ParamWrapper`` on the experts module): with moekit's experts
    implementation the adapter's gradients are eager's (< 1e-5); on swapped blocks the block's own forward applies
    it (session 54: blocks swapped first left the adapter out in silence, its Parameters without a gradient), and
    ``use_moekit_blocks`` after peft leaves each such block, naming peft in ``report.left``."""
    state = weights("qwen3_moe")

    def run(name: str) -> tuple:
        model = build("qwen3_moe", "moekit" if name == "moekit" else "eager", state)
        model = swapped(model) if name == "swap_then_lora" else model
        tuned = lora(model, target_parameters=EXPERTS)
        report = moekit.hf.use_moekit_blocks(tuned) if name == "lora_then_swap" else None
        out = tuned(input_ids=IDS, labels=IDS)
        out.loss.backward()
        return out.loss.detach(), grads(tuned), report

    want_loss, want, _ = run("eager")
    loss, got, report = run(how)
    assert want and set(got) == set(want) and all("lora_" in k for k in want)
    assert rel(loss, want_loss) < 1e-6 and max(rel(got[k], want[k]) for k in want) < 1e-5
    if report is not None:
        assert not report.swapped and len(report.left) == 2
        assert all("peft" in block.reason and "target_parameters" in block.reason for block in report.left)
