"""The problem, call and kept counters that the down GEMM's k-sum tests share (``test_triton_ksum_fold``: the sum
folded into the down epilogue; ``test_triton_sum_after``: in the programs after the GEMM's), under Triton's
interpreter: both hold their path against the separate k-sum launch (``SEP``) on the same small config."""

from __future__ import annotations

import torch

from _helpers import make_problem, partial_expert_map
from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_plan import plan_for

SEP = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=0)  # the separate k-sum launch
# down BLOCK_N 16: K = 40 is three K tiles, the last one 8 columns wide (an odd tail)
SMALL = KernelConfig(16, GemmTile(16, 32), GemmTile(16, 16))
HIDDEN, INTER = 40, 24


def problem(m, k, e, with_map, seed):
    """(x, w13, w2, ids, weights, expert_map): with a map, ids range over e + 3 global experts, e of them here
    (the other 3 map to -1)."""
    p = make_problem(m, k, e + 3 if with_map else e, HIDDEN, INTER, seed=seed, skips=True)
    expert_map = partial_expert_map(e + 3, e, seed) if with_map else None
    return p.x, p.w13[:e], p.w2[:e], p.ids, p.weights, expert_map


def run(interpreter, args, options, **kw):
    """``fused_experts`` of ``problem``'s args on SMALL with ``options``."""
    x, w13, w2, ids, weights, expert_map = args
    return interpreter.fused_experts(x, w13, w2, ids, weights, expert_map, config=SMALL, options=options, **kw)


def kept_counters(interpreter, args, options) -> torch.Tensor:
    """The pool's kept counters that a call of ``problem``'s args with ``options`` uses."""
    x, w13, w2, ids, weights, expert_map = args
    plan = plan_for(x, w13, w2, ids, weights, expert_map, "silu", SMALL, options)
    return interpreter._WORKSPACES.buffers(plan.workspace, x.device)["counters"]
