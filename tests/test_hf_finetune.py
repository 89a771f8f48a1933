"""A fine-tuner's tools on tiny transformers models (random weights, built offline) with moekit serving the experts
(``experts_implementation="moekit"``) or the whole blocks (``use_moekit_blocks``), each against transformers' own
eager experts from the same weights: ``Trainer`` steps (losses and final weights), gradient checkpointing with and
without the router's aux loss, resuming from a ``Trainer`` checkpoint, ``save_pretrained`` / ``from_pretrained``,
and the swap leaving torch's random generator alone. peft's LoRA: tests/test_hf_peft.py."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf  # noqa: E402

from _finetune_models import build, grads, rel, trainer, weights  # noqa: E402

IDS = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
CASES = [("qwen3_moe", "moekit"), ("qwen3_moe", "blocks"), ("deepseek_v3", "moekit"), ("deepseek_v3", "blocks"),
         ("mixtral", "blocks"), ("gpt_oss", "moekit")]


@pytest.mark.parametrize("family,how", CASES)
def test_trainer_steps_equal_eager(family, how, tmp_path):
    """Four AdamW steps of ``Trainer``: every step's loss within 1e-6 of eager's and every final weight within 5e-5
    (float32 summation order; AdamW divides by the gradients' own size, so a tiny gradient's last bits show most)."""
    state = weights(family)
    runs = {}
    for name in ("eager", how):
        model = build(family, name, state)
        run, losses = trainer(model, tmp_path / name)
        run.train()
        runs[name] = (losses.losses, model.state_dict())
    (want_losses, want), (got_losses, got) = runs["eager"], runs[how]
    assert len(got_losses) == len(want_losses) == 4
    assert all(abs(g - w) <= 1e-6 * abs(w) for g, w in zip(got_losses, want_losses)), (got_losses, want_losses)
    worst = max((rel(got[k], want[k]), k) for k in want if want[k].is_floating_point() and want[k].norm() > 0)
    assert worst[0] < 5e-5, worst


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("how", ["moekit", "blocks"])
@pytest.mark.parametrize("router_logits", [True, False])
def test_gradient_checkpointing_equals_eager(router_logits, how, reentrant):
    """``activation_checkpointing_enable`` (transformers 5.25's name for ``gradient_checkpointing_enable``, which
    ``Trainer(gradient_checkpointing=True)`` calls; either ``use_reentrant``) on Qwen3-MoE, with transformers' aux loss
    (``output_router_logits=True``) or without: loss and every gradient within 1e-5 of eager's with the same
    checkpointing. Non-reentrant, also of eager's without checkpointing (session 54: the swapped blocks raised
    CheckpointError with router logits, their recomputation outside transformers' recording running moekit's layer
    where the forward had run the block's own). Reentrant checkpointing records the router logits under no_grad, so
    transformers' aux loss takes no gradient there, eager's included (docs/training.md)."""
    state = weights("qwen3_moe")

    def run(name: str, checkpointing: bool) -> tuple:
        model = build("qwen3_moe", name, state)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        out = model(input_ids=IDS, labels=IDS, output_router_logits=router_logits)
        out.loss.backward()
        return out.loss.detach(), grads(model)

    loss, got = run(how, True)
    references = [run("eager", True)] + ([] if reentrant else [run("eager", False)])
    for want_loss, want in references:
        assert set(got) == set(want)
        assert rel(loss, want_loss) < 1e-6
        assert max(rel(got[k], want[k]) for k in want) < 1e-5


def test_use_moekit_blocks_leaves_the_random_generator():
    """The swap builds each ``MoE`` (its gate's init draw overwritten by the block's weights) from a fork of torch's
    generator: a seeded script's later draws, such as a LoRA's init, are those it would get unswapped (session 54:
    peft's LoRA weights after a swap came out different)."""
    model = build("qwen3_moe", "eager", weights("qwen3_moe"))
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    moekit.hf.use_moekit_blocks(model)
    model.to(torch.float64)  # a move rebuilds every MoE
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("how", ["moekit", "blocks"])
def test_resume_from_a_trainer_checkpoint_and_reload(how, tmp_path):
    """Four steps saving a checkpoint at step 2, then a resume from it into a model loaded from that checkpoint
    (transformers 5.25's ``Trainer`` reloads a checkpoint's state dict without converting the per-expert tensors it
    saved back into fused experts: docs/training.md) ends bit-equal to the uninterrupted run; ``save_pretrained`` of
    the result then ``from_pretrained(..., experts_implementation="moekit")`` gives bit-equal logits."""
    state = weights("qwen3_moe")
    model = build("qwen3_moe", how, state)
    trainer(model, tmp_path, save_strategy="steps", save_steps=2)[0].train()
    checkpoint = os.path.join(tmp_path, "checkpoint-2")
    resumed = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, experts_implementation="moekit" if how == "moekit" else "eager")
    if how == "blocks":
        moekit.hf.use_moekit_blocks(resumed)
    trainer(resumed, tmp_path, save_strategy="steps", save_steps=2)[0].train(resume_from_checkpoint=checkpoint)
    want, got = model.state_dict(), resumed.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    resumed.save_pretrained(tmp_path / "final")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final", experts_implementation="moekit")
    if how == "blocks":
        moekit.hf.use_moekit_blocks(reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(IDS).logits, resumed.eval()(IDS).logits)
