"""Where the CPU branch's experts run (``moekit.offload.cpu_runner``, ``cpu_pooled``): the pool's row blocks
against a float64 loop written here, the pool's order / backup / error semantics, the worker's, and an
offloaded layer on each runner against the plain layer. CPU only: both "devices" are the CPU."""

from __future__ import annotations

import threading

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload import CpuOptions, MissCosts, OffloadedMoE
from moekit.offload.cpu_pooled import block_rows, experts_pooled
from moekit.offload.cpu_runner import RUNNERS, BranchWorker, ChunkPool, shared_runner

from _helpers import TOLERANCE, make_problem, rel_l2

E, K, N = 8, 32, 16


def _share_loop(x, w13, w2, ids, weights, experts, b13=None, b2=None) -> torch.Tensor:
    """float64: out[t] = sum_j w[t, j] (w2[e] @ (silu(g) * u) + b2[e]) over slots routed to ``experts``."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e not in experts:
                continue
            h = w13[e].double() @ x[t].double() + (0 if b13 is None else b13[e].double())
            y = w2[e].double() @ (torch.nn.functional.silu(h[:N]) * h[N:]) + (0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, j]) * y
    return out


def test_block_rows_cover_every_row_once_within_the_bytes():
    for rows, cols, size, most in [(1536, 2048, 2, 1 << 20), (7, 3, 4, 1), (32, 16, 4, 1 << 30), (10, 100, 2, 450)]:
        blocks = block_rows(rows, cols, size, most)
        assert blocks[0][0] == 0 and blocks[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # contiguous, in order
        assert all(hi > lo for lo, hi in blocks)
        assert all((hi - lo) * cols * size <= most for lo, hi in blocks) or all(hi - lo == 1 for lo, hi in blocks)
    assert block_rows(3, 100, 1, 150) == [(0, 1), (1, 2), (2, 3)]  # 1 row of 100 bytes a block, not 2 of 3 rows
    assert block_rows(1536, 2048, 2) == [(256 * i, 256 * (i + 1)) for i in range(6)]  # Qwen3 w13: 1 MiB blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_pooled_share_equals_the_float64_loop(dtype, m, bias):
    p = make_problem(m, 3, E, K, N, dtype, seed=m, skips=True)  # -1 slots contribute nothing
    g = torch.Generator().manual_seed(7)
    b13 = torch.randn(E, 2 * N, generator=g).to(dtype) if bias else None
    b2 = torch.randn(E, K, generator=g).to(dtype) if bias else None
    experts = [1, 2, 5, 6]
    pool = shared_runner("pool", 2)
    got = experts_pooled(p.x, p.w13, p.w2, p.ids, p.weights, experts, pool, b13=b13, b2=b2,
                         block_bytes=5 * K * p.w13.element_size())  # 5-row blocks: several a weight, a short last one
    want = _share_loop(p.x, p.w13, p.w2, p.ids, p.weights, set(experts), b13, b2)
    assert got.dtype == dtype and got.shape == p.x.shape
    assert rel_l2(got, want) < TOLERANCE[dtype]


def test_pool_map_keeps_order_and_a_backup_run_can_finish_a_task():
    pool = ChunkPool(2, cpus=None)
    assert [int(t) for t in pool.map([lambda i=i: torch.tensor(i) for i in range(7)])] == list(range(7))
    assert pool.map([]) == []
    release, runs, lock = threading.Event(), [], threading.Lock()

    def held() -> torch.Tensor:  # its first run waits until the test releases it; a second run returns at once
        with lock:
            runs.append(len(runs))
            first = len(runs) == 1
        if first:
            release.wait(timeout=30)
            return torch.tensor(-1)
        return torch.tensor(1)

    got = pool.map([held])  # the other worker, free, runs it again: its result is taken
    release.set()
    assert int(got[0]) == 1 and len(runs) == 2


def test_pool_and_worker_raise_the_task_error_in_the_caller():
    pool, worker = ChunkPool(2), BranchWorker(1)

    def bad():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        pool.map([lambda: torch.zeros(1), bad])
    assert int(pool.map([lambda: torch.tensor(3)])[0]) == 3  # still serving
    with pytest.raises(RuntimeError, match="boom"):
        worker.run(bad)
    assert worker.run(lambda a, b: a + b, 2, 3) == 5


def test_runners_run_at_their_own_thread_counts_and_leave_the_callers():
    before = torch.get_num_threads()
    pool = ChunkPool(2)
    worker = BranchWorker(1)
    assert [int(t) for t in pool.map([lambda: torch.tensor(torch.get_num_threads())] * 3)] == [1, 1, 1]
    assert worker.run(torch.get_num_threads) == 1
    assert torch.get_num_threads() == before
    assert shared_runner("worker", 1) is shared_runner("worker", 1) and shared_runner("inline", 4) is None
    with pytest.raises(ValueError, match="runner must be one of"):
        shared_runner("threads", 2)
    with pytest.raises(ValueError, match="CpuOptions.runner"):
        CpuOptions(runner="threads")
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ChunkPool(0)


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
               router="torch")


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("place", ["cpu", "auto"])
def test_an_offloaded_layer_on_each_runner_keeps_the_plain_output(runner, place):
    moe = _moe()
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6, cpu_threads=2)  # "auto" mixes both
    off = OffloadedMoE.from_moe(moe, cache_experts=3, compute_misses_on=place, costs=costs,
                                cpu_options=CpuOptions(gemm="direct", runner=runner))
    for seed in range(4):  # warm caches: hits on the "GPU", misses on the CPU, partial sums
        x = torch.randn(5, K, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.cache.stats.cpu_experts > 0
