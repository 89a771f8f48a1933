"""The kept training forward's tile pick (``triton_kept_forward``): which gate-up and down tiles a shape runs by
source, and the kept forward and backward run with each (Triton's interpreter, real tile sizes on tiny shapes: every
tail masked) against the float64 per-token loop of ``test_triton_backward_kept`` and its autograd.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, spy_launches  # noqa: E402, F401  (fixture)
from _helpers import make_problem, rel_l2  # noqa: E402
from test_triton_backward_kept import NAMES, grads, loop64  # noqa: E402

H100 = "NVIDIA_H100_80GB_HBM3"  # reads the H200's packaged files (its sibling)
SM90_SHARED = 232448


def _shape(m, e, n, k, top_k, device=H100):
    from moekit.experts.triton_kept_forward import KeptShape

    return KeptShape(m, e, n, k, top_k, torch.bfloat16, device)


def _kept():
    from moekit.experts.triton_backward_sorted import KEPT_FORWARD

    return KEPT_FORWARD


def _packaged(name: str, m: int) -> dict:
    import moekit.experts.configs as configs

    return json.loads((Path(configs.__file__).parent / name).read_text())["configs"][str(m)]


def test_inference_source_takes_the_packaged_entry_as_kept_tiles():
    """Mixtral at M=1024 on an H100: the H200 file's entry (64-row blocks, 256 wide, GROUP_M 32 / 8), read here from
    the JSON, as rows / cols / red / warps / stages / group of both tiles; it fits 227 KB with TMA so it is unshrunk."""
    from moekit.experts.triton_kept_forward import forward_tiles

    entry = _packaged("E8_N14336_K4096_bfloat16_NVIDIA_H200.json", 1024)
    pick = forward_tiles(_shape(1024, 8, 14336, 4096, 2), 128, True, SM90_SHARED, _kept(), "inference")
    assert pick.source == "inference"
    for tile, want in ((pick.fwd13, entry["up"]), (pick.fwd2, entry["down"])):
        assert (tile.rows, tile.cols, tile.red, tile.num_warps, tile.num_stages, tile.group) == (
            entry["BLOCK_M"], want["BLOCK_N"], want["BLOCK_K"], want["num_warps"], want["num_stages"], want["GROUP_M"])
        assert tile.desc and tile.contiguous


def test_a_pipeline_too_big_for_the_shared_memory_is_refit():
    """With a 100 KB limit the kept gate-up tile (4 stages of [128 x 64] x_p + two [128 x 64] weight tiles, bf16 =
    48 KB a stage) keeps at most 2 stages of 64-wide steps: each stage counted here by hand."""
    from moekit.experts.triton_kept_forward import forward_tiles

    pick = forward_tiles(_shape(4096, 128, 768, 2048, 8), 128, True, 100_000, _kept(), "s3")
    up, down = pick.fwd13, pick.fwd2
    assert up.num_stages * (up.rows * up.red + 2 * up.red * up.cols) * 2 + 1024 <= 100_000
    assert down.num_stages * (down.rows * down.red + down.red * down.cols) * 2 + 1024 <= 100_000
    assert up.num_stages == 2 and down.num_stages == 3  # down: 3 x 32 KB fit


def test_a_block_that_does_not_divide_the_layout_falls_back_to_kept():
    """The kept layout's block is the backward's: a 128-row source on a 64-row layout cannot run, so "kept" runs."""
    from moekit.experts.triton_kept_forward import forward_tiles

    pick = forward_tiles(_shape(4096, 128, 768, 2048, 8), 64, False, SM90_SHARED, _kept(), "s3")
    assert pick.source == "kept" and pick.fwd13 == dataclasses.replace(_kept(), desc=False) == pick.fwd2


def test_the_rule_picks_by_class_and_an_unknown_source_is_named(monkeypatch):
    """FORWARD_RULE by ``shape_class``: Qwen3 at M=4096 is "narrow/few"; a class without an entry runs "kept"; a
    source that is none of the names is refused with them."""
    import moekit.experts.triton_kept_forward as kf

    monkeypatch.setattr(kf, "FORWARD_RULE", {"narrow/few": "n64"})
    assert kf.forward_tiles(_shape(4096, 128, 768, 2048, 8), 128, True, SM90_SHARED, _kept()).source == "n64"
    assert kf.forward_tiles(_shape(1024, 8, 14336, 4096, 2), 128, True, SM90_SHARED, _kept()).source == "kept"
    with pytest.raises(ValueError, match="source must be .*'m64'.*got 'wide'"):
        kf.forward_tiles(_shape(1024, 8, 14336, 4096, 2), 128, True, SM90_SHARED, _kept(), "wide")


def test_tuned_forward_tiles_of_the_shape_stay():
    """"wide/many" carries forward tiles of its own (``TUNED``): the pick leaves them, whatever the rule."""
    import moekit.experts.triton_backward_launch as bl
    from moekit.experts.triton_backward_sorted import kept_tiles
    from moekit.experts.triton_kept_forward import with_kept_forward

    tiles = bl.TUNED["wide/many"]
    x, w13 = torch.empty(16384, 4096, dtype=torch.bfloat16), torch.empty(8, 2 * 14336, 1, dtype=torch.bfloat16)
    got = with_kept_forward(tiles, kept_tiles(tiles), x, w13, torch.empty(16384, 2, dtype=torch.int32), "m64")
    assert got.fwd13 == tiles.fwd13 and got.fwd2 == tiles.fwd2


def _layout_tiles(block_m: int, fwd13, fwd2):
    """The interpreter's backward tiles on a ``block_m``-row layout with the given forward tiles (pointer loads)."""
    from moekit.experts.triton_backward_launch import backward_tiles
    from moekit.experts.triton_backward_sorted import kept_tiles

    return kept_tiles(dataclasses.replace(backward_tiles(1, 1, 1, torch.float32), block_m=block_m, fwd13=fwd13,
                                          fwd2=fwd2))


def _source_tiles(source: str, block_m: int):
    from moekit.experts.triton_kept_forward import CANDIDATES, as_kept

    return as_kept(CANDIDATES[source], source, block_m, 4, False, 1 << 40)


@pytest.mark.parametrize("source, m, k, e", [("s3", 19, 2, 4), ("n64", 33, 6, 8), ("m64", 1, 1, 4),
                                             ("m64", 21, 3, 8)])
def test_each_source_forward_and_grads_equal_the_float64_loop(interpreter, source, m, k, e):
    """Each candidate's real tiles (rows 64 or 128 of a 128-row layout, 64 / 128 / 256 wide) at K=33, N=17 (every
    tail masked), skipped slots, M = 1: the kept forward's output and the backward that reads its h_p against the
    float64 loop and its autograd; the launches ran the source's tiles."""
    from moekit.experts.triton_backward_launch import experts_backward
    from moekit.experts.triton_train_forward import sorted_forward

    x, w13, w2, ids, weights = make_problem(m, k, e, 33, 17, seed=40 + m, skips=m > 1)
    pick = _source_tiles(source, 128)
    tiles = _layout_tiles(128, pick.fwd13, pick.fwd2)
    kept = sorted_forward(x, w13, w2, ids, weights, None, "silu", tiles, keep_h=True)
    assert rel_l2(kept.out, loop64(x, w13, w2, ids, weights)) < 1e-6
    dout = torch.randn(m, 33, generator=torch.Generator().manual_seed(m))
    got = experts_backward(dout, x, w13, w2, ids, weights, None, kept.h_p, "silu", (True,) * 4, tiles=tiles,
                           x_p=kept.x_p)
    want = grads(loop64, (x, w13, w2, ids, weights), dout, torch.float64)
    for name in NAMES:
        assert rel_l2(getattr(got, name), want[name]) < 1e-5, name


def test_expert_map_with_unrouted_slots_through_a_64_row_source(interpreter):
    """An expert map (3 of 11 global experts elsewhere, -1) and ids out of range with "m64"'s 64-row blocks in a
    128-row layout: the output equals the float64 loop's, unrouted tokens' rows exactly 0."""
    from moekit.experts.triton_train_forward import sorted_forward

    x, w13, w2, _, weights = make_problem(21, 3, 8, 33, 17, seed=7)
    g = torch.Generator().manual_seed(7)
    expert_map = torch.full((11,), -1, dtype=torch.int32)
    expert_map[torch.randperm(11, generator=g)[:8]] = torch.arange(8, dtype=torch.int32)
    ids = torch.randint(-1, 13, (21, 3), generator=g, dtype=torch.int32)
    ids[0] = -1  # token 0 routed nowhere
    pick = _source_tiles("m64", 128)
    kept = sorted_forward(x, w13, w2, ids, weights, expert_map, "silu", _layout_tiles(128, pick.fwd13, pick.fwd2),
                          keep_h=True)
    assert rel_l2(kept.out, loop64(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-6
    assert torch.equal(kept.out[0], torch.zeros(33))


def _forward_launches(monkeypatch, problem) -> list:
    """(kernel, BLOCK_M, BLOCK_N, BLOCK_K) of each launch of the kept forward's GEMMs in one forward call."""
    import moekit.experts.triton_train_forward as tf
    from moekit.experts.triton_backward import experts_triton_kept

    with monkeypatch.context() as m:
        launched = spy_launches(m, tf, lambda name, kw: (name, kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("BLOCK_K")))
        experts_triton_kept(*problem)
    return [s for s in launched if s[0] in ("gate_up_train_kernel", "down_train_kernel")]


def test_the_op_runs_the_rules_inference_tiles(interpreter, monkeypatch):
    """Through ``experts_triton_kept`` with the rule naming "inference": off an sm_90 GPU the rule does not apply (the
    interpreter's "kept" tile, 16 x 16); on one (taken for it here) the forward's launches take the inference forward's
    config of the shape (the heuristic's, off CUDA), and the grads hold to the float64 loop's within bf16's tolerance;
    M = 0 gives zeros."""
    import moekit.experts.triton_kept_forward as kf
    from moekit.experts.configs import heuristic_config
    from moekit.experts.triton_backward import experts_triton_kept

    monkeypatch.setattr(kf, "FORWARD_RULE", dict.fromkeys(("narrow/few",), "inference"))
    problem = make_problem(6, 2, 8, 33, 17, dtype=torch.bfloat16, seed=12)
    launched_off_sm90 = _forward_launches(monkeypatch, problem)
    assert launched_off_sm90 and all(b == 16 and n == 16 for _, b, n, _ in launched_off_sm90), launched_off_sm90
    facts = kf.device_facts(torch.device("cpu"))  # the interpreter's device taken for a measured one
    monkeypatch.setattr(kf, "device_facts", lambda device: dataclasses.replace(facts, measured=True))
    launched = _forward_launches(monkeypatch, problem)
    dout = torch.randn(6, 33, generator=torch.Generator().manual_seed(4))
    got = grads(experts_triton_kept, problem, dout, torch.bfloat16)
    want = grads(loop64, problem, dout, torch.float64)
    config = heuristic_config(6, 8, 17, 33, 2)
    assert ("gate_up_train_kernel", config.BLOCK_M, config.up.BLOCK_N, config.up.BLOCK_K) in launched, launched
    assert ("down_train_kernel", config.BLOCK_M, config.down.BLOCK_N, config.down.BLOCK_K) in launched, launched
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < 1e-2, name
    x, w13, w2, ids, weights = make_problem(0, 2, 8, 33, 17, seed=1)
    assert experts_triton_kept(x, w13, w2, ids, weights).shape == (0, 33)


def test_a_user_config_written_after_a_pick_is_taken(tmp_path, monkeypatch):
    """The picks are kept per shape and cleared with the config lookups: a user file written (``write_configs``) for
    Mixtral at M=1024 on an H100 after a first pick gives the next pick its tiles."""
    from moekit.experts.configs import GemmTile, KernelConfig, clear_config_cache, write_configs
    from moekit.experts.triton_kept_forward import forward_tiles

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    clear_config_cache()
    shape = _shape(1024, 8, 14336, 4096, 2)
    before = forward_tiles(shape, 128, True, SM90_SHARED, _kept(), "inference")
    mine = KernelConfig(128, GemmTile(64, 64, 4, 8, 3), GemmTile(128, 64, 2, 8, 2))
    write_configs(tmp_path / f"E8_N14336_K4096_bfloat16_{H100}.json", 8, 14336, 4096, torch.bfloat16, H100,
                  {1024: mine})
    after = forward_tiles(shape, 128, True, SM90_SHARED, _kept(), "inference")
    assert before.fwd13.rows == 64 and (after.fwd13.rows, after.fwd13.cols, after.fwd13.group) == (128, 64, 4)
    assert (after.fwd2.cols, after.fwd2.num_stages, after.fwd2.group) == (128, 2, 2)
    monkeypatch.delenv("MOEKIT_CONFIG_DIR")
    clear_config_cache()
