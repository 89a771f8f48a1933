"""The fp8 Gluon down GEMM with the tail consumer (``_kernels/gluon_gemm_fp8_tail.py``, issue 19 / 15's padding tax)
on the CPU: its tile's checks, and the plain and lean launches binding it (a torch stand-in in the kernel's place,
``_gluon_fakes``) equal to the launches without it bit for bit and to the fp8 twin. The kernel itself runs on the
H200 (``benchmarks/padding_device_check.py``) and compiles for sm_90 in ``benchmarks/tail_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)


def test_tail_tile_checks():
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE_T64, Fp8GluonTile, launch_gemm_fp8

    assert DOWN_TILE_T64.tail == 64 and DOWN_TILE_T64.max_registers * 16 * 32 <= 65536  # four warpgroups
    for bad in (dict(tail=128), dict(tail=64, pingpong=True), dict(tail=64, stagger=True)):
        with pytest.raises(ValueError, match="tail"):
            Fp8GluonTile(**bad)
    t = torch.zeros(256, 256)
    with pytest.raises(ValueError, match="down GEMM only"):
        launch_gemm_fp8(t, t, t, t, t, t, t, t, DOWN_TILE_T64, gated=True, gate_offset=128)
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm_fp8(t, t, t.view(1, 256, 256), t, t, None, t, t, DOWN_TILE_T64, gated=False)


def test_tail_launches_equal_the_plain_pipeline_and_the_twin(fake_gemms):  # noqa: F811
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8, experts_gluon_fp8_twin
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
    plain = experts_gluon_fp8(x, *q13, *q2, ids, weights, down=DOWN_TILE_T64, lean=False)
    lean = experts_gluon_fp8(x, *q13, *q2, ids, weights, down=DOWN_TILE_T64)
    again = experts_gluon_fp8(x, *q13, *q2, ids, weights, down=DOWN_TILE_T64)  # the recorded sequence
    assert torch.equal(plain, base) and torch.equal(lean, base) and torch.equal(again, base)
    calls = fake_gemms["fp8 tail"].log
    assert len(calls) == 3
    _, bound, _ = calls[-1]
    used = int(bound["used_ptr"][0])
    assert merged_blocks(bound["experts_ptr"], bound["sorted_ptr"], used, bound["num_assignments"], 64).any()
    assert bound["num_assignments"] == m * top_k and bound["STAGES"] == DOWN_TILE_T64.stages
    twin = experts_gluon_fp8_twin(x, *q13, *q2, ids, weights)
    assert ((base.float() - twin.float()).norm() / twin.float().norm()).item() < 2e-2
