"""The simulator for a model (``--preset`` / ``--config``): ``moekit simulate`` and the page's JSON API route with
its layer's router, LongCat-Flash's identity slots reported apart; the page's files carry the new fields."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from moekit import MoEConfig
from moekit.cli import main
from moekit.sim import SimParams, simulate

LONGCAT = {"model_type": "longcat_flash", "hidden_size": 64, "num_layers": 2, "n_routed_experts": 32,
           "zero_expert_num": 16, "moe_topk": 4, "expert_ffn_hidden_size": 16, "ffn_hidden_size": 64,
           "routed_scaling_factor": 6.0, "vocab_size": 100}


@pytest.fixture
def longcat_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LONGCAT))
    return str(path)


def test_simulate_a_longcat_config(capsys, longcat_json):
    assert main(["simulate", "--config", longcat_json, "--gpus", "4", "--spare-slots", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = simulate(SimParams(experts=32, top_k=4, gpus=4, spare_slots=4), LONGCAT)  # the file's fields
    assert got == json.loads(json.dumps(want.to_dict()))
    assert "(longcat_flash's config has no field 'num_attention_heads' the bill reads)" in got["param_shape"]
    assert len(got["identity_hits"]) == 16 and sum(got["identity_hits"]) > 0
    assert sum(got["loads"]) + sum(got["identity_hits"]) == 128 * 4 and got["router"]["num_identity_experts"] == 16
    assert main(["simulate", "--config", longcat_json, "--gpus", "4", "--spare-slots", "4"]) == 0
    out = capsys.readouterr().out
    assert "zero-compute      " in out and "on the 16 identity experts" in out and "num_identity_experts=16" in out


def test_simulate_a_preset_routes_with_its_router(capsys):
    assert main(["simulate", "--preset", "deepseek-v3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["params"]["experts"] == 256 and got["params"]["top_k"] == 8 and got["identity_hits"] == []
    assert got["router"] == {"scoring": "sigmoid", "renormalize": True, "n_group": 8, "topk_group": 4,
                             "use_correction_bias": True, "renorm_eps": 1e-20}  # DeepseekV3TopkRouter's / (sum + 1e-20)


def test_a_preset_run_states_that_model_s_parameters_and_expert_cost(capsys):
    """DeepSeek-V3's own bill, not Mixtral's shapes with E = 256, k = 8 (1.4T): its card's 671B, and the 248 experts a
    token does not pick in each of its 58 MoE layers (3 * 7168 * 2048 each) between total and active; each
    assignment priced at 6 * 7168 * 2048 FLOPs at the H100's dense bf16 peak (989.4 TFLOP/s, half its sparse 1979)."""
    assert main(["simulate", "--preset", "deepseek-v3", "--tokens", "64", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert round(got["total_params"] / 1e9) == 671
    assert got["total_params"] - got["active_params"] == 58 * (256 - 8) * 3 * 7168 * 2048
    assert got["param_shape"].startswith("deepseek_v3 shapes (d=7168, d_ff=2048, 61 layers)")
    for placement in got["ep"]["placements"]:
        want_us = max(placement["gpu_loads"]) * 6 * 7168 * 2048 / 989.4e12 * 1e6
        assert placement["step_time_us"] == pytest.approx(want_us, rel=1e-3)
    assert "deepseek_v3 expert: 0.09 µs each" in got["ep"]["cost_model"]
    default = simulate(SimParams(experts=256, top_k=8, tokens=64))  # no model: Mixtral's shapes, as the lesson's
    assert default.param_shape.startswith("mixtral-8x7b shapes") and "Mixtral expert" in default.ep.cost_model


def test_simulate_refuses_experts_with_a_model(capsys, longcat_json):
    assert main(["simulate", "--config", longcat_json, "--experts", "8"]) == 2
    assert "--experts / --top-k come from --preset / --config" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served():
    from moekit.sim.server import make_server

    server = make_server(model=MoEConfig.from_hf_config(LONGCAT), model_name="longcat-tiny", model_fields=LONGCAT)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_served_model_fixes_experts_and_top_k(served):
    status, d = _get(served + "/api/defaults")
    assert status == 200 and d["model"] == "longcat-tiny" and d["router"]["num_identity_experts"] == 16
    assert (d["params"]["experts"], d["params"]["top_k"]) == (32, 4) and d["limits"]["experts"] == [32, 32]
    status, got = _get(served + "/api/simulate?skew=0.3&gpus=4&spare_slots=4")
    want = simulate(SimParams(experts=32, top_k=4, skew=0.3, gpus=4, spare_slots=4), LONGCAT)
    assert status == 200 and got == json.loads(json.dumps(want.to_dict()))
    assert _get(served + "/api/simulate?experts=32&top_k=4&gpus=4&spare_slots=4")[0] == 200
    status, err = _get(served + "/api/simulate?experts=64")
    assert status == 400 and err["parameter"] == "experts" and "fixed by the served model longcat-tiny" in err["error"]


def test_the_page_shows_the_zero_compute_share(served):
    with urllib.request.urlopen(served + "/", timeout=60) as r:
        html = r.read().decode()
    with urllib.request.urlopen(served + "/app.js", timeout=60) as r:
        js = r.read().decode()
    assert 'id="zero-compute-row" hidden' in html and 'id="model"' in html
    assert "r.identity_hits" in js and "r.zero_compute_share" in js and "r.routed_assignments" in js


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "llama4", "hy_v4_vl"])
def test_a_multimodal_config_json_is_read_from_its_text_config(tmp_path, capsys, model_type):
    """A VL model's config.json keeps its MoE fields in a nested text_config (Qwen3-VL-MoE, Llama-4, HY-V4-VL;
    written here from transformers' own config classes, offline): `moekit simulate --config` and `moekit analyze
    --config` find them there, as from_hf_config does, and give what the text config alone gives. Before, the layer
    was read but the bill looked for hidden_size at the top level and priced Mixtral-8x7B's shapes instead."""
    transformers = pytest.importorskip("transformers")
    nested = transformers.AutoConfig.for_model(model_type).to_dict()
    text = nested["text_config"]
    assert "hidden_size" not in nested and "hidden_size" in text  # the top level alone has no MoE layer
    paths = {}
    for name, fields in (("nested", nested), ("text", text)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(fields))
    runs = {}
    for name, path in paths.items():
        assert main(["simulate", "--config", str(path), "--tokens", "64", "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    shape = runs["nested"].pop("param_shape")
    assert shape.startswith(f"{model_type} shapes (d={text['hidden_size']}") and "has no field" not in shape
    assert runs["text"].pop("param_shape").startswith(f"{text['model_type']} shapes (d={text['hidden_size']}")
    costs = {name: run["ep"].pop("cost_model") for name, run in runs.items()}  # each names its config's model_type
    assert costs["nested"].replace(f"({model_type} ", f"({text['model_type']} ") == costs["text"]
    assert runs["nested"] == runs["text"]
    bills = {}
    for name, path in paths.items():
        assert main(["analyze", "--config", str(path), "--json"]) == 0
        out = capsys.readouterr()
        assert "no parameter or memory bills" not in out.err
        bills[name] = json.loads(out.out)["bills"]
    assert bills["nested"] == bills["text"] and bills["nested"]["params"]["routed_experts"] > 0
