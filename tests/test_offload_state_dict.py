"""An ``OffloadedMoE``'s ``state_dict`` carries its routed experts (the host store's) under the ``MoE``'s names: it
equals the layer it was built from, goes through ``torch.save`` / ``torch.load(weights_only=True)`` into another
offloaded layer or a plain ``MoE``, and a plain ``MoE``'s loads into an offloaded layer. Before, the experts were an
empty ``w13`` [0, 2N, K]: a save lost them in silence and a load kept the target's own. Shapes: K=32 hidden, N=16,
E=8 experts, top-2, a separate shared expert; float32 and int4_w4a16."""

from __future__ import annotations

import io

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload import OffloadedMoE

from _helpers import TOLERANCE, rel_l2

CONFIG = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, shared_expert_intermediate_size=16)


def _moe(seed: int, scheme: str | None) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(CONFIG, fuse_shared=False, backend="grouped_mm", router="torch")
    return moe.quantize_(scheme) if scheme else moe


def _saved(module) -> dict:
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(9, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", [None, "int4_w4a16"])
def test_the_state_dict_is_the_layers_it_was_built_from(scheme):
    moe = _moe(0, scheme)
    off = OffloadedMoE.from_moe(moe, cache_experts=3)
    got, want = off.state_dict(), moe.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)


@pytest.mark.parametrize("scheme", [None, "int4_w4a16"])
def test_a_saved_offloaded_layer_loads_into_an_offloaded_or_a_plain_layer(scheme):
    source = _moe(0, scheme)
    off = OffloadedMoE.from_moe(source, cache_experts=3)
    saved = _saved(off)
    other = OffloadedMoE.from_moe(_moe(7, scheme), cache_experts=3)
    plain = _moe(7, scheme)
    with torch.no_grad():
        before = other(_x())  # a warm cache: its slots hold the old experts, which the load must drop
        assert rel_l2(before, source(_x())) > 0.1  # other weights: the check below can fail
        other.load_state_dict(saved)
        plain.load_state_dict(saved)
        for seed in (1, 2):
            x = _x(seed)
            assert rel_l2(other(x), source(x)) < TOLERANCE[torch.float32]
            assert torch.equal(plain(x), source(x))


def test_a_plain_layers_state_dict_loads_into_an_offloaded_layer():
    """It was refused: "size mismatch for w13: ... [8, 32, 32] from checkpoint, ... [0, 32, 32] in current model"."""
    source = _moe(0, None)
    off = OffloadedMoE.from_moe(_moe(7, None), cache_experts=8)
    assert off.load_state_dict(_saved(source)) is not None
    with torch.no_grad():
        assert rel_l2(off(_x()), source(_x())) < TOLERANCE[torch.float32]


def test_a_state_dict_that_does_not_fit_writes_nothing():
    off = OffloadedMoE.from_moe(_moe(7, None), cache_experts=3)
    host_w13 = off.cache.host(off.layer_id).parts["w13"].clone()
    wide = MoE(CONFIG.replace(num_experts=16), fuse_shared=False).state_dict()
    with pytest.raises(RuntimeError, match=r"w13: the state_dict's \[16, 32, 32\] torch.float32 does not fit this "
                                           r"offloaded layer's experts, \[8, 32, 32\] torch.float32"):
        off.load_state_dict(wide)
    assert torch.equal(off.cache.host(off.layer_id).parts["w13"], host_w13)
    partial = {k: v for k, v in _moe(0, None).state_dict().items() if k != "w2"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "w2"'):
        off.load_state_dict(partial)
    assert torch.equal(off.cache.host(off.layer_id).parts["w13"], host_w13)  # w13 alone is not written


@pytest.mark.parametrize("saved, target", [(None, "int4_w4a16"), ("int4_w4a16", None), ("int8_w8a16", "mxfp4")])
def test_another_format_is_named_once_per_weight(saved, target):
    """Torch's words were ``Missing key(s): "w13.q" ...`` and ``Unexpected key(s): "w13"`` (or the reverse)."""
    off = OffloadedMoE.from_moe(_moe(7, target), cache_experts=3)
    host = {k: v.clone() for k, v in off.cache.host(off.layer_id).parts.items()}
    with pytest.raises(RuntimeError) as err:
        off.load_state_dict(_saved(OffloadedMoE.from_moe(_moe(0, saved), cache_experts=3)))
    text = str(err.value)
    for weight in ("w13", "w2"):
        assert f"{weight}: the state_dict holds {saved or 'float'} experts, this offloaded layer's are " \
               f"{target or 'float'}: offload a MoE of that format" in text
    assert "Missing key" not in text and "Unexpected key" not in text
    assert all(torch.equal(off.cache.host(off.layer_id).parts[k], v) for k, v in host.items())
