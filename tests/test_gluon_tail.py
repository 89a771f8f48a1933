"""The folded-tail Gluon down GEMM (``triton_gluon_tail``, issue 19's padding tax) on the CPU: the tile list (which
row blocks fold the next one) against a reference computed from the experts' row counts, the launches (a torch
stand-in in the kernel's place) against a float64 loop on every real row, the SMEM fit, and where the route takes it.
The kernel itself compiles for sm_90 in ``benchmarks/tail_compile_cpu.py``; it ran on the H200 in
``padding_device_check.py`` (removed: ``git show 87f368f6:benchmarks/padding_device_check.py``)."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.triton_gluon_launch import (
    DOWN_TILE, NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile, down_tile, wants_tail, with_tail,
)
from moekit.experts.triton_gluon_tail import merged_blocks, tail_down_twin

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)

BLOCK = 128


def layout_from_counts(counts: list[int], num_assignments: int | None = None):
    """(block_experts, sorted_ids, rows_used, A) of a 128-aligned layout whose expert e holds counts[e] rows: real
    rows first in each segment (ids 0..A-1 in order), then padding (id A)."""
    a = sum(counts) if num_assignments is None else num_assignments
    experts, ids, nxt = [], [], 0
    for e, n in enumerate(counts):
        blocks = -(-n // BLOCK)
        experts += [e] * blocks
        ids += list(range(nxt, nxt + n)) + [a] * (blocks * BLOCK - n)
        nxt += n
    spare = 2  # blocks past rows_used, as the plan's static rows leave them
    experts += [-1] * spare
    ids += [a] * (spare * BLOCK)
    return (torch.tensor(experts, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32),
            (len(experts) - spare) * BLOCK, a)


def expected_folds(counts: list[int], tail: int = 64) -> list[bool]:
    """Per used block: True where the block is the second-to-last of its expert and the last holds <= tail rows."""
    out = []
    for n in counts:
        blocks = -(-n // BLOCK)
        last_rows = n - BLOCK * (blocks - 1)
        out += [blocks >= 2 and b == blocks - 2 and last_rows <= tail for b in range(blocks)]
    return out


@pytest.mark.parametrize("counts", [
    [130, 0, 128, 200, 7, 0, 384 + 64, 384 + 65, 256 + 1],  # tails of 2 / 72 / 64 / 65 / 1 rows, empty experts
    [0, 0, 1000, 0],  # one expert with every row: 7 full blocks and 104 rows
    [64, 129, 192, 193, 0],  # tail exactly 64, a one-block expert with 64 rows
    [5],  # one block: nothing folds
    [0, 0],  # no rows at all
])
def test_merged_blocks_follow_the_counts(counts):
    experts, ids, used, a = layout_from_counts(counts)
    got = merged_blocks(experts, ids, used, a)
    want = expected_folds(counts)
    assert got[:len(want)].tolist() == want
    assert not got[len(want):].any()  # blocks past rows_used never fold


def test_tail_tiles_fit_sm90_with_the_most_stages_and_only_on_the_down_gemm():
    for tile in (DOWN_TILE, NARROW_DOWN_TILE):
        t = with_tail(tile)
        assert (t.tail, t.stages, t.block_n, t.block_k, t.group_m) == (64, 4, tile.block_n, tile.block_k, tile.group_m)
        ring = 4 * (BLOCK + 64 + tile.block_n) * tile.block_k * 2
        assert t.shared_bytes(gated=False) == ring + (BLOCK + 64) * tile.block_n * 2 <= 232448
        with pytest.raises(ValueError, match="SMEM"):  # one stage more does not fit
            check_tile(GluonTile(stages=5, tail=64), gated=False)
        assert down_tile(2048 if tile is DOWN_TILE else 768, tail=True) == t
    with pytest.raises(ValueError, match="down GEMM only"):
        check_tile(GluonTile(stages=3, tail=64), gated=True)
    with pytest.raises(ValueError, match="tail"):
        GluonTile(tail=128)


def test_the_route_takes_the_tail_where_an_expert_holds_about_one_block():
    """M*k/E in [112, 160] for experts wider than 1024: DeepSeek-V3 (E=256, k=8, N=2048) at M = 4096 only."""
    assert wants_tail(4096, 8, 256, 2048)  # 128 a expert: 1.083x the fused route, >= 3% in 6 of 7
    assert not wants_tail(16384, 8, 256, 2048) and not wants_tail(2048, 8, 256, 2048)  # 512 / 64 a expert
    assert not wants_tail(2048, 8, 128, 768)  # Qwen3 M = 2048: 128 a expert, but narrow experts
    assert not wants_tail(4096, 2, 8, 14336)  # Mixtral: 1024 a expert
    from moekit.experts.triton_gluon import GluonChoice

    choice = GluonChoice()
    assert choice.wants(4096, 2048, 8, 256) and not choice.wants(4096, 2048)  # top_k / E unknown: no tail clause
    assert not choice.wants(3072, 2048, 8, 256)  # 96 a expert: the fused kernels


def test_tail_launch_matches_a_float64_loop(fake_gemms):  # noqa: F811
    from moekit.experts.triton_gluon_launch import launch_gemm

    torch.manual_seed(0)
    counts = [130, 0, 200, 64, 257, 1]
    experts, ids, used, a = layout_from_counts(counts)
    rows, k, n = ids.numel(), 64, 128
    num_experts = len(counts)
    h = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(num_experts * n, k) * k ** -0.5).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    tile = with_tail(DOWN_TILE)
    used_t = torch.tensor([used], dtype=torch.int32)
    launch_gemm(h, w, out, experts, used_t, tile, False, n, 0, ids, a)  # the tail kernel
    (_, bound, _), = fake_gemms["tail"].log
    assert not fake_gemms["bf16"].log
    assert bound["STAGES"] == tile.stages and bound["t_desc"].block_shape[0] == 64
    twin = torch.full_like(out, float("nan"))
    tail_down_twin(h, w, twin, experts, ids, used_t, a, n)
    torch.testing.assert_close(twin, out, equal_nan=True)
    for r in range(used):  # every real row, as float64
        if int(ids[r]) >= a:
            continue
        e = int(experts[r // BLOCK])
        want = h[r].double() @ w[e * n:(e + 1) * n].double().T
        torch.testing.assert_close(out[r].double(), want, rtol=2e-2, atol=2e-2)
    for b, f in enumerate(expected_folds(counts)):  # rows past a folded tail: never written
        if f:
            assert torch.isnan(out[(b + 1) * BLOCK + 64:(b + 2) * BLOCK].float()).all()
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm(h, w, out, experts, used_t, tile, False, n)


@pytest.mark.parametrize("in_loader", [False, True])
def test_lean_launch_with_tails_equals_the_plain_tiles_and_a_float64_loop(fake_gemms, in_loader):  # noqa: F811
    """The lean launch binds the tail kernel (its T / CT descriptors, sorted_ids) for the down GEMM; the call equals
    the one without the tail bit for bit (the stand-ins compute every real row alike), first call and recorded
    sequence, with either gate-up GEMM; the plain launch too."""
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.experts.triton_gluon_tail import merged_blocks as folds_of

    g = torch.Generator().manual_seed(3)
    e, n, k, m, top_k = 4, 128, 128, 300, 2  # ~150 rows an expert: a 128-row block and a mostly empty one each
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k ** -0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n ** -0.5).bfloat16()
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    down = with_tail(DOWN_TILE)
    plain = run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_TILE, in_loader=in_loader)
    first = run_lean(x, w13, w2, ids, weights, None, UP_TILE, down, in_loader=in_loader)
    again = run_lean(x, w13, w2, ids, weights, None, UP_TILE, down, in_loader=in_loader)
    assert torch.equal(first, plain) and torch.equal(again, plain)
    tail_calls = fake_gemms["tail"].log
    assert len(tail_calls) == 2
    _, bound, _ = tail_calls[0]
    assert bound["t_desc"].block_shape == [64, 64] and bound["ct_desc"].block_shape == [64, 128]
    used = int(bound["used_ptr"][0])
    assert folds_of(bound["experts_ptr"], bound["sorted_ptr"], used, bound["num_assignments"]).any()
    with pytest.raises(ValueError, match="down GEMM only"):
        run_lean(x, w13, w2, ids, weights, None, GluonTile(stages=3, tail=64), DOWN_TILE, in_loader=False)
    want = torch.zeros(m, k, dtype=torch.float64)
    for t in range(m):
        for j in range(top_k):
            ex = int(ids[t, j])
            gu = w13[ex].double() @ x[t].double()
            want[t] += float(weights[t, j]) * (w2[ex].double() @ (torch.nn.functional.silu(gu[:n]) * gu[n:]))
    assert ((plain.double() - want).norm() / want.norm()).item() < 1e-2
