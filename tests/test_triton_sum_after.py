"""The k-sum in the down GEMM's grid after its programs (``LaunchOptions.sum_tail_max``, ``_kernels/gemm.py``
SUM_AFTER), under Triton's interpreter: the output equals a float64 per-token loop and, bit for bit, the separate
k-sum launch (tails: K not a multiple of the sum tile, M not a multiple of its tokens; skipped slots, an expert
map with -1, tokens no slot routes here); the kept counters are back at zero after every call; it runs only where
the counters are kept (eager, reused workspace) or passed in; M = 0 launches nothing."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _down_sum_cases import HIDDEN, INTER, SEP, SMALL, kept_counters, problem, run  # noqa: E402
from _helpers import experts_loop, make_problem  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import SumTail, plan_for  # noqa: E402

TAIL = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=1 << 20)
# SMALL's down: K = 40 is three GEMM tiles; the sum tile is 4 tokens x min(64, 2048 / k) columns

# (M, k, E): the naive shortcut (A*4 <= E), one token, aligned blocks holding several tokens, M not a multiple of
# the sum tile's 4 tokens, k in {1, 2, 6, 8}
CASES = [(1, 8, 40), (1, 2, 3), (2, 1, 9), (5, 6, 8), (13, 2, 6), (9, 8, 12)]


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k,e", CASES)
def test_sum_after_equals_per_token_loop_and_separate_sum(interpreter, launch_log, m, k, e, with_map):
    args = problem(m, k, e, with_map, seed=m * 7 + k + e)
    want = experts_loop(*args)
    after = run(interpreter, args, TAIL)
    ran = launch_log.take()
    downs = [kw for name, kw in ran if name == "down_kernel"]
    assert len(downs) == 1 and downs[0]["SUM_AFTER"] and "sum_slots_kernel" not in {name for name, _ in ran}
    assert bool((kept_counters(interpreter, args, TAIL) == 0).all())  # the last sum program set them back
    separate = run(interpreter, args, SEP)
    assert [kw["ORDERED"] for name, kw in launch_log.take() if name == "sum_slots_kernel"] == [True]
    assert torch.equal(after, separate)
    assert torch.allclose(after.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_map", [False, True])
def test_tokens_no_slot_routes_here_are_zero(interpreter, monkeypatch, with_map):
    """Their sum programs read no slot and write 0, over a NaN-filled ``out``."""
    x, w13, w2, ids, weights, expert_map = problem(13, 2, 6, with_map, seed=5)
    ids[[0, 7, 12]] = -1  # three tokens with every slot skipped
    if with_map:
        ids[3] = torch.nonzero(expert_map == -1).flatten()[:2].int()  # both slots on other ranks (map entry -1)
    args = (x, w13, w2, ids, weights, expert_map)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    after = run(interpreter, args, TAIL)
    monkeypatch.undo()
    none_here = [0, 7, 12] + ([3] if with_map else [])
    assert bool((after[none_here] == 0).all()) and not after.isnan().any()
    assert torch.equal(after, run(interpreter, args, SEP))
    assert torch.allclose(after.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)


def test_counters_are_reused_and_left_at_zero_call_after_call(interpreter):
    """Calls of one kind with different routing share the two kept counters; each equals the separate k-sum."""
    first = problem(9, 8, 12, False, seed=1)
    kept = kept_counters(interpreter, first, TAIL)
    assert kept.numel() == 2
    for seed in (2, 3):  # two routings after the first: each shares the kept counters and leaves them at 0
        x, w13, w2, _, _, _ = first
        p = make_problem(9, 8, 12, HIDDEN, INTER, seed=seed, skips=True)
        args = (x, w13, w2, p.ids, p.weights, None)
        assert torch.equal(run(interpreter, args, TAIL), run(interpreter, args, SEP))
        counters = kept_counters(interpreter, args, TAIL)
        assert counters.data_ptr() == kept.data_ptr() and bool((counters == 0).all())


def test_given_counters_as_a_graph_capture_passes_them(interpreter, launch_log):
    """``counters=`` (what a CUDA graph capture passes) runs the sum programs with them and leaves them at 0."""
    args = problem(5, 6, 8, True, seed=7)
    eager = run(interpreter, args, TAIL)
    launch_log.take()
    counters = torch.zeros(plan_for(*args[:6], "silu", SMALL, TAIL).workspace.counters, dtype=torch.int32)
    for _ in range(2):
        assert torch.equal(run(interpreter, args, TAIL, counters=counters), eager)
        assert bool((counters == 0).all())
    assert [name for name, _ in launch_log.take()].count("sum_slots_kernel") == 0


def test_where_it_runs(interpreter, launch_log):
    """The plan has it past sum_fold_max up to sum_tail_max tokens; the fold wins below; a call without a reused
    workspace (a graph capture, the custom op) runs the separate k-sum, bit-equal."""
    args = problem(5, 6, 8, False, seed=9)
    x, w13, w2, ids, weights, _ = args

    def plan(**kw):
        return plan_for(x, w13, w2, ids, weights, None, "silu", SMALL, LaunchOptions(**kw))

    # counters: 2 for the sum programs, [M, K tiles] = 5 x 3 folded
    assert plan(sum_fold_max=4, sum_tail_max=5).workspace.counters == 2
    assert plan(sum_fold_max=5, sum_tail_max=5).workspace.counters == 15
    assert plan(sum_fold_max=4, sum_tail_max=4).down_sum is None
    fresh = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=8, reuse_workspace=False)
    out = run(interpreter, args, fresh)
    assert "sum_slots_kernel" in [name for name, _ in launch_log.take()]
    assert torch.equal(out, run(interpreter, args, TAIL))
    with pytest.raises(ValueError, match="sum_tail_max"):
        LaunchOptions(sum_tail_max=-1)


def test_sum_programs_cover_out():
    """4 tokens x min(next_pow2(K), max(32, 2048 / next_pow2(k))) columns per program, the separate k-sum's tile."""
    tail = SumTail.of(13, 40, 6, None)
    assert (tail.constexprs["SUM_T"], tail.constexprs["SUM_K"]) == (4, 64) and tail.programs == 4
    tail = SumTail.of(1024, 2048, 8, torch.zeros(5, dtype=torch.int32))
    assert (tail.constexprs["SUM_K"], tail.programs, tail.constexprs["num_global"]) == (256, 256 * 8, 5)


def test_no_tokens(interpreter, launch_log):
    out = run(interpreter, problem(0, 2, 4, False, seed=0), TAIL)
    assert out.shape == (0, HIDDEN) and launch_log.take() == []


def test_default_options_run_the_sum_programs_past_eight_tokens(interpreter, launch_log):
    """The defaults (sum_fold_max 8, sum_tail_max 64): at 9 tokens gate-up and one down launch (the alignment
    folded), bit-equal to the separate k-sum; at 65 tokens the k-sum's own launch again."""
    defaults = LaunchOptions(poison_workspace=True)
    assert (defaults.sum_fold_max, defaults.sum_tail_max) == (8, 64)
    args = problem(9, 2, 6, False, seed=9)
    out = run(interpreter, args, defaults)
    assert [name for name, _ in launch_log.take()] == ["gate_up_kernel", "down_kernel"]
    assert torch.equal(out, run(interpreter, args, SEP))
    launch_log.take()
    x, w13, w2, ids, weights, _ = problem(65, 1, 6, False, seed=65)
    assert plan_for(x, w13, w2, ids, weights, None, "silu", SMALL, defaults).workspace.counters == 0
