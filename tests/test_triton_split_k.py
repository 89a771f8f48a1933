"""The gate-up GEMM's split-K (``GemmTile.split_k``: fp32 partials summed through glu by the down GEMM) and the
warp-specialisation flag (``GemmTile.warp_specialize``), under Triton's interpreter: the output equals a
float64 per-token loop on the naive shortcut, the folded and the launched alignment, with an expert map, a
split with no K steps left, and a clamped, shifted, interleaved SwiGLU; the flags are off in the
config files' dicts; a split where the path has none is a clear error."""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import make_problem, routed_slots  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

HIDDEN, INTER = 40, 24  # K = 40: three BLOCK_K = 16 steps, the last 8 wide
OPTIONS = LaunchOptions(poison_workspace=True)
UNFOLDED = LaunchOptions(poison_workspace=True, align_fold_max=0)
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)


def _config(split: int, block_m: int = 16, ws: bool = False) -> KernelConfig:
    return KernelConfig(block_m, GemmTile(16, 16, split_k=split, warp_specialize=ws),
                        GemmTile(16, 16, warp_specialize=ws))


def _glu64(gate_up: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """The gated activation of one row in float64, written out here (gate rows first, or interleaved)."""
    n = gate_up.numel() // 2
    gate, up = (gate_up[0::2], gate_up[1::2]) if spec.interleaved else (gate_up[:n], gate_up[n:])
    if spec.limit is not None:
        gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
    return gate * torch.sigmoid(spec.alpha * gate) * (up + spec.up_shift)


def _per_token(x, w13, w2, ids, weights, spec, expert_map=None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * w2[e] @ glu(w13[e] @ x_t), in float64, one slot at a time."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j, e in routed_slots(ids, w13.shape[0], expert_map):
        h = _glu64(w13[e].double() @ x[t].double(), spec)
        out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def _map(e_global: int, e_local: int) -> torch.Tensor:
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[torch.arange(e_global - e_local, e_global)] = torch.arange(e_local, dtype=torch.int32)
    return expert_map


# (M, k, E, options, with_map): naive shortcut (A*4 <= E), folded alignment, launched alignment
CASES = [(1, 8, 40, OPTIONS, False), (5, 2, 4, OPTIONS, False), (5, 2, 4, OPTIONS, True), (20, 2, 6, UNFOLDED, False),
         (20, 2, 6, UNFOLDED, True)]


@pytest.mark.parametrize("split", [2, 3, 4])  # 4: K's three steps leave the last split none (its partials 0)
@pytest.mark.parametrize("m,k,e,options,with_map", CASES)
def test_split_k_equals_per_token_loop(interpreter, launch_log, m, k, e, options, with_map, split):
    p = make_problem(m, k, e + 2 if with_map else e, HIDDEN, INTER, seed=m + k + e + split, skips=True)
    expert_map = _map(e + 2, e) if with_map else None
    w13, w2 = p.w13[:e], p.w2[:e]
    got = interpreter.fused_experts(p.x, w13, w2, p.ids, p.weights, expert_map, config=_config(split), options=options)
    ups = [kw for name, kw in launch_log.take() if name == "gate_up_kernel"]
    assert len(ups) == 1 and ups[0]["SPLIT"] == split
    want = _per_token(p.x, w13, w2, p.ids, p.weights, ActivationSpec(), expert_map)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_split_k_applies_the_clamped_interleaved_swiglu(interpreter):
    """The down GEMM's glu of the summed partials takes the gate-up's variant constexprs."""
    p = make_problem(6, 2, 5, HIDDEN, INTER, seed=7)
    got = interpreter.fused_experts(p.x * 4, p.w13, p.w2, p.ids, p.weights, None, GPT_OSS, config=_config(2),
                                    options=OPTIONS)
    want = _per_token(p.x * 4, p.w13, p.w2, p.ids, p.weights, GPT_OSS)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)


def test_split_k_partials_sized_like_the_split(interpreter):
    """The plan's h region holds the fp32 partials [split, A, 2N] instead of h [A, N]."""
    from moekit.experts.triton_plan import plan_for

    p = make_problem(3, 2, 4, HIDDEN, INTER, seed=3)
    plan = plan_for(p.x, p.w13, p.w2, p.ids, p.weights, None, "silu", _config(3), OPTIONS)
    shape = dict(zip(plan.workspace.names, plan.workspace.shapes))["h"]
    assert shape == (3, 6, 2 * INTER) and math.prod(shape) == 3 * 6 * 2 * INTER


def test_warp_specialize_flag_leaves_the_result(interpreter, launch_log):
    """The interpreter ignores the loop attribute: the flagged launch gives the default's output bit for bit."""
    p = make_problem(7, 2, 4, HIDDEN, INTER, seed=5)
    plain = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=_config(1), options=OPTIONS)
    assert not any(kw.get("WS") for _, kw in launch_log.take())  # off by default
    flagged = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=_config(1, ws=True),
                                        options=OPTIONS)
    ran = {name: kw for name, kw in launch_log.take()}
    assert ran["gate_up_kernel"]["WS"] and ran["down_kernel"]["WS"]
    assert torch.equal(plain, flagged)


def test_flags_stay_out_of_config_dicts_unless_set():
    plain = KernelConfig(16, GemmTile(32, 64), GemmTile(32, 64))
    assert set(plain.to_dict()["up"]) == {"BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    split = _config(4, ws=True)
    assert split.to_dict()["up"]["split_k"] == 4 and split.to_dict()["down"]["warp_specialize"]
    assert KernelConfig.from_dict(split.to_dict()) == split


@pytest.mark.parametrize("bad,match", [
    (KernelConfig(16, GemmTile(16, 16), GemmTile(16, 16, split_k=2)), "config.down.split_k"),
    (KernelConfig(16, GemmTile(16, 16, split_k=0), GemmTile(16, 16)), "config.up.split_k must be >= 1"),
])
def test_split_k_where_it_does_not_apply_is_an_error(interpreter, bad, match):
    p = make_problem(2, 2, 4, HIDDEN, INTER, seed=1)
    with pytest.raises(ValueError, match=match):
        interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=bad, options=OPTIONS)


def test_split_k_with_b13_is_an_error(interpreter):
    p = make_problem(2, 2, 4, HIDDEN, INTER, seed=1)
    b13 = torch.zeros(4, 2 * INTER)
    with pytest.raises(ValueError, match="split_k=2 needs a gated activation and no b13"):
        interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=_config(2), options=OPTIONS, b13=b13)


def test_split_k_through_the_lean_launch_and_fast_path(interpreter):
    """Default options (recorded launch sequence, then the repeated call's fast path): the same output as the
    poisoned-workspace call, call after call with new routing."""
    p = make_problem(1, 8, 40, HIDDEN, INTER, seed=9)
    for seed in (9, 10, 9):
        q = make_problem(1, 8, 40, HIDDEN, INTER, seed=seed)
        fast = interpreter.fused_experts(q.x, p.w13, p.w2, q.ids, q.weights, config=_config(4))
        want = _per_token(q.x, p.w13, p.w2, q.ids, q.weights, ActivationSpec())
        assert torch.allclose(fast.double(), want, rtol=1e-5, atol=1e-5)


def test_tuned_split_k_is_dropped_where_the_call_cannot_split(interpreter, monkeypatch):
    """A tuned entry's split-K (config=None) with b13: the call runs unsplit instead of raising."""
    from moekit.experts import triton_plan

    monkeypatch.setattr(triton_plan, "get_config", lambda *a, **kw: _config(3))
    triton_plan.clear_plans()
    p = make_problem(4, 2, 5, HIDDEN, INTER, seed=11)
    b13 = torch.randn(5, 2 * INTER, generator=torch.Generator().manual_seed(12))
    got = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, options=OPTIONS, b13=b13)
    triton_plan.clear_plans()
    want = torch.zeros(p.x.shape, dtype=torch.float64)
    for t, j, e in routed_slots(p.ids, 5):
        h = _glu64(p.w13[e].double() @ p.x[t].double() + b13[e].double(), ActivationSpec())
        want[t] += float(p.weights[t, j]) * (p.w2[e].double() @ h)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
