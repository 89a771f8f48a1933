"""The bf16 Gluon GEMMs' tile walk (``triton_gluon_order``, the twin of ``_kernels/gluon_gemm._tile_at``) on the CPU:
the GROUP_M order and the expert order against loops that build them group by group, the segments' offsets against
a running sum, and the launches with expert-order tiles (torch stand-ins in the kernels' place, which check the
offsets they are handed and that the walk covers every tile once) against the default tiles and a float64 loop.
The kernels compile for sm_90 in ``benchmarks/pre7_compile_cpu.py`` and run on the H200 in
``benchmarks/pre7_device_check.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, with_tail
from moekit.experts.triton_gluon_order import segment_offsets, tile_order

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from test_triton_gluon_lean import _bf16_problem, _f64

BLOCK = 128


def layout(counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block_experts with two spare blocks of -1, offsets [E + 1], rows used) of experts holding counts[e] rows."""
    experts, offsets = [], [0]
    for e, n in enumerate(counts):
        experts += [e] * -(-n // BLOCK)
        offsets.append(len(experts) * BLOCK)
    return torch.tensor(experts + [-1, -1], dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32), offsets[-1]


def expert_walk(counts: list[int], num_col_blocks: int, group_m: int) -> list[tuple[int, int]]:
    """Expert by expert, its blocks in groups of at most group_m from its first, each group's column blocks in turn,
    the group's row blocks fastest."""
    out, first = [], 0
    for n in counts:
        blocks = -(-n // BLOCK)
        for start in range(first, first + blocks, group_m):
            rows = range(start, min(start + group_m, first + blocks))
            out += [(rb, cb) for cb in range(num_col_blocks) for rb in rows]
        first += blocks
    return out


def group_walk(num_row_blocks: int, num_col_blocks: int, group_m: int) -> list[tuple[int, int]]:
    out = []
    for start in range(0, num_row_blocks, group_m):
        rows = range(start, min(start + group_m, num_row_blocks))
        out += [(rb, cb) for cb in range(num_col_blocks) for rb in rows]
    return out


COUNTS = [
    [130, 0, 128, 600, 7, 0, 384 + 64, 1100, 256 + 1],  # 2-9 blocks, empty experts
    [512] * 6,  # balanced: 4 blocks each
    [0, 0, 3000, 0],  # one expert, 24 blocks: several groups of one expert
    [1],
]


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("num_col_blocks, group_m", [(6, 8), (16, 16), (3, 4), (1, 1)])
def test_tile_order_matches_the_loops(counts, num_col_blocks, group_m):
    experts, offsets, used = layout(counts)
    got = tile_order(experts, offsets, used, num_col_blocks, group_m, expert_order=True)
    assert list(map(tuple, got.tolist())) == expert_walk(counts, num_col_blocks, group_m)
    got = tile_order(experts, offsets, used, num_col_blocks, group_m, expert_order=False)
    assert list(map(tuple, got.tolist())) == group_walk(used // BLOCK, num_col_blocks, group_m)


def test_segment_offsets_are_the_padded_running_sum():
    counts = [130, 0, 128, 600, 7, 0, 1]
    want, total = [0], 0
    for n in counts:
        total += -(-n // 64) * 64
        want.append(total)
    got = segment_offsets(torch.tensor(counts, dtype=torch.int32), 64)
    assert got.dtype == torch.int32 and got.tolist() == want


# M = 100, k = 4: A = 400 assignments past the alignment's two-launch limit lowered to 256, so its plan writes the
# segments' offsets (hist + scan, scatter); M = 40, k = 2 (one launch, no offsets): the expert order is refused
def test_lean_expert_order_equals_the_default_tiles(fake_gemms, monkeypatch):
    from moekit.experts import triton_gluon_lean
    from moekit.experts.triton_gluon import experts_gluon
    from moekit.experts.triton_launch import LaunchOptions

    lowered = LaunchOptions(align_one_launch_max=256, align_two_launch_max=256)
    monkeypatch.setattr(triton_gluon_lean, "LaunchOptions", lambda: lowered)
    monkeypatch.setattr(triton_gluon_lean, "_PLANS", {})
    x, w13, w2, ids, weights = _bf16_problem(100, 4)
    up, down = replace(UP_TILE, expert_order=True, group_m=2), replace(down_tile(128), expert_order=True)
    plain = experts_gluon(x, w13, w2, ids, weights, lean=False)
    for in_loader, down in ((True, down), (False, down), (False, with_tail(down))):  # the tail kernel's walk too
        for fake in fake_gemms.values():
            fake.log.clear()
        out = triton_gluon_lean.run_lean(x, w13, w2, ids, weights, None, up, down, in_loader=in_loader)
        assert torch.equal(out, plain)
        logs = [entry for fake in fake_gemms.values() for entry in fake.log]
        assert len(logs) == 2 and all(bound["EXPERT_ORDER"] for _, bound, _ in logs)
    assert rel_l2(plain, _f64(x, w13, w2, ids, weights)) < 1e-2
    x, w13, w2, ids, weights = _bf16_problem(40, 2)
    with pytest.raises(ValueError, match="segment offsets"):
        triton_gluon_lean.run_lean(x, w13, w2, ids, weights, None, up, down)


def test_plain_launch_expert_order(fake_gemms):
    """launch_gemm / launch_gather_gemm with expert-order tiles read the layout's offsets; none given: refused."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_gather_gemm, launch_gemm

    x, w13, w2, ids, _ = _bf16_problem(100, 4)
    tile = replace(UP_TILE, expert_order=True)
    lay = gluon_layout(x, ids, w2.shape[0], in_loader=True)
    w13_2d = w13.view(-1, w13.shape[2])
    h = x.new_zeros(lay.sorted_ids.numel(), w2.shape[2])
    launch_gather_gemm(x, lay.sorted_ids, lay.src_to_dst.view(-1), w13_2d, h, lay.block_experts, lay.rows_used,
                       ids.shape[1], tile, lay.offsets)
    y = x.new_zeros(h.shape[0], x.shape[1])
    launch_gemm(h, w2.view(-1, w2.shape[2]), y, lay.block_experts, lay.rows_used, replace(tile, group_m=1), False,
                x.shape[1], offsets=lay.offsets)
    assert fake_gemms["gather"].log[-1][1]["EXPERT_ORDER"] and fake_gemms["bf16"].log[-1][1]["EXPERT_ORDER"]
    with pytest.raises(ValueError, match="offsets"):
        launch_gemm(h, w2.view(-1, w2.shape[2]), y, lay.block_experts, lay.rows_used, tile, False, x.shape[1])
