"""The bound kernel's work split and arithmetic (``benchmarks/ovl_plan.py``; the Gluon kernel itself runs only on the
H200: ``ovl_device_check.py`` checks it there against ``ovl_twin``): every weight byte in exactly one box of exactly
one program, the programs within one box of each other, the MMAs the cell's real rows' FLOPs, and the twin against a
float64 loop written here over the same boxes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ovl_plan as op  # noqa: E402


def small_plan(programs: int = 5, block_w: int = 128, block_k: int = 64, tn: int = 16, rows: int = 96) -> op.OvlPlan:
    return op.plan_for(experts=3, n=128, k=192, rows=rows, block_w=block_w, block_k=block_k, tn=tn, programs=programs)


@pytest.mark.parametrize("programs", [1, 4, 7, 13])
@pytest.mark.parametrize("block_w,block_k", [(64, 64), (128, 64), (128, 128)])
def test_every_weight_element_read_once(programs, block_w, block_k):
    plan = op.plan_for(3, 256, 384, 48, block_w, block_k, 16, programs)
    seen13 = torch.zeros(3 * 2 * 256, 384, dtype=torch.int32)  # [E·2N, K]
    seen2 = torch.zeros(3 * 384, 256, dtype=torch.int32)  # [E·K, N]
    sizes = []
    for p in range(programs):
        lo, hi = plan.span(p)
        sizes.append(hi - lo)
        for b in range(lo, hi):
            which, row, col = plan.box(b)
            (seen13, seen2)[which][row:row + block_w, col:col + block_k] += 1
    assert torch.all(seen13 == 1) and torch.all(seen2 == 1)
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == plan.boxes
    assert plan.weight_bytes(2) == 3 * 3 * 256 * 384 * 2


@pytest.mark.parametrize("rows,tokens,tn,nchunk", [(96, 32, 32, 1), (100, 40, 40, 1), (3 * 512, 512, 256, 2),
                                                   (3 * 1024, 1024, 128, 8)])
def test_tokens_rounded_to_the_mma_and_flops_exact(rows, tokens, tn, nchunk):
    plan = op.plan_for(3, 128, 256, rows, 128, 64, 256 if tn == 256 or nchunk == 1 else tn, 4)
    assert (plan.tokens, plan.tn, plan.nchunk) == (tokens, tn, nchunk)
    assert plan.flops() == 2 * 3 * tokens * 3 * 128 * 256  # 6·N·K a row, T rows an expert, E experts


def test_bad_shapes_refused():
    with pytest.raises(ValueError):
        op.OvlPlan(2, 96, 128, 32, 128, 64, 32, 4)  # 2N = 192 not a multiple of 128
    with pytest.raises(ValueError):
        op.OvlPlan(2, 128, 128, 40, 128, 64, 16, 4)  # 40 tokens are not 16-chunks


def reference_loop(plan: op.OvlPlan, w13, w2, a, promote: bool) -> torch.Tensor:
    """float64: per program, per box in order, per chunk, per consumer row, per token: the dot product."""
    views = (w13.double(), w2.double())
    ad = a.double()
    out = torch.zeros(plan.programs, plan.block_w, plan.tn, dtype=torch.float64)
    for p in range(plan.programs):
        lo, hi = plan.span(p)
        for i in range(hi - lo):
            which, row, col = plan.box(lo + i)
            w = views[which][row:row + plan.block_w, col:col + plan.block_k]
            for c in range(plan.nchunk):  # chunk c multiplies resident tile c mod 2
                for t in range(plan.tn):
                    s = (1 + (t % 8) / 16) * (1 + (i % 4) / 8) if promote else 1.0
                    out[p, :, t] += (w * ad[c % 2 * plan.tn + t][None, :]).sum(1) * s
    return out.view(plan.programs, plan.consumers, 64, plan.tn)


@pytest.mark.parametrize("dtype,promote", [(torch.bfloat16, False), (torch.float8_e4m3fn, False),
                                           (torch.float8_e4m3fn, True)])
@pytest.mark.parametrize("block_w,tn,rows", [(128, 16, 96), (64, 8, 48), (128, 16, 3 * 64), (64, 8, 3 * 32)])
def test_twin_against_float64_loop(dtype, promote, block_w, tn, rows):
    block_k = 128 if promote else 64
    plan = op.plan_for(3, 128, 256, rows, block_w, block_k, tn, 3)
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(3 * 256, 256, generator=g).to(dtype)  # [E·2N, K]
    w2 = torch.randn(3 * 256, 128, generator=g).to(dtype)  # [E·K, N]
    a = torch.randn(plan.resident_rows, block_k, generator=g).to(dtype)  # [TN or 2·TN, BK]
    got = op.ovl_twin(plan, w13, w2, a, promote).double()
    want = reference_loop(plan, w13, w2, a, promote)
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    some = op.ovl_twin(plan, w13, w2, a, promote, programs=[2, 0])
    assert torch.equal(some, op.ovl_twin(plan, w13, w2, a, promote)[[2, 0]])


@pytest.mark.parametrize("promote", [False, True])
def test_ring_twin_against_float64_loop(promote):
    plan = op.plan_for(2, 128, 256, 64, 128, 128, 16, 3)  # T 32 = 2 chunks of 16
    stages = 3
    g = torch.Generator().manual_seed(2)
    w13 = torch.randn(2 * 256, 256, generator=g)
    a = torch.randn(plan.resident_rows, 128, generator=g)
    want = torch.zeros(3, 2, 64, plan.tn, dtype=torch.float64)
    for p in range(3):
        lo, hi = plan.span(p)
        for i in range(hi - lo):
            s = i % stages
            for c in range(2):
                w = w13[(s * 2 + c) * 64:(s * 2 + c + 1) * 64, :128].double()
                for k in range(plan.nchunk):
                    prod = w @ a[k % 2 * plan.tn:(k % 2 + 1) * plan.tn].double().t()  # [64, TN]
                    if promote:
                        prod = prod * (1 + (torch.arange(plan.tn) % 8).double() / 16)[None, :] * (1 + (i % 4) / 8)
                    want[p, c] += prod
    got = op.ring_twin(plan, w13, a, stages, promote, [0, 1, 2]).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
