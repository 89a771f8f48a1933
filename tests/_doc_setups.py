"""What the docs' examples take as given (``<!-- test: setup NAME -->`` before a block), built small for the CPU.

Each setup is a context manager that yields the names it puts in the example's namespace; the ``ref_*``
names are for the test's checks, which hold the example's results against them.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import transformers

from moekit import MoEConfig
from moekit.hf import moe_from_hf
from moekit.layer import MoE

from _parallel_harness import free_port


def _tiny_qwen3_moe() -> transformers.PreTrainedModel:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@contextlib.contextmanager
def hf_model():
    """``model``: a transformers MoE model (Qwen3-MoE, 3 layers of 8 experts, random weights), and ``moe``:
    its first block as a moekit layer; ``ref_ids`` a prompt and ``ref_logits`` the untouched model's logits."""
    model = _tiny_qwen3_moe()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    moe = moe_from_hf(_tiny_qwen3_moe().model.layers[0].mlp)
    yield {"model": model, "moe": moe, "ref_ids": ids, "ref_logits": logits, "ref_blocks": 3}


@contextlib.contextmanager
def one_rank_group():
    """docs/parallel.md's script on one gloo rank in this process (one rank holds no replica, so the EPLB
    example asks for none): ``LOCAL_RANK`` and the rendezvous in the environment, ``tiny_config``
    (DeepSeek-V3's router at tiny widths), the checkpoint readers ``read_w13``, ``read_w2``, ``read_gate``,
    ``read_bias`` over ``ref_moe``'s weights, ``x_local`` and ``batches``."""
    config = MoEConfig.preset("deepseek-v3").replace(
        hidden_size=64, moe_intermediate_size=32, num_experts=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    ref = MoE(config).eval()
    environ = dict(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   GLOO_SOCKET_IFNAME="lo")
    saved = {key: os.environ.get(key) for key in environ}
    os.environ.update(environ)
    generator = torch.Generator().manual_seed(2)
    try:
        yield {"tiny_config": config, "ref_moe": ref, "read_w13": lambda e: ref.w13[e], "read_w2": lambda e: ref.w2[e],
               "read_gate": lambda: ref.gate.weight, "read_bias": lambda: ref.e_score_correction_bias,
               "x_local": torch.randn(6, 64, generator=generator),
               "batches": [torch.randn(5, 64, generator=generator) for _ in range(10)]}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


SETUPS = {"hf_model": hf_model, "one_rank_group": one_rank_group}
