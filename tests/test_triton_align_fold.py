"""The alignment folded into the gate-up GEMM (``LaunchOptions.align_fold_max``), under Triton's
interpreter: no alignment kernel runs, the output equals a float64 per-token loop and the unfolded path,
and the layout the gate-up programs leave for the down GEMM equals the torch twin ``align_block``."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import make_problem, routed_slots  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import ALIGN_ONE_LAUNCH_LIMIT, LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import plan_for  # noqa: E402
from moekit.layouts.block_aligned import align_block  # noqa: E402

FOLD = LaunchOptions(poison_workspace=True, align_fold_max=ALIGN_ONE_LAUNCH_LIMIT)
UNFOLDED = LaunchOptions(poison_workspace=True, align_fold_max=0)
ALIGN_KERNELS = {"align_small_kernel", "align_naive_kernel", "align_hist_kernel", "align_scan_kernel",
                 "align_scatter_kernel", "align_place_kernel"}


def _per_token(p, expert_map=None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * w2[e] @ (silu(gate) * up), in float64, one slot at a time."""
    out = torch.zeros(p.x.shape, dtype=torch.float64)
    w13, w2, n = p.w13.double(), p.w2.double(), p.w2.shape[2]
    for t, j, e in routed_slots(p.ids, p.w13.shape[0], expert_map):
        gate_up = w13[e] @ p.x[t].double()
        h = torch.nn.functional.silu(gate_up[:n]) * gate_up[n:]
        out[t] += float(p.weights[t, j]) * (w2[e] @ h)
    return out


def _map(e_global: int, e_local: int, seed: int) -> torch.Tensor:
    """A map [e_global] onto e_local experts, the rest -1 (not on this rank)."""
    g = torch.Generator().manual_seed(seed)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[torch.randperm(e_global, generator=g)[:e_local]] = torch.arange(e_local, dtype=torch.int32)
    return expert_map


# (M, k, E): a few assignments over many experts (mostly one row per block), many over few (blocks full
# of one expert, several blocks each), E not a power of two; with skipped slots (-1)
CASES = [(3, 2, 5), (9, 4, 16), (40, 3, 6), (17, 8, 32)]


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k,e", CASES)
def test_folded_equals_per_token_loop_and_unfolded(interpreter, launch_log, m, k, e, with_map):
    p = make_problem(m, k, e + 2 if with_map else e, 32, 16, seed=m * 7 + e, skips=True)
    expert_map = _map(e + 2, e, seed=m) if with_map else None
    w13, w2 = (p.w13[:e], p.w2[:e]) if with_map else (p.w13, p.w2)
    want = _per_token(p._replace(w13=w13, w2=w2), expert_map)
    folded = interpreter.fused_experts(p.x, w13, w2, p.ids, p.weights, expert_map, options=FOLD)
    ran = [name for name, _ in launch_log.take()]
    assert not ALIGN_KERNELS & set(ran) and ran[0] == "gate_up_kernel"
    unfolded = interpreter.fused_experts(p.x, w13, w2, p.ids, p.weights, expert_map, options=UNFOLDED)
    assert ALIGN_KERNELS & {name for name, _ in launch_log.take()}
    assert torch.equal(folded, unfolded)
    assert torch.allclose(folded.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k,e", CASES + [(1, 1, 2), (64, 2, 3)])
def test_layout_left_for_the_down_gemm_equals_twin(interpreter, m, k, e):
    """sorted_ids, expert_ids and num_padded as the gate-up programs wrote them: the twin's layout in
    the first R rows and R/B blocks, then only the sentinel A and -1 (the plan rounds R up to blocks)."""
    p = make_problem(m, k, e, 32, 16, seed=m + e, skips=True)
    plan = plan_for(p.x, p.w13, p.w2, p.ids, p.weights, None, "silu", None, FOLD)
    assert plan.align is not None and plan.align.folded and plan.align.launches == 0
    b = interpreter._WORKSPACES.buffers(plan.workspace, p.x.device)  # the views the call will write
    for name in ("sorted_ids", "expert_ids", "num_padded"):
        b[name].fill_(-7)  # nothing left from an earlier call
    interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, options=FOLD)
    want = align_block(p.ids, e, plan.config.BLOCK_M, allow_naive=False)
    rows, blocks = want.sorted_ids.numel(), want.expert_ids.numel()
    assert torch.equal(b["sorted_ids"][:rows], want.sorted_ids)
    assert torch.equal(b["expert_ids"][:blocks], want.expert_ids)
    assert torch.equal(b["num_padded"], want.num_padded)
    assert bool((b["sorted_ids"][rows:] == m * k).all()) and bool((b["expert_ids"][blocks:] == -1).all())


def test_threshold_and_who_folds(interpreter):
    """Up to align_fold_max assignments the plain path folds, above it launches the alignment; the
    naive shortcut never aligns; the fp8 / weight-only plans' alignment (plan_block_rows without fold)
    always launches."""
    from moekit.experts.triton_align import plan_block_rows

    opts = LaunchOptions(align_fold_max=12)
    for m, folded in ((6, True), (7, False)):  # A = 12, 14
        p = make_problem(m, 2, 4, 32, 16, seed=m)
        plan = plan_for(p.x, p.w13, p.w2, p.ids, p.weights, None, "silu", None, opts)
        assert plan.align.folded is folded and (plan.align.launches == 0) is folded
    p = make_problem(2, 2, 64, 32, 16, seed=3)  # A * 4 <= E: the shortcut
    assert plan_for(p.x, p.w13, p.w2, p.ids, p.weights, None, "silu", None, opts).align is None
    assert not plan_block_rows(12, 4, 16, None, opts).align.folded
    assert plan_block_rows(12, 4, 16, None, opts, fold=True).align.folded


def test_fold_option_is_checked():
    with pytest.raises(ValueError, match="align_fold_max"):
        LaunchOptions(align_fold_max=-1)
    with pytest.raises(ValueError, match="align_fold_max"):
        LaunchOptions(align_fold_max=ALIGN_ONE_LAUNCH_LIMIT + 1)
