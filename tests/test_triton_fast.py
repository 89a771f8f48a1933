"""The fast path of a repeated eager Triton experts call (``triton_fast``) under Triton's interpreter: a
call it serves returns what the full path returns (bit for bit, the ``BoundLaunch`` calls with the lean
launch off) and skips the check and the plan lookup; an in-place weight update is served with the new
values (an entry holds addresses, never values); and it misses, running the full path, whenever
something its entry recorded changed: a new weight tensor, a weight whose
``.data`` became another view of the same memory, new workspaces, a retune, autograd, a call that only
``experts_triton_unchecked`` saw (the public call checks it once), another thread; bad arguments still raise.
"""

from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import TOLERANCE as TOL, RacingDict, count_calls, make_problem, rel_l2  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit import MoE, MoEConfig  # noqa: E402
from moekit.experts.configs import clear_config_cache  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N = 8, 40, 24  # 16-byte weight rows in bf16: the TMA descriptor path runs
BOUND = LaunchOptions(lean_launch=False)  # the full path, never kept


def _fast():
    from moekit.experts import triton_fast

    return triton_fast


@pytest.fixture
def counts(interpreter, monkeypatch):
    """Counts the calls the fast path served ("hits"), the plans looked up and the checks run."""
    fast = _fast()
    seen = count_calls(monkeypatch, {"hits": 0, "plans": 0, "checks": 0}, [
        (fast, "launch_lean", "hits"), (interpreter, "plan_for", "plans"),
        (interpreter, "check_experts_args", "checks")])
    interpreter.clear_launch_caches()
    return seen


def _ref(problem):
    x, w13, w2, ids, weights = problem
    return experts_reference(x.double(), w13.double(), w2.double(), ids, weights)


def _same_as_full_path(tri, problem, full=None, **kwargs):
    """The call's output, asserted equal to the full path's (``full``: that output, computed before for these very
    inputs; the full path keeps nothing, so a repeat of it would only cost an interpreted call) and near float64."""
    got = tri.experts_triton(*problem, **kwargs)
    assert torch.equal(got, tri.experts_triton(*problem, options=BOUND) if full is None else full)
    assert rel_l2(got, _ref(problem)) < TOL[torch.bfloat16]
    return got


@pytest.mark.parametrize("m", [1, 8, 33])
def test_repeated_call_served_equal_to_full_path(interpreter, counts, m):
    x, w13, w2, ids, weights = make_problem(m, 2, E, K, N, torch.bfloat16, seed=0, skips=True)
    _same_as_full_path(interpreter, (x, w13, w2, ids, weights))  # compiles: no sequence, nothing kept
    _same_as_full_path(interpreter, (x, w13, w2, ids, weights))  # launches lean: kept
    before = dict(counts)
    for seed in (1, 2):  # new tensors of the same kind: served
        _, _, _, ids, weights = make_problem(m, 2, E, K, N, torch.bfloat16, seed=seed, skips=True)
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
        _same_as_full_path(interpreter, (x, w13, w2, ids, weights))
    assert counts["hits"] - before["hits"] == 2
    assert counts["checks"] - before["checks"] == 2  # the full-path (BOUND) calls' only
    assert counts["plans"] - before["plans"] == 2


def test_misses_when_the_weights_change(interpreter, counts):
    x, w13, w2, ids, weights = make_problem(8, 2, E, K, N, torch.bfloat16, seed=0)
    full = interpreter.experts_triton(x, w13, w2, ids, weights, options=BOUND)
    for _ in range(3):
        _same_as_full_path(interpreter, (x, w13, w2, ids, weights), full)
    hits = counts["hits"]
    w13.mul_(-0.5)  # in place: _version moves, the addresses stay: served, with the new values
    updated = _same_as_full_path(interpreter, (x, w13, w2, ids, weights))
    assert counts["hits"] == hits + 1 and not torch.equal(updated, full)
    hits = counts["hits"]
    new_w2 = w2.clone() * 2  # a new tensor of the same kind
    full = _same_as_full_path(interpreter, (x, w13, new_w2, ids, weights))  # from here on the values are new_w2's
    assert counts["hits"] == hits  # both ran the full path (and were kept again)
    _same_as_full_path(interpreter, (x, w13, new_w2, ids, weights), full)
    assert counts["hits"] == hits + 1
    w2_param = torch.nn.Parameter(new_w2, requires_grad=False)
    _same_as_full_path(interpreter, (x, w13, w2_param, ids, weights), full)
    _same_as_full_path(interpreter, (x, w13, w2_param, ids, weights), full)
    w2_param.data = w2_param.data[:, :, : N - 8]  # the same memory, another shape: no longer fits w13
    with pytest.raises(ValueError, match="w2 must have shape"):
        interpreter.experts_triton(x, w13, w2_param, ids, weights)
    w2_param.data = new_w2  # back: served again once kept
    for _ in range(2):
        _same_as_full_path(interpreter, (x, w13, w2_param, ids, weights), full)
    w2_param.data = new_w2.view(torch.float16)  # the same memory, shape and strides, another dtype
    with pytest.raises(TypeError, match="w2"):
        interpreter.experts_triton(x, w13, w2_param, ids, weights)


def test_misses_after_new_workspaces_a_retune_or_with_autograd(interpreter, counts):
    from moekit.experts.triton import _WORKSPACES

    problem = make_problem(8, 2, E, K, N, torch.bfloat16, seed=3)
    full = interpreter.experts_triton(*problem, options=BOUND)
    for _ in range(3):
        _same_as_full_path(interpreter, problem, full)
    hits = counts["hits"]
    _WORKSPACES.clear()  # the recorded addresses are stale
    _same_as_full_path(interpreter, problem, full)
    clear_config_cache()  # a retune: every entry dropped
    assert len(_fast()._MEMO) == 0
    _same_as_full_path(interpreter, problem, full)
    x, w13, w2, ids, weights = problem
    with torch.enable_grad():
        x_grad = x.clone().requires_grad_()
        got = interpreter.experts_triton(x_grad, w13, w2, ids, weights)  # through the custom op
        assert got.grad_fn is not None and torch.equal(got.detach(), interpreter.experts_triton(*problem))
    assert counts["hits"] == hits  # the retune's new plan compiled, then recorded: nothing served yet
    _same_as_full_path(interpreter, problem, full)
    assert counts["hits"] == hits + 1


def test_public_call_checks_what_only_unchecked_calls_kept(interpreter, counts):
    problem = make_problem(8, 2, E, K, N, torch.bfloat16, seed=4)
    for _ in range(2):
        interpreter.experts_triton_unchecked(*problem)  # kept, unchecked
    checks, hits = counts["checks"], counts["hits"]
    _same_as_full_path(interpreter, problem)  # checks once, then keeps it checked
    assert counts["checks"] == checks + 2 and counts["hits"] == hits  # its own check and BOUND's
    _same_as_full_path(interpreter, problem)
    assert counts["checks"] == checks + 3 and counts["hits"] == hits + 1  # BOUND's only
    x, w13, w2, ids, weights = problem
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        interpreter.experts_triton(x, w13, w2, ids[:4], weights[:4])
    outs = []
    thread = threading.Thread(target=lambda: outs.append(interpreter.experts_triton(*problem)))
    thread.start()
    thread.join()
    assert torch.equal(outs[0], interpreter.experts_triton(*problem, options=BOUND))


def test_layer_served_equal_to_full_path(interpreter, counts):
    config = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    torch.manual_seed(0)
    layer = MoE(config, backend="triton", dtype=torch.bfloat16).eval()
    full = MoE(config, backend="triton", dtype=torch.bfloat16, backend_options={"options": BOUND}).eval()
    full.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(5, K, generator=torch.Generator().manual_seed(seed)).bfloat16()
            assert torch.equal(layer(x), full(x))
        assert counts["hits"] == 2  # the first call compiles, the second records; then served
        with torch.no_grad():
            layer.w13.mul_(2)
        full.load_state_dict(layer.state_dict())
        x = torch.randn(5, K).bfloat16()
        assert torch.equal(layer(x), full(x)) and counts["hits"] == 3  # served after the update, with its values


def test_fast_path_off_never_serves(interpreter, counts):
    problem = make_problem(8, 2, E, K, N, torch.bfloat16, seed=6)
    off = LaunchOptions(fast_path=False)
    outs = [interpreter.experts_triton(*problem, options=off) for _ in range(3)]
    assert counts["hits"] == 0 and len(_fast()._MEMO) == 0
    full = interpreter.experts_triton(*problem, options=BOUND)
    assert all(torch.equal(out, full) for out in outs)


def test_inference_mode_weights_kept_and_updates_seen(interpreter, counts):
    with torch.inference_mode():  # weights without a version counter: an entry needs none (addresses only)
        problem = make_problem(8, 2, E, K, N, torch.bfloat16, seed=7)
        outs = [interpreter.experts_triton(*problem) for _ in range(3)]
        hits = counts["hits"]
        problem.w13.mul_(2)
        after = interpreter.experts_triton(*problem)
        assert counts["hits"] == hits + 1  # served from the kept entry, reading the new values
        assert torch.equal(after, interpreter.experts_triton(*problem, options=BOUND))
        assert rel_l2(after, _ref(problem)) < TOL[torch.bfloat16]
    assert len(_fast()._MEMO) == 1
    assert not torch.equal(after, outs[0])


def test_quantized_weights_never_take_bf16_entries(interpreter, counts):
    """Weight-only quantized weights (not tensors) never use a bf16 entry (their own: ``triton_quant_fast``),
    with or without autograd on."""
    config = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=E, top_k=2)
    torch.manual_seed(1)
    layer = MoE(config, backend="triton", dtype=torch.bfloat16).eval().quantize_("int8_w8a16")
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        want = layer(x)
    with torch.enable_grad():
        outs = [layer(x) for _ in range(2)]
    assert all(torch.equal(out, want) for out in outs) and counts["hits"] == 0


def test_weight_views_made_per_call_never_kept(interpreter, counts):
    """transformers' transposed storage: a new view of the weights per call is never the same object."""
    x, w13, w2, ids, weights = make_problem(8, 2, E, K, N, torch.bfloat16, seed=8)
    w13_t, w2_t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # stored [E, K, 2N], [E, N, K]
    full = interpreter.experts_triton(x, w13_t.transpose(1, 2), w2_t.transpose(1, 2), ids, weights, options=BOUND)
    for _ in range(3):
        _same_as_full_path(interpreter, (x, w13_t.transpose(1, 2), w2_t.transpose(1, 2), ids, weights), full)
    assert counts["hits"] == 0 and len(_fast()._MEMO) == 0


def test_eviction_survives_the_oldest_entry_going_meanwhile(monkeypatch):
    """An entry can go at any moment (its w13 freed: a weakref callback; ``clear_fast``; neither locks):
    evicting the oldest must not fail when it is already gone."""
    fast = _fast()
    monkeypatch.setattr(fast, "_MEMO", RacingDict())
    monkeypatch.setattr(fast, "MAX_ENTRIES", 1)
    x, ids, weights = torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    sets = [(torch.zeros(4, 16, 8), torch.zeros(4, 8, 8)) for _ in range(2)]
    for w13, w2 in sets:  # the second evicts the first, which is already gone
        fast.remember((0, fast._epoch[0]), x, w13, w2, ids, weights, "silu", LaunchOptions(), None, None, True)
    assert len(fast._MEMO) == 1
