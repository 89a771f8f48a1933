"""EPMoE.from_moe on 2 gloo ranks: everything a rank holds in full comes from the layer (the router's bias of a
``router_bias`` config too), a gate bias that differs between ranks is caught, a quantized layer is refused
naming the order that works, and a float32 layer takes a bf16 x under autocast as ``MoE`` does. Shapes: K=32
hidden, N=16, E=8 experts."""

from __future__ import annotations

import torch

from _helpers import TOLERANCE, rel_l2, rel_max_err, value_error_of
from _parallel_harness import run_ranks
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.parallel import EPMoE

BIASED = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, router_bias=True,
                   shared_expert_intermediate_size=16)


def _moe(seed: int = 0, bias_shift: float = 0.0, **kwargs) -> MoE:
    torch.manual_seed(seed)  # the same weights on every rank
    moe = MoE(BIASED, **kwargs)
    moe.gate.bias.copy_(torch.linspace(-3.0, 3.0, 8) + bias_shift)  # large: the bias decides most choices
    return moe


@torch.no_grad()
def _scenarios(rank: int, world_size: int) -> dict:
    x = torch.randn(2 * world_size + 3, 32, generator=torch.Generator().manual_seed(5))
    mine = x[rank::world_size]  # this rank's tokens
    moe = _moe()
    unbiased = MoE(BIASED.replace(router_bias=False))
    unbiased.load_state_dict({k: v for k, v in moe.state_dict().items() if k != "gate.bias"})
    return {
        "router_bias": rel_max_err(EPMoE.from_moe(moe)(mine), moe(mine)),
        "bias_matters": rel_max_err(unbiased(mine), moe(mine)),  # the check above could fail without the bias
        "bias_mismatch": value_error_of(lambda: EPMoE.from_moe(_moe(bias_shift=float(rank == 1)))),
        "quantized": value_error_of(lambda: EPMoE.from_moe(_moe(fuse_shared=False).quantize_("int8_w8a16"))),
        "autocast": _autocast(moe, mine.bfloat16()),
        "mode": (EPMoE.from_moe(_moe().eval()).training, EPMoE.from_moe(_moe().train()).training),
    }


def _autocast(moe: MoE, x: torch.Tensor) -> tuple:
    """(out dtype, rel L2 against the single-process MoE under the same autocast) of the exact and padded dispatch."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = moe(x).double()
        outs = [EPMoE.from_moe(moe, max_tokens_per_rank=cap)(x) for cap in (None, 8)]
    return tuple((out.dtype, rel_l2(out.double(), want)) for out in outs)


def test_from_moe_takes_the_router_bias_refuses_quantized_layers_and_follows_autocast():
    """from_moe takes the router bias, refuses quantized layers, follows autocast and keeps the layer's mode (it came
    back in training mode: an eval Phi-MoE layer, whose router refuses training, raised; fuz44)."""
    for res in run_ranks(_scenarios, 2, timeout_s=120):
        assert res["mode"] == (False, True), res
        assert res["router_bias"] < 2e-6 and res["bias_matters"] > 1e-2, res
        assert "replicated weights" in res["bias_mismatch"] and "gate_bias" in res["bias_mismatch"], res
        assert "quantized (int8_w8a16)" in res["quantized"], res
        assert "EPMoE.from_moe(moe).quantize_('int8_w8a16')" in res["quantized"], res
        assert all(dtype == torch.bfloat16 and err < TOLERANCE[torch.bfloat16] for dtype, err in res["autocast"]), res
