"""The one-launch Gluon decode kernel's schedule and torch twin (``moekit.experts.triton_gluon_decode``).

Gluon does not run in the interpreter, so the kernel itself is checked on the H200 (``benchmarks/m1_device_check.py``
against ``experts_reference``); here: the tile schedule the kernel walks (every tile once, every program's gate-up
tiles before its down tiles, the ring steps its two partitions agree on, shared memory) and the twin that follows
it, against a float64 loop written here.
"""

from __future__ import annotations

import pytest
import torch

import moekit.experts.triton_gluon_decode as decode
from moekit.experts.triton_gluon_decode import BM, SHARED_BYTES, DecodeChoice, decode_twin, decode_unfit, plan_decode


def _loop(x, w13, w2, ids, wts):
    """float64: h rounded to x's dtype as the kernel stores it; out = sum over slots in order."""
    m, k = ids.shape
    e_count, hidden, inter = w2.shape
    out = torch.zeros(m, hidden, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if e >= e_count:
                continue  # EP skip marker: contributes nothing
            g = w13[e, :inter].double() @ x[t].double()
            u = w13[e, inter:].double() @ x[t].double()
            h = (g * torch.sigmoid(g) * u).to(x.dtype).double()
            out[t] += float(wts[t, j]) * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("m,k,programs,split", [(1, 8, 132, 1), (2, 8, 132, 1), (1, 4, 5, 2), (3, 2, 7, 4),
                                                (1, 8, 132, 4)])
def test_schedule_covers_every_tile_once_gate_up_first(m, k, programs, split):
    plan = plan_decode(m, k, 768, 2048, programs, split=split)
    seen = []
    for p in range(plan.grid):
        tiles = plan.program_tiles(p)
        kinds = [up for up, _, _, _ in tiles]
        assert kinds == sorted(kinds, reverse=True)  # gate-up tiles, then down tiles: waits never form a cycle
        seen += tiles
    expect = [(True, s, b, q) for s in range(m * k) for b in range(768 // BM) for q in range(split)]
    expect += [(False, s, b, 0) for s in range(m * k) for b in range(2048 // BM)]
    assert sorted(seen) == sorted(expect)
    assert plan.grid == min(programs, len(expect))
    steps = sum(plan.ring_steps(p) for p in range(plan.grid))
    assert steps == m * k * (768 * 2 * 2048 // (2 * BM * plan.block_k) + 2048 * 768 // (2 * BM * plan.block_k))


def test_plan_fills_shared_memory_and_refuses_what_does_not_fit():
    plan = plan_decode(1, 8, 768, 2048, 132)
    assert plan.stages == 5 and plan.shared_bytes() <= SHARED_BYTES
    assert plan_decode(1, 8, 768, 2048, 132, block_k=64).stages == 11
    with pytest.raises(ValueError, match="stages=6"):
        plan_decode(1, 8, 768, 2048, 132, stages=6)
    with pytest.raises(ValueError, match="M\\*k <= 16"):
        plan_decode(3, 8, 768, 2048, 132)
    with pytest.raises(ValueError, match="split=3"):
        plan_decode(1, 8, 768, 2048, 132, split=3)
    with pytest.raises(ValueError, match="N=640"):
        plan_decode(1, 8, 640, 2048, 132)


def test_unfit_names_the_reason():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(4, 512, 256, dtype=torch.bfloat16), torch.zeros(4, 256, 256, dtype=torch.bfloat16)
    ids = torch.zeros(1, 8, dtype=torch.int32)
    assert decode_unfit(x, w13, w2, ids) is None
    assert "slots" in decode_unfit(x.expand(3, 256).contiguous(), w13, w2, torch.zeros(3, 8, dtype=torch.int32))
    assert "dtypes" in decode_unfit(x.float(), w13, w2, ids)
    assert "biases" in decode_unfit(x, w13, w2, ids, b2=torch.zeros(4, 256))
    assert "N=128" in decode_unfit(x, w13[:, :256].contiguous(), w2[:, :, :128].contiguous(), ids)


@pytest.mark.parametrize("m,k,skip,split", [(1, 8, False, 1), (2, 4, True, 2), (1, 8, False, 4)])
def test_twin_matches_float64_loop(m, k, skip, split):
    torch.manual_seed(m * 10 + k)
    e_count, inter, hidden = 6, 256, 512
    x = torch.randn(m, hidden).bfloat16()
    w13 = (torch.randn(e_count, 2 * inter, hidden) / hidden ** 0.5).bfloat16()
    w2 = (torch.randn(e_count, hidden, inter) / inter ** 0.5).bfloat16()
    ids = torch.randint(0, e_count, (m, k), dtype=torch.int32)
    wts = torch.rand(m, k)
    if skip:
        ids[0, 1] = e_count  # transformers' EP skip marker (weight 0 by contract; any weight is ignored here)
    out = decode_twin(x, w13, w2, ids, wts, plan_decode(m, k, inter, hidden, 5, split=split))
    ref = _loop(x, w13, w2, ids, wts)
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_route_takes_only_what_it_can_run(monkeypatch):
    """The backend's decode route: off by default's choice when max_slots is 0; on, it still leaves CPU tensors,
    other options, quantized weights and too many slots to the Triton path (None), and the backend's result is the
    reference's."""
    from moekit.experts.reference import experts_reference
    from moekit.experts.triton import experts_triton

    x = torch.randn(1, 256, dtype=torch.bfloat16)
    w13 = (torch.randn(4, 512, 256) / 16).bfloat16()
    w2 = (torch.randn(4, 256, 256) / 16).bfloat16()
    ids, wts = torch.tensor([[0, 3]], dtype=torch.int32), torch.tensor([[0.6, 0.4]])
    assert decode.route(True, x, w13, w2, ids, wts, "silu", True) is None  # off by default
    monkeypatch.setattr(decode, "DEFAULT_DECODE", DecodeChoice(max_slots=16, fp8_max_slots=16))
    assert decode.route(True, x, w13, w2, ids, wts, "silu", True) is None  # CPU
    assert decode.route(False, x, w13, w2, ids, wts, "silu", True) is None
    assert decode.route(True, x, object(), w2, ids, wts, "silu", True) is None
    out = experts_triton(x, w13, w2, ids, wts)
    ref = experts_reference(x, w13, w2, ids, wts)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
