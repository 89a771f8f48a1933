"""The fp8 Gluon path's gather-quantize kernel with several 128-column groups per program (``gather_groups``), under
the interpreter: the same layout bit for bit as one group per program and as a float64 quantization written here, for
widths that are and are not a multiple of the program's columns; the lean launch binds it like the plain one."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import block_experts, e4m3_groups_f64
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
from moekit.layouts.block_aligned import align_block

E = 4


@pytest.mark.parametrize("hidden", [384, 512])
@pytest.mark.parametrize("groups", [2, 4])
def test_groups_per_program_give_the_same_layout(hidden, groups):
    g = torch.Generator().manual_seed(hidden + groups)
    x = torch.randn(29, hidden, generator=g).bfloat16()
    x[5] = 0  # a zero row: scale 1
    ids = torch.rand(29, E, generator=g).topk(2, dim=1).indices.int()
    one = gluon_fp8_layout(x, ids, E, align=align_block)
    many = gluon_fp8_layout(x, ids, E, align=align_block, gather_groups=groups)
    dst = one.src_to_dst.reshape(-1).long()
    assert torch.equal(many.src_to_dst, one.src_to_dst)
    assert torch.equal(many.x_q[dst], one.x_q[dst]) and torch.equal(many.x_s[dst], one.x_s[dst])
    got = many.x_q[dst].double() * many.x_s[dst].repeat_interleave(128, 1).double()
    assert torch.equal(got, e4m3_groups_f64(x[torch.arange(dst.numel()) // 2]))


def test_lean_launch_binds_the_groups(fake_gemms):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    g = torch.Generator().manual_seed(3)
    hidden, inter = 512, 128
    x = torch.randn(40, hidden, generator=g).bfloat16()
    q = block_experts(g, E, inter, hidden)
    ids = torch.rand(40, E, generator=g).topk(2, dim=1).indices.int()
    weights = torch.rand(40, 2, generator=g)
    plain = experts_gluon_fp8(x, *q, ids, weights, lean=False)
    assert torch.equal(experts_gluon_fp8(x, *q, ids, weights, gather_groups=4), plain)
    assert torch.equal(experts_gluon_fp8(x, *q, ids, weights, gather_groups=4, lean=False), plain)
    from moekit.experts.triton_gluon_lean import _PLANS

    (plan,) = _PLANS.values()
    assert plan.gather.grid[1] == 1  # hidden 512 = 4 groups: one program column of 4 groups
