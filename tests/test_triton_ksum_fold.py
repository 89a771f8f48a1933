"""The k-sum folded into the down GEMM's epilogue (``LaunchOptions.sum_fold_max``, ``_kernels/gemm.py`` KSUM),
under Triton's interpreter: the output equals a float64 per-token loop and, bit for bit, the separate k-sum
launch; the kept counters are back at zero after every call; tokens no slot routes here are written 0;
the fold runs only where the counters are kept (eager, reused workspace) or passed in."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _down_sum_cases import HIDDEN, INTER, SEP, SMALL, kept_counters, problem, run  # noqa: E402
from _helpers import experts_loop, make_problem  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import plan_for, sum_launch  # noqa: E402

FOLD = LaunchOptions(poison_workspace=True, sum_fold_max=1 << 20)

# (M, k, E): naive shortcut (A*4 <= E: one row per block), aligned blocks holding several tokens, more tokens
# than one zero-fill program takes (16), k in {1, 2, 6, 8}
CASES = [(1, 8, 40), (2, 1, 9), (3, 1, 5), (5, 6, 8), (20, 2, 6), (9, 8, 12)]


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k,e", CASES)
def test_folded_equals_per_token_loop_and_separate_sum(interpreter, launch_log, m, k, e, with_map):
    args = problem(m, k, e, with_map, seed=m * 11 + k + e)
    want = experts_loop(*args)
    folded = run(interpreter, args, FOLD)
    ran = launch_log.take()
    downs = [kw for name, kw in ran if name == "down_kernel"]
    assert len(downs) == 1 and downs[0]["KSUM"] and "sum_slots_kernel" not in {name for name, _ in ran}
    assert bool((kept_counters(interpreter, args, FOLD) == 0).all())  # the last arrivals set them back
    separate = run(interpreter, args, SEP)
    sums = [kw for name, kw in launch_log.take() if name == "sum_slots_kernel"]
    assert len(sums) == 1 and sums[0]["ORDERED"]
    assert torch.equal(folded, separate)
    assert torch.allclose(folded.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 8])
def test_default_options_fold_up_to_eight_tokens(interpreter, launch_log, m):
    """The default launch options fold the k-sum up to sum_fold_max = 8 tokens (a decode batch): a call is the
    gate-up and the down launch only (the alignment folded or the shortcut), bit-equal to the separate k-sum and
    the float64 loop; at 9 tokens the k-sum runs in sum programs after the down GEMM's (SUM_AFTER,
    ``test_triton_sum_after.py``), the fold no more."""
    defaults = LaunchOptions(poison_workspace=True)  # the defaults, NaN in the workspaces
    assert defaults.sum_fold_max == 8
    args = problem(m, 2, 6, False, seed=m)
    folded = run(interpreter, args, defaults)
    assert [name for name, _ in launch_log.take()] == ["gate_up_kernel", "down_kernel"]
    assert torch.equal(folded, run(interpreter, args, SEP))
    assert torch.allclose(folded.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)
    launch_log.take()
    run(interpreter, problem(9, 2, 6, False, seed=9), defaults)
    downs = [kw for name, kw in launch_log.take() if name == "down_kernel"]
    assert len(downs) == 1 and downs[0]["SUM_AFTER"] and not downs[0].get("KSUM")


def test_counters_are_reused_and_left_at_zero_call_after_call(interpreter):
    """Calls of one kind with different routing share the kept counters; each equals the separate k-sum."""
    first = problem(9, 8, 12, False, seed=1)
    kept = kept_counters(interpreter, first, FOLD)
    kept.fill_(0)
    for seed in (2, 3):  # two routings after the first: each shares the kept counters and leaves them at 0
        x, w13, w2, _, _, _ = first
        p = make_problem(9, 8, 12, HIDDEN, INTER, seed=seed, skips=True)
        args = (x, w13, w2, p.ids, p.weights, None)
        assert torch.equal(run(interpreter, args, FOLD), run(interpreter, args, SEP))
        counters = kept_counters(interpreter, args, FOLD)
        assert counters.data_ptr() == kept.data_ptr() and bool((counters == 0).all())


@pytest.mark.parametrize("with_map", [False, True])
def test_tokens_no_slot_routes_here_are_zero(interpreter, monkeypatch, with_map):
    """No down program arrives for them: the zero-fill programs write them, over a NaN-filled ``out``."""
    x, w13, w2, ids, weights, expert_map = problem(20, 2, 6, with_map, seed=5)
    ids[[0, 7, 19]] = -1  # three tokens with every slot skipped
    if with_map:
        ids[3] = torch.nonzero(expert_map == -1).flatten()[:2].int()  # both slots on other ranks
    args = (x, w13, w2, ids, weights, expert_map)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    folded = run(interpreter, args, FOLD)
    monkeypatch.undo()
    none_here = [0, 7, 19] + ([3] if with_map else [])
    assert bool((folded[none_here] == 0).all()) and not folded.isnan().any()
    assert torch.equal(folded, run(interpreter, args, SEP))
    assert torch.allclose(folded.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)


def test_given_counters_as_a_graph_capture_passes_them(interpreter, launch_log):
    """``counters=`` (what a CUDA graph capture passes: the pool keeps none then) runs the fold with them
    and leaves them at zero; the result equals the eager call's."""
    args = problem(5, 6, 8, True, seed=7)
    eager = run(interpreter, args, FOLD)
    launch_log.take()
    plan = plan_for(*args[:6], "silu", SMALL, FOLD)
    counters = torch.zeros(plan.workspace.counters, dtype=torch.int32)
    for _ in range(2):
        assert torch.equal(run(interpreter, args, FOLD, counters=counters), eager)
        assert bool((counters == 0).all())
    assert [name for name, _ in launch_log.take()].count("sum_slots_kernel") == 0
    for bad in (counters[:-1], counters.long()):
        with pytest.raises(ValueError, match="counters must be int32"):
            run(interpreter, args, FOLD, counters=bad)


def test_fold_runs_only_where_counters_are_kept(interpreter, launch_log):
    """Up to sum_fold_max tokens the plan has the folded launch; a call without a reused workspace (what a
    graph capture and the custom op get) runs the separate k-sum, with the same result bit for bit."""
    args = problem(5, 6, 8, False, seed=9)
    x, w13, w2, ids, weights, _ = args
    assert plan_for(x, w13, w2, ids, weights, None, "silu", SMALL, LaunchOptions(sum_fold_max=5)).down_sum is not None
    no_sum = LaunchOptions(sum_fold_max=4, sum_tail_max=0)  # past both limits
    assert plan_for(x, w13, w2, ids, weights, None, "silu", SMALL, no_sum).down_sum is None
    fresh = LaunchOptions(poison_workspace=True, sum_fold_max=8, reuse_workspace=False)
    out = run(interpreter, args, fresh)
    names = [name for name, _ in launch_log.take()]
    assert "sum_slots_kernel" in names
    assert torch.equal(out, run(interpreter, args, FOLD))
    via_op = torch.ops.moekit.triton_experts(x, w13, w2, ids, weights, None, None, None, "silu", True, False, 1.0, None,
                                             0.0, *LaunchOptions(sum_fold_max=8).as_op_args())
    assert "sum_slots_kernel" in [name for name, _ in launch_log.take()]  # the op never keeps workspaces
    assert torch.allclose(via_op.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sum_fold_max"):
        LaunchOptions(sum_fold_max=-1)
    with pytest.raises(ValueError, match="split"):
        sum_launch(4, 8, 2, 3, None, LaunchOptions(), split=2, ordered=True)


def test_no_tokens(interpreter, launch_log):
    args = problem(0, 2, 4, False, seed=0)
    out = run(interpreter, args, FOLD)
    assert out.shape == (0, HIDDEN) and launch_log.take() == []


def test_pool_keeps_counters_above_its_byte_limit_and_regrows_them():
    """Counters are kept even where the regions are fresh (above ``max_bytes``); a plan needing more grows
    them (zeroed) and the views carved before see the new ones."""
    from moekit.experts.triton_cache import WorkspacePool, WorkspaceSpec

    pool = WorkspacePool(max_bytes=1024)
    small = WorkspaceSpec.of([("h", torch.float32, (4, 4))], counters=6)
    large = WorkspaceSpec.of([("h", torch.float32, (64, 64))], counters=20)  # 16 KiB: fresh regions
    a = pool.buffers(small, torch.device("cpu"))
    assert a["counters"].shape == (6,) and bool((a["counters"] == 0).all())
    b1, b2 = pool.buffers(large, torch.device("cpu")), pool.buffers(large, torch.device("cpu"))
    assert b1["h"].data_ptr() != b2["h"].data_ptr()  # fresh regions each call
    assert b1["counters"].data_ptr() == b2["counters"].data_ptr() and b2["counters"].numel() == 20
    again = pool.buffers(small, torch.device("cpu"))
    assert again["counters"].data_ptr() == b2["counters"].data_ptr()  # carved again from the grown counters
    assert "counters" not in small.allocate(torch.device("cpu"))
