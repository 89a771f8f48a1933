"""The word decode's split-K gate-up (``WordConfig.up_split``: ``_kernels/wo_split.py``, float32 partials per
split summed with the activation in one launch) on the CPU under Triton's interpreter, tiny shapes: the gemv
against the float64 loop of ``test_triton_wo`` (the tiny-batch shortcut and 2-row aligned blocks, splits that
do not divide the steps, odd K with a group tail, with the down GEMM split too), its launches, and the
config's errors. The compiled kernels were checked at real shapes by session 21's
``wo_ahead_device_check.py`` (removed: ``git show 87f368f6:benchmarks/wo_ahead_device_check.py``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

triton = pytest.importorskip("triton")

from moekit.experts.configs import GemmTile  # noqa: E402
from test_triton_wo import PER, POISON, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)


def word_config(scheme: str, block_m: int, words: int, up_split: int, down_split: int = 0, fold: bool = False):
    tile = GemmTile(16, words * PER[scheme], 1, 1, 1)
    word = importlib.import_module("moekit.experts.triton_wo_gemv").WordConfig  # the plan's module
    return word(block_m, tile, tile, up_split=up_split, down_split=down_split, glu_fold=fold)


def run(wo, x, w13, w2, ids, weights, cfg, decode):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, None, w13.scheme, config=cfg, options=POISON, decode=decode)


@pytest.mark.parametrize("decode,scheme,group", [("gemv", "int4_w4a16", 32), ("gemv", "int8_w8a16", 0),
                                                 ("gemv", "mxfp4", 32)])
def test_split_gate_up_matches_loop(wo, decode, scheme, group):
    # K = 95 (odd: a group tail; int8 92: its rows read as words), 4-word steps: 3 (int8 6) steps a row in 2
    # splits of 2 and 1 (3 and 3) steps; M = 2, k = 2 over 8 experts: the tiny-batch shortcut (one row a
    # block); the down GEMM (N = 40) in 2 splits as well
    hidden = 92 if scheme == "int8_w8a16" else 95
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=2, e=8, hidden=hidden, n=40, seed=5)
    out = run(wo, x, w13, w2, ids, weights, word_config(scheme, 1, 4, up_split=2, down_split=2), decode)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


def test_split_gate_up_aligned_two_row_blocks(wo):
    # M = 5, k = 2 over 4 experts: aligned 2-row blocks (padding rows); K = 96: 3 steps in 3 splits (one each),
    # more splits asked (8) than steps: 3 splits, none empty
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=5, k=2, hidden=96, n=32, seed=9)
    out = run(wo, x, w13, w2, ids, weights, word_config("int4_w4a16", 2, 4, up_split=8), "gemv")
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


@pytest.mark.parametrize("decode,scheme,group,block_m,down_split", [
    ("gemv", "int4_w4a16", 32, 1, 2), ("gemv", "int8_w8a16", 0, 2, 1), ("gemv", "mxfp4", 32, 1, 1),
    ("gemv", "int4_w4a16", 32, 2, 2)])
def test_folded_split_equals_the_activation_launch(wo, decode, scheme, group, block_m, down_split):
    # the down GEMM sums the partials and applies the activation as it reads h (``glu_fold``): the same sums in
    # the same order as the activation launch, so bit-equal, and the float64 loop's values; K = 95 (int8 92) in
    # 3 splits of 4-word steps (the last short), N = 40 (a step tail); 1-row blocks (shortcut) and aligned 2-row
    # blocks (M = 5, k = 2 over 4 experts: padding rows); the down GEMM split too
    hidden = 92 if scheme == "int8_w8a16" else 95
    m, e = (2, 8) if block_m == 1 else (5, 4)
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=m, k=2, e=e, hidden=hidden, n=40, seed=11)
    launched = run(wo, x, w13, w2, ids, weights, word_config(scheme, block_m, 4, 3, down_split), decode)
    folded = run(wo, x, w13, w2, ids, weights, word_config(scheme, block_m, 4, 3, down_split, fold=True), decode)
    assert torch.equal(folded, launched)
    assert rel(folded, loop64(x, w13, w2, ids, weights)) < 2e-3


def test_split_plan_launches_and_errors(wo):
    plan_mod = importlib.import_module("moekit.experts.triton_wo_plan")
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=1, k=2, e=4, hidden=96, n=64, seed=1)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]

    def plan(cfg):
        return plan_mod.build_wo_plan(x, *args, ids, None, "int4_w4a16", "silu", cfg, POISON, decode="gemv")

    split = plan(word_config("int4_w4a16", 1, 4, up_split=3, down_split=2))
    assert split.glu is not None and split.gate_up.grid[1] == 3 and split.split_k == 2
    assert dict(zip(split.workspace.names, split.workspace.shapes))["p"] == (3 * 2, 128)  # [SPLIT * A, 2N]
    folded = plan(word_config("int4_w4a16", 1, 4, up_split=3, down_split=2, fold=True))
    assert folded.glu is None and folded.glu_fold and folded.gate_up.grid[1] == 3
    assert "p" in folded.workspace.names and folded.down.tail[7] == 128  # down reads p: stride_hm 2N
    stand_ins = {name: i for i, name in enumerate(folded.workspace.names)}
    launches = wo.wo_launches(folded, stand_ins, x, *args, ids, weights, None, None)
    assert [launch for launch, _ in launches][-3:] == [folded.gate_up, folded.down, folded.sum_slots]
    assert launches[-2][1][0] == stand_ins["p"]  # down's h pointer: the partials
    assert plan(word_config("int4_w4a16", 1, 4, up_split=1, fold=True)).down.tail[7] == 64  # nothing to fold
    whole = plan(word_config("int4_w4a16", 1, 4, up_split=1))
    assert whole.glu is None and whole.gate_up.grid[1] == 1 and "p" not in whole.workspace.names
    with pytest.raises(ValueError, match="up_split"):
        plan(word_config("int4_w4a16", 1, 4, up_split=0))


def test_measured_splits_apply_where_a_row_covers_the_call():
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_gemv import WordConfig, gemv_heuristic_config
    from moekit.experts.triton_wo_word_winners import WordPick, word_config, word_pick

    table = {("int4_w4a16", 256, 2048, 7168, 2): WordPick("gemv", 2),
             ("int4_w4a16", 256, 2048, 7168, 8): WordPick("gemv", 4, 8),
             ("int4_w4a16", 256, 2048, 7168, 64): WordPick("other", 2)}  # another decode's row
    # rows cover m/2 <= M <= 2m, the nearest in log2 (ties: the smaller m); M = 1-32 run 1-row blocks (M*k <= E)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 1, 8, "gemv", table) == WordPick("gemv", 2)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 3, 8, "gemv", table) == WordPick("gemv", 2)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 4, 8, "gemv", table) == WordPick("gemv", 2)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 5, 8, "gemv", table) == WordPick("gemv", 4, 8)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 17, 8, "gemv", table) is None  # none within a factor 2
    assert word_pick("int4_w4a16", 256, 2048, 7168, 64, 8, "gemv", table) is None  # the other decode's row only
    assert word_pick("int4_w4a16", 256, 2048, 7168, 64, 8, "other", table) == WordPick("other", 2)
    assert word_pick("int4_w4a16", 256, 2048, 7168, 32, 8, "other", table) is None  # 1-row blocks at 32
    assert word_pick("mxfp4", 256, 2048, 7168, 2, 8, "gemv", table) is None
    # the shipped table: DeepSeek-V3 int4 M = 1 splits its gate-up, the heuristic tiles kept
    base = gemv_heuristic_config(1, 256, 2048, 7168, 8, "int4_w4a16")
    cfg = wo_config(1, 256, 2048, 7168, 8, "int4_w4a16", "nowhere", "gemv")
    assert isinstance(cfg, WordConfig) and cfg.up_split > 1 and (cfg.up, cfg.down) == (base.up, base.down)
    assert not cfg.glu_fold  # folding measured slower here (105.2 against 98.9 µs)
    # Qwen3-30B-A3B int4 M = 1 (and M = 2, its row) folds the split gate-up into down: the plan launches no glu
    from moekit.experts.triton_wo_gemv import folded_splits

    qwen = wo_config(1, 128, 768, 2048, 8, "int4_w4a16", "nowhere", "gemv")
    assert qwen.glu_fold and folded_splits(qwen, 2048 // 8, "int4_w4a16") == qwen.up_split == 4
    assert wo_config(2, 128, 768, 2048, 8, "int4_w4a16", "nowhere", "gemv") == qwen
    assert not wo_config(8, 128, 768, 2048, 8, "int4_w4a16", "nowhere", "gemv").glu_fold  # 91.2 against 80.8
    assert word_config(1, 6, 64, 96, 2, "int4_w4a16", "gemv") == gemv_heuristic_config(1, 6, 64, 96, 2, "int4_w4a16")


def test_a_pick_sets_the_tiles_words_ahead_and_x_tile():
    from moekit.experts.triton_wo_gemv import gemv_heuristic_config
    from moekit.experts.triton_wo_word_winners import WordPick, with_pick

    base = gemv_heuristic_config(1, 128, 768, 2048, 8, "int4_w4a16")
    cfg = with_pick(base, WordPick("gemv", 4, 0, (32, 16, 2, 1), None, fold=True, x_tile=True), "int4_w4a16")
    # gemv: a tile's 4th entry is its words loaded ahead beyond one step (num_stages = 1 + it: AHEAD 2)
    assert (cfg.up.BLOCK_N, cfg.up.BLOCK_K, cfg.up.num_warps, cfg.up.num_stages) == (32, 128, 2, 2)
    assert cfg.down == base.down and cfg.up_split == 4 and cfg.glu_fold and cfg.x_tile
    assert not with_pick(base, WordPick("gemv", 2), "int4_w4a16").x_tile
