"""A state_dict loaded into a layer of another experts format (a quantized scheme into another scheme, float into
quantized, quantized into float) is refused naming what the state_dict holds and what the layer has; the same
format loads bit for bit. The scheme is read off the saved tensors' names and dtypes alone (no metadata)."""

from __future__ import annotations

import io
import re

import pytest
import torch

from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.quant import SCHEMES, quantize, scheme_of_tensors

CONFIG = MoEConfig(hidden_size=128, moe_intermediate_size=64, num_experts=4, top_k=2)
FORMATS = ("float", *SCHEMES)


def _layer(fmt: str, seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(CONFIG, backend="reference")
    return moe if fmt == "float" else moe.quantize_(fmt)


def _saved(fmt: str) -> dict:
    """The layer's state_dict through torch.save / torch.load(weights_only=True), as a checkpoint file gives it."""
    buffer = io.BytesIO()
    torch.save(_layer(fmt, seed=0).state_dict(), buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_scheme_is_told_by_the_tensors(scheme):
    w = quantize(torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0)), scheme)
    assert scheme_of_tensors(w.tensors()) == scheme
    assert scheme_of_tensors({**w.tensors(), "extra": torch.zeros(1)}) is None
    assert scheme_of_tensors({name: t.float() for name, t in w.tensors().items()}) is None


@pytest.mark.parametrize("held", FORMATS)
@pytest.mark.parametrize("layer_format", FORMATS)
def test_a_state_dict_of_another_format_is_refused_by_name(held, layer_format):
    state = _saved(held)
    layer = _layer(layer_format, seed=1)
    x = torch.randn(5, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))
    if held == layer_format:
        layer.load_state_dict(state)
        with torch.no_grad():
            assert torch.equal(layer(x), _layer(held, seed=0)(x))
        return
    w13, w2 = layer.w13, layer.w2
    with pytest.raises(RuntimeError) as err:
        layer.load_state_dict(state)
    message = str(err.value)
    for name in ("w13", "w2"):
        said = f"{name}: the state_dict holds {held} experts, this layer's are {layer_format}: load it into a float MoE"
        assert said in message
    assert "Unexpected key" not in message  # the other format's entries are named once, in the line above
    if held != "float":
        assert f"quantize_({held!r})" in message
    assert layer.w13 is w13 and layer.w2 is w2  # the layer keeps its own experts


@pytest.mark.parametrize("scheme, saved, loaded", [
    ("int4_w4a16", {"group_size": 64}, {"group_size": 128}),
    ("fp8_block", {"block_shape": (64, 64)}, {"block_shape": (128, 128)}),
])
def test_a_state_dict_of_other_options_is_refused_naming_the_layers(scheme, saved, loaded):
    """The same scheme saved with other options (int4's group size, fp8's block shape): the error names the layer's
    options and what to do, not only a scale's shape ("scale must have shape [4, 128, 1], got [4, 128, 2]")."""
    torch.manual_seed(0)
    buffer = io.BytesIO()
    torch.save(MoE(CONFIG, backend="reference").quantize_(scheme, **saved).state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    layer = MoE(CONFIG, backend="reference").quantize_(scheme, **loaded)
    (name, value), = loaded.items()
    with pytest.raises(RuntimeError, match=rf"w13: {scheme}: .*shape.*this layer's {scheme} options: {name}="
                                           rf"{re.escape(str(value))}; quantize_ it with the options the state_dict "
                                           "was saved with"):
        layer.load_state_dict(state)
