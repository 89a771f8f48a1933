"""Which kept-call lookups a repeated ``triton`` backend call makes (``triton._run_kept``), on the CPU: the
alignment, gather and combine kernels under Triton's interpreter, the Gluon GEMMs as torch stand-ins
(``_gluon_fakes``). One lookup where one can hit: a call the Gluon path took is served from its entry without a
Triton-path lookup first; a call below the Gluon choice's sizes never looks the Gluon entries up; a call the choice
wants that the Gluon path could not take (an unfit shape) is served by the Triton path's entry after the Gluon
miss. Every output equals the path's own plain launch (bit for bit).
"""

from __future__ import annotations

import pytest
import torch

from _fp8_cases import block_experts
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)

E = 4


@pytest.fixture
def lookups(monkeypatch):
    """Counts the fast-path lookups (``triton_fast.run_fast``, by every module that calls it) and the hits."""
    import moekit.experts.triton as tri
    import moekit.experts.triton_fast as fast
    import moekit.experts.triton_gluon_lean as lean

    seen = {"lookups": 0, "hits": 0}
    real = fast.run_fast

    def counted(*args, **kwargs):
        seen["lookups"] += 1
        out = real(*args, **kwargs)
        seen["hits"] += out is not None
        return out

    for module in (tri, lean):
        monkeypatch.setattr(module, "run_fast", counted)
    return seen


def _bf16(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * n, k, generator=g) * k**-0.5).bfloat16()
    w2 = (torch.randn(E, k, n, generator=g) * n**-0.5).bfloat16()
    ids = torch.rand(m, E, generator=g).topk(2, dim=1).indices.int()
    return x, w13, w2, ids, torch.softmax(torch.rand(m, 2, generator=g), dim=1)


def _repeat(call, lookups, times: int = 3) -> tuple[list, int, int]:
    """``call`` three times (the first compiles, the second records and keeps): outputs, then the lookups and hits
    of the last call alone."""
    outs = [call() for _ in range(times - 1)]
    before = dict(lookups)
    outs.append(call())
    return outs, lookups["lookups"] - before["lookups"], lookups["hits"] - before["hits"]


def test_bf16_gluon_call_one_lookup_and_below_the_choice_no_gluon_lookup(fake_gemms, lookups, monkeypatch):
    import moekit.experts.triton_gluon as tg
    from moekit.experts.triton import experts_triton_unchecked

    x, w13, w2, ids, weights = _bf16(40, 128, 128)
    monkeypatch.setattr(tg, "DEFAULT_CHOICE", tg.GluonChoice(min_tokens=40, min_tokens_wide=40))
    outs, count, hits = _repeat(lambda: experts_triton_unchecked(x, w13, w2, ids, weights), lookups)
    plain = tg.experts_gluon(x, w13, w2, ids, weights, lean=False)
    assert all(torch.equal(out, plain) for out in outs)
    assert (count, hits) == (1, 1)  # the Gluon entry, no Triton lookup before it
    small = [t[:39] for t in (x, ids, weights)]  # below the choice: the fused kernels, the Triton entry only
    outs, count, hits = _repeat(lambda: experts_triton_unchecked(small[0], w13, w2, small[1], small[2]), lookups)
    assert (count, hits) == (1, 1) and all(torch.equal(out, outs[0]) for out in outs)


def test_a_call_the_gluon_path_cannot_take_is_served_after_the_gluon_miss(fake_gemms, lookups, monkeypatch):
    import moekit.experts.triton_gluon as tg
    from moekit.experts.triton import experts_triton_unchecked

    x, w13, w2, ids, weights = _bf16(40, 96, 128)  # N = 96: not a multiple of 128, the Gluon path's unfit
    assert tg.gluon_unfit(x, w13, w2) is not None
    monkeypatch.setattr(tg, "DEFAULT_CHOICE", tg.GluonChoice(min_tokens=1, min_tokens_wide=1))
    outs, count, hits = _repeat(lambda: experts_triton_unchecked(x, w13, w2, ids, weights), lookups)
    assert (count, hits) == (2, 1)  # the Gluon miss, then the Triton entry
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_fp8_gluon_call_one_lookup(fake_gemms, lookups, monkeypatch):
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts.triton import experts_triton_unchecked
    from moekit.quant.fp8_block import Fp8BlockWeight

    g = torch.Generator().manual_seed(0)
    m, n, k = 16, 128, 256
    x = torch.randn(m, k, generator=g).bfloat16()
    q13_q, q13_s, q2_q, q2_s = block_experts(g, E, n, k)
    ids = torch.rand(m, E, generator=g).topk(2, dim=1).indices.int()
    weights = torch.rand(m, 2, generator=g)
    w13 = Fp8BlockWeight(q=q13_q, scale=q13_s, dtype=torch.bfloat16)
    w2 = Fp8BlockWeight(q=q2_q, scale=q2_s, dtype=torch.bfloat16)
    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", tgf.Fp8GluonChoice(min_flops=1, min_rows_per_expert=0))
    outs, count, hits = _repeat(lambda: experts_triton_unchecked(x, w13, w2, ids, weights), lookups)
    plain = tgf.experts_gluon_fp8(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, lean=False)
    assert all(torch.equal(out, plain) for out in outs)
    assert (count, hits) == (1, 1)  # no quantized Triton-path lookup (``run_quant_fast``) before it


def test_weight_only_call_at_a_gluon_size_one_lookup(lookups, monkeypatch):
    """A weight-only call where the bf16 Gluon choice wants the size: the Triton entry only (that path keeps no
    weight-only call), served equal to the plain launch."""
    import moekit.experts.triton_gluon as tg
    from moekit.experts.triton import experts_triton_unchecked
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.quant import quantize

    x, w13, w2, ids, weights = _bf16(8, 64, 128)
    q13, q2 = quantize(w13, "int8_w8a16"), quantize(w2, "int8_w8a16")
    monkeypatch.setattr(tg, "DEFAULT_CHOICE", tg.GluonChoice(min_tokens=1, min_tokens_wide=1))
    outs, count, hits = _repeat(lambda: experts_triton_unchecked(x, q13, q2, ids, weights), lookups)
    plain = experts_triton_unchecked(x, q13, q2, ids, weights, options=LaunchOptions(lean_launch=False))
    assert all(torch.equal(out, plain) for out in outs)
    assert (count, hits) == (1, 1)
