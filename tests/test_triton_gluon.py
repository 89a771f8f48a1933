"""The Gluon contiguous-layout path on the CPU: its plan, layout, combine kernel (interpreted), torch twin,
chooser and fallback. The Gluon GEMMs themselves need a Hopper GPU (they cannot run in the interpreter):
``benchmarks/gluon_device_check.py`` checks them against the twin at the real shapes."""

from __future__ import annotations

import importlib

import pytest
import torch

from _helpers import experts_loop
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.experts import backend_names, get_backend
from moekit.experts.triton_gluon import (
    GluonChoice, experts_gluon, experts_gluon_twin, experts_triton_gluon, gluon_layout, gluon_unfit,
)
from moekit.experts.triton_gluon_launch import (
    BLOCK_M, DOWN_TILE, NARROW_DOWN_TILE, UP_TILE, gluon_importable, gluon_supported,
    SUM_TILE, SumTile, launch_contiguous_sum, plan_gluon,
)
from moekit.layouts.block_aligned import align_block

E, N, K = 4, 128, 128  # the smallest N and K the Gluon path takes


def _weights(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dtype)
    return w13, w2


def _routing(m, k, seed=1, num_experts=E):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(m, num_experts, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return ids, weights


def test_combine_kernel_matches_a_float64_loop_at_every_tile():
    """Tiles past the tokens and columns (masked edges), the default; all equal bit for bit (the same sums)."""
    g = torch.Generator().manual_seed(3)
    m, k, rows = 37, 3, 160
    y = torch.randn(rows, 96, generator=g).bfloat16()
    dst = torch.randperm(rows, generator=g)[: m * k].view(m, k).int()
    dst[1, 2] = -1  # not routed here: never read
    dst[4, 0] = -1
    weights = torch.rand(m, k, generator=g)
    ref = torch.zeros(m, 96, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            if dst[t, j] >= 0:
                ref[t] += float(weights[t, j]) * y[int(dst[t, j])].double()
    outs = []
    for tile in (SumTile(4, 64, 4), SumTile(32, 128, 4), SumTile(16, 256, 4), SumTile(8, 32, 2), SUM_TILE):
        out = torch.empty(m, 96, dtype=torch.bfloat16)
        launch_contiguous_sum(y, dst, weights, out, tile)
        outs.append(out)
    torch.testing.assert_close(outs[0].double(), ref, rtol=1e-2, atol=1e-2)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("field", ["block_t", "block_k", "num_warps"])
def test_sum_tile_fields_are_powers_of_two(field):
    with pytest.raises(ValueError, match=field):
        SumTile(**{field: 24})


def test_layout_groups_rows_by_expert_in_aligned_blocks():
    """gluon_layout with the torch alignment; its gather kernel interpreted."""
    m, k = 37, 2
    ids, _ = _routing(m, k)
    ids[3, 1] = -1  # dropped: no row
    x = torch.randn(m, K).bfloat16()
    lay = gluon_layout(x, ids, E, align=align_block)
    used = int(lay.rows_used)
    assert used % BLOCK_M == 0
    seen = set()
    for t in range(m):
        for j in range(k):
            r = int(lay.src_to_dst[t, j])
            if int(ids[t, j]) < 0:
                assert r == -1
                continue
            assert 0 <= r < used and r not in seen
            seen.add(r)
            assert torch.equal(lay.x_perm[r], x[t])
            assert int(lay.block_experts[r // BLOCK_M]) == int(ids[t, j])
    assert len(seen) == m * k - 1  # every routed assignment has its row


def test_twin_matches_a_float64_loop():
    w13, w2 = _weights()
    ids, weights = _routing(24, 2)
    ids[0, 0] = 9  # >= E: skipped
    x = torch.randn(24, K).bfloat16()
    out = experts_gluon_twin(x, w13, w2, ids, weights)
    ref = experts_loop(x, w13, w2, ids, weights)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_expert_map_reaches_the_layout():
    w13, w2 = _weights()
    ids, weights = _routing(16, 2, num_experts=2 * E)
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32)  # odd global experts live elsewhere
    x = torch.randn(16, K).bfloat16()
    out = experts_gluon_twin(x, w13, w2, ids, weights, expert_map=emap)
    local = torch.where(emap[ids.long()] >= 0, emap[ids.long()], -1)
    ref = experts_loop(x, w13, w2, local, weights)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("case, reason", [
    ("fp32", "dtype"), ("gelu", "activation"), ("bias", "biases"), ("strided", "strided"),
    ("narrow", "multiples of 128"),
])
def test_unfit_calls_name_their_reason(case, reason):
    w13, w2 = _weights(torch.float32 if case == "fp32" else torch.bfloat16)
    x = torch.randn(4, K, dtype=w13.dtype)
    kwargs = {"activation": "gelu" if case == "gelu" else "silu"}
    if case == "bias":
        kwargs["b2"] = torch.zeros(E, K, dtype=x.dtype)
    if case == "strided":
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    if case == "narrow":
        w13, w2 = w13[:, :192].contiguous(), w2[:, :, :96].contiguous()  # N = 96
    assert reason in gluon_unfit(x, w13, w2, **kwargs)
    assert gluon_unfit(x.bfloat16(), *_weights()) is None


def test_choice_follows_the_measured_cells():
    choice = GluonChoice()
    assert choice.wants(4096, 768)  # Qwen3 M=4096: 1.115x (8 of 9 rounds), 1.108x (6 of 7)
    assert choice.wants(6144, 768) and choice.wants(4096, 1024)
    # Qwen3 M=2048 / 3072 with the gather in the gate-up GEMM's loader: 1.108x (6 of 7) and 1.119x (8 of 9) / 1.130x
    # (8 of 9) against the fused kernels
    assert choice.wants(2048, 768) and choice.wants(3072, 768)
    assert not choice.wants(1024, 768)  # 1.030x, >= 3% in 3 of 9
    assert not choice.wants(4096, 2048)  # M=4096: DeepSeek-V3 1.04x in 4 of 9 rounds, 1.036x in 4 of 7
    assert not choice.wants(4096, 1536)  # not measured: wider than Qwen3's narrow experts
    assert choice.wants(8192, 768) and choice.wants(8192, 2048)  # Qwen3 1.12x, DeepSeek-V3 1.08x, 8 of 9 rounds
    assert choice.wants(16384, 768)
    assert choice.wants(4096, 14336)  # Mixtral: 1.12x
    assert choice.wants(1024, 14336)  # Mixtral M=1024: 1.24x
    assert not choice.wants(2048, 2048)  # DeepSeek-V3 0.98x
    assert not choice.wants(2047, 768)
    assert choice.wants(512, 14336)  # Mixtral M=512: 1.11x
    assert not choice.wants(256, 14336)  # not measured below 512: the fused kernels
    assert not choice.wants(512, 768) and not choice.wants(1024, 2048)  # Qwen3 0.84x, DeepSeek-V3 0.80x


def test_tiles_fit_shared_memory():
    """Each stage holds a [128, BK] bf16 activation tile and the weight tiles ([BN, BK]: gate and up for
    the gate-up GEMM, one for the down GEMM); the epilogue stages a [128, BN] output tile. sm_90 gives one
    program at most 227 KB (232448 bytes) of dynamic shared memory."""
    def smem(tile, weight_tiles):
        return tile.stages * (128 + weight_tiles * tile.block_n) * tile.block_k * 2 + 128 * tile.block_n * 2

    assert smem(UP_TILE, 2) <= 232448
    assert smem(DOWN_TILE, 1) <= 232448
    assert smem(NARROW_DOWN_TILE, 1) <= 232448


def test_plan_rows_hold_any_routing_and_narrow_experts_get_their_down_tile():
    plan = plan_gluon(num_tokens=100, top_k=8, num_experts=128, inter=768)
    assert plan.rows == 800 + 128 * (BLOCK_M - 1)  # every expert may leave a partial block
    assert plan.down == NARROW_DOWN_TILE and plan.up == UP_TILE
    assert plan_gluon(100, 2, 8, 14336).down == DOWN_TILE


def test_cpu_falls_back_to_the_triton_kernels():
    assert not gluon_supported("cpu")
    w13, w2 = _weights()
    ids, weights = _routing(20, 2)
    x = torch.randn(20, K).bfloat16()
    everywhere = GluonChoice(min_tokens=1, min_tokens_wide=1)
    out = experts_triton_gluon(x, w13, w2, ids, weights, choice=everywhere)
    triton = get_backend("triton")(x, w13, w2, ids, weights)
    assert torch.equal(out, triton)
    with pytest.raises(RuntimeError, match="Hopper"):
        experts_gluon(x, w13, w2, ids, weights)


def test_calls_that_need_autograd_take_the_triton_kernels(monkeypatch):
    """Where the Gluon path could run, a call whose output needs a backward still goes to the Triton
    kernels (their custom op has one; the Gluon launches do not)."""
    import moekit.experts.triton_gluon as tg

    taken = []
    monkeypatch.setattr(tg, "gluon_supported", lambda device: True)
    monkeypatch.setattr(tg, "launch_gluon",
                        lambda x, *args, **kwargs: taken.append(x.shape[0]) or torch.zeros_like(x))
    w13, w2 = _weights()
    ids, weights = _routing(20, 2)
    x = torch.randn(20, K).bfloat16()
    everywhere = GluonChoice(min_tokens=1, min_tokens_wide=1)
    tg.experts_triton_gluon(x, w13, w2, ids, weights, choice=everywhere)
    assert taken == [20]  # no autograd: the (stubbed) Gluon path
    for grad in ("x", "w13", "routed weights"):
        args = [t.detach().clone() for t in (x, w13, w2, ids, weights)]
        args[{"x": 0, "w13": 1, "routed weights": 4}[grad]].requires_grad_(True)
        out = tg.experts_triton_gluon(*args, choice=everywhere)
        assert out.requires_grad and taken == [20], grad
    with torch.no_grad():
        tg.experts_triton_gluon(x, w13.requires_grad_(True), w2, ids, weights, choice=everywhere)
    assert taken == [20, 20]  # no grad mode: nothing to differentiate


def test_backend_is_registered():
    assert "triton_gluon" in backend_names()
    assert get_backend("triton_gluon") is experts_triton_gluon


def test_importable_needs_a_tma_copy_under_either_name(monkeypatch):
    tma = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper").tma
    gluon_importable.cache_clear()
    assert gluon_importable()  # this Triton has the pieces (3.9 here; the device's 3.6 spells TMA differently)
    for name in ("async_load", "async_copy_global_to_shared"):
        if hasattr(tma, name):
            monkeypatch.delattr(tma, name)
    gluon_importable.cache_clear()
    try:
        assert not gluon_importable()
    finally:
        monkeypatch.undo()
        gluon_importable.cache_clear()
