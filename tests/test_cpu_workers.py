"""moekit.experts.cpu_workers and the split per-expert CPU loop (``cpu_gemm="onednn_packed_split"``, what
``auto`` runs): the largest-first order, the dynamic hand-out, the worker threads' thread counts, and the
split loop against a float64 loop of test_cpu_packed: biases, an expert map with -1, skipped slots,
experts with no rows, one row, M = 0, more workers than experts, and the same bits on every run and for
every worker count."""

import threading

import pytest
import torch

from _helpers import experts_loop
from moekit.activations import ActivationSpec
from moekit.experts import cpu_packed
from moekit.experts.cpu_packed import ExpertParams, PackedWeightCache, experts_cpu_fused
from moekit.experts.cpu_split_choice import split_chooser
from moekit.experts.cpu_workers import largest_first, run_dynamic, run_shares
from moekit.experts.grouped_mm import experts_grouped_mm
from test_cpu_packed import rel_err

E, N, K = 6, 16, 32
SILU = ActivationSpec("silu")

needs_onednn = pytest.mark.skipif(not cpu_packed.fused_loop_supported(torch.float32),
                                  reason="this torch build has no oneDNN linear")


def problem(m=48, k=2, seed=0, experts_used=E):
    """Routing over the first ``experts_used`` experts only (the rest get no rows); skipped slots."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    w13 = torch.randn(E, 2 * N, K, generator=g) * K**-0.5
    w2 = torch.randn(E, K, N, generator=g) * N**-0.5
    ids = torch.stack([torch.randperm(experts_used, generator=g)[:k] for _ in range(m)] or
                      [torch.zeros(0, k, dtype=torch.long)]).reshape(m, k).int()
    if m > 2:
        ids[1::7, 0] = -1
        ids[2::9, -1] = E + 1
    return x, w13, w2, ids, torch.rand(m, k, generator=g)


def split(x, w13, w2, ids, weights, workers, cache=None, **kw):
    ex = ExpertParams(w13, w2, kw.get("b13"), kw.get("b2"), SILU)
    return experts_cpu_fused(x, ex, ids, weights, kw.get("expert_map"), cache, workers=workers)


def test_largest_first_orders_the_busy_experts_by_rows_then_id():
    assert largest_first([5, 1, 3, 0, 4]) == [0, 4, 2, 1]
    assert largest_first([2, 2, 0, 2]) == [0, 1, 3]  # ties: lower id first
    assert largest_first([0, 0]) == [] and largest_first([]) == []


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_run_dynamic_runs_every_item_once_single_threaded(workers):
    before = torch.get_num_threads()
    seen, lock = [], threading.Lock()

    def fn(item):
        with lock:
            seen.append((item, torch.get_num_threads(), threading.get_ident()))

    items = [7, 3, 5, 1, 0]
    run_dynamic(items, workers, fn)
    assert sorted(i for i, _, _ in seen) == sorted(items)
    if workers > 1:
        assert {threads for _, threads, _ in seen} == {1}
    else:  # one worker: the calling thread as it is (the GEMMs keep their intra-op threads)
        assert {(threads, ident) for _, threads, ident in seen} == {(before, threading.get_ident())}
    assert torch.get_num_threads() == before
    run_dynamic([], workers, fn)
    with pytest.raises(ValueError, match="workers"):
        run_dynamic(items, 0, fn)


def test_run_dynamic_reraises_and_the_other_workers_drain_the_rest():
    done, lock = [], threading.Lock()

    def fn(item):
        if item == 2:
            raise RuntimeError("item 2 failed")
        with lock:
            done.append(item)

    with pytest.raises(RuntimeError, match="item 2 failed"):
        run_dynamic(list(range(20)), 2, fn)
    assert len(done) >= 18 and 2 not in done and len(set(done)) == len(done)


def test_run_shares_single_thread_each_order_kept_and_caller_threads_restored():
    before = torch.get_num_threads()
    seen = {}

    def fn(share):
        seen[share[0]] = (torch.get_num_threads(), threading.get_ident())
        return sum(share)

    assert run_shares([[1, 2], [3], [4, 5, 6]], fn) == [3, 3, 15]
    assert {threads for threads, _ in seen.values()} == {1}
    assert seen[1][1] == threading.get_ident()  # share 0 on the calling thread
    assert seen[3][1] != seen[1][1] and seen[4][1] != seen[1][1]  # the others on the pool (a free thread each)
    assert torch.get_num_threads() == before
    fresh = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [before]  # the default torch gives new threads is the caller's again
    assert run_shares([], fn) == []


def test_run_shares_reraises_after_every_share_finished():
    done = []

    def fn(share):
        if share == [2]:
            raise RuntimeError("share 2 failed")
        done.append(share[0])
        return share[0]

    with pytest.raises(RuntimeError, match="share 2 failed"):
        run_shares([[1], [2], [3]], fn)
    assert sorted(done) == [1, 3]


@needs_onednn
@pytest.mark.parametrize("workers", [1, 2, 3, 16])  # 16: more workers than experts
@pytest.mark.parametrize("packed", [False, True])
def test_split_loop_equals_float64_loop(workers, packed):
    x, w13, w2, ids, weights = problem(seed=workers)
    cache = PackedWeightCache(budget_bytes=1 << 30) if packed else None
    got = split(x, w13, w2, ids, weights, workers, cache)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5


@needs_onednn
def test_split_with_biases_expert_map_and_idle_experts():
    x, w13, w2, ids, weights = problem(seed=3, experts_used=E)
    g = torch.Generator().manual_seed(4)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    expert_map = torch.tensor([2, -1, 0, 5, -1, 1])  # global 1 and 4 are not here; local 3 and 4 get no rows
    store13 = w13.transpose(1, 2).contiguous()  # transformers' storage, read as a view
    got = split(x, store13.transpose(1, 2), w2, ids, weights, 2, PackedWeightCache(budget_bytes=1 << 30),
                b13=b13, b2=b2, expert_map=expert_map)
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, expert_map, b13=b13, b2=b2)) < 1e-5


@needs_onednn
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_split_runs_the_workers_under_the_callers_grad_mode(mode):
    """Biases that require grad (a module's parameters, gpt-oss's) under the caller's inference_mode / no_grad: the
    pool threads run under it too (they once recorded autograd there and raised on the caller's inference tensors)."""
    g = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(E, 2 * N, generator=g).requires_grad_(), torch.randn(E, K, generator=g).requires_grad_()
    with getattr(torch, mode)():
        x, w13, w2, ids, weights = problem(seed=5)
        got = split(x, w13, w2, ids, weights, 2, b13=b13, b2=b2)
    assert not got.requires_grad and torch.is_grad_enabled()
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, b13=b13.detach(), b2=b2.detach())) < 1e-5


@needs_onednn
def test_split_handles_no_tokens_and_one_busy_expert():
    x, w13, w2, ids, weights = problem(m=0)
    got = split(x, w13, w2, ids, weights, 2)
    assert got.shape == (0, K)
    x, w13, w2, ids, weights = problem(m=5, k=1, seed=5, experts_used=1)  # every row on expert 0
    got = split(x, w13, w2, ids, weights, 4)
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    ids.fill_(-1)  # every slot skipped: zeros
    assert torch.equal(split(x, w13, w2, ids, weights, 4), torch.zeros(5, K))


@needs_onednn
def test_split_gives_the_same_bits_on_every_run_and_for_every_worker_count():
    x, w13, w2, ids, weights = problem(m=96, k=3, seed=6)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    first = split(x, w13, w2, ids, weights, 1, cache)
    assert rel_err(first, experts_loop(x, w13, w2, ids, weights)) < 1e-5
    for workers in (2, 3, 2, 3, 5):
        assert torch.equal(split(x, w13, w2, ids, weights, workers, cache), first)


@needs_onednn
def test_split_with_one_row_and_b2_scales_the_output_not_the_activation():
    x, w13, w2, ids, weights = problem(m=1, k=3, seed=9)  # three experts of one row each
    b2 = torch.randn(E, K, generator=torch.Generator().manual_seed(10))
    got = split(x, w13, w2, ids, weights, 2, b2=b2)
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, b2=b2)) < 1e-5
    ids[0, 1] = -1  # a skipped slot: its weight and its bias add nothing
    got = split(x, w13, w2, ids, weights, 2, b2=b2)
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, b2=b2)) < 1e-5


@needs_onednn
def test_grouped_mm_split_runs_one_worker_per_torch_thread(monkeypatch):
    x, w13, w2, ids, weights = problem(seed=7)
    calls = []
    real = cpu_packed.run_dynamic
    monkeypatch.setattr(cpu_packed, "run_dynamic",
                        lambda items, workers, fn: calls.append(min(workers, len(items))) or real(items, workers, fn))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed_split")
        auto = experts_grouped_mm(x, w13, w2, ids, weights)
        unsplit = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed")
    finally:
        torch.set_num_threads(before)
    assert calls == [3, 3, 1]
    want = experts_loop(x, w13, w2, ids, weights)
    for out in (got, auto, unsplit):
        assert rel_err(out, want) < 1e-5
    x, w13, w2, ids, weights = problem(m=1, k=2, seed=8)  # decode: 2 experts of 1 row
    calls.clear()
    split_chooser().clear()
    torch.set_num_threads(3)
    try:
        decode = experts_grouped_mm(x, w13, w2, ids, weights)  # a decode size's first call: the split
        forced = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed_split")
    finally:
        torch.set_num_threads(before)
    assert calls == [2, 2]  # one worker per busy expert (test_cpu_split_choice: auto's choice at decode)
    want = experts_loop(x, w13, w2, ids, weights)
    assert rel_err(decode, want) < 1e-5 and rel_err(forced, want) < 1e-5
