"""moekit.experts.cpu_packed: the fused per-expert CPU loop on packed oneDNN weights against the plain
path and a float64 loop written here; the packed-weight cache's invalidation (new tensor, in-place
update, replaced data, other dtype, another batch hint), its budget, and its release with the weights."""

import gc
import weakref

import pytest
import torch

from _helpers import experts_loop
from moekit.activations import ActivationSpec
from moekit.experts import cpu_loop, cpu_packed
from moekit.experts.cpu_packed import PACKED_MIN_ROWS, ExpertParams, PackedWeightCache, experts_cpu_fused
from moekit.experts.grouped_mm import experts_grouped_mm

E, N, K = 4, 16, 32
SILU = ActivationSpec("silu")

pytestmark = pytest.mark.skipif(not cpu_packed.packing_supported(torch.float32),
                                reason="this torch build has no oneDNN weight packing")


def rel_err(got, want):
    assert not got.isnan().any()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def problem(m=40, k=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).int()
    ids[1::7, 0] = -1  # skipped slots
    ids[2::9, -1] = E + 1
    return x, w13, w2, ids, torch.rand(m, k, generator=g).to(dtype)


def run(cache, x, w13, w2, ids, weights, **kw):
    ex = ExpertParams(w13, w2, kw.get("b13"), kw.get("b2"), SILU)
    return experts_cpu_fused(x, ex, ids, weights, kw.get("expert_map"), cache)


def test_packed_equals_plain_path_and_float64_loop():
    x, w13, w2, ids, weights = problem()
    cache = PackedWeightCache(budget_bytes=1 << 30)
    got = run(cache, x, w13, w2, ids, weights)
    assert cache.used_bytes() == (w13.numel() + w2.numel()) * 4  # every expert has >= PACKED_MIN_ROWS rows
    assert cache.weight(w13, 0).is_mkldnn
    plain = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_loop")
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    assert rel_err(got, plain.double()) < 1e-5


def test_packed_with_biases_transposed_views_and_expert_map():
    x, w13, w2, ids, weights = problem(seed=1)
    g = torch.Generator().manual_seed(9)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    store13, store2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # transformers' storage
    expert_map = torch.tensor([2, -1, 0, 3, 1, -1])  # 6 global ids onto 4 local experts
    ids = torch.randint(0, 6, ids.shape, generator=g).int()
    cache = PackedWeightCache(budget_bytes=1 << 30)
    got = run(cache, x, store13.transpose(1, 2), store2.transpose(1, 2), ids, weights, b13=b13, b2=b2,
              expert_map=expert_map)
    assert cache.used_bytes() > 0
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, expert_map, b13=b13, b2=b2)) < 1e-5


def test_view_per_call_hits_the_entry_of_its_storage():
    x, w13, w2, ids, weights = problem(seed=2)
    store13 = w13.transpose(1, 2).contiguous()
    cache = PackedWeightCache(budget_bytes=1 << 30)
    first = cache.weight(store13.transpose(1, 2), 1)
    assert cache.weight(store13.transpose(1, 2), 1) is first  # a new view object, the same storage: a hit
    got = cpu_packed.onednn_linear(torch.float32)(x, first, None, "none", [], "")  # [m, 2N]
    assert rel_err(got, x.double() @ w13[1].double().t()) < 1e-6


def test_rows_below_the_threshold_and_budget_keep_plain_weights():
    x, w13, w2, ids, weights = problem(m=1, k=2, seed=3)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    run(cache, x, w13, w2, ids, weights)
    assert PACKED_MIN_ROWS > 1 and cache.used_bytes() == 0  # one row per expert: nothing packed
    one_expert = w13[0].numel() * 4
    small = PackedWeightCache(budget_bytes=one_expert + 10)
    x, w13, w2, ids, weights = problem(seed=3)
    got = run(small, x, w13, w2, ids, weights)
    assert small.used_bytes() == one_expert  # the first w13 expert fits, nothing else does
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5


def test_in_place_update_repacks():
    x, w13, w2, ids, weights = problem(seed=4)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    before = cache.weight(w13, 0)
    run(cache, x, w13, w2, ids, weights)
    with torch.no_grad():
        w13.mul_(-0.5)  # bumps _version
        w2[1].add_(0.25)
    got = run(cache, x, w13, w2, ids, weights)
    assert cache.weight(w13, 0) is not before
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    assert cache.used_bytes() == (w13.numel() + w2.numel()) * 4  # stale copies released, not kept beside


def test_new_tensor_replaced_data_and_other_dtype_repack():
    x, w13, w2, ids, weights = problem(seed=5)
    p13, p2 = torch.nn.Parameter(w13, requires_grad=False), torch.nn.Parameter(w2, requires_grad=False)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    run(cache, x, p13, p2, ids, weights)
    _, n13, n2, _, _ = problem(seed=6)
    assert rel_err(run(cache, x, n13, n2, ids, weights), experts_loop(x, n13, n2, ids, weights)) < 1e-5  # new tensors
    p13.data, p2.data = n13.clone(), n2.clone()  # same Parameter objects, new storage (no _version bump)
    assert rel_err(run(cache, x, p13, p2, ids, weights), experts_loop(x, n13, n2, ids, weights)) < 1e-5
    if not cpu_packed.packing_supported(torch.bfloat16):
        return
    p13.data, p2.data = w13.bfloat16(), w2.bfloat16()  # other dtype
    got = run(cache, x.bfloat16(), p13, p2, ids, weights.bfloat16())
    assert cache.weight(p13, 0).dtype == torch.bfloat16
    assert rel_err(got, experts_loop(x.bfloat16(), p13, p2, ids, weights.bfloat16())) < 2e-2


def test_inference_tensors_are_never_packed():
    x, w13, w2, ids, weights = problem(seed=11)
    with torch.inference_mode():
        i13, i2 = w13.clone(), w2.clone()  # no version counter: an in-place update would go unseen
        cache = PackedWeightCache(budget_bytes=1 << 30)
        got = run(cache, x, i13, i2, ids, weights)
    assert cache.used_bytes() == 0 and rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5


def test_another_batch_hint_repacks_and_clear_drops_everything():
    x, w13, w2, ids, weights = problem(seed=7)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    first = cache.weight(w13, 2)
    cache.batch_hint = 16  # a retune of the packing
    assert cache.weight(w13, 2) is not first
    assert rel_err(run(cache, x, w13, w2, ids, weights), experts_loop(x, w13, w2, ids, weights)) < 1e-5
    cache.clear()
    assert cache.used_bytes() == 0


def test_packed_copies_die_with_the_weights():
    cache = PackedWeightCache(budget_bytes=1 << 30)
    x, w13, w2, ids, weights = problem(seed=8)
    store13 = w13.transpose(1, 2).contiguous()
    run(cache, x, store13.transpose(1, 2), w2, ids, weights)
    packed = weakref.ref(cache.weight(store13.transpose(1, 2), 0))
    assert packed() is not None and cache.used_bytes() > 0
    del store13, w2
    gc.collect()
    assert packed() is None and cache.used_bytes() == 0


def test_auto_uses_the_shared_cache_and_falls_back_without_packing(monkeypatch):
    x, w13, w2, ids, weights = problem(seed=10)
    cpu_packed.clear_packed_weights()
    got = experts_grouped_mm(x, w13, w2, ids, weights)  # cpu_gemm="auto"
    shared = cpu_packed.packed_weight_cache()
    assert shared.budget_bytes == 0 or shared.used_bytes() > 0
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    cpu_packed.clear_packed_weights()
    monkeypatch.setattr(cpu_packed, "packing_supported", lambda dtype: False)
    got = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed")
    assert shared.used_bytes() == 0 and rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5


def _onednn_refusing_plain_weights(monkeypatch):
    """oneDNN's linear, but failing on a plain (unpacked) weight: a call that passes took BLAS for those."""
    real = cpu_packed.onednn_linear(torch.float32)

    def linear(a, w, bias, *args):
        if not w.is_mkldnn:
            raise AssertionError("oneDNN's linear on a plain weight")
        return real(a, w, bias, *args)

    monkeypatch.setattr(cpu_packed, "onednn_linear", lambda dtype: linear)


@pytest.mark.parametrize("workers", [1, 2])
def test_blas_for_experts_below_the_packing_threshold(monkeypatch, workers):
    # 6 tokens x 2 slots on 4 experts: experts 0 and 1 get >= PACKED_MIN_ROWS rows (packed, oneDNN), others fewer
    x, w13, w2, ids, weights = problem(m=6, seed=12)
    g = torch.Generator().manual_seed(13)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    ids[:4] = torch.tensor([[0, 1]] * 4, dtype=ids.dtype)  # experts 0 and 1: >= 4 rows each
    store13 = w13.transpose(1, 2).contiguous()  # transformers' storage: a strided view per expert
    counts = torch.bincount(ids[(ids >= 0) & (ids < E)].long(), minlength=E)
    assert counts.max() >= PACKED_MIN_ROWS and 0 < counts[counts > 0].min() < PACKED_MIN_ROWS
    want = experts_loop(x, w13, w2, ids, weights, b13=b13, b2=b2)
    ex = ExpertParams(store13.transpose(1, 2), w2, b13, b2, SILU)
    plain = experts_cpu_fused(x, ex, ids, weights, None, PackedWeightCache(budget_bytes=1 << 30), workers=workers)
    _onednn_refusing_plain_weights(monkeypatch)
    got = experts_cpu_fused(x, ex, ids, weights, None, PackedWeightCache(budget_bytes=1 << 30), workers=workers,
                            blas_plain=True)
    assert rel_err(got, want) < 1e-5 and rel_err(plain, want) < 1e-5
    one = experts_cpu_fused(x, ex, ids, weights, None, PackedWeightCache(budget_bytes=1 << 30), workers=1,
                            blas_plain=True)
    assert torch.equal(got, one)  # the same bits for any worker count


def test_blas_plain_rows_rule(monkeypatch):
    for vendor, mkl, dtype, want in [("GenuineIntel", True, torch.float32, True),
                                     ("AuthenticAMD", True, torch.float32, False),
                                     ("GenuineIntel", False, torch.float32, False),
                                     ("GenuineIntel", True, torch.bfloat16, False)]:
        monkeypatch.setattr(cpu_packed, "cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(torch.backends.mkl, "is_available", lambda mkl=mkl: mkl)
        cpu_packed.blas_plain_rows.cache_clear()
        assert cpu_packed.blas_plain_rows(dtype) is want, (vendor, mkl, dtype)
    monkeypatch.undo()
    cpu_packed.blas_plain_rows.cache_clear()


def test_auto_takes_blas_where_the_rule_says_and_explicit_onednn_never(monkeypatch):
    x, w13, w2, ids, weights = problem(m=3, seed=14)  # at most 3 rows an expert: none packed
    want = experts_loop(x, w13, w2, ids, weights)
    monkeypatch.setattr(cpu_loop, "blas_plain_rows", lambda dtype: True)
    _onednn_refusing_plain_weights(monkeypatch)
    assert rel_err(experts_grouped_mm(x, w13, w2, ids, weights), want) < 1e-5
    with pytest.raises(AssertionError, match="plain weight"):
        experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed_split")
