"""Per-shape tiles of the fp8 Gluon path (``triton_gluon_fp8_launch.SHAPE_TILES``, session 43): an entry for (E, K, N)
replaces the plan's rules there (each tile where given; tiles a caller passes still win), the GEMMs launch with its
stages and GROUP_M, the result is unchanged (stages, the tile walk's order and the gather's groups a program move no
arithmetic: bit-equal to the rules' tiles under the GEMMs' torch stand-ins, and within e4m3's rounding of a float64
loop); other shapes keep the rules; a bad entry is named."""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import emulation_f64, quantize_weight
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.activations import ActivationSpec
from moekit.experts import triton_gluon_fp8_launch as launch
from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
from moekit.experts.triton_gluon_fp8_launch import Fp8GluonShapeTiles, Fp8GluonTile, plan_gluon_fp8

GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.6, up_shift=1.0)
E, N, K, M, TOP_K = 3, 208, 176, 12, 2
TILES = Fp8GluonShapeTiles(up=Fp8GluonTile(stages=2, group_m=4), down=Fp8GluonTile(stages=6, group_m=16),
                           gather_groups=2)


def test_an_entry_replaces_the_rules_at_its_shape_only(monkeypatch):
    monkeypatch.setattr(launch, "SHAPE_TILES", {(E, K, N): TILES})
    plan = plan_gluon_fp8(M, TOP_K, E, K, inter=N, b2=True)
    assert (plan.up, plan.down, plan.gather_groups) == (TILES.up, TILES.down, 2)
    given = Fp8GluonTile(stages=3, group_m=2)
    assert plan_gluon_fp8(M, TOP_K, E, K, up=given, inter=N).up == given  # a caller's tile still wins
    assert plan_gluon_fp8(M, TOP_K, E, K, inter=N, gather_groups=4).gather_groups == 4
    other = plan_gluon_fp8(M, TOP_K, E, K, inter=N + 16)
    assert (other.up, other.down, other.gather_groups) == (launch.UP_TILE, launch.DOWN_TILE, launch.GATHER_GROUPS)
    assert plan_gluon_fp8(M, TOP_K, E, K).up == launch.UP_TILE  # N not known: no entry
    partial = Fp8GluonShapeTiles(down=Fp8GluonTile(stages=4))
    monkeypatch.setattr(launch, "SHAPE_TILES", {(E, K, N): partial})
    plan = plan_gluon_fp8(M, TOP_K, E, K, inter=N)
    assert (plan.up, plan.down, plan.gather_groups) == (launch.UP_TILE, partial.down, launch.GATHER_GROUPS)


def test_a_bad_entry_is_named(monkeypatch):
    monkeypatch.setattr(launch, "SHAPE_TILES", {(E, K, N): Fp8GluonShapeTiles(gather_groups=3)})
    with pytest.raises(ValueError, match="gather_groups=3"):
        plan_gluon_fp8(M, TOP_K, E, K, inter=N)


def test_the_path_launches_the_entry_and_its_result_is_unchanged(fake_gemms, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).bfloat16()
    q = (*quantize_weight(torch.randn(E, 2 * N, K, generator=g) / K**0.5, (128, 128)),
         *quantize_weight(torch.randn(E, K, N, generator=g) / N**0.5, (128, 128)))
    ids = torch.rand(M, E, generator=g).topk(TOP_K, dim=1).indices.int()
    weights = torch.rand(M, TOP_K, generator=g)
    b13, b2 = torch.randn(E, 2 * N, generator=g).bfloat16(), torch.randn(E, K, generator=g).bfloat16()
    rules = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
    fake_gemms["fp8"].log.clear()
    monkeypatch.setattr(launch, "SHAPE_TILES", {(E, K, N): TILES})
    shaped = experts_gluon_fp8(x, *q, ids, weights, activation=GPT_OSS, b13=b13, b2=b2)
    launched = {bound["GATED"]: (bound["STAGES"], bound["GROUP_M"]) for _, bound, _ in fake_gemms["fp8"].log}
    assert launched == {True: (2, 4), False: (6, 16)}
    assert torch.equal(shaped, rules)
    assert rel_l2(shaped, emulation_f64(x, *q, ids, weights, (128, 128), b13=b13, b2=b2, spec=GPT_OSS)) < 1e-2
