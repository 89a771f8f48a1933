"""Roofline: FLOPs, bytes, intensity and its limits, the ridge batch, time floors, the seed's numbers."""

import numpy as np
import pytest

from moekit.analysis.formats import get_format
from moekit.analysis.gpus import get_gpu
from moekit.analysis.roofline import (
    asymptotic_slope,
    batch_cost,
    dense_step_floor_s,
    expert_params,
    intensity_at_batch_one,
    ridge_batch,
)
from moekit.config import MoEConfig

V3 = MoEConfig.preset("deepseek-v3")
QWEN3 = MoEConfig.preset("qwen3-30b-a3b")
H100 = get_gpu("h100")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("cfg", [V3, QWEN3], ids=["v3", "qwen3"])
def test_intensity_limits(cfg, dtype):
    fmt = get_format(dtype)
    assert batch_cost(cfg, 1, fmt, H100).intensity == pytest.approx(intensity_at_batch_one(fmt))
    assert intensity_at_batch_one(fmt) == pytest.approx(2 / fmt.bytes_per_weight)
    big = [batch_cost(cfg, b, fmt, H100).intensity for b in (100_000, 100_001)]
    assert big[1] - big[0] == pytest.approx(asymptotic_slope(cfg, fmt))
    assert asymptotic_slope(cfg, fmt) == pytest.approx(2 / fmt.bytes_per_weight * cfg.top_k / cfg.num_experts)


def test_flops_and_bytes():
    c = batch_cost(V3, 64, get_format("fp8"), H100)
    assert c.flops == 64 * 8 * 6 * 7168 * 2048
    assert c.weight_bytes == pytest.approx(c.experts_touched * 3 * 7168 * 2048)
    assert c.intensity == pytest.approx(2 * 64 * 8 / c.experts_touched)
    assert c.time_floor_s == max(c.memory_time_s, c.compute_time_s)
    assert c.step_time_floor_s == pytest.approx(58 * c.time_floor_s)
    assert batch_cost(V3.replace(num_moe_layers=None), 64, get_format("fp8"), H100).num_moe_layers == 1


def test_ridge_batch():
    fmt = get_format("fp8")
    b = ridge_batch(V3, fmt, H100)
    assert batch_cost(V3, round(b), fmt, H100).intensity == pytest.approx(H100.ridge_intensity("fp8"), rel=1e-3)
    assert b == pytest.approx(fmt.bytes_per_weight * H100.ridge_intensity("fp8") * 256 / (2 * 8))
    # Seed: 9,456 with I* rounded to 591 (1,979 TFLOP/s / 3.35 TB/s); unrounded it is 9,451.
    assert b == pytest.approx(591 * 256 / 16, rel=1e-3)
    assert H100.ridge_intensity("fp8") == pytest.approx(591, abs=0.5)
    assert ridge_batch(V3, fmt, H100.with_overrides(dense_tflops={"fp8": 1.0})) == 1.0  # compute-bound at B=1
    # Dense crossover x E/k: the same ridge from the other end.
    dense_crossover = fmt.bytes_per_weight * H100.ridge_intensity("fp8") / 2
    assert b == pytest.approx(dense_crossover * 256 / 8, rel=1e-6)


def test_seed_chapter_bytes_and_times():
    fp8 = get_format("fp8")
    assert expert_params(V3) == 44_040_192  # 44.04 M per expert
    assert batch_cost(V3, 1, fp8, H100).weight_bytes == pytest.approx(352.3e6, rel=1e-3)
    assert batch_cost(V3, 256, fp8, H100).weight_bytes == pytest.approx(11.27e9, rel=1e-3)
    # Qwen3-30B-A3B: 541 µs of expert-weight streaming per decode step at batch 1 on H100 in fp8,
    # and the step time stops growing at batch 128.
    assert batch_cost(QWEN3, 1, fp8, H100).step_time_floor_s == pytest.approx(541e-6, rel=1e-3)
    t128, t512 = (batch_cost(QWEN3, b, fp8, H100).step_time_floor_s for b in (128, 512))
    assert t128 == pytest.approx(t512, rel=1e-3)
    # Step 7 of the walk-through: 64 tokens, ~9.78 GB streamed, intensity 4.6 FLOP/B.
    c = batch_cost(V3, 64, fp8, H100)
    assert c.weight_bytes == pytest.approx(9.78e9, rel=2e-3)
    assert c.intensity == pytest.approx(4.6, abs=0.05)


def test_dense_floor():
    bf16 = get_format("bf16")
    # A dense 8B bf16 model streams 16 GB per step: 4.78 ms at 3.35 TB/s (the seed quotes 4.48 ms from
    # another chapter, which is 15.0 GB). Memory-bound at batch 1, compute-bound past the dense crossover.
    assert dense_step_floor_s(8e9, 1, bf16, H100) == pytest.approx(16e9 / 3.35e12)
    assert dense_step_floor_s(8e9, 4096, bf16, H100) == pytest.approx(2 * 8e9 * 4096 / 989.4e12)


def test_skewed_inclusion():
    fp8 = get_format("fp8")
    uniform = np.full(256, 8 / 256)
    for b in (1, 64, 4096):
        assert batch_cost(V3, b, fp8, H100, uniform).weight_bytes == pytest.approx(
            batch_cost(V3, b, fp8, H100).weight_bytes)
    assert ridge_batch(V3, fp8, H100, uniform) == pytest.approx(ridge_batch(V3, fp8, H100))
    skewed = np.zeros(256)
    skewed[:16] = 0.5  # 16 hot experts, each in half the tokens
    cost = batch_cost(V3, 64, fp8, H100, skewed)
    assert cost.experts_touched == pytest.approx(16) and cost.intensity > batch_cost(V3, 64, fp8, H100).intensity
    assert ridge_batch(V3, fp8, H100, skewed) == pytest.approx(591 * 16 / 16, rel=1e-3)  # b_w·I*·16/(2k)
    with pytest.raises(ValueError, match="sum to top_k"):
        batch_cost(V3, 8, fp8, H100, np.full(256, 1 / 256))


def test_identity_experts_run_no_weights():
    """LongCat-Flash's shape (E = 512 experts, Z = 256 identity experts, k = 12): a token runs k·E/(E+Z) = 8 real
    experts on average, so the byte model counts 8 slots' FLOPs and touches each expert with probability
    k/(E+Z) a token: the closed forms written here."""
    cfg = MoEConfig(hidden_size=6144, moe_intermediate_size=2048, num_experts=512, top_k=12, scoring="softmax",
                    renormalize=False, use_correction_bias=True, num_identity_experts=256)
    fmt = get_format("bf16")
    assert cfg.routed_slots_per_token == 8.0
    for batch in (1, 16, 256):
        cost = batch_cost(cfg, batch, fmt, H100)
        assert cost.flops == pytest.approx(batch * 8 * 2 * 3 * 6144 * 2048)
        assert cost.experts_touched == pytest.approx(512 * (1 - (1 - 12 / 768) ** batch))
    assert asymptotic_slope(cfg, fmt) == pytest.approx(2 * 8 / (2 * 512))
    plain = cfg.replace(num_identity_experts=0)
    assert plain.routed_slots_per_token == 12 and batch_cost(plain, 16, fmt, H100).flops == 16 * 12 * 6 * 6144 * 2048
