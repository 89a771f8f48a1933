"""The k-sum folded into the down GEMM's epilogue (``LaunchOptions.sum_fold_max``, ``_kernels/gemm.py`` KSUM),
under Triton's interpreter: the default options fold it up to 8 tokens; the fold runs only where the counters are
kept (eager, reused workspace) or passed in; the pool keeps the counters. Against the loop and the separate k-sum,
with the sum programs after the GEMM's (SUM_AFTER): ``test_triton_down_sum.py``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _down_sum_cases import SEP, SMALL, problem, run  # noqa: E402
from _helpers import experts_loop  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import plan_for, sum_launch  # noqa: E402

FOLD = LaunchOptions(poison_workspace=True, sum_fold_max=1 << 20)


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
                                             0.0, False, *LaunchOptions(sum_fold_max=8).as_op_args())
    assert "sum_slots_kernel" in [name for name, _ in launch_log.take()]  # the op never keeps workspaces
    assert torch.allclose(via_op.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sum_fold_max"):
        LaunchOptions(sum_fold_max=-1)
    with pytest.raises(ValueError, match="split"):
        sum_launch(4, 8, 2, 3, None, LaunchOptions(), split=2, ordered=True)


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
