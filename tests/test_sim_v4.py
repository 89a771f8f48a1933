"""``moekit simulate`` / the balance simulator of a DeepSeek-V4 config.json (transformers' own, built offline, at
E=16, k=4): its top-k layers route with sqrt(softplus) scores, the correction bias on them for selection (loads
against a float64 loop written here, after DeepSeek's bias updates), balancing lowers the imbalance, and its hash
layers are named and not simulated (``moekit.sim.run``'s module doc; the summary, the JSON and ``moekit serve``'s
page); a hash layer's ``MoEConfig`` and a model whose every MoE layer hash-routes are refused, in the API and on the
command line (``simulate`` and ``serve``).

Shapes: M tokens 96, E experts 16, k = top_k 4, F router inputs.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.request

import pytest
import torch

from _helpers import cli_error
from moekit import MoEConfig
from moekit.sim import SimParams, simulate, streams
from moekit.sim.balance import update_bias
from moekit.sim.report import summary
from moekit.sim.router import draw_tokens, make_router

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

E, K_TOP = 16, 4


def _v4_fields(kinds: list[str]) -> dict:
    cfg = transformers.AutoConfig.for_model("deepseek_v4", n_routed_experts=E, num_experts_per_tok=K_TOP,
                                            num_hidden_layers=len(kinds), mlp_layer_types=kinds)
    return cfg.to_dict()


def _loop_loads(logits: torch.Tensor, bias: torch.Tensor) -> list[int]:
    """V4's top-k selection per token in float64: the k largest sqrt(log(1 + e^x)) + bias (lower id on a tie)."""
    loads = [0] * E
    for row in logits.double().tolist():
        s = [math.sqrt(math.log1p(math.exp(v))) + float(b) for v, b in zip(row, bias)]
        for e in sorted(range(E), key=lambda i: (-s[i], i))[:K_TOP]:
            loads[e] += 1
    return loads


def test_v4_top_k_layers_simulate_with_sqrtsoftplus_and_bias_balancing():
    fields = _v4_fields(["hash_moe", "hash_moe", "moe", "moe"])
    params = SimParams(experts=E, top_k=K_TOP, tokens=96, skew=0.6, balance="bias", bias_batches=60, gpus=4,
                       spare_slots=4)
    result = simulate(params, fields)
    assert result.router["scoring"] == "sqrtsoftplus" and result.router["use_correction_bias"]
    config = MoEConfig.from_hf_config(fields, layer="typical")
    router = make_router(E, K_TOP, params.skew, params.seed, config)
    bias = update_bias(router, params.bias_batches, params.seed).correction_bias  # [E]
    x = draw_tokens(params.tokens, router.width, streams.generator(params.seed, streams.EVAL))  # [M, F]
    assert result.loads == _loop_loads(router.logits(x), bias)
    plain = _loop_loads(router.logits(x), torch.zeros(E))
    assert result.loads != plain  # the bias moved choices: on sqrt(softplus) scores, not on the logits
    assert result.balance.imbalance_after < result.balance.imbalance_before
    assert result.hash_layers == [0, 1]
    assert "hash layers       0, 1: not simulated" in summary(result)


def test_aux_loss_balancing_trains_the_v4_router_too():
    """The aux loss trains the router weight whose logits V4's router scores by sqrt(softplus) and routes top-k."""
    params = SimParams(experts=E, top_k=K_TOP, tokens=96, skew=0.6, balance="aux-loss", aux_steps=40, gpus=4,
                       spare_slots=4)
    b = simulate(params, _v4_fields(["hash_moe", "moe"])).balance
    assert b.imbalance_after < b.imbalance_before and b.drop_rate_after < b.drop_rate_before, b


def test_a_config_without_hash_layers_names_none():
    result = simulate(SimParams(experts=E, top_k=K_TOP, tokens=32, gpus=4, spare_slots=0), _v4_fields(["moe"] * 2))
    assert result.hash_layers == [] and "hash layers" not in summary(result)


def test_hash_only_models_and_hash_layer_configs_are_refused(tmp_path, capsys):
    params = SimParams(experts=E, top_k=K_TOP, tokens=32, gpus=4, spare_slots=0)
    only_hash = _v4_fields(["hash_moe"] * 3)
    with pytest.raises(ValueError, match=r"every MoE layer of this deepseek_v4 config \(3\) routes by a token-id"):
        simulate(params, only_hash)
    layer = MoEConfig.from_hf_config(_v4_fields(["hash_moe", "moe"]), layer=0)
    assert layer.hash_table_size == only_hash["vocab_size"]
    with pytest.raises(ValueError, match=r"config.hash_table_size=\d+: a hash layer routes by a token-id table"):
        simulate(params, layer)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(only_hash))
    for command in ("simulate", "serve"):  # the page would answer every run with an error: refused before it serves
        line = cli_error(capsys, [command, "--config", str(path)])
        assert f"--config {path}: every MoE layer" in line and "tid2eid" in line, line


def test_the_page_names_the_hash_layers_of_the_model_it_serves():
    from moekit.sim.server import make_server

    fields = _v4_fields(["hash_moe", "moe", "moe"])
    server = make_server(port=0, model=MoEConfig.from_hf_config(fields, layer="typical"), model_name="v4-tiny",
                         model_fields=fields)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = "http://{}:{}".format(*server.server_address[:2])
    try:
        with urllib.request.urlopen(url + "/api/simulate?tokens=32&gpus=4&spare_slots=0", timeout=60) as r:
            assert json.loads(r.read())["hash_layers"] == [0]
        with urllib.request.urlopen(url + "/app.js", timeout=60) as r:
            js = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert '$("hash-row").hidden = r.hash_layers.length === 0' in js and "r.hash_layers.join" in js
