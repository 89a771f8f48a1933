"""The shapes ``moekit simulate`` prices a config.json's model at (``moekit.sim.shape``: the parameter bill, the EP
what-if's cost of one expert) are the config's own, for every family the repo has fixtures for: the hf fuzzer's tiny
config of each transformers MoE family (``_hf_fuzz_models.tiny_config``, no model built) and the presets. Session 48:
DeepSeek-V4's config (no ``intermediate_size``: every layer is MoE) was priced at Mixtral-8x7B's shapes, as were
Qwen3.5-MoE, Solar-Open, Kolibri-1 / 1.1, Lara-mini and Qwen4-exp, because the bill read the dense MLPs' width even
where the model has none (or names it otherwise: Kolibri-1.1's ``mlp_only_intermediate_size``).

Shapes: d hidden, N one expert's width, L layers, E experts, k = top_k.
"""

from __future__ import annotations

import json
import warnings

import pytest

from moekit.analysis import get_gpu, param_bill
from moekit.config import MoEConfig, hf_layer_fields
from moekit.presets import hf_config_of_preset, preset_names
from moekit.sim import SimParams, simulate
from moekit.sim.shape import EP_DTYPE, EP_GPU, param_counts, seconds_per_assignment, stated_model

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _family_fields() -> dict[str, dict]:
    """family key -> its tiny config's fields (the fuzzer's fixtures), for the families the simulator accepts
    (``from_hf_config`` reads a top-k layer; a hash-only or unreadable one is the simulator's refusal, not a price)."""
    from _hf_families import config_class
    from _hf_fuzz_fills import UNFUZZABLE
    from _hf_fuzz_models import FuzzFamily, _walked, tiny_config

    out = {}
    for key, fam in _walked().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config_cls = type(config_class(fam)().get_text_config())
                fields = hf_layer_fields(tiny_config(FuzzFamily(key, fam, config_cls, None)).to_dict())
                config = MoEConfig.from_hf_config(fields, layer="typical")
            except Exception:  # noqa: BLE001 (a family the fixtures or the reader do not take: not priced at all)
                continue
        if key not in UNFUZZABLE and config.hash_table_size is None:
            out[key] = fields
    return out


FAMILIES = _family_fields()
PEAK = get_gpu(EP_GPU).flops_per_s(EP_DTYPE)


def _check_priced_as_itself(fields: dict, num_experts: int, top_k: int) -> None:
    layer = MoEConfig.from_hf_config(fields, layer="typical")
    d, n = fields["hidden_size"], layer.moe_intermediate_size
    model = stated_model(num_experts, top_k, fields)
    counts = param_counts(num_experts, top_k, model=model)
    assert counts.shape.startswith(f"{fields['model_type']} shapes (d={d}, d_ff={n}, "), counts.shape
    assert "has no field" not in counts.shape and counts.total == param_bill(fields).total
    assert seconds_per_assignment(model) * PEAK == pytest.approx(6 * d * n, rel=1e-9)  # w13 and w2, multiply-add


def test_the_fixtures_cover_the_families_that_were_mispriced():
    assert {"deepseek_v4:DeepseekV4Experts", "qwen3_5_moe:Qwen3_5MoeExperts", "solar_open:SolarOpenExperts",
            "kolibri1_1:Kolibri1_1Experts", "mixtral:MixtralExperts"} <= set(FAMILIES)


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_every_family_is_priced_at_its_own_shapes(key):
    fields = FAMILIES[key]
    layer = MoEConfig.from_hf_config(fields, layer="typical")
    _check_priced_as_itself(fields, layer.num_experts, layer.top_k)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_is_priced_at_its_own_shapes(name):
    _check_priced_as_itself(hf_config_of_preset(name), 8, 2)


def test_deepseek_v4_at_its_real_shapes(tmp_path):
    """transformers' DeepSeek-V4 defaults (d 4096, N 2048 = moe_intermediate_size, 43 layers all MoE, E 256, top-6):
    the routed experts billed from the config's own fields, through ``simulate`` of its config.json's dict."""
    fields = transformers.AutoConfig.for_model("deepseek_v4").to_dict()
    assert "intermediate_size" not in fields  # the field the bill read
    d, n, layers = fields["hidden_size"], fields["moe_intermediate_size"], fields["num_hidden_layers"]
    e, k = fields["n_routed_experts"], fields["num_experts_per_tok"]
    bill = param_bill(fields)
    assert (bill.routed_experts, bill.num_dense_layers, bill.dense_mlp) == (layers * e * 3 * d * n, 0, 0)
    assert bill.active_routed_experts == layers * k * 3 * d * n and bill.shared_experts == layers * 3 * d * n
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    result = simulate(SimParams(experts=e, top_k=k, tokens=32, gpus=8, spare_slots=0), json.loads(path.read_text()))
    assert result.param_shape == f"deepseek_v4 shapes (d={d}, d_ff={n}, {layers} layers) with E={e}, k={k}"
    assert result.total_params == bill.total


def test_kolibri_1_1s_dense_layers_billed_at_their_own_width():
    """Kolibri-1.1's dense MLPs (``mlp_only_layers``) are ``mlp_only_intermediate_size`` wide: its config has no
    ``intermediate_size``."""
    fields = FAMILIES["kolibri1_1:Kolibri1_1Experts"]
    bill = param_bill(fields)
    dense = len(fields["mlp_only_layers"])
    assert dense and "intermediate_size" not in fields and bill.num_dense_layers == dense
    assert bill.dense_mlp == dense * 3 * fields["hidden_size"] * fields["mlp_only_intermediate_size"]
