"""The word MMA decode (``gemm_wo_mma``) in 32-row blocks and with GROUP_M > 1 (issue #16 session 32: at Mixtral
M = 64 16-row blocks give an expert ~1.45 blocks, each decoding its weights again) on the CPU under Triton's
interpreter, tiny shapes on the aligned layout, against the float64 loop of ``test_triton_wo``: experts with one, two
and three blocks, the two-sided and the halves gate-up, 128- and 256-column steps, the plan's block rows.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from test_triton_wo import POISON, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)

SCHEMES = [("int4_w4a16", 128), ("mxfp4", 32), ("int8_w8a16", 0)]


def config(block_m: int, block_k: int = 128, group_m: int = 1, halves: bool = False) -> WordConfig:
    tile = GemmTile(32, block_k, group_m, 1, 1)
    return WordConfig(block_m, tile, tile, halves=halves)


def run(wo, x, w13, w2, ids, weights, cfg):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, None, w13.scheme, config=cfg, options=POISON, decode="mma")


def routed(m: int, e: int) -> torch.Tensor:
    """ids [m, 2]: expert 0 on every token (m rows: 2-3 blocks of 32 at m = 40..96), expert 1 on the first 3, the
    others in turn (one block each)."""
    ids = torch.zeros(m, 2, dtype=torch.int32)
    ids[:, 1] = 2 + torch.arange(m) % (e - 2)
    ids[:3, 1] = 1
    return ids


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("block_m,group_m,halves", [(32, 1, False), (32, 4, True), (16, 8, False)])
def test_blocks_match_float64_loop(wo, scheme, group, block_m, group_m, halves):
    # E = 6, M = 40: expert 0's 40 rows in two 32-row blocks (three 16-row ones), the rest 1-10 rows; K = 256 in one
    # 256-column step or two 128-column ones
    x, w13, w2, _, weights = problem(wo, scheme, group, m=40, k=2, e=6, hidden=256, n=64, seed=block_m + group_m)
    ids = routed(40, 6)
    want = loop64(x, w13, w2, ids, weights)
    for block_k in (128, 256):
        out = run(wo, x, w13, w2, ids, weights, config(block_m, block_k, group_m, halves))
        assert rel(out, want) < 1e-3


def test_plan_rows_follow_block_m(wo):
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_wo_plan import build_wo_plan

    x, w13, w2, _, weights = problem(wo, "int4_w4a16", 128, m=40, k=2, e=6, hidden=256, n=64, seed=5)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    for block_m in (16, 32):
        plan = build_wo_plan(x, *args, routed(40, 6), None, "int4_w4a16", "silu", config(block_m, group_m=8),
                             LaunchOptions(), None, "mma")
        assert plan.align is not None  # M = 40: the aligned layout
        assert plan.config.BLOCK_M == block_m and plan.config.up.GROUP_M == plan.config.down.GROUP_M == 8


def test_measured_configs_cover_their_bucket(monkeypatch):
    # an MMA_CONFIGS row covers M / 2 .. 2M in its M's tile-height bucket (E = 8, top 2: 16 rows an expert from
    # M = 64), ahead of the heuristic (and of a tuned file); other calls, other decodes: as before
    from moekit.experts import triton_wo_configs as configs

    shape = ("int4_w4a16", 8, 512, 256)
    short, tall = config(16, 128), config(32, 128, halves=True)
    monkeypatch.setitem(configs.MMA_CONFIGS, (*shape, 1), short)
    monkeypatch.setitem(configs.MMA_CONFIGS, (*shape, 64), tall)

    def cfg(m: int, decode: str = "mma"):
        return configs.wo_config(m, 8, 512, 256, 2, "int4_w4a16", "no-such-device", decode)

    assert [cfg(m) for m in (1, 2, 64, 127)] == [short, short, tall, tall]
    for m in (3, 32, 63, 128):
        assert cfg(m) == configs.wo_heuristic_config(m, 8, 512, 256, 2, "int4_w4a16", "mma")
    assert cfg(64, "tile") == configs.wo_heuristic_config(64, 8, 512, 256, 2, "int4_w4a16", "tile")
