"""The hash routers' renormalisation eps and the simulator's router summary (session 49's left items): the hash
routers (``hash_route``, ``FusedHashRouter``, ``HashMoE``) divide by sum + 1e-20 as transformers'
``DeepseekV4HashRouter`` does, which a V4 config's hash layer reads as ``renorm_eps``; a hand-built hash config with
another eps is refused, not routed with 1e-20 silently. ``router_summary`` (``moekit simulate``'s page, summary and
JSON) states the renormalisation eps and ERNIE-4.5's clamp."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from moekit import HashMoE, MoEConfig
from moekit.cli import main
from moekit.routing.hash_route import hash_route
from moekit.sim.run import router_summary

transformers = pytest.importorskip("transformers")

HASH = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
                 hash_table_size=50)


def test_v4_hash_layers_read_transformers_eps():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    source = inspect.getsource(modeling_deepseek_v4.DeepseekV4HashRouter.forward)
    assert "weights.sum(dim=-1, keepdim=True) + 1e-20" in source  # the formula the hash routers compute
    hashed = MoEConfig.from_hf_config(DeepseekV4Config(), layer=0)
    assert hashed.hash_table_size is not None and hashed.renorm_eps == 1e-20


@pytest.mark.parametrize("eps", [0.0, 1e-20])
def test_the_hash_routers_take_their_eps(eps):
    """0 (a hand-built config's default) and 1e-20 route alike: w / (sum + 1e-20), a float64 loop here."""
    cfg = HASH.replace(renorm_eps=eps)
    layer = HashMoE(cfg, router="torch")
    # the last row at -80: S ~ 2e-17, the eps 6e-4 of it (above float32's rounding: the eps is seen)
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) - torch.tensor([[0.0], [0.0], [80.0]])
    token_ids = torch.tensor([1, 7, 30])
    got = hash_route(logits, token_ids, layer.tid2eid, cfg)
    for t in range(3):
        s = torch.nn.functional.softplus(logits[t].double()).sqrt()[layer.tid2eid[token_ids[t]]]  # [k]
        want = s / (s.sum() + 1e-20)
        assert torch.allclose(got.topk_weights[t].double(), want, rtol=1e-5, atol=0)


def test_another_eps_is_refused_by_every_hash_router(monkeypatch):
    cfg = HASH.replace(renorm_eps=1e-6)
    with pytest.raises(ValueError, match=r"renorm_eps: the hash routers divide by sum\(w\) \+ 1e-20.*got 1e-06"):
        HashMoE(cfg, router="torch")
    table = torch.zeros(50, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="renorm_eps"):
        hash_route(torch.zeros(2, 16), torch.zeros(2, dtype=torch.int64), table, cfg)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from moekit.routing.hash_fused import FusedHashRouter

    with pytest.raises(ValueError, match="renorm_eps"):
        FusedHashRouter(cfg)


def test_router_summary_states_the_renormalisation():
    plain = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4)
    assert router_summary(plain)["renorm_eps"] == 0.0
    assert router_summary(plain.replace(renorm_eps=1e-6))["renorm_eps"] == 1e-6
    ernie = plain.replace(use_correction_bias=True, renorm_clamp=1e-12)
    assert router_summary(ernie)["renorm_clamp"] == 1e-12


def test_simulate_prints_the_eps_with_the_routers_other_fields(capsys, tmp_path):
    """The text page's router line and the JSON, for a config.json of DeepSeek-V3 (eps 1e-20) and ERNIE-4.5 (clamp)."""
    from transformers import DeepseekV3Config, Ernie4_5_MoeConfig

    cases = {"v3": (DeepseekV3Config(), "renorm_eps=1e-20"),
             "ernie": (Ernie4_5_MoeConfig(), "renorm_clamp=1e-12")}
    for name, (hf, shown) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(hf.to_json_string())
        assert main(["simulate", "--config", str(path), "--tokens", "32"]) == 0
        router_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("router "))
        assert "scoring=" in router_line and shown in router_line
        assert main(["simulate", "--config", str(path), "--tokens", "32", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["router"]
        assert got["renorm_eps"] == (1e-20 if name == "v3" else 0.0)
