"""The real client on seeded random configs of every MoE family transformers ships (``_hf_fuzz_cases``: the family's
expert count, top-k from 1 to E, norm_topk_prob, expert groups, routed scaling, shared experts and their width,
dense first layers, MoE layer frequency, odd widths; padding masks; float32 / float64 / bfloat16): the model on
``set_experts_implementation("moekit")`` (``reference`` and ``grouped_mm``) against transformers' eager experts,
logits and for some seeds the gradients; ``moe_from_hf`` on a block against the block; quantized blocks against their
float64 dequantized twin (``_hf_fuzz_check``, which states the tolerances).

A failure prints the seed and the case; ``python3 benchmarks/fuzz_hf.py --seeds S:S+1`` reruns it alone. Longer
runs (and ``triton`` interpreted, ``torch.compile``): ``benchmarks/fuzz_hf.py --seeds 0:2000``. The checks are shown
to fail on experts off by 0.01%; each bug a seed found has its own test below.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402

from _hf_fuzz_cases import draw_case  # noqa: E402
from _hf_fuzz_check import check_case, rel_l2  # noqa: E402
from _hf_fuzz_models import FuzzFamily, family_keys, family_of, tiny_config, build_model  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SEEDS = range(14)  # ~45 s of CPU on the dev machine (AVX2 EPYC, loaded), the families' first builds included
_CASES = {}


def _case(seed: int):
    if seed not in _CASES:
        _CASES[seed] = draw_case(seed, compile_rate=0.0)
    return _CASES[seed]


@pytest.mark.parametrize("seed", SEEDS)
def test_real_client_matches_transformers_eager(seed):
    case = _case(seed)
    outcome = check_case(case)
    assert not outcome.failures, f"{case.describe()}\n" + "\n".join(outcome.failures)
    assert outcome.compared >= len(case.backends) - len(outcome.left_out)


def test_the_seeds_reach_every_kind_of_draw():
    """The fixed seeds draw several families, k = 1 and k = E, both norm_topk_prob, expert groups, a shared-expert
    count of 0, padding, float64 and bfloat16, gradients, moe_from_hf (fused shared too) and a quantized model: else
    the test above tests less than it says."""
    cases = [_case(s) for s in SEEDS]
    assert len({c.fam.key for c in cases}) >= 8
    tops = [(f.get("num_experts_per_tok", f.get("moe_k")), max((v for k, v in f.items() if k in (
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")), default=None))
            for f in (c.fields for c in cases)]
    assert any(k == 1 for k, _ in tops) and any(k == e and e and e > 1 for k, e in tops)
    assert {c.fields.get("norm_topk_prob") for c in cases} >= {True, False}
    assert any(c.fields.get("n_group", 1) > 1 for c in cases)
    assert any(c.padded for c in cases) and {torch.float64, torch.bfloat16} <= {c.dtype for c in cases}
    assert any(c.scheme for c in cases) and any(c.fields.get("n_shared_experts") == 0 for c in cases)
    assert any(c.grad for c in cases) and any(c.block and c.fuse_shared for c in cases)


def test_the_checks_fail_on_experts_off_by_a_little(monkeypatch):
    """Every moekit experts output 1.0001x (fused and composed): every seed fails (the checks can fail, and no
    near-tie rule hides it)."""
    for target in ("call_backend", "run_composed"):
        real = getattr(moekit_hf, target)
        monkeypatch.setattr(moekit_hf, target, lambda *a, _f=real, **k: _f(*a, **k) * 1.0001)
    for seed in SEEDS[:2]:
        case = _case(seed)
        assert any("logits" in f for f in check_case(case).failures), case.describe()


def test_every_family_builds_or_says_why():
    """Every experts class of the walk is fuzzed or skipped with a reason; the families the issue names are fuzzed,
    and some of those the tiny-config rules of session 47 made build."""
    found = {key: family_of(key) for key in family_keys()}
    assert all(isinstance(f, FuzzFamily) or f.reason for f in found.values())
    fuzzed = {key.split(":")[0] for key, f in found.items() if isinstance(f, FuzzFamily)}
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen2_moe", "olmoe"} <= fuzzed
    # hfz47's rules (_hf_fuzz_fills): per-layer configs, None defaults filled, hybrid kinds, M-RoPE, mamba groups
    assert {"gemma4", "dots3_note", "dots1", "lfm2_moe", "glm4v_moe", "nemotron_h", "zaya", "longcat_flash"} <= fuzzed


def _model(family: str, fields: dict, dtype=torch.float32):
    fam = family_of(next(k for k in family_keys() if k.startswith(family + ":")))
    model = build_model(fam, tiny_config(fam, fields), 0, dtype)
    model.set_experts_implementation("eager")
    return model


def _block(family: str, fields: dict, dtype=torch.float32):
    return next(m for m in _model(family, fields, dtype).modules() if hasattr(m, "experts") and hasattr(m, "gate"))


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_zero_shared_experts_convert(fuse_shared):
    """hfz46, seed 6 (DeepSeek-V3.2, n_shared_experts = 0): transformers builds the shared MLP at width 0 (it adds
    zeros); moe_from_hf refused the block ("holds a shared expert its config does not describe") and
    use_moekit_blocks left every block. Now a MoE without one, equal to the block; the model swapped, equal to its
    own."""
    block = _block("deepseek_v3", {"n_shared_experts": 0, "first_k_dense_replace": 0})
    assert block.shared_experts.gate_proj.weight.numel() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    assert not moe.config.has_shared_expert
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = block(x)
        assert rel_l2(moe(x), want[0] if isinstance(want, tuple) else want) < 1e-5
    model = _model("deepseek_v3", {"n_shared_experts": 0, "first_k_dense_replace": 0})
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        report = moekit_hf.use_moekit_blocks(model, fuse_shared=fuse_shared)
        assert len(report.swapped) == 3 and not report.left
        assert rel_l2(model(ids).logits, want) < 1e-5


@pytest.mark.parametrize("family", ["deepseek_v2", "unlimited_ocr"])
def test_deepseek_v2_router_ignores_norm_topk_prob(family):
    """hfz46, seed 47 (DeepSeek-V2, norm_topk_prob=True, k = 3 of 4): transformers' V2 router never renormalises (it
    does not read the field); from_hf_config did, so moe_from_hf and the swap were 1.3e-3 off the model. Now the
    MoE equals the block with the field on, and its routed weights sum to the scaling, not to 1."""
    block = _block(family, {"norm_topk_prob": True, "num_experts_per_tok": 3, "first_k_dense_replace": 0,
                            "routed_scaling_factor": 1.5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = moekit_hf.moe_from_hf(block)
    assert not moe.config.renormalize
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = block(x)
        assert rel_l2(moe(x), want[0] if isinstance(want, tuple) else want) < 1e-5


def test_a_float64_post_expert_norm_in_float32_is_held_to_float32_s_bound():
    """fuz53's run, seed 50001 (drawn as ``benchmarks/fuzz_hf.py --quant-rate 0.3 --compile-rate 0.1`` draws it):
    Muse Spark in float64, whose experts' ``post_expert_norm`` computes in float32; eager sums its weight's gradient
    over each expert's rows, moekit's composed path over all rows at once: 2.3e-8 apart, failed against float64's
    1e-12 (``rounds_through_float32`` read the experts class's own code only, not its submodules')."""
    case = draw_case(50001, compile_rate=0.1, quant_rate=0.3)
    assert case.fam.key.startswith("muse_spark") and case.dtype == torch.float64 and case.grad
    outcome = check_case(case)
    assert outcome.compared and not outcome.failures, "\n".join(outcome.failures)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_beam_gelu_experts_convert(dtype):
    """hfz47 (the hfz46 run's refusals, Beam with hidden_act gelu): Beam's _apply_gate computes in float32 whatever
    its input, which put its gelu 1.9e-6 off the float64 probe's and moe_from_hf refused the block ("computes no
    activation moekit implements"). Now the MoE equals the block (at float32's bound: the block rounds through it)."""
    block = _block("beam", {"hidden_act": "gelu", "first_k_dense_replace": 0}, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = moekit_hf.moe_from_hf(block)
    assert moe.config.activation == "gelu"
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), dtype=dtype) * 3
    with torch.no_grad():
        want = block(x)
        assert rel_l2(moe(x), want[0] if isinstance(want, tuple) else want) < 1e-5


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_dots1_converts(fuse_shared):
    """hfz47: dots1 (newly fuzzed: its default config leaves n_shared_experts None) has DeepSeek-V3's router, expert
    groups included; from_hf_config did not know its model type. Now moe_from_hf equals its block with groups on and
    the swapped model its own logits."""
    fields = {"n_group": 2, "topk_group": 1, "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1}
    block = _block("dots1", fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    assert (moe.config.n_group, moe.config.use_correction_bias) == (2, True)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_l2(moe(x), block(x)) < 1e-5
    model = _model("dots1", fields)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(ids).logits
        report = moekit_hf.use_moekit_blocks(model, fuse_shared=fuse_shared)
        assert len(report.swapped) == 2 and not report.left
        assert rel_l2(model(ids).logits, want) < 1e-5
