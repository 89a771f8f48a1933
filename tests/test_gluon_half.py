"""The half-tile Gluon GEMM (``triton_gluon_half``, issue 19's padding tax at the ridge) on the CPU: which row blocks
run as 64-row tiles against a reference computed from the experts' row counts, the launches (a torch stand-in in the
kernel's place) and the torch twin against a float64 loop on every real row, both GEMMs, and the tile's checks.
The kernel itself runs on the H200 (``benchmarks/mid7_device_check.py``) and compiles for sm_90 in
``benchmarks/mid7_compile_cpu.py``."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.triton_gluon_launch import DOWN_TILE, UP_TILE, GluonTile, launch_gemm
from moekit.experts.triton_gluon_half import half_blocks, half_gemm_twin

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from test_gluon_tail import layout_from_counts

BLOCK = 128


def expected_halves(counts: list[int]) -> list[bool]:
    """Per used block: True where the block holds at most 64 real rows (an expert's last, or only, block)."""
    out = []
    for n in counts:
        blocks = -(-n // BLOCK)
        out += [n - BLOCK * b <= BLOCK // 2 for b in range(blocks)]
    return out


@pytest.mark.parametrize("counts", [
    [130, 0, 128, 200, 7, 0, 384 + 64, 384 + 65, 256 + 1],  # last blocks of 2 / 72 / 64 / 65 / 1 rows, empty experts
    [0, 0, 1000, 0],  # one expert: 7 full blocks and 104 rows
    [64, 65, 192, 193],  # exactly 64 rows (half) and 65 (full)
    [0, 0],  # no rows at all
])
def test_half_blocks_follow_the_counts(counts):
    _, ids, used, a = layout_from_counts(counts)
    got = half_blocks(ids, used, a)
    want = expected_halves(counts)
    assert got[:len(want)].tolist() == want
    assert not got[len(want):].any()  # blocks past rows_used: never


def float64_rows(a, w, experts, ids, used, num_assignments, w_rows, cols, gate_offset=0, gated=False):
    """{row: float64 output} for every real row of the layout, from the weights of its block's expert."""
    out = {}
    for r in range(used):
        if int(ids[r]) >= num_assignments:
            continue
        first = int(experts[r // BLOCK]) * w_rows
        v = w[first:first + cols].double() @ a[r].double()
        if gated:
            up = w[first + gate_offset:first + gate_offset + cols].double() @ a[r].double()
            v = torch.nn.functional.silu(v) * up
        out[r] = v
    return out


@pytest.mark.parametrize("gated", [True, False])
def test_half_launch_and_twin_match_a_float64_loop(fake_gemms, gated):  # noqa: F811
    torch.manual_seed(1)
    counts = [130, 0, 200, 64, 257, 1, 129]
    experts, ids, used, a = layout_from_counts(counts)
    rows, k, n = ids.numel(), 64, 128
    w_rows = 2 * n if gated else n
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(len(counts) * w_rows, k) * k ** -0.5).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
    used_t = torch.tensor([used], dtype=torch.int32)
    tile = GluonTile(stages=4 if gated else 6, halves=True)
    launch_gemm(x, w, out, experts, used_t, tile, gated, w_rows, n if gated else 0, ids, a)
    (grid, bound, options), = fake_gemms["half"].log
    assert not fake_gemms["bf16"].log and not fake_gemms["tail"].log
    assert bound["GATED"] == gated and bound["STAGES"] == tile.stages and bound["num_assignments"] == a
    twin = torch.full_like(out, float("nan"))
    half_gemm_twin(x, w, twin, experts, ids, used_t, a, gated, w_rows, n if gated else 0)
    torch.testing.assert_close(twin, out, equal_nan=True)
    for r, want in float64_rows(x, w, experts, ids, used, a, w_rows, n, n, gated).items():
        torch.testing.assert_close(out[r].double(), want, rtol=2e-2, atol=2e-2)
    for b, half in enumerate(expected_halves(counts)):  # rows 64-127 of a half block: not written
        assert torch.isnan(out[b * BLOCK + 64:(b + 1) * BLOCK].float()).all() == half
    with pytest.raises(ValueError, match="sorted_ids"):
        launch_gemm(x, w, out, experts, used_t, tile, gated, w_rows, n if gated else 0)


def test_halves_are_one_padding_scheme_and_fit_like_the_plain_tiles():
    with pytest.raises(ValueError, match="one padding scheme"):
        GluonTile(stages=4, tail=64, halves=True)
    for tile, gated in ((UP_TILE, True), (DOWN_TILE, False)):
        half = GluonTile(tile.block_n, tile.block_k, tile.stages, tile.group_m, halves=True)
        assert half.shared_bytes(gated) == tile.shared_bytes(gated)  # the same ring: the A stage's first 64 rows


def test_lean_launch_with_halves_equals_the_plain_tiles_and_a_float64_loop(fake_gemms):  # noqa: F811
    """The lean launch binds the half kernel (sorted_ids after expert_ids) for either GEMM; the call equals the one
    without halves bit for bit (the stand-ins compute every real row alike), first call and recorded sequence."""
    from moekit.experts.triton_gluon_lean import run_lean

    g = torch.Generator().manual_seed(5)
    e, n, k, m, top_k = 4, 128, 128, 300, 2  # ~150 rows an expert: a 128-row block and a mostly empty one each
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k ** -0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n ** -0.5).bfloat16()
    ids = torch.rand(m, e, generator=g).topk(top_k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, top_k, generator=g), dim=1)
    up = GluonTile(UP_TILE.block_n, UP_TILE.block_k, UP_TILE.stages, UP_TILE.group_m, halves=True)
    down = GluonTile(DOWN_TILE.block_n, DOWN_TILE.block_k, DOWN_TILE.stages, DOWN_TILE.group_m, halves=True)
    plain = run_lean(x, w13, w2, ids, weights, None, UP_TILE, DOWN_TILE, in_loader=False)
    for tiles in ((up, DOWN_TILE), (UP_TILE, down), (up, down)):
        first = run_lean(x, w13, w2, ids, weights, None, *tiles, in_loader=False)
        again = run_lean(x, w13, w2, ids, weights, None, *tiles, in_loader=False)
        assert torch.equal(first, plain) and torch.equal(again, plain)
    calls = fake_gemms["half"].log
    assert [c[1]["GATED"] for c in calls] == [True, True, False, False, True, False, True, False]
    _, bound, _ = calls[0]
    assert half_blocks(bound["sorted_ptr"], int(bound["used_ptr"][0]), bound["num_assignments"]).any()
    with pytest.raises(ValueError, match="in-loader"):
        run_lean(x, w13, w2, ids, weights, None, up, DOWN_TILE, in_loader=True)
    want = torch.zeros(m, k, dtype=torch.float64)
    for t in range(m):
        for j in range(top_k):
            ex = int(ids[t, j])
            gu = w13[ex].double() @ x[t].double()
            want[t] += float(weights[t, j]) * (w2[ex].double() @ (torch.nn.functional.silu(gu[:n]) * gu[n:]))
    assert ((plain.double() - want).norm() / want.norm()).item() < 1e-2
