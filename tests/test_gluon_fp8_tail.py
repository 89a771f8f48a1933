"""The fp8 Gluon down GEMM with the tail consumer (``_kernels/gluon_gemm_fp8_tail.py``, issue 15's padding tax at
the ridge) on the CPU: its tile's checks, and the plain launch binding it (a torch stand-in in the kernel's place,
``_gluon_fakes``) equal bit for bit to the launches without it, and to a float64 loop over the recipe's steps. The
kernel itself runs on the H200 (``benchmarks/f8mid8_device_check.py``) and compiles for sm_90 in
``benchmarks/f8mid8_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import quantize_weight
from _gluon_fakes import FakeKernel, fake_gemms, fp8_tail_down  # noqa: F401  (fake_gemms: fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)


@pytest.fixture
def fake_tail(fake_gemms, monkeypatch):  # noqa: F811
    """The Gluon stand-ins and the tail kernel's (``_gluon_fakes.fp8_tail_down``) in its module."""
    import moekit.experts._kernels.gluon_gemm_fp8_tail as mod

    fake = FakeKernel(mod.tail_down_fp8_kernel, fp8_tail_down)
    monkeypatch.setattr(mod, "tail_down_fp8_kernel", fake)
    return fake


def test_tail_tile_checks():
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE_T64, Fp8GluonTile, launch_gemm_fp8

    assert DOWN_TILE_T64.tail == 64 and DOWN_TILE_T64.max_registers * 16 * 32 <= 65536  # four warpgroups
    for bad in (dict(tail=128), dict(tail=64, pingpong=True), dict(tail=64, stagger=True), dict(tail=64, wide=True)):
        with pytest.raises(ValueError, match="tail"):
            Fp8GluonTile(**bad)
    t = torch.zeros(256, 256)
    with pytest.raises(ValueError, match="down GEMM only"):
        launch_gemm_fp8(t, t, t.view(1, 256, 256), t, t, t, t, t, DOWN_TILE_T64, gated=True, gate_offset=128)
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm_fp8(t, t, t.view(1, 256, 256), t, t, None, t, t, DOWN_TILE_T64, gated=False)


def _e4m3_groups(v: torch.Tensor) -> torch.Tensor:
    """v [R, C] float64 through the recipe's 1 x 128 quantization and back (s = amax / 448, 1 for zeros)."""
    g = v.view(v.shape[0], -1, 128)
    amax = g.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((g / s).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * s).view(v.shape)


def _float64_loop(x, q13, q2, ids, weights):
    """Token by token, slot by slot: x and h quantized per 128 columns, dequantized weights, y rounded to bf16."""
    w13 = (q13[0].double() * q13[1].double().repeat_interleave(128, 1).repeat_interleave(128, 2))
    w2 = (q2[0].double() * q2[1].double().repeat_interleave(128, 1).repeat_interleave(128, 2))
    inter = w2.shape[2]
    xq = _e4m3_groups(x.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ xq[t]  # [2N]
            h = _e4m3_groups((torch.nn.functional.silu(gu[:inter]) * gu[inter:])[None])[0]
            out[t] += (w2[e] @ h).bfloat16().double() * float(weights[t, j])
    return out


def test_tail_launch_equals_the_plain_pipeline_and_a_float64_loop(fake_tail):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE_T64
    from moekit.experts.triton_gluon_tail import merged_blocks

    g = torch.Generator().manual_seed(4)
    e, n, k, m, top_k = 4, 128, 256, 300, 2  # ~150 rows an expert: each with a mostly empty last block
    x = torch.randn(m, k, generator=g).bfloat16()
    q13 = quantize_weight(torch.randn(e, 2 * n, k, generator=g) / k ** 0.5, (128, 128))
    q2 = quantize_weight(torch.randn(e, k, n, generator=g) / n ** 0.5, (128, 128))
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    base = experts_gluon_fp8(x, *q13, *q2, ids, weights, lean=False)
    tail = experts_gluon_fp8(x, *q13, *q2, ids, weights, down=DOWN_TILE_T64, lean=False)
    assert torch.equal(tail, base)
    calls = fake_tail.log
    assert len(calls) == 1
    _, bound, _ = calls[-1]
    used = int(bound["used_ptr"][0])
    assert merged_blocks(bound["experts_ptr"], bound["sorted_ptr"], used, bound["num_assignments"]).any()
    assert bound["num_assignments"] == m * top_k and bound["STAGES"] == DOWN_TILE_T64.stages
    ref = _float64_loop(x, q13, q2, ids, weights)
    assert ((tail.double() - ref).norm() / ref.norm()).item() < 1e-2
    with pytest.raises(ValueError, match="plain launch"):
        experts_gluon_fp8(x, *q13, *q2, ids, weights, down=DOWN_TILE_T64)
