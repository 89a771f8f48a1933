"""The tiny-batch shortcut up to ``LaunchOptions.shortcut_max_tokens`` tokens (session 53) on the weight-only decodes
and the bf16 path, under Triton's interpreter: at 1, a call of more tokens where A*4 <= E and tokens share experts
runs aligned blocks (an expert's slots in one block, its weights read once) and still equals a float64 per-token
loop written here (``test_triton_wo.loop64``, ``_per_token`` below); one token keeps the shortcut (its k experts
are distinct); the default keeps vLLM's rule. The words decode (Gluon) has no interpreter: its aligned
plan is checked here, its output by ``benchmarks/tiny53_device_check.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import make_problem, routed_slots  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import SHORTCUT_ANY_TOKENS  # noqa: E402
from test_triton_wo import PER, POISON, loop64, problem, rel, wo  # noqa: E402, F401  (wo: fixture)

E, K_SLOTS = 32, 2  # M = 4: A = 8, A*4 = 32 <= E, the shortcut's condition
ALIGNED = replace(POISON, shortcut_max_tokens=1)
SHORTCUT = replace(POISON, shortcut_max_tokens=SHORTCUT_ANY_TOKENS)  # vLLM's rule alone


def shared_ids(m: int) -> torch.Tensor:
    """[m, 2] int32: distinct experts a token, drawn from 3 of the 32, so experts repeat across tokens (expert 9
    in every token: one expert with m slots, more than a 2-row block holds)."""
    pool = torch.tensor([[9, 20], [3, 9], [9, 3], [20, 9], [3, 9]], dtype=torch.int32)
    return pool[:m].contiguous()


def config(decode: str, scheme: str, block_m: int = 16) -> KernelConfig | None:
    """A config each decode takes at the tiny shape (None: the heuristic's)."""
    if decode == "mma":
        tile = GemmTile(32, 128, 1, 1, 1)
    elif decode == "gemv":
        tile = GemmTile(16, 4 * PER[scheme], 1, 1, 1)
    else:
        return None
    return KernelConfig(block_m, tile, tile)


def wo_call(wo, scheme, group, decode, m, block_m, options):
    x, w13, w2, _, weights = problem(wo, scheme, group, m=m, k=K_SLOTS, e=E, hidden=256, n=128, seed=m + block_m)
    ids = shared_ids(m)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    cfg = config(decode, scheme, block_m)
    out = wo.run_experts_wo(x, *args, ids, weights, None, scheme, config=cfg, options=options, decode=decode)
    plan = wo.wo_plan_for(x, *args, ids, weights, None, scheme, "silu", cfg, options, None, decode)
    return out, plan, loop64(x, w13, w2, ids, weights)


CASES = [("tile", "int4_w4a16", 32, 16), ("register", "int4_w4a16", 32, 16), ("mma", "mxfp4", 32, 16),
         ("mma", "int8_w8a16", 0, 16), ("gemv", "int4_w4a16", 128, 1), ("gemv", "int4_w4a16", 128, 2),
         ("gemv", "mxfp4", 32, 2)]


@pytest.mark.parametrize("decode,scheme,group,block_m", CASES)
def test_aligned_past_one_token_equals_float64_loop(wo, decode, scheme, group, block_m):
    out, plan, want = wo_call(wo, scheme, group, decode, 4, block_m, ALIGNED)
    assert plan.align is not None and plan.config.BLOCK_M == block_m  # aligned: expert 9's 4 slots in its blocks
    assert want.norm() > 0.1 and rel(out, want) < 1e-3
    shortcut, plan, _ = wo_call(wo, scheme, group, decode, 4, block_m, SHORTCUT)
    assert plan.align is None and rel(shortcut, want) < 1e-3


def test_default_rule(wo):
    """Today's default (``LaunchOptions()``): vLLM's rule alone, the shortcut at 4 tokens (no device measured the
    aligned layout faster yet: ``benchmarks/tiny53_device_check.py``)."""
    _, plan, _ = wo_call(wo, "int4_w4a16", 32, "tile", 4, 16, POISON)
    assert plan.align is None


@pytest.mark.parametrize("decode,scheme,group,block_m", CASES[:1] + CASES[4:5])
def test_one_token_keeps_the_shortcut(wo, decode, scheme, group, block_m):
    out, plan, want = wo_call(wo, scheme, group, decode, 1, block_m, ALIGNED)
    assert plan.align is None and rel(out, want) < 1e-3


def test_words_plan_aligns_past_one_token(wo):
    """The words decode's plan (Gluon kernels: no interpreter) at the same shape: shortcut=False (past
    shortcut_max_tokens) aligns into 8-row blocks, whose bound on the rows (A + E'(8 - 1), E' = min(E, A)) gives as
    many blocks as the shortcut's A; one token keeps the shortcut."""
    from moekit.experts.triton_align import shortcut_allowed
    from moekit.experts.triton_wo_words_lean import words_plan

    x, w13, w2, _, _ = problem(wo, "int4_w4a16", 128, m=4, k=K_SLOTS, e=E, hidden=256, n=256, dtype=torch.bfloat16)
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    ids = shared_ids(4)
    naive = words_plan(x, *args, ids)
    aligned = words_plan(x, *args, ids, shortcut=shortcut_allowed(4, ALIGNED))
    assert naive.align is None and aligned.align is not None and aligned.gate_up.grid == naive.gate_up.grid
    assert shortcut_allowed(1, ALIGNED) and shortcut_allowed(4, SHORTCUT) and not shortcut_allowed(2, ALIGNED)


def test_max_tokens_is_checked():
    from moekit.experts.triton_launch import LaunchOptions

    with pytest.raises(ValueError, match="shortcut_max_tokens must be >= 0"):
        LaunchOptions(shortcut_max_tokens=-1)


def _per_token(p) -> torch.Tensor:
    """bf16 path's reference: out[t] = sum_j w[t, j] * w2[e] @ (silu(gate) * up), float64, one slot at a time."""
    out = torch.zeros(p.x.shape, dtype=torch.float64)
    w13, w2, n = p.w13.double(), p.w2.double(), p.w2.shape[2]
    for t, j, e in routed_slots(p.ids, p.w13.shape[0], None):
        gate_up = w13[e] @ p.x[t].double()
        out[t] += float(p.weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(gate_up[:n]) * gate_up[n:]))
    return out


def test_bf16_path_aligns_past_one_token(interpreter):
    """The 16-bit plan past shortcut_max_tokens: the alignment folded into gate-up (A <= align_fold_max), the output
    the float64 loop's; vLLM's rule alone: the shortcut, the same output."""
    from moekit.experts.triton_plan import plan_for

    p = make_problem(4, K_SLOTS, E, 32, 16, seed=5)
    p = p._replace(ids=shared_ids(4))
    want = _per_token(p)
    for options, aligned in ((ALIGNED, True), (SHORTCUT, False)):
        out = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, options=options)
        plan = plan_for(p.x, p.w13, p.w2, p.ids, p.weights, None, "silu", None, options)
        assert (plan.align is not None) is aligned and (not aligned or plan.align.folded)
        assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
