"""The Triton GEMMs' SWAP_AB (issues 19 / 15), under Triton's interpreter, tiny shapes.

``KernelConfig.swap_ab`` (each K-step computes w_tile @ act^T into a transposed accumulator) must give the result
of a float64 per-slot loop written here: fp8 (the recipe) with K and N tails, the tiny-batch shortcut (M = 1) and
the aligned layout (M = 7), TMA descriptors and pointer loads; the bf16 kernels refuse it. The GPU runs it (wgmma,
e4m3) in ``benchmarks/decode_q3_device_check.py``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import SHAPES, emulation_f64, problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8, interpreted  # noqa: E402, F401  (fp8: fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SHAPE, BLOCK = SHAPES[0]  # E=4, K=160 (a K tail past 128), N=96 (an N tail), 128 x 128 blocks
POISON_TMA = LaunchOptions(poison_workspace=True, weight_descriptors=True)
POISON_PTR = LaunchOptions(poison_workspace=True, weight_descriptors=False)


@pytest.mark.parametrize("m,options", [(1, POISON_TMA), (7, POISON_PTR)])
@pytest.mark.parametrize("up_n", [32, 128])  # h in float32 (quantized by down) / re-quantized in gate-up
def test_fp8_swap_ab_matches_float64_recipe(fp8, m, options, up_n):
    x, _, quantized, ids, weights = problem(m, 2, SHAPE, BLOCK, seed=m + up_n)
    config = KernelConfig(16, GemmTile(up_n, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2), swap_ab=True)
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, config, options)
    want = emulation_f64(x, *quantized, ids, weights, BLOCK)
    # float32 sums against float64: equal up to a rare e4m3 rounding flip (~1e-4 here, see _fp8_cases.FLIP_TOL)
    assert rel_l2(out, want) < 1e-3
    plain = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK,
                                         KernelConfig(16, config.up, config.down), options)
    assert rel_l2(out, plain) < 1e-3


def test_bf16_swap_ab_is_refused():
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = (torch.randn(1, 160, generator=g), torch.randn(8, 192, 160, generator=g),
                  torch.randn(8, 160, 96, generator=g))
    config = KernelConfig(16, GemmTile(32, 64, 1, 4, 2), GemmTile(32, 64, 1, 4, 2), swap_ab=True)
    with interpreted("moekit.experts", "moekit.experts.triton") as tr, pytest.raises(ValueError, match="swap_ab"):
        tr.fused_experts(x, w13, w2, torch.tensor([[0, 1]], dtype=torch.int32), torch.rand(1, 2), config=config)


def test_swap_ab_round_trips_through_a_config_entry():
    base = KernelConfig(16, GemmTile(64, 128), GemmTile(64, 128))
    assert base.to_dict() == {"BLOCK_M": 16, "up": vars(base.up), "down": vars(base.down)}  # files unchanged
    swapped = KernelConfig(16, base.up, base.down, swap_ab=True)
    assert swapped.to_dict()["swap_ab"] is True and KernelConfig.from_dict(swapped.to_dict()) == swapped


def test_shipped_fp8_entries_swap_where_the_h200_measured_it(tmp_path, monkeypatch):
    # H200 graph µs, tuned entry against swapped (raw/NVIDIA_H200-2026-12-03-dd8bed6-verdict.*, 5 interleaved rounds)
    from moekit.experts.triton_fp8_plan import fp8_entry

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))  # no user file shadows the shipped ones
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    mixtral = fp8_entry(1, 8, 14336, 4096, 2, 128, "NVIDIA_H200").config
    assert mixtral.swap_ab and mixtral.down.BLOCK_N == 64  # 109.4 -> 102.4 (down 32 wide: mma.sync when swapped)
    assert fp8_entry(2, 8, 14336, 4096, 2, 128, "NVIDIA_H200").config == mixtral  # M = 2 takes entry 1
    assert not fp8_entry(64, 8, 14336, 4096, 2, 128, "NVIDIA_H200").config.swap_ab
    assert fp8_entry(8, 256, 2048, 7168, 8, 128, "NVIDIA_H200").config.swap_ab  # 671.0 -> 650.0
    assert not fp8_entry(1, 256, 2048, 7168, 8, 128, "NVIDIA_H200").config.swap_ab  # 98.6 -> 95.9: under 3%
    assert fp8_entry(1, 128, 768, 2048, 8, 128, "NVIDIA_H200").config.swap_ab  # Qwen3 (session 18)
