"""``use_moekit_blocks`` on the path a GPU takes (Triton's interpreter, bf16): the triton backend and the fused router,
so a swapped block's decode call (hidden states [1, 1, K]) reaches the layer's decode fast path; a greedy generate
gives the unswapped model's tokens and logits within bf16's tolerance."""

from __future__ import annotations

import pytest
import torch

from _helpers import rel_l2
from _triton_helpers import interpreted
from moekit import layer_fast

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        yield


def _tiny_qwen3_bf16():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def test_decode_reaches_the_layers_fast_path(monkeypatch):
    import copy

    import moekit.hf as moekit_hf

    model = _tiny_qwen3_bf16()
    twin = copy.deepcopy(model)
    twin.set_experts_implementation("eager")
    report = moekit_hf.use_moekit_blocks(model, backend="triton")
    swaps = [m._moekit_swap for m in model.modules() if hasattr(m, "_moekit_swap")]
    assert len(report.swapped) == len(swaps) == 2
    for swap in swaps:
        swap.moe.router = "fused"  # what "auto" resolves to on CUDA
    served = []  # one bool a call of the layers' decode fast path: served (True) or the full forward ran
    real = layer_fast.DecodeFast.__call__

    def counted(self, layer, x2d):
        out = real(self, layer, x2d)
        served.append(out is not None)
        return out

    monkeypatch.setattr(layer_fast.DecodeFast, "__call__", counted)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        got, want = model.generate(prompt, **kwargs), twin.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert rel_l2(torch.stack(got.logits), torch.stack(want.logits)) < 2e-2
    assert sum(served) >= 2 * (4 - 2)  # each layer's M = 1 calls after the first kept one served
