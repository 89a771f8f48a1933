"""The word MMA decode's gate-up with its gate rows and up rows in separate programs (``WordConfig.halves``,
``gemm_wo_mma.gate_up_halves_wo_mma_kernel``, issue #16 session 29) on the CPU under Triton's interpreter, tiny
shapes, against the float64 loop of ``test_triton_wo``: float32 pre-activation partials activated by the split_glu
launch, with K splits, odd K tails, int4 tail groups, a row block across the gate / up boundary, M = 0 / 1 and an
expert map's -1; where the chooser takes it; the refusals by name.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from test_triton_wo import POISON, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)
from test_triton_wo_mma import check_edges, run  # noqa: E402

SCHEMES = [("int4_w4a16", 128), ("mxfp4", 32), ("int8_w8a16", 0)]


def halves(rows: int = 32, block_k: int = 128, up_split: int = 1) -> WordConfig:
    tile = GemmTile(rows, block_k, 1, 1, 1)
    return WordConfig(16, tile, tile, up_split=up_split, halves=True)


def plan_of(wo, x, w13, w2, ids, weights, cfg):
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_wo_plan import build_wo_plan

    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return build_wo_plan(x, *args, ids, None, w13.scheme, "silu", cfg, LaunchOptions(), None, "mma")


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_halves_match_float64_loop(wo, scheme, group):
    # N = 48: the 96 w13 rows in 32-row programs, the second one holding gate rows 32..47 and up rows 0..15 (p's
    # columns are w13's rows); K = 200: a tail step (25 words; int8 50 of 64), int4's tail group 72 wide
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=200, n=48, seed=3)
    out = run(wo, x, w13, w2, ids, weights, halves())
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
def test_halves_wide_steps_split_along_k(wo, scheme, group):
    # K = 640 in steps of 256 columns (two dots each), split in 2 (512 + 128: the second split's step half past the
    # row) and 3, the partial sets summed in split order by the split_glu launch; the down GEMM split in 2 too.
    # E = 2: every token takes both experts, so two row blocks of 3 rows each (the interpreter's time: E = 4 put
    # the same 6 slots in 4 blocks)
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, e=2, hidden=640, n=384, seed=17)
    want = loop64(x, w13, w2, ids, weights)
    for split in (2, 3):
        out = run(wo, x, w13, w2, ids, weights, halves(block_k=256, up_split=split), split_k=2)
        assert rel(out, want) < 1e-3


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("m", [0, 1])
def test_halves_edges(wo, scheme, group, m):
    # M = 0 (an empty output) and M = 1 with an expert map whose -1 drops one of the token's experts
    check_edges(wo, scheme, group, m, halves(), hidden=256, n=128, seed=29 + m)


def test_halves_plan(wo):
    # the gate-up's grid covers the 2N rows; p holds one partial set ([A, 2N]) a K split, the split_glu launch sums them
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 128, m=3, k=2, hidden=256, n=48, seed=5)
    tile = GemmTile(32, 128, 1, 1, 1)
    together = plan_of(wo, x, w13, w2, ids, weights, WordConfig(16, tile, tile))
    apart = plan_of(wo, x, w13, w2, ids, weights, halves())
    programs = together.gate_up.grid[0] // 2  # M-blocks: 2 programs of 32 of the 48 gate (and up) rows each
    assert apart.gate_up.grid[:2] == (3 * programs, 1) and apart.glu.grid[:2] == (6, 1)
    split = plan_of(wo, x, w13, w2, ids, weights, halves(up_split=2))
    assert split.gate_up.grid[:2] == (3 * programs, 2) and split.glu.grid[:2] == (6, 1)
    for plan, sets in ((apart, 1), (split, 2)):
        spec = plan.workspace
        assert spec.shapes[spec.names.index("p")] == (sets * 6, 96) and "p" not in together.workspace.names


def test_refusals(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 128, m=2, k=2, hidden=256, n=64, seed=9)
    tile = GemmTile(32, 128, 1, 1, 1)
    with pytest.raises(ValueError, match="glu_fold"):  # the partials are activated in their own launch
        run(wo, x, w13, w2, ids, weights, WordConfig(16, tile, tile, glu_fold=True, halves=True))
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    with pytest.raises(ValueError, match="halves"):
        wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", options=POISON, decode="gemv",
                          config=WordConfig(1, GemmTile(64, 128, 1, 2, 1), GemmTile(64, 128, 1, 2, 1), halves=True))


def test_halves_taken_where_measured():
    # the mma decode's gate-up with the halves apart within a factor 2 of a measured M (``MMA_HALVES``): DeepSeek-V3
    # int4 M = 32 .. 128 in 32 x 128 one-warp tiles (H200: M=64 2172.2 against 2272.8 µs two-sided), Mixtral int4
    # M = 4 .. 16 in 64 x 128 two-warp tiles (M=8 319.2 against 334.2); the two-sided gate-up elsewhere, the down GEMM
    # as before
    from moekit.experts.triton_wo_configs import wo_config

    def config_at(m, e, n, k, top_k):
        return wo_config(m, e, n, k, top_k, "int4_w4a16", "NVIDIA_H200", "mma")

    one, two = GemmTile(32, 128, 1, 1, 3), GemmTile(64, 128, 1, 2, 3)
    deepseek = {m: config_at(m, 256, 2048, 7168, 8) for m in (16, 31, 32, 64, 128, 129)}
    assert {m: getattr(c, "halves", False) for m, c in deepseek.items()} == {
        16: False, 31: False, 32: True, 64: True, 128: True, 129: False}
    assert {c.up for c in deepseek.values()} == {one} and {c.down for c in deepseek.values()} == {one}
    mixtral = {m: config_at(m, 8, 14336, 4096, 2) for m in (3, 4, 8, 16, 17, 64)}
    assert {m: (getattr(c, "halves", False), c.up) for m, c in mixtral.items()} == {
        3: (False, one), 4: (True, two), 8: (True, two), 16: (True, two), 17: (False, one), 64: (False, one)}
    assert not getattr(config_at(64, 128, 768, 2048, 8), "halves", False)  # Qwen3: 165.1 against 160.4
