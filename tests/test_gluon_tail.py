"""The folded-tail Gluon GEMMs (``triton_gluon_tail``, issue 19's padding tax) on the CPU: the tile list (which row
blocks fold the next one) against a reference computed from the experts' row counts, the launch (a torch stand-in in
the kernel's place) against a float64 loop on every real row, and the SMEM fit. The kernels themselves run on the
H200 (``benchmarks/padding_device_check.py``) and compile for sm_90 in ``benchmarks/tail_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.triton_gluon_launch import DOWN_TILE, NARROW_DOWN_TILE, UP_TILE, GluonTile, check_tile
from moekit.experts.triton_gluon_tail import merged_blocks, tail_gemm_twin, with_tail

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


def expected_folds(counts: list[int], tail: int) -> list[bool]:
    """Per used block: True where the block is the second-to-last of its expert and the last holds <= tail rows."""
    out = []
    for n in counts:
        blocks = -(-n // BLOCK)
        last_rows = n - BLOCK * (blocks - 1)
        out += [blocks >= 2 and b == blocks - 2 and last_rows <= tail for b in range(blocks)]
    return out


@pytest.mark.parametrize("tail", [64, 128])
@pytest.mark.parametrize("counts", [
    [130, 0, 128, 200, 7, 0, 384 + 64, 384 + 65, 256 + 1],  # tails of 2 / 72 / 64 / 65 / 1 rows, empty experts
    [0, 0, 1000, 0],  # one expert with every row: 7 full blocks and 104 rows
    [64, 129, 192, 193, 0],  # tail exactly 64, a one-block expert with 64 rows
    [5],  # one block: nothing folds
    [0, 0],  # no rows at all
])
def test_merged_blocks_follow_the_counts(counts, tail):
    experts, ids, used, a = layout_from_counts(counts)
    got = merged_blocks(experts, ids, used, a, tail)
    want = expected_folds(counts, tail)
    assert got[:len(want)].tolist() == want
    assert not got[len(want):].any()  # blocks past rows_used never fold


def test_merged_blocks_refuses_other_tails():
    experts, ids, used, a = layout_from_counts([130])
    with pytest.raises(ValueError, match="tail"):
        merged_blocks(experts, ids, used, a, 32)


def test_tail_tiles_fit_sm90_with_the_most_stages_and_a_128_row_gate_up_tail_is_refused():
    for tile, tail, gated, stages in ((UP_TILE, 64, True, 3), (DOWN_TILE, 64, False, 4), (DOWN_TILE, 128, False, 3),
                                      (NARROW_DOWN_TILE, 64, False, 4)):
        t = with_tail(tile, tail, gated)
        assert (t.tail, t.stages, t.block_n, t.block_k, t.group_m) == (tail, stages, tile.block_n, tile.block_k,
                                                                       tile.group_m)
        ring = stages * (BLOCK + tail + (2 if gated else 1) * tile.block_n) * tile.block_k * 2
        assert t.shared_bytes(gated) == ring + (BLOCK + tail) * tile.block_n * 2 <= 232448
        with pytest.raises(ValueError, match="SMEM"):  # one stage more does not fit
            check_tile(GluonTile(stages=stages + 1, tail=tail, group_m=tile.group_m), gated)
    with pytest.raises(ValueError):
        with_tail(UP_TILE, 128, True)
    with pytest.raises(ValueError, match="tail"):
        GluonTile(tail=32)


@pytest.mark.parametrize("tail, gated", [(64, True), (64, False), (128, False)])
def test_tail_launch_matches_a_float64_loop(fake_gemms, tail, gated):  # noqa: F811
    from moekit.experts.triton_gluon_launch import launch_gemm

    torch.manual_seed(0)
    counts = [130, 0, 200, 64, 257, 1]
    experts, ids, used, a = layout_from_counts(counts)
    rows, k, n = ids.numel(), 64, 128
    num_experts = len(counts)
    w_rows = 2 * n if gated else n
    h = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(num_experts * w_rows, k) * k ** -0.5).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    tile = with_tail(UP_TILE if gated else DOWN_TILE, tail, gated)
    used_t = torch.tensor([used], dtype=torch.int32)
    launch_gemm(h, w, out, experts, used_t, tile, gated, w_rows, n if gated else 0, ids, a)  # the tail kernel
    (_, bound, _), = fake_gemms["tail"].log
    assert not fake_gemms["bf16"].log
    assert bound["GATED"] == gated and bound["STAGES"] == tile.stages and bound["t_desc"].block_shape[0] == tail
    twin = torch.full_like(out, float("nan"))
    tail_gemm_twin(h, w, twin, experts, ids, used_t, a, tile, w_rows, gated, n if gated else 0)
    torch.testing.assert_close(twin, out, equal_nan=True)
    for r in range(used):  # every real row, as float64
        if int(ids[r]) >= a:
            continue
        e = int(experts[r // BLOCK])
        we = w[e * w_rows:(e + 1) * w_rows].double()
        prod = h[r].double() @ we.T
        want = torch.nn.functional.silu(prod[:n]) * prod[n:] if gated else prod
        torch.testing.assert_close(out[r].double(), want, rtol=2e-2, atol=2e-2)
    folds = expected_folds(counts, tail)
    for b, f in enumerate(folds):  # rows past a folded tail: never written
        if f:
            assert torch.isnan(out[(b + 1) * BLOCK + tail:(b + 2) * BLOCK].float()).all()


def test_lean_launch_with_tails_equals_the_plain_tiles_and_a_float64_loop(fake_gemms):  # noqa: F811
    """The lean launch binds the tail kernel (its T / CT descriptors, sorted_ids) for both GEMMs; the call equals the
    one without tails bit for bit (the stand-ins compute every real row alike), first call and recorded sequence."""
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.experts.triton_gluon_tail import merged_blocks as folds_of

    g = torch.Generator().manual_seed(3)
    e, n, k, m, top_k = 4, 128, 128, 300, 2  # ~150 rows an expert: a 128-row block and a mostly empty one each
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k ** -0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n ** -0.5).bfloat16()
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    up, down = with_tail(UP_TILE, 64, True), with_tail(DOWN_TILE, 64, False)
    plain = run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_TILE, in_loader=False)
    first = run_lean(x, w13, w2, ids, weights, None, up, down)  # in_loader None: not with a gate-up tail
    again = run_lean(x, w13, w2, ids, weights, None, up, down)
    assert torch.equal(first, plain) and torch.equal(again, plain)
    tail_calls = fake_gemms["tail"].log
    assert len(tail_calls) == 4 and [c[1]["GATED"] for c in tail_calls] == [True, False, True, False]
    _, bound, _ = tail_calls[0]
    assert bound["t_desc"].block_shape == [64, 64] and bound["ct_desc"].block_shape == [64, 128]
    used = int(bound["used_ptr"][0])
    assert folds_of(bound["experts_ptr"], bound["sorted_ptr"], used, bound["num_assignments"], 64).any()
    want = torch.zeros(m, k, dtype=torch.float64)
    for t in range(m):
        for j in range(top_k):
            ex = int(ids[t, j])
            gu = w13[ex].double() @ x[t].double()
            want[t] += float(weights[t, j]) * (w2[ex].double() @ (torch.nn.functional.silu(gu[:n]) * gu[n:]))
    assert ((plain.double() - want).norm() / want.norm()).item() < 1e-2


def test_a_tail_tile_without_sorted_ids_is_refused():
    from moekit.experts.triton_gluon_launch import launch_gemm

    t = torch.zeros(256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm(t, t, t, torch.zeros(2, dtype=torch.int32), torch.tensor([256]), with_tail(DOWN_TILE, 64, False),
                    False, 128)
