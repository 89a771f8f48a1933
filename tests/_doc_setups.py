"""What the docs' examples take as given (``<!-- test: setup NAME -->`` before a block), built small for the CPU.

Each setup is a context manager that yields the names it puts in the example's namespace; the ``ref_*``
names are for the test's checks, which hold the example's results against them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moekit import MoEConfig
from moekit.layer import MoE


@contextlib.contextmanager
def hf_model():
    """``model``: a transformers MoE model (Qwen3-MoE, 3 layers of 8 experts, random weights), and ``moe``:
    its first block as a moekit layer; ``ref_ids`` a prompt and ``ref_logits`` the untouched model's logits."""
    import _hf_tiny_models  # here, not at the top: the spawned EP ranks need no transformers
    from moekit.hf import moe_from_hf

    model = _hf_tiny_models.qwen3_moe_small()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    moe = moe_from_hf(_hf_tiny_models.qwen3_moe_small().model.layers[0].mlp)
    yield {"model": model, "moe": moe, "ref_ids": ids, "ref_logits": logits, "ref_blocks": 3}


@contextlib.contextmanager
def ep_checkpoint():
    """docs/parallel.md's script on a rank of the test's gloo group: ``tiny_config`` (DeepSeek-V3's router at
    tiny widths), the checkpoint readers ``read_w13``, ``read_w2``, ``read_gate``, ``read_bias`` over
    ``ref_moe``'s weights (the same on every rank), and this rank's ``x_local`` and ``batches``."""
    config = MoEConfig.preset("deepseek-v3").replace(
        hidden_size=64, moe_intermediate_size=32, num_experts=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    ref = MoE(config).eval()
    generator = torch.Generator().manual_seed(2 + dist.get_rank())
    yield {"tiny_config": config, "ref_moe": ref, "read_w13": lambda e: ref.w13[e], "read_w2": lambda e: ref.w2[e],
           "read_gate": lambda: ref.gate.weight, "read_bias": lambda: ref.e_score_correction_bias,
           "x_local": torch.randn(6, 64, generator=generator),
           "batches": [torch.randn(5 + i % 3, 64, generator=generator) for i in range(10)]}


SETUPS = {"hf_model": hf_model, "ep_checkpoint": ep_checkpoint}
