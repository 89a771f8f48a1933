"""moekit.experts.cpu_phased: the unsplit loop in phases (auto's unsplit mode at decode sizes) against
test_cpu_packed's float64 loop, and bit for bit against ``cpu_packed``'s loop (split and unsplit): biases, an expert
map with -1, skipped slots, idle experts, experts packed from 4 rows, BLAS rows, bf16, a gpt-oss activation, M = 0."""

import pytest
import torch

from _helpers import experts_loop
from moekit.activations import ActivationSpec
from moekit.experts.cpu_packed import ExpertParams, PackedWeightCache, experts_cpu_fused
from moekit.experts import cpu_loop, cpu_packed
from moekit.experts.cpu_phased import ExpertRun, expert_runs, experts_cpu_phased, phased_blas_rows
from moekit.experts.cpu_split_choice import SPLIT, UNSPLIT
from test_cpu_packed import rel_err
from test_cpu_workers import E, K, N, SILU, needs_onednn, problem

GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.5, up_shift=1.0)
GPT_OSS_7 = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)  # gpt-oss's own limit


def both(x, w13, w2, ids, weights, spec=SILU, cache=None, blas=False, **kw):
    """(phased, the per-expert loop unsplit, the per-expert loop split over 2 workers) on the same call."""
    ex = ExpertParams(w13, w2, kw.get("b13"), kw.get("b2"), spec)
    em = kw.get("expert_map")
    return (experts_cpu_phased(x, ex, ids, weights, em, cache, blas_plain=blas),
            experts_cpu_fused(x, ex, ids, weights, em, cache, workers=1, blas_plain=blas),
            experts_cpu_fused(x, ex, ids, weights, em, cache, workers=2, blas_plain=blas))


def test_expert_runs_sort_stably_and_drop_what_is_not_here():
    order, runs = expert_runs([3, 1, 6, 1, 3, 0], 6)  # 6: not routed here
    assert order == [5, 1, 3, 0, 4]
    assert runs == [ExpertRun(0, 0, 1), ExpertRun(1, 1, 3), ExpertRun(3, 3, 5)]
    assert expert_runs([2, 2], 2) == ([], [])


@needs_onednn
@pytest.mark.parametrize("m", [1, 3, 7, 40])  # 40: experts of >= 4 rows (packed)
@pytest.mark.parametrize("blas", [False, True])
def test_phased_equals_float64_and_the_per_expert_loop_bit_for_bit(m, blas):
    x, w13, w2, ids, weights = problem(m=m, k=4, seed=m)
    phased, unsplit, split = both(x, w13, w2, ids, weights, cache=PackedWeightCache(budget_bytes=1 << 30), blas=blas)
    assert phased.shape == x.shape and phased.dtype == torch.float32
    assert rel_err(phased, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    assert torch.equal(phased, unsplit) and torch.equal(phased, split)


@needs_onednn
def test_phased_with_biases_expert_map_and_a_transposed_view():
    x, w13, w2, ids, weights = problem(m=6, k=3, seed=3)
    g = torch.Generator().manual_seed(4)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    expert_map = torch.tensor([2, -1, 0, 5, -1, 1])  # global 1 and 4 are not here
    store13 = w13.transpose(1, 2).contiguous()  # transformers' storage, read as a view
    outs = both(x, store13.transpose(1, 2), w2, ids, weights, b13=b13, b2=b2, expert_map=expert_map)
    assert rel_err(outs[0], experts_loop(x, w13, w2, ids, weights, expert_map, b13=b13, b2=b2)) < 1e-5
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_onednn
def test_phased_bf16_and_the_gpt_oss_activation_keep_the_loops_bits():
    x, w13, w2, ids, weights = problem(m=5, k=4, seed=8)
    outs = both(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), ids, weights)
    assert outs[0].dtype == torch.float32
    assert rel_err(outs[0], experts_loop(x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float(), ids,
                                         weights)) < 2e-2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    b2 = torch.randn(E, K, generator=torch.Generator().manual_seed(9))
    outs = both(x, w13, w2, ids, weights, spec=GPT_OSS, b2=b2)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_onednn
def test_phased_handles_no_tokens_and_every_slot_skipped():
    x, w13, w2, ids, weights = problem(m=0)
    assert both(x, w13, w2, ids, weights)[0].shape == (0, K)
    x, w13, w2, ids, weights = problem(m=3, k=2, seed=5)
    ids.fill_(-1)
    assert torch.equal(both(x, w13, w2, ids, weights)[0], torch.zeros(3, K))


def test_phased_blas_rows_follow_the_split_rule_and_native_bf16():
    phased_blas_rows.cache_clear()
    assert phased_blas_rows(torch.float32) == cpu_packed.blas_plain_rows(torch.float32)
    assert phased_blas_rows(torch.bfloat16) == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert not phased_blas_rows(torch.float16) or cpu_packed.blas_plain_rows(torch.float16)


@needs_onednn
@pytest.mark.parametrize("spec", [SILU, GPT_OSS_7])
def test_phased_keeps_the_bits_where_a_whole_row_range_would_vectorise_differently(spec):
    """N = 8, ~6 rows an expert (packed): one expert's activation temporaries are [6, 8], 48 elements (a vector body
    and a scalar tail); all 36 rows at once as one flat range would put the tail elsewhere (exp 1 ulp apart), so
    gpt-oss's activation goes one expert at a time."""
    g = torch.Generator().manual_seed(2)
    n, k_dim, m = 8, 16, 12
    x = torch.randn(m, k_dim, generator=g)
    w13, w2 = torch.randn(E, 2 * n, k_dim, generator=g) * 0.5, torch.randn(E, k_dim, n, generator=g) * 0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(m)])
    b13, b2 = torch.randn(E, 2 * n, generator=g), torch.randn(E, k_dim, generator=g)
    outs = both(x, w13, w2, ids, torch.rand(m, 3, generator=g), spec=spec, b13=b13, b2=b2,
                cache=PackedWeightCache(budget_bytes=1 << 30))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@needs_onednn
@pytest.mark.parametrize("gemv", [False, True])  # one row as mm (no AMX) or as mv (AMX): ``bf16_row_gemv``
@pytest.mark.parametrize("m", [1, 2])  # 1: every expert one row; 2: rows of 1 and 2
def test_phased_bf16_blas_rows_keep_the_split_loops_bits(m, gemv, monkeypatch):
    """bf16 experts of one row on BLAS (auto's phased mode, and the split loop's ``one_row_blas``) run as
    matrix-vector products or as mm: the bits of the split loop's oneDNN linear, and within bf16's rounding of the
    float64 loop."""
    monkeypatch.setattr(cpu_packed, "bf16_row_gemv", lambda: gemv)
    x, w13, w2, ids, weights = problem(m=m, k=4, seed=11 + m)
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    outs = both(x, w13, w2, ids, weights, blas=True)
    assert rel_err(outs[0], experts_loop(x.float(), w13.float(), w2.float(), ids, weights)) < 2e-2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ex = ExpertParams(w13, w2, None, None, SILU)
    for workers in (1, 2):
        one_row = experts_cpu_fused(x, ex, ids, weights, None, None, workers=workers, one_row_blas=True)
        assert torch.equal(one_row, outs[0])


def test_one_bf16_row_is_a_matrix_vector_product_on_amx_cpus_only():
    cpu_packed.bf16_row_gemv.cache_clear()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_packed.bf16_row_gemv() == bool(amx())


@pytest.mark.parametrize("gemv", [False, True])  # one bf16 row as mm (no AMX) or as mv (AMX)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_blas_rows_one_bf16_row_as_a_matrix_vector_product(bias, rows, gemv, monkeypatch):
    """``linear_rows`` on BLAS: one bf16 row (``torch.mv`` / ``addmv`` where ``bf16_row_gemv``, else mm) and several
    (mm), into ``out`` or not, on a row-major weight and a transposed view: within one bf16 rounding of the float64
    product (+ bias)."""
    monkeypatch.setattr(cpu_packed, "bf16_row_gemv", lambda: gemv)
    g = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 64, generator=g).bfloat16()  # [m, in]
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()  # [out, in]
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    want = (a.double() @ w.double().t() + (0 if b is None else b.double())).to(torch.bfloat16)  # [m, out]
    for weight in (w, w.t().contiguous().t()):
        got = cpu_packed.linear_rows(None, a, weight, b)
        out = torch.full((rows, 96), float("nan"), dtype=torch.bfloat16)
        assert cpu_packed.linear_rows(None, a, weight, b, out=out) is out
        assert got.shape == (rows, 96) and torch.equal(got, out)
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -8


class _FixedMode:
    """A stand-in for ``cpu_split_choice``'s chooser that always runs one mode."""

    def __init__(self, mode: str):
        self.mode = mode

    def call(self, key, run):
        return run(self.mode)


def test_one_row_blas_takes_float32_experts_stored_transposed():
    x, w13, w2, _, _ = problem(m=1)
    t13, t2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))  # views of [E, K, R] / [E, N, K]
    transposed = ExpertParams(t13, t2, None, None, SILU)
    assert cpu_loop.stored_transposed(transposed) and cpu_loop.one_row_blas_rows(x, transposed)
    assert not cpu_loop.one_row_blas_rows(x.expand(cpu_loop.ONE_ROW_BLAS_BELOW, -1), transposed)  # decode sizes only
    assert not cpu_loop.stored_transposed(ExpertParams(w13, w2, None, None, SILU))
    assert not cpu_loop.stored_transposed(ExpertParams(t13, w2, None, None, SILU))
    assert not cpu_loop.one_row_blas_rows(x, ExpertParams(t13, w2, None, None, SILU))  # fp32, neither rule
    bf16 = ExpertParams(t13.bfloat16(), t2.bfloat16(), None, None, SILU)
    assert cpu_loop.stored_transposed(bf16) and not cpu_loop.one_row_blas_rows(x.bfloat16(), bf16)
    row_major = ExpertParams(w13.bfloat16(), w2.bfloat16(), None, None, SILU)
    assert cpu_loop.one_row_blas_rows(x.bfloat16(), row_major) == phased_blas_rows(torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("m", [1, 2, 3])  # 2, 3: experts of one and of more rows, skipped slots
def test_auto_runs_float32_experts_stored_transposed_of_one_row_on_blas_in_both_modes(m, monkeypatch):
    """gpt-oss's storage ([E, K, R] / [E, N, K] read as views) in float32, with biases: ``auto``'s split and phased
    modes both send experts of one row through BLAS (``one_row_blas_rows``), the rest through oneDNN: the same bits,
    within float32's rounding of the float64 loop."""
    x, w13, w2, ids, weights = problem(m=m, k=4, seed=20 + m)
    g = torch.Generator().manual_seed(m)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    t13, t2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))
    ex = ExpertParams(t13, t2, b13, b2, SILU)
    blas, calls = cpu_packed._blas_rows, []
    monkeypatch.setattr(cpu_packed, "_blas_rows", lambda *a: calls.append(a[0].shape[0]) or blas(*a))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the chooser's path
    try:
        outs = []
        for mode in (SPLIT, UNSPLIT):
            monkeypatch.setattr(cpu_loop, "split_chooser", lambda: _FixedMode(mode))
            calls.clear()
            outs.append(cpu_loop.run_cpu_loop(x, ex, ids, weights, None, None, auto=True, split=True))
            assert 1 in calls and (cpu_packed.blas_plain_rows(torch.float32) or set(calls) == {1})
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], experts_loop(x, t13, t2, ids, weights, b13=b13, b2=b2)) < 1e-5
