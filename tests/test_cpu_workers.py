"""moekit.experts.cpu_workers and the split per-expert CPU loop (``cpu_gemm="onednn_packed_split"``, what
``auto`` runs): the greedy balance, the worker threads' thread counts, and the split loop against a
float64 loop of test_cpu_packed: biases, an expert map with -1, skipped slots, experts with no rows, M = 0,
more workers than experts, and the same bits on every run."""

import threading

import pytest
import torch

from moekit.activations import ActivationSpec
from moekit.experts import cpu_packed
from moekit.experts.cpu_packed import ExpertParams, PackedWeightCache, experts_cpu_fused
from moekit.experts.cpu_workers import balance_by_rows, run_shares
from moekit.experts.grouped_mm import experts_grouped_mm
from test_cpu_packed import loop64, rel_err  # the float64 per-(token, slot) loop both files check against

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


def test_balance_is_greedy_by_rows_and_covers_each_busy_expert_once():
    # by hand: 0 (5 rows) -> share 0; 4 (4) -> share 1; 2 (3) -> share 1 (4 < 5); 1 (1) -> share 0 (5 < 7)
    assert balance_by_rows([5, 1, 3, 0, 4], 2) == [[0, 1], [2, 4]]
    assert balance_by_rows([2, 2, 2], 2) == [[0, 2], [1]]  # ties: lower id first, onto the lower share
    assert balance_by_rows([0, 3, 0, 1], 8) == [[1], [3]]  # no empty shares
    assert balance_by_rows([0, 0], 4) == [] and balance_by_rows([], 2) == []
    counts = [int(c) for c in torch.randint(0, 40, (128,), generator=torch.Generator().manual_seed(1))]
    shares = balance_by_rows(counts, 3)
    assert sorted(e for s in shares for e in s) == [e for e, c in enumerate(counts) if c]
    assert all(s == sorted(s) for s in shares)
    loads = [sum(counts[e] for e in s) for s in shares]
    assert max(loads) - min(loads) <= max(counts)  # greedy onto the least loaded share
    with pytest.raises(ValueError, match="workers"):
        balance_by_rows([1], 0)


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
    assert rel_err(got, loop64(x, w13, w2, ids, weights)) < 1e-5


@needs_onednn
def test_split_with_biases_expert_map_and_idle_experts():
    x, w13, w2, ids, weights = problem(seed=3, experts_used=E)
    g = torch.Generator().manual_seed(4)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, K, generator=g)
    expert_map = torch.tensor([2, -1, 0, 5, -1, 1])  # global 1 and 4 are not here; local 3 and 4 get no rows
    store13 = w13.transpose(1, 2).contiguous()  # transformers' storage, read as a view
    got = split(x, store13.transpose(1, 2), w2, ids, weights, 2, PackedWeightCache(budget_bytes=1 << 30),
                b13=b13, b2=b2, expert_map=expert_map)
    assert rel_err(got, loop64(x, w13, w2, ids, weights, b13, b2, expert_map)) < 1e-5


@needs_onednn
def test_split_handles_no_tokens_and_one_busy_expert():
    x, w13, w2, ids, weights = problem(m=0)
    got = split(x, w13, w2, ids, weights, 2)
    assert got.shape == (0, K)
    x, w13, w2, ids, weights = problem(m=5, k=1, seed=5, experts_used=1)  # every row on expert 0
    got = split(x, w13, w2, ids, weights, 4)
    assert rel_err(got, loop64(x, w13, w2, ids, weights)) < 1e-5
    ids.fill_(-1)  # every slot skipped: zeros
    assert torch.equal(split(x, w13, w2, ids, weights, 4), torch.zeros(5, K))


@needs_onednn
def test_split_gives_the_same_bits_on_every_run():
    x, w13, w2, ids, weights = problem(m=96, k=3, seed=6)
    cache = PackedWeightCache(budget_bytes=1 << 30)
    first = split(x, w13, w2, ids, weights, 3, cache)
    for _ in range(5):
        assert torch.equal(split(x, w13, w2, ids, weights, 3, cache), first)


@needs_onednn
def test_grouped_mm_split_runs_one_worker_per_torch_thread(monkeypatch):
    x, w13, w2, ids, weights = problem(seed=7)
    calls = []
    real = cpu_packed.run_shares
    monkeypatch.setattr(cpu_packed, "run_shares", lambda shares, fn: calls.append(len(shares)) or real(shares, fn))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed_split")
        auto = experts_grouped_mm(x, w13, w2, ids, weights)
        unsplit = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed")
    finally:
        torch.set_num_threads(before)
    assert calls == [3, 3, 1]
    want = loop64(x, w13, w2, ids, weights)
    for out in (got, auto, unsplit):
        assert rel_err(out, want) < 1e-5
    x, w13, w2, ids, weights = problem(m=1, k=2, seed=8)  # decode: 2 experts of 1 row
    calls.clear()
    torch.set_num_threads(3)
    try:
        decode = experts_grouped_mm(x, w13, w2, ids, weights)
        forced = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm="onednn_packed_split")
    finally:
        torch.set_num_threads(before)
    assert calls == [2, 2]  # auto splits at decode too: one share per busy expert
    want = loop64(x, w13, w2, ids, weights)
    assert rel_err(decode, want) < 1e-5 and rel_err(forced, want) < 1e-5
