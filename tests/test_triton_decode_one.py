"""The one-launch tiny-batch experts kernel (``triton_decode_one``) under Triton's interpreter, against a
float64 loop written here. The interpreter runs programs one after another in program-id order, so
ticket order is program order and every wait is already satisfied: these tests check the kernel's
logic (phases, tails, an expert hit twice, unrouted slots, the k-sum, counters left at 0); the spin
and memory ordering are the H200's to check (benchmarks/decode_one_device_check.py)."""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreter  # noqa: F401
from moekit.experts.triton_launch import LaunchOptions

# tails everywhere: N = 24 against 16-wide tiles, K = 40 against 16-wide steps and 16-row down tiles
E, N, K = 4, 24, 40
TAILS = dict(block_n_up=16, block_k_up=16, block_k_out=16, block_n_red=16)
IDS = {  # (M, k) -> ids; -1: a slot routed nowhere
    (1, 1): [[2]], (1, 2): [[1, 3]], (2, 1): [[0], [0]], (2, 2): [[1, 3], [3, 0]],
    (1, 8): [[3, 1, 0, 2, 5, 7, 6, 4]], (2, 8): [[0, 1, 2, 3, 4, 5, 6, 7], [7, 7, 1, 0, -1, 2, 3, 6]],
}


def float64_loop(x, w13, w2, ids, weights) -> torch.Tensor:
    """out[t] = sum_j weight[t, j] * w2[e] (silu(w_g[e] x_t) * (w_u[e] x_t)), e = ids[t, j], in float64."""
    num_experts, n = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < num_experts:
                continue
            xt = x[t].double()
            gate = [sum(float(w13[e, c, i]) * float(xt[i]) for i in range(x.shape[1])) for c in range(n)]
            up = [sum(float(w13[e, n + c, i]) * float(xt[i]) for i in range(x.shape[1])) for c in range(n)]
            h = torch.tensor([g / (1.0 + math.exp(-g)) * u for g, u in zip(gate, up)], dtype=torch.float64)
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def _inputs(m: int, k: int, num_experts: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    w13 = torch.randn(num_experts, 2 * N, K, generator=g) / K**0.5
    w2 = torch.randn(num_experts, K, N, generator=g) / N**0.5
    ids = torch.tensor(IDS[(m, k)])
    weights = torch.rand(m, k, generator=g)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("form", ["gemv", "dot", "tiles2", "tiles3"])  # tiles: down tiles per program (K: 3 tiles)
@pytest.mark.parametrize("mk", sorted(IDS), ids=lambda mk: f"M{mk[0]}k{mk[1]}")
def test_matches_float64_loop(interpreter, mk, form):  # noqa: F811
    from moekit.experts.triton_decode_one import DecodeOneConfig, _WORKSPACES, run_decode_one

    x, w13, w2, ids, weights = _inputs(*mk)
    tiles = {"tiles2": dict(down_tiles=2, block_n_red=8), "tiles3": dict(down_tiles=3)}.get(form, {})
    config = DecodeOneConfig(gemv=form != "dot", **{**TAILS, **tiles})
    out = run_decode_one(x, w13, w2, ids, weights, config)
    want = float64_loop(x, w13, w2, ids, weights)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    again = run_decode_one(x, w13, w2, ids, weights, config)
    assert torch.equal(out, again)  # the same order of sums every time
    for ws in _WORKSPACES.values():
        assert int(ws.counters.abs().sum()) == 0  # the kernel leaves its counters at 0 for the next launch


def test_program_id_order_variant(interpreter):  # noqa: F811
    """ticket=False (the A/B of the ticket's cost): the same result, counters back at 0."""
    from moekit.experts.triton_decode_one import _ARENAS, DecodeOneConfig, run_decode_one

    x, w13, w2, ids, weights = _inputs(2, 8)
    out = run_decode_one(x, w13, w2, ids, weights, DecodeOneConfig(ticket=False, **TAILS))
    torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    assert all(int(a.abs().sum()) == 0 for a in _ARENAS.values())


def test_twin_matches_float64_loop(interpreter):  # noqa: F811
    from moekit.experts.triton_decode_one import decode_one_torch

    x, w13, w2, ids, weights = _inputs(2, 8)
    torch.testing.assert_close(decode_one_torch(x, w13, w2, ids, weights).double(),
                               float64_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_default_config_and_wide_tiles(interpreter):  # noqa: F811
    """The heuristic tiles, wider than N and K here: every tile is a tail."""
    from moekit.experts.triton_decode_one import run_decode_one

    x, w13, w2, ids, weights = _inputs(1, 8)
    torch.testing.assert_close(run_decode_one(x, w13, w2, ids, weights).double(),
                               float64_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def _count_runs(monkeypatch, interpreter):  # noqa: F811
    import moekit.experts.triton as tri

    calls = []
    real = tri.run_and_record
    monkeypatch.setattr(tri, "run_and_record", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_option_routes_fitting_calls(interpreter, monkeypatch):  # noqa: F811
    calls = _count_runs(monkeypatch, interpreter)
    x, w13, w2, ids, weights = _inputs(2, 8)
    on = LaunchOptions(decode_one=True)
    out = interpreter.experts_triton(x, w13, w2, ids, weights, options=on)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    interpreter.experts_triton(x, w13, w2, ids, weights)  # the default: off
    assert len(calls) == 1
    x3, ids3, weights3 = x.repeat(3, 1)[:3], ids.repeat(2, 1)[:3], weights.repeat(2, 1)[:3]  # 24 slots > 16
    interpreter.experts_triton(x3, w13, w2, ids3, weights3, options=on)
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["map", "b13", "activation", "transposed_w2", "slots"])
def test_refusals_fall_back(interpreter, monkeypatch, case):  # noqa: F811
    from moekit.experts.triton_decode_one import decode_one_refusal

    calls = _count_runs(monkeypatch, interpreter)
    x, w13, w2, ids, weights = _inputs(1, 2)
    kw = {}
    if case == "map":
        kw["expert_map"] = torch.arange(8, dtype=torch.int32)
    elif case == "b13":
        kw["b13"] = torch.zeros(8, 2 * N)
    elif case == "activation":
        kw["activation"] = "gelu"
    elif case == "transposed_w2":
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    if case == "slots":
        x, ids, weights = x.repeat(9, 1), ids.repeat(9, 1), weights.repeat(9, 1)  # 18 slots
    reason = decode_one_refusal(x, w13, w2, ids, kw.get("expert_map"), kw.get("activation", "silu"), kw.get("b13"))
    assert reason  # a stated reason
    interpreter.experts_triton(x, w13, w2, ids, weights, options=LaunchOptions(decode_one=True), **kw)
    assert not calls


def test_ids_and_weights_dtypes_get_their_own_launch(interpreter):  # noqa: F811
    """A kept launch is compiled for its pointers' dtypes: int32 then int64 ids, float32 then bf16 routed weights."""
    from moekit.experts.triton_decode_one import run_decode_one

    x, w13, w2, ids, weights = _inputs(2, 2)
    for ids_dtype, weights_dtype in ((torch.int32, torch.float32), (torch.int64, torch.float32),
                                     (torch.int64, torch.bfloat16)):
        w = weights.to(weights_dtype)
        out = run_decode_one(x, w13, w2, ids.to(ids_dtype), w)
        torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, w.float()), rtol=1e-5, atol=1e-5)


def test_custom_op_carries_the_options(interpreter, monkeypatch):  # noqa: F811
    """The op's schema takes every LaunchOptions field: decode_one crosses it and routes the call."""
    calls = _count_runs(monkeypatch, interpreter)
    x, w13, w2, ids, weights = _inputs(1, 8)
    out = torch.ops.moekit.triton_experts(x, w13, w2, ids, weights, None, None, None, "silu", True, False, 1.0, None, 0.0,
                                          *LaunchOptions(decode_one=True).as_op_args())
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), float64_loop(x, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)


def test_default_choice_routes_its_cells(interpreter, monkeypatch):  # noqa: F811
    """``decode_one_choice`` (default on) takes the cells of DEFAULT_DECODE_ONE_CHOICE; off, or past it, it does not."""
    import moekit.experts.triton_decode_one as d1

    calls = _count_runs(monkeypatch, interpreter)
    monkeypatch.setattr(d1, "DEFAULT_DECODE_ONE_CHOICE", d1.DecodeOneChoice(max_slots=8, max_expert_elems=3 * N * K))
    x, w13, w2, ids, weights = _inputs(1, 8)
    interpreter.experts_triton(x, w13, w2, ids, weights)
    assert len(calls) == 1
    interpreter.experts_triton(x, w13, w2, ids, weights, options=LaunchOptions(decode_one_choice=False))
    x2, w13, w2, ids2, weights2 = _inputs(2, 8)  # 16 slots > 8
    interpreter.experts_triton(x2, w13, w2, ids2, weights2)
    assert len(calls) == 1


def test_repeated_call_takes_the_fast_path(interpreter, monkeypatch):  # noqa: F811
    """A repeated eager call launches the recorded one-launch sequence (``triton_fast``), bit-equal to the first."""
    calls = _count_runs(monkeypatch, interpreter)
    x, w13, w2, ids, weights = _inputs(2, 8)
    on = LaunchOptions(decode_one=True)
    first = interpreter.experts_triton(x, w13, w2, ids, weights, options=on)
    again = [interpreter.experts_triton(x, w13, w2, ids, weights, options=on) for _ in range(2)]
    assert len(calls) == 1 and all(torch.equal(a, first) for a in again)
    x2 = torch.randn_like(x)  # new values, same kind: the fast path, the new result
    torch.testing.assert_close(interpreter.experts_triton(x2, w13, w2, ids, weights, options=on).double(),
                               float64_loop(x2, w13, w2, ids, weights), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1
