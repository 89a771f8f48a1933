"""The eager layer's decode fast path (``moekit.layer_fast``) under Triton's interpreter: a repeated forward of
up to 256 tokens (one launch for the gate and router up to 8, ``torch.mm`` and the router above) that it serves returns
what the full forward returns, bit for bit (the fast path off), and that is the float64 reference's; and it steps aside,
running the full forward, whenever something its entry was made for changed: a new gate weight tensor, its ``.data``
swapped, a new correction bias, new expert weights, the router or capacity factor set, autograd on, a strided x, another
thread, a cast; an in-place update of a weight is served with the new values. Kinds it never keeps: more than 256
tokens, a gated shared expert."""

from __future__ import annotations

import threading

import pytest
import torch

from _helpers import TOLERANCE as TOL, count_served, rel_l2
from _threads import in_turn
from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, layer_fast
from moekit.experts.reference import experts_reference

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

K, N = 40, 24  # 16-byte weight rows in bf16
CONFIGS = {
    "softmax": MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=8, top_k=2),
    "grouped_shared": MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=16, top_k=4, scoring="sigmoid",
                                n_group=4, topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True,
                                shared_expert_intermediate_size=N),
    # ERNIE-4.5's router: softmax, the bias for the choice, w / max(sum(w), 1e-12) (router="fused": session 49's ern49)
    "ernie": MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=8, top_k=2, use_correction_bias=True,
                       renorm_clamp=1e-12, shared_expert_intermediate_size=N),
}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        yield


@pytest.fixture
def hits(monkeypatch):
    """Counts the forwards the fast path served."""
    seen = [0]
    real = layer_fast.DecodeFast.__call__

    def counted(self, layer, x2d):
        out = real(self, layer, x2d)
        seen[0] += out is not None
        return out

    monkeypatch.setattr(layer_fast.DecodeFast, "__call__", counted)
    return seen


def _pair(name: str, **kwargs):
    """(layer, full): the same weights; ``full`` never takes the fast path."""
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    layer = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16, **kwargs).eval()
    if cfg.use_correction_bias:
        layer.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
    full = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16, **kwargs).eval()
    full.load_state_dict(layer.state_dict())
    full._decode = _Never()
    return layer, full


class _Never:
    """A ``DecodeFast`` that keeps nothing: the full forward every time."""

    def __call__(self, layer, x2d):
        return None

    def keep(self, layer, x2d) -> None:
        pass

    def clear(self) -> None:
        pass


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """float64 experts over the layer's own routing of x (its shared slots included)."""
    routing = layer.route_tokens(x).routing
    return experts_reference(x.double(), layer.w13.double(), layer.w2.double(), routing.topk_ids.long(),
                             routing.topk_weights.double())


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()


# 1 and 8 rows: the one gate + router launch (8 its limit; 3 rows took the same launch and were dropped), 12: the
# torch.mm gate and the router's launch. 256 rows (the fast path's limit) on the softmax plan only: the grouped
# plan's rows above 8 take the same launches as at 12, and its 256-row case alone cost ~50 s under the interpreter
@pytest.mark.parametrize("name, m", [(name, m) for name in ("softmax", "grouped_shared") for m in (1, 8, 12)]
                         + [("softmax", 256), ("ernie", 1), ("ernie", 12)])
def test_served_equal_to_full_forward(hits, name, m):
    layer, full = _pair(name)
    with torch.no_grad():
        for seed in range(3):
            x = _x(m, seed)
            got = layer(x)
            assert torch.equal(got, full(x))
        assert rel_l2(got, _reference(layer, x)) < TOL[torch.bfloat16]  # a served call's output
    assert hits[0] == 2  # the first call keeps, the others are served


def _served_after(hits, layer, full, change, m: int = 2) -> bool:
    """Whether the forward after ``change(layer, full)`` was served; its output must equal full's either way."""
    with torch.no_grad():
        layer(_x(m, 0)), layer(_x(m, 1))
        change(layer, full)
        before = hits[0]
        x = _x(m, 2)
        want = full(x)
        assert torch.equal(layer(x), want)
        served = hits[0] > before
        assert torch.equal(layer(x), want)  # kept again: served from here on
    return served


def _new_gate(layer, full):
    w = torch.randn_like(layer.gate.weight)
    layer.gate.weight, full.gate.weight = torch.nn.Parameter(w), torch.nn.Parameter(w.clone())


def _gate_data(layer, full):
    w = torch.randn_like(layer.gate.weight)
    layer.gate.weight.data, full.gate.weight.data = w, w.clone()


def _gate_in_place(layer, full):
    layer.gate.weight.mul_(-1), full.gate.weight.mul_(-1)


def _new_bias(layer, full):
    b = torch.randn_like(layer.e_score_correction_bias)
    layer.e_score_correction_bias, full.e_score_correction_bias = b, b.clone()


def _bias_in_place(layer, full):
    b = torch.randn_like(layer.e_score_correction_bias)
    layer.e_score_correction_bias.copy_(b), full.e_score_correction_bias.copy_(b)


def _new_w13(layer, full):
    w = layer.w13.detach() * 2
    layer.w13, full.w13 = torch.nn.Parameter(w), torch.nn.Parameter(w.clone())


def _w2_in_place(layer, full):
    layer.w2.mul_(2), full.w2.mul_(2)


def _router(layer, full):
    layer.router = full.router = "torch"


def _capacity(layer, full):
    layer.capacity_factor = full.capacity_factor = 4.0


@pytest.mark.parametrize("change, served", [
    (_new_gate, False), (_gate_data, False), (_gate_in_place, True), (_new_bias, False), (_bias_in_place, True),
    (_new_w13, False), (_w2_in_place, True), (_router, False), (_capacity, False)])
def test_steps_aside_when_its_entry_is_stale(hits, change, served):
    """New tensors, swapped data, another router or capacity: the full forward; an in-place update of the gate
    weight or bias is served with the new values, and of the expert weights too (the routing served, the
    experts through the layer's own call: the backend's fast path misses on the moved version)."""
    layer, full = _pair("grouped_shared")
    assert _served_after(hits, layer, full, change) is served


@pytest.mark.parametrize("change, served", [(_new_gate, False), (_gate_in_place, True), (_bias_in_place, True)])
def test_above_the_one_launch_steps_aside_too(hits, change, served):
    """At 12 tokens (the gate on torch.mm, then the router's own launch) the same rules."""
    layer, full = _pair("grouped_shared")
    assert _served_after(hits, layer, full, change, m=12) is served


def test_two_sizes_in_turn_keep_an_entry_each(hits):
    """A layer called with 1 and 12 tokens in turn (decode and a small prefill, or two batch sizes) keeps one
    entry per M: after each size's first call every call is served, none replaces the other's entry."""
    layer, full = _pair("grouped_shared")
    with torch.no_grad():
        for seed in range(2):  # the second round is served for both sizes: neither keep replaced the other
            for m in (1, 12):
                x = _x(m, seed)
                assert torch.equal(layer(x), full(x))
    assert hits[0] == 2 and sorted(layer._decode._entries) == [1, 12]


def test_autograd_strided_x_another_thread_and_a_cast_take_the_full_forward(hits):
    layer, full = _pair("softmax")
    x = _x(2, 0)
    with torch.no_grad():
        layer(x), layer(x)
    assert hits[0] == 1
    assert torch.equal(layer(x), full(x)) and hits[0] == 1  # grad mode on
    with torch.no_grad():
        wide = torch.cat([x, x], dim=1)[:, :K]  # [2, K], row stride 2K
        assert torch.equal(layer(wide), full(wide)) and hits[0] == 1
        outs = []
        def other_thread():
            with torch.no_grad():  # grad mode is per thread
                outs.append(layer(x))

        thread = threading.Thread(target=other_thread)
        thread.start(), thread.join()
        assert torch.equal(outs[0], full(x)) and hits[0] == 1
        layer.float(), full.float()
        assert len(layer._decode._entries) == 0
        xf = x.float()
        assert torch.equal(layer(xf), full(xf)) and hits[0] == 1


def test_kinds_it_never_keeps(hits):
    layer, _ = _pair("softmax")
    gated = MoE(CONFIGS["grouped_shared"].replace(shared_expert_gate=True), backend="triton", router="fused",
                dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for _ in range(2):
            layer(_x(layer_fast.MAX_ROWS + 1, 0)), gated(_x(1, 0))
    assert hits[0] == 0 and not layer._decode._entries and not gated._decode._entries


def test_switch_off_never_serves(hits, monkeypatch):
    monkeypatch.setattr(layer_fast, "ENABLED", False)
    layer, full = _pair("softmax")
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(layer(_x(1, seed)), full(_x(1, seed)))
    assert hits[0] == 0


def test_kept_experts_call_serves_and_finds_its_entry_again(hits, monkeypatch):
    """The experts' kept call (``triton_fast.KeptCall``): it serves the repeated calls, an in-place update of w13
    too (it holds addresses, never values: the new values are read); a retune's clear misses it once (the layer's
    own experts call runs); on the next call it finds the entry the full path kept since and serves again.
    Outputs equal full's throughout."""
    from moekit.experts import triton_fast

    served = count_served(monkeypatch, triton_fast.KeptCall, "__call__")
    layer, full = _pair("grouped_shared")
    fulls = {}  # seed -> full's output for the weights of the time (full keeps nothing: computed once)

    def run(seed: int) -> int:
        before = served[0]
        x = _x(3, seed)
        if seed not in fulls:
            fulls[seed] = full(x)
        assert torch.equal(layer(x), fulls[seed])
        return served[0] - before

    with torch.no_grad():
        run(0), run(1)  # the first call keeps; the kept call finds its entry once the kernels are compiled
        assert run(2) == 1
        layer.w13.mul_(2), full.w13.mul_(2)
        fulls.clear()
        assert [run(s) for s in range(2)] == [1, 1]
        triton_fast.clear_fast()
        assert [run(s) for s in range(2)] == [0, 1]
    assert hits[0] == 6


def test_forward_tries_it_first_and_still_refuses_bad_input(hits):
    """``MoE.forward`` tries the fast path before its own checks: with an entry kept for M = 2, a bad x still
    raises forward's errors, and a 3-D x of the same tokens is served after the reshape, equal to full's."""
    layer, full = _pair("softmax")
    x = _x(2, 0)
    with torch.no_grad():
        layer(x), layer(x)
        assert hits[0] == 1
        with pytest.raises(ValueError, match="hidden_size"):
            layer(torch.randn(2, K + 8).bfloat16())
        with pytest.raises(TypeError, match="floating-point"):
            layer(torch.ones(2, K, dtype=torch.int32))
        with pytest.raises(TypeError, match="torch.Tensor"):
            layer(x.tolist())
        assert torch.equal(layer(x[None]), full(x[None])) and hits[0] == 2


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_call_without_kept_buffers_routes_as_the_eager_one(hits, name, monkeypatch):
    """A forward with stats (its routing outlives the call, like a CUDA graph capture's) at 6 rows: a sigmoid/grouped
    plan routes with the one gate + router launch into fresh buffers, as the kept path does (its two launches' bits
    differ on the H200); a renormalised softmax plan with the gate kernel and the router's launch (measured bit-equal
    to the one launch, faster in a graph). The same output bit for bit either way."""
    from moekit.routing import gate_route

    launches = [0]
    real = gate_route._BoundGateRoute.__call__

    def counted(self, *args):
        launches[0] += 1
        return real(self, *args)

    monkeypatch.setattr(gate_route._BoundGateRoute, "__call__", counted)
    layer, _ = _pair(name)
    x = _x(6, 0)
    with torch.no_grad():
        plain = layer(x)
        stats = layer(x, return_stats=True)
        assert launches[0] == (2 if name == "grouped_shared" else 1) and torch.equal(stats.out, plain)
        assert torch.equal(stats.router_logits, layer.route_tokens(x, layer._route_ws).router_logits)


def test_two_threads_calling_in_turn_each_keep_their_own_call(hits):
    """A server's two request threads calling one layer in turn: after each thread's first call, every call is
    served, bit-equal to the full forward. Keyed by M alone, each call replaced the other thread's entry: no call was
    ever served (session 54)."""
    layer, full = _pair("softmax")
    x = _x(1, 0)
    with torch.no_grad():
        want = full(x)
    outs = in_turn(lambda: layer(x), rounds=4)
    assert len(outs) == 8 and all(torch.equal(out, want) for out in outs)
    assert hits[0] == 6 and len(layer._decode._kept) == 2  # each thread's first call kept, its other 3 served
