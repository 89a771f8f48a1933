"""Every measured winners row of the weight-only word decode (``triton_wo_word_winners.WORD_WINNERS``) and every
default config is launched through the lean eager path (``triton_quant_fast``), under Triton's interpreter.

A winners row changes the plan (splits, tiles, words ahead, x tile, the folded activation), and the plan decides the
launches the lean path records; a row whose launches the lean path cannot record (or whose entry goes stale on every
call) sends every eager call down the full path, which re-records each time: the merged bench's Qwen3 int4 M = 1
read 79.6 µs of host time a call under session 21's x tile + A2 row against 36.6 under the pick before it. Here each
row is applied to a small shape whose gate-up splits still split (K: one 128-value gate-up step a split; the
down GEMM's N = 64 is one step: its splits do not, the interpreter's time), then three calls of one kind: the first
compiles and keeps its entry, the next two are served by the kept entry (counted), the last with the plain path's
output bit for bit, near a loop over the dequantized weights; the plan the calls ran carries the row's splits
and tiles.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from _helpers import bf16_quantized_pair, bf16_routing, count_calls, quantized_experts_loop, rel_l2

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import clear_config_cache  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.quant import quantize  # noqa: E402

E, N, TOP_K = 16, 64, 2  # M * k <= E up to M = 8: the 1-row blocks of the rows' own cells
STEP = 128  # the rows' gate-up step: 16 words of 8 values; K = STEP x the row's splits, so each split has one
PLAIN = LaunchOptions(lean_launch=False)
TOL = 2e-2  # bf16 x and h against the loop's float32 on the same dequantized weights
winners = importlib.import_module("moekit.experts.triton_wo_word_winners")
plans = importlib.import_module("moekit.experts.triton_wo_plan")


@pytest.fixture
def hits(interpreter, monkeypatch):
    """The quantized fast path's launches (``triton_quant_fast._launch``), counted."""
    from moekit.experts import triton_quant_fast

    seen = count_calls(monkeypatch, {"hits": 0}, [(triton_quant_fast, "_launch", "hits")])
    interpreter.clear_launch_caches()
    yield seen
    clear_config_cache()  # the rows patched in go with the monkeypatch: no plan of theirs stays


def _weights(scheme: str, e: int, n: int, k: int):
    return bf16_quantized_pair(scheme, e, n, k)


def _routing(m: int, e: int, k: int, seed: int):
    return bf16_routing(m, k, e, TOP_K, seed)


def _served_three_times(tri, hits, q13, q2, m: int, e: int, k: int, tol: float = TOL) -> None:
    """Three calls of one kind: the first keeps its entry, the next two are served; the last equal to the plain
    path bit for bit and near the loop (the interpreter's time: one comparison a kind)."""
    for seed in range(3):
        x, ids, weights = _routing(m, e, k, seed)
        got = tri.experts_triton(x, q13, q2, ids, weights)
    assert hits["hits"] == 2, "a repeated call took the full path: the lean path did not keep or serve it"
    assert torch.equal(got, tri.experts_triton(x, q13, q2, ids, weights, options=PLAIN))
    assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights)) < tol


@pytest.mark.parametrize("row", sorted(winners.WORD_WINNERS), ids=lambda r: "-".join(map(str, r)))
def test_every_winners_row_is_served_by_the_lean_path(interpreter, hits, monkeypatch, row):
    scheme, _, _, _, m = row
    pick = winners.WORD_WINNERS[row]
    k = STEP * pick.up_split
    monkeypatch.setitem(plans.DECODE_MEASURED, (scheme, E, N, k), {m: pick.decode})
    monkeypatch.setitem(winners.WORD_WINNERS, (scheme, E, N, k, m), pick)
    clear_config_cache()
    q13, q2 = _weights(scheme, E, N, k)
    _served_three_times(interpreter, hits, q13, q2, m, E, k)
    kept = [plan for plan in plans._WO_PLANS.values() if plan.decode == pick.decode]
    assert kept, "the row's decode never ran"
    for plan in kept:  # the row applied: its splits (capped by the small shape) and its tiles
        assert (plan.config.up_split, plan.config.glu_fold, plan.config.x_tile) == (pick.up_split, pick.fold,
                                                                                     pick.x_tile)
        for spec, tile in ((pick.up_tile, plan.config.up), (pick.down_tile, plan.config.down)):
            if spec is not None:
                assert (tile.BLOCK_N, tile.num_warps, tile.num_stages) == (spec[0], spec[2], 1 + spec[3])
        assert plan.glu_fold == (pick.fold and pick.up_split > 1)


@pytest.mark.parametrize("scheme", ["fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4"])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_every_default_config_is_served_by_the_lean_path(interpreter, hits, scheme, m):
    e, n, k = 4, 32, 128  # no winners row or measured decode here: the defaults' decodes (tile, register, gemv)
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k**-0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n**-0.5).bfloat16()
    extra = dict(block_shape=(32, 32)) if scheme == "fp8_block" else {}
    q13, q2 = quantize(w13, scheme, **extra), quantize(w2, scheme, **extra)
    # the fp8 path quantizes x too: its loop tolerance is fp8's (e4m3 activations)
    _served_three_times(interpreter, hits, q13, q2, m, e, k, 8e-2 if scheme == "fp8_block" else TOL)
