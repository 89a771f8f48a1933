"""The k-sum in the down GEMM's grid after its programs (``LaunchOptions.sum_tail_max``, ``_kernels/gemm.py``
SUM_AFTER), under Triton's interpreter: it runs only where the counters are kept (eager, reused workspace) or passed
in, the fold winning below sum_fold_max; its programs cover ``out``; the defaults take it past 8 tokens. Against the
loop and the separate k-sum (tails: K not a multiple of the sum tile, M not a multiple of its tokens; skipped
slots, an expert map with -1, tokens no slot routes here), the counters, M = 0, beside the fold:
``test_triton_down_sum.py``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _down_sum_cases import SEP, SMALL, problem, run  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import SumTail, plan_for  # noqa: E402

TAIL = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=1 << 20)
# SMALL's down: K = 40 is three GEMM tiles; the sum tile is 4 tokens x min(64, 2048 / k) columns


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
