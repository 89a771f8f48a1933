"""The k-sum in the down GEMM's launch, both ways (``_kernels/gemm.py``): folded into its epilogue
(``LaunchOptions.sum_fold_max``, KSUM) and in the programs after its tiles (``sum_tail_max``, SUM_AFTER), under
Triton's interpreter: the output equals a float64 per-token loop and, bit for bit, the separate k-sum launch; the
kept counters are back at zero after every call, call after call, and when a graph capture passes its own; tokens no
slot routes here are written 0; M = 0 launches nothing. What one way alone does: ``test_triton_ksum_fold.py``,
``test_triton_sum_after.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")

from _down_sum_cases import HIDDEN, INTER, SEP, SMALL, kept_counters, problem, run  # noqa: E402
from _helpers import experts_loop, make_problem  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import plan_for  # noqa: E402


@dataclass(frozen=True)
class Way:
    options: LaunchOptions
    flag: str  # the down launch's constexpr that takes the k-sum in
    cases: list  # (M, k, E)
    seed_step: int  # a case's seed: M * seed_step + k + E
    counters_at_9_8_12: int  # the kept counters of a call at M = 9, k = 8, E = 12
    m_none_here: int  # the tokens of the "no slot routes here" problem (sum programs: not a multiple of 4)


WAYS = {
    # naive shortcut (A*4 <= E: one row per block), aligned blocks holding several tokens, more tokens than one
    # zero-fill program takes (16), k in {1, 2, 6, 8}; counters [M, K tiles] = 9 x 3 (SMALL's K = 40)
    "fold": Way(LaunchOptions(poison_workspace=True, sum_fold_max=1 << 20), "KSUM",
                [(1, 8, 40), (2, 1, 9), (3, 1, 5), (5, 6, 8), (20, 2, 6), (9, 8, 12)], 11, 27, 20),
    # the naive shortcut, one token, aligned blocks holding several tokens, M not a multiple of the sum tile's 4
    # tokens, k in {1, 2, 6, 8}; two counters (the sum programs')
    "after": Way(LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=1 << 20), "SUM_AFTER",
                 [(1, 8, 40), (1, 2, 3), (2, 1, 9), (5, 6, 8), (13, 2, 6), (9, 8, 12)], 7, 2, 13),
}


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("way,m,k,e", [(way, *case) for way, w in WAYS.items() for case in w.cases])
def test_equals_per_token_loop_and_separate_sum(interpreter, launch_log, way, m, k, e, with_map):
    w = WAYS[way]
    args = problem(m, k, e, with_map, seed=m * w.seed_step + k + e)
    want = experts_loop(*args)
    out = run(interpreter, args, w.options)
    ran = launch_log.take()
    downs = [kw for name, kw in ran if name == "down_kernel"]
    assert len(downs) == 1 and downs[0][w.flag] and "sum_slots_kernel" not in {name for name, _ in ran}
    assert bool((kept_counters(interpreter, args, w.options) == 0).all())  # the last arrivals set them back
    separate = run(interpreter, args, SEP)
    assert [kw["ORDERED"] for name, kw in launch_log.take() if name == "sum_slots_kernel"] == [True]
    assert torch.equal(out, separate)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("way", WAYS)
def test_tokens_no_slot_routes_here_are_zero(interpreter, monkeypatch, way, with_map):
    """No down program arrives for them: the zero-fill programs (fold) or their sum programs (after) read no slot
    and write 0, over a NaN-filled ``out``."""
    w = WAYS[way]
    m = w.m_none_here
    x, w13, w2, ids, weights, expert_map = problem(m, 2, 6, with_map, seed=5)
    ids[[0, 7, m - 1]] = -1  # three tokens with every slot skipped
    if with_map:
        ids[3] = torch.nonzero(expert_map == -1).flatten()[:2].int()  # both slots on other ranks (map entry -1)
    args = (x, w13, w2, ids, weights, expert_map)
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))
    out = run(interpreter, args, w.options)
    monkeypatch.undo()
    none_here = [0, 7, m - 1] + ([3] if with_map else [])
    assert bool((out[none_here] == 0).all()) and not out.isnan().any()
    assert torch.equal(out, run(interpreter, args, SEP))
    assert torch.allclose(out.double(), experts_loop(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("way", WAYS)
def test_counters_are_reused_and_left_at_zero_call_after_call(interpreter, way):
    """Calls of one kind with different routing share the kept counters; each equals the separate k-sum."""
    w = WAYS[way]
    first = problem(9, 8, 12, False, seed=1)
    kept = kept_counters(interpreter, first, w.options)
    assert kept.numel() == w.counters_at_9_8_12 and bool((kept == 0).all())
    for seed in (2, 3):  # two routings after the first: each shares the kept counters and leaves them at 0
        x, w13, w2, _, _, _ = first
        p = make_problem(9, 8, 12, HIDDEN, INTER, seed=seed, skips=True)
        args = (x, w13, w2, p.ids, p.weights, None)
        assert torch.equal(run(interpreter, args, w.options), run(interpreter, args, SEP))
        counters = kept_counters(interpreter, args, w.options)
        assert counters.data_ptr() == kept.data_ptr() and bool((counters == 0).all())


@pytest.mark.parametrize("way", WAYS)
def test_given_counters_as_a_graph_capture_passes_them(interpreter, launch_log, way):
    """``counters=`` (what a CUDA graph capture passes: the pool keeps none then) runs the k-sum with them and
    leaves them at zero; the result equals the eager call's; counters not int32 (or too few) are refused."""
    options = WAYS[way].options
    args = problem(5, 6, 8, True, seed=7)
    eager = run(interpreter, args, options)
    launch_log.take()
    counters = torch.zeros(plan_for(*args[:6], "silu", SMALL, options).workspace.counters, dtype=torch.int32)
    for _ in range(2):
        assert torch.equal(run(interpreter, args, options, counters=counters), eager)
        assert bool((counters == 0).all())
    assert [name for name, _ in launch_log.take()].count("sum_slots_kernel") == 0
    for bad in (counters[:-1], counters.long()):
        with pytest.raises(ValueError, match="counters must be int32"):
            run(interpreter, args, options, counters=bad)


@pytest.mark.parametrize("way", WAYS)
def test_no_tokens(interpreter, launch_log, way):
    out = run(interpreter, problem(0, 2, 4, False, seed=0), WAYS[way].options)
    assert out.shape == (0, HIDDEN) and launch_log.take() == []
