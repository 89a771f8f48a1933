"""Tiny causal LMs for the fine-tuning tests (random weights, built offline from configs): one family's model with
transformers' own experts ("eager") or moekit's, the same weights for each; a toy token dataset; transformers'
``Trainer`` for a few steps. Shapes: V = 64 tokens, K = 32 hidden, 2 layers."""

from __future__ import annotations

import torch
import transformers

import moekit.hf

HEADS = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**HEADS, intermediate_size=64, moe_intermediate_size=16,
                                                     num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                                     router_aux_loss_coef=0.01),
    "mixtral": lambda: transformers.MixtralConfig(**HEADS, intermediate_size=16, num_hidden_layers=2,
                                                  num_local_experts=6, num_experts_per_tok=2),
    # layer 0 dense, layer 1 MoE: grouped routing, a shared expert, routed scaling, the correction bias
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
        moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5),
    # biased, interleaved, transposed experts: swapped blocks under autograd run their own forward (views)
    "gpt_oss": lambda: transformers.GptOssConfig(**HEADS, intermediate_size=16, num_hidden_layers=2,
                                                 num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
                                                 layer_types=["sliding_attention", "full_attention"]),
}


def weights(family: str, seed: int = 0) -> dict:
    """A state dict for ``family``'s model: transformers' init from ``seed``, expert biases random and non-zero."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        bias = name.endswith("_bias") and "experts" in name
        state[name] = torch.randn(tensor.shape, generator=g) * 0.5 if bias else tensor.clone()
    return state


def build(family: str, how: str, state: dict) -> torch.nn.Module:
    """``family``'s model over ``state`` in training mode: ``how`` "eager" (transformers' experts loop), "moekit"
    (``experts_implementation="moekit"``) or "blocks" (eager, then ``use_moekit_blocks``)."""
    impl = "moekit" if how == "moekit" else "eager"
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family](), experts_implementation=impl)
    model.load_state_dict(state)
    if how == "blocks":
        report = moekit.hf.use_moekit_blocks(model)
        assert report.swapped and not report.left, report
    return model.train()


class Tokens(torch.utils.data.Dataset):
    """``n`` sequences of ``length`` random token ids, each its own labels (a causal LM's loss)."""

    def __init__(self, n: int = 16, length: int = 12, seed: int = 1):
        self.ids = torch.randint(0, HEADS["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(transformers.TrainerCallback):
    """The training loss of every logged step."""

    def __init__(self):
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def trainer(model, out_dir, steps: int = 4, **arguments) -> tuple[transformers.Trainer, Losses]:
    """A CPU ``Trainer`` over ``Tokens()`` logging every step's loss (AdamW, lr 1e-2, batch 4, seed 0)."""
    losses = Losses()
    args = transformers.TrainingArguments(
        str(out_dir), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, **{"save_strategy": "no", **arguments})
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[losses]), losses


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of ``got`` against ``want``."""
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def grads(model: torch.nn.Module) -> dict:
    """Every Parameter's gradient by name (those that have one)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
