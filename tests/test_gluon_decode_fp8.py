"""The one-launch Gluon decode kernel on fp8_block weights: its torch twin (``decode_fp8_twin``, along the kernel's
tile schedule) against DeepSeek-V3's recipe as a float64 loop written here, and its fit checks. The kernel itself
runs on the H200 only (Gluon has no interpreter): ``benchmarks/m1_device_check.py`` checks it against
``experts_fp8_block_reference``."""

from __future__ import annotations

import pytest
import torch

from moekit.experts.triton_gluon_decode import plan_decode
from moekit.experts.triton_gluon_decode_fp8 import decode_fp8_twin, decode_fp8_unfit
from moekit.quant import quantize


def _quant_rows(v: torch.Tensor) -> torch.Tensor:
    """float64 [R, C] -> what the fp8 GEMM sees: per row per 128 columns, s = amax / 448 (1 if 0), e4m3(v / s) * s."""
    r, c = v.shape
    blocks = v.view(r, c // 128, 128)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * s).view(r, c)


def _deq(w) -> torch.Tensor:
    """float64 [E, R, C] = q * scale per 128 x 128 block."""
    e, r, c = w.q.shape
    return w.q.double() * w.scale.double().repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :r, :c]


def _recipe(x, w13, w2, ids, wts):
    m, k = ids.shape
    e_count, hidden, inter = w2.shape
    xq = _quant_rows(x.double())
    d13, d2 = _deq(w13), _deq(w2)
    out = torch.zeros(m, hidden, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if e >= e_count:
                continue
            g, u = d13[e, :inter] @ xq[t], d13[e, inter:] @ xq[t]
            h = _quant_rows((g * torch.sigmoid(g) * u).view(1, -1))[0]
            out[t] += float(wts[t, j]) * (d2[e] @ h)
    return out


@pytest.mark.parametrize("m,k,split", [(1, 8, 1), (2, 4, 2), (1, 4, 4)])
def test_fp8_twin_matches_the_recipe(m, k, split):
    torch.manual_seed(m * 7 + k)
    e_count, inter, hidden = 5, 256, 512
    x = torch.randn(m, hidden).bfloat16()
    w13 = quantize((torch.randn(e_count, 2 * inter, hidden) / hidden ** 0.5), "fp8_block")
    w2 = quantize((torch.randn(e_count, hidden, inter) / inter ** 0.5), "fp8_block")
    ids = torch.randint(0, e_count, (m, k), dtype=torch.int32)
    wts = torch.rand(m, k)
    out = decode_fp8_twin(x, w13, w2, ids, wts, plan_decode(m, k, inter, hidden, 7, split=split, fp8=True))
    ref = _recipe(x, w13, w2, ids, wts)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_fp8_unfit_and_plan():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    w13 = quantize(torch.randn(2, 512, 256), "fp8_block")
    w2 = quantize(torch.randn(2, 256, 256), "fp8_block")
    ids = torch.zeros(1, 8, dtype=torch.int32)
    assert decode_fp8_unfit(x, w13, w2, ids) is None
    assert "fp8_block" in decode_fp8_unfit(x, w13.dequantize(), w2, ids)
    assert "slots" in decode_fp8_unfit(x, w13, w2, torch.zeros(3, 8, dtype=torch.int32))
    plan = plan_decode(1, 8, 768, 2048, 132, fp8=True)
    assert plan.stages == 12 and plan.shared_bytes() <= 227 * 1024
    with pytest.raises(ValueError, match="block_k=64"):
        plan_decode(1, 8, 768, 2048, 132, block_k=64, fp8=True)
