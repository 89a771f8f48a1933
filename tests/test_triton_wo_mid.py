"""The tile decode's mid-batch configs (tall tiles, deeper pipelines, AHEAD: the next step's dequant
overlapping the dot, ``_kernels/gemm_wo``) and the measured winners table (``triton_wo_winners``) that
the chooser reads, on the CPU under Triton's interpreter, tiny shapes. The kernels against the float64
loop of ``test_triton_wo`` (odd K with group tails, M = 0 / 1, an expert map with -1, split-K); the
table's covering rule and its use by ``choose_decode``, ``wo_config``, the plan and ``run_experts_wo``'s
scratch diversion. Timing is ``benchmarks/wo_mid_device_check.py``'s (H200).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from moekit.experts.triton_wo_winners import WoWinner, tile  # noqa: E402
from test_triton_wo import loop64, problem, rel, run_kernels, wo  # noqa: E402, F401  (wo: fixture)

SCHEMES = [("int8_w8a16", 0), ("int4_w4a16", 32), ("int4_w4a16", 64), ("mxfp4", 32)]
CONFIGS = {  # tile(BLOCK_M, gate-up (BLOCK_N, BLOCK_K, GROUP_M, warps, stages), down (..), AHEAD)
    "ahead": tile(16, (32, 64, 1, 4, 2), (32, 32, 1, 4, 2), True),
    "tall": tile(128, (64, 64, 8, 8, 4), (128, 64, 8, 8, 4), True),
    "taller": tile(256, (32, 64, 8, 8, 3), (64, 64, 8, 8, 3), True),
    "long_steps": tile(32, (32, 128, 1, 4, 3), (64, 128, 1, 4, 3), True),  # one step past K = 99, N = 64
}
QWEN3 = (128, 768, 2048)  # E, N, K


@pytest.mark.parametrize("scheme,group", SCHEMES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_mid_batch_configs_match_the_loop(wo, scheme, group, name):
    # hidden = 99: an odd K (a padding nibble) and a last group cut short; M = 9, k = 2 over 4 experts
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=9, k=2, hidden=99, seed=5)
    out = run_kernels(wo, x, w13, w2, ids, weights, config=CONFIGS[name], decode="tile")
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


@pytest.mark.parametrize("m", [0, 1])
@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 32), ("mxfp4", 32)])
def test_ahead_at_empty_and_single_token(wo, m, scheme, group):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=m, k=1, seed=m)
    out = run_kernels(wo, x, w13, w2, ids, weights, config=CONFIGS["ahead"], decode="tile")
    assert out.shape == (m, 100)
    if m:
        assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


@pytest.mark.parametrize("scheme,group", [("int8_w8a16", 0), ("int4_w4a16", 64), ("mxfp4", 32)])
def test_ahead_with_an_expert_map_and_skipped_ids(wo, scheme, group):
    x, w13, w2, _, weights = problem(wo, scheme, group, m=6, k=2, seed=3)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, 2], [3, 0], [5, 7]], dtype=torch.int32)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32)
    out = run_kernels(wo, x, w13, w2, ids, weights, expert_map=expert_map, config=CONFIGS["tall"], decode="tile")
    assert torch.all(out[4] == 0)  # token 4 routes nowhere here
    assert rel(out, loop64(x, w13, w2, ids, weights, expert_map)) < 2e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32)])
def test_ahead_across_split_k(wo, scheme, group):
    # down BLOCK_K = 32 over N = 64 in 2 splits: each split's look-ahead decodes the other split's step
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, seed=8)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    out = wo.run_experts_wo(x, *args, ids, weights, None, scheme, config=CONFIGS["ahead"], split_k=2, decode="tile")
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


def test_a_row_covers_calls_within_a_factor_of_two():
    from moekit.experts.triton_wo_winners import winner

    table = {("int8_w8a16", 4, 64, 100, 1024): WoWinner("tile"), ("int8_w8a16", 4, 64, 100, 4096): WoWinner("scratch"),
             ("int8_w8a16", 4, 64, 100, 32): WoWinner("scratch")}  # below MIN_M: never taken
    picks = {m: winner("int8_w8a16", 4, 64, 100, m, table) for m in (128, 511, 512, 2047, 2048, 8191, 8192)}
    assert picks == {128: None, 511: None, 512: table[("int8_w8a16", 4, 64, 100, 1024)],
                     2047: table[("int8_w8a16", 4, 64, 100, 1024)], 2048: table[("int8_w8a16", 4, 64, 100, 4096)],
                     8191: table[("int8_w8a16", 4, 64, 100, 4096)], 8192: None}
    assert winner("int4_w4a16", 4, 64, 100, 1024, table) is None  # another scheme
    assert winner("int8_w8a16", 8, 64, 100, 1024, table) is None  # another shape


def test_shipped_row_mixtral_int4_takes_the_mma_decode_at_64():
    from moekit.experts.configs import GemmTile, KernelConfig
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_plan import choose_decode

    mixtral = (8, 14336, 4096)
    # session 29: the mma decode 474.0 µs against the 64-row tile's 819.5 (3e6e2c6: that tile 824, the 32-row 1032);
    # the row covers M = 32 .. 127, its config the mma decode's own (16-row blocks, 32 x 128 one-warp tiles)
    assert {choose_decode("int4_w4a16", m, *mixtral, 2) for m in (32, 64, 127)} == {"mma"}
    mma = GemmTile(32, 128, 1, 1, 3)
    assert wo_config(64, *mixtral, 2, "int4_w4a16", "nowhere", "mma") == KernelConfig(16, mma, mma)
    assert wo_config(64, *mixtral, 2, "mxfp4", "nowhere").BLOCK_M == 32  # mxfp4: within the noise, not taken
    assert choose_decode("int4_w4a16", 8, *mixtral, 2) == "mma"  # below the row's factor 2 (session 26: mma at 8)


def test_shipped_row_qwen3_int8_takes_the_fused_tile_at_4096():
    from moekit.experts.triton_wo_plan import choose_decode

    assert choose_decode("int8_w8a16", 4096, *QWEN3, 8) == "tile"  # 87d0e52: tile 1084 µs, scratch 1215
    assert choose_decode("int8_w8a16", 16384, *QWEN3, 8) == "scratch"  # beyond the row: the threshold
    assert choose_decode("int4_w4a16", 4096, *QWEN3, 8) == "scratch"  # no row there


def test_chooser_and_config_read_the_table(monkeypatch):
    from moekit.experts import triton_wo_winners as winners
    from moekit.experts.triton_wo_configs import ahead_of, wo_config, wo_heuristic_config
    from moekit.experts.triton_wo_plan import choose_decode

    best = tile(256, (32, 64, 8, 8, 3), (128, 64, 8, 8, 3), True)
    monkeypatch.setattr(winners, "WO_WINNERS", {("mxfp4", *QWEN3, 1024): WoWinner("scratch", best),
                                                ("mxfp4", *QWEN3, 4096): WoWinner("tile", best)})
    assert choose_decode("mxfp4", 1024, *QWEN3, 8) == "scratch"  # below SCRATCH_MIN_TOKENS: the row
    assert choose_decode("mxfp4", 1024, *QWEN3, 8, fused=True) == "tile"  # fused only: the usual rule
    assert choose_decode("mxfp4", 4096, *QWEN3, 8) == "tile"  # above it: the row again
    assert wo_config(4096, *QWEN3, 8, "mxfp4", "NVIDIA_H200") == best and ahead_of(best)
    assert wo_config(1024, *QWEN3, 8, "mxfp4", "cpu") == best  # the fastest tile, for a fused call
    assert wo_config(4096, *QWEN3, 8, "mxfp4", "cpu", "register") != best  # the tile decode's only
    assert wo_config(300, *QWEN3, 8, "mxfp4", "cpu") == wo_heuristic_config(300, *QWEN3, 8, "mxfp4")
    assert not ahead_of(wo_heuristic_config(300, *QWEN3, 8, "mxfp4"))
    huge = ("mxfp4", 4, 1 << 15, 1 << 16)  # one expert's bf16 w13 of 8 GiB: the scratch cannot run
    monkeypatch.setattr(winners, "WO_WINNERS", {(*huge, 1024): WoWinner("scratch")})
    assert choose_decode(*huge[:1], 1024, *huge[1:], 2) == "tile"


def test_a_tuned_file_of_the_device_comes_before_the_table(user_config_dir):
    """The table is one H200 run's; a file ``moekit tune`` wrote for this device (any GPU) measured this
    device, so it decides the tile config where both cover a call (the table still decides the decode)."""
    import json

    from moekit.experts.configs import KernelConfig
    from moekit.experts.triton_wo_configs import wo_config
    from moekit.experts.triton_wo_winners import winner

    entry = {"BLOCK_M": 32, "up": {"BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2},
             "down": {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}}
    path = user_config_dir / "E128_N768_K2048_int4_w4a16_NVIDIA_A100.json"
    path.write_text(json.dumps({"configs": {"1024": entry}}))
    assert winner("int4_w4a16", *QWEN3, 1024).tile is not None  # a shipped row covers the call
    assert wo_config(1024, *QWEN3, 8, "int4_w4a16", "NVIDIA_A100") == KernelConfig.from_dict(entry)
    assert wo_config(1024, *QWEN3, 8, "int4_w4a16", "NVIDIA_H200") == winner("int4_w4a16", *QWEN3, 1024).tile


def test_plan_launches_the_rows_tile_with_ahead(wo, monkeypatch):
    from moekit.experts import triton_wo_winners as winners
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.experts.triton_wo_plan import build_wo_plan

    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=600, k=2, seed=4)
    config = CONFIGS["long_steps"]
    monkeypatch.setattr(winners, "WO_WINNERS", {("int4_w4a16", 4, 64, 100, 1024): WoWinner("tile", config)})
    a13, a2 = (wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    plan = build_wo_plan(x, a13, a2, ids, None, "int4_w4a16", "silu", None, LaunchOptions())
    assert plan.decode == "tile" and plan.config.up == config.up and plan.config.down == config.down
    assert all(launch.compile_arguments(())[1]["AHEAD"] is True for launch in (plan.gate_up, plan.down))


def test_a_scratch_row_below_the_threshold_diverts_the_public_entry(wo, monkeypatch):
    from moekit.experts import triton_wo_winners as winners

    calls = []
    real = wo.run_experts_wo_scratch
    monkeypatch.setattr(winners, "MIN_M", 8)  # a row at M = 8 (this batch of 6 is within a factor 2)
    monkeypatch.setattr(wo, "MIN_M", 8)
    monkeypatch.setattr(winners, "WO_WINNERS", {("mxfp4", 4, 64, 100, 8): WoWinner("scratch")})
    monkeypatch.setattr(wo, "run_experts_wo_scratch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w13, w2, ids, weights = problem(wo, "mxfp4", 32, m=6, k=2, dtype=torch.bfloat16, seed=6)
    out = wo.fused_experts_wo(x, w13, w2, ids, weights)
    assert calls == [1] and rel(out, loop64(x, w13, w2, ids, weights)) < 1e-2


def test_mixtral_int8_m64_row_groups_16_row_blocks():
    # session 32: Mixtral int8 M = 32..127 on the tile decode in M = 8's 16-row tiles with GROUP_M 8 (an expert's second
    # block reads its weights from L2); M = 128 and M < 32 as before
    from moekit.experts.triton_wo_configs import wo_config, wo_heuristic_config
    from moekit.experts.triton_wo_plan import choose_decode

    mixtral = (8, 14336, 4096)
    for m in (32, 64, 127):
        cfg = wo_config(m, *mixtral, 2, "int8_w8a16", "NVIDIA_H200")
        assert choose_decode("int8_w8a16", m, *mixtral, 2) == "tile"
        assert (cfg.BLOCK_M, cfg.up.GROUP_M, cfg.down.GROUP_M, cfg.up.BLOCK_N, cfg.down.BLOCK_N) == (16, 8, 8, 64, 128)
    for m in (8, 128):
        assert wo_config(m, *mixtral, 2, "int8_w8a16", "NVIDIA_H200") == wo_heuristic_config(m, *mixtral, 2,
                                                                                            "int8_w8a16")
