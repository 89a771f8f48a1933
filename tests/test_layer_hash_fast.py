"""``HashMoE``'s decode fast path (``moekit.layer_hash_fast``) under Triton's interpreter: a repeated forward with the
one-launch hash router is served and equals the full forward bit for bit (the fast path off) and ``_hash_loop``'s
float64 layer, with the shared expert fused or separate, flat or 3-D; it steps aside, running the full forward, for a
new table tensor, token ids of another dtype or stride, new expert weights, the switch off; an in-place table load is
served with the new table; a token id out of range or a NaN logit on a served call still raises, and the next good call
is right. The torch router never keeps. Tried before forward's checks, it misses what they refuse (their errors); the
gate of up to 8 rows is the gate kernel in both paths; where the router asserts in its kernel the gate, the router and
the experts are joined into one C call, whose served output equals the full forward's (session 49)."""

from __future__ import annotations

import pytest
import torch

from _hash_loop import hash_layer_loop
from _helpers import count_calls
from _threads import in_turn
from _triton_helpers import interpreted
from moekit import HashMoE, MoEConfig, layer_fast
from moekit.layer_hash_fast import HashDecodeFast

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

V, K = 50, 16
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
                   routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=8)


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.routing", "moekit.routing.hash_fused"), \
            interpreted("moekit.experts", "moekit.experts.triton"):
        yield


@pytest.fixture
def hits(monkeypatch):
    """Counts the forwards the fast path served."""
    seen = [0]
    real = HashDecodeFast.__call__

    def counted(self, layer, x2d, token_ids):
        out = real(self, layer, x2d, token_ids)
        seen[0] += out is not None
        return out

    monkeypatch.setattr(HashDecodeFast, "__call__", counted)
    return seen


class _Never:
    """A ``HashDecodeFast`` that keeps nothing: the full forward every time."""

    def __call__(self, layer, x2d, token_ids):
        return None

    def keep(self, layer, x2d, token_ids, logits) -> None:
        pass

    def clear(self) -> None:
        pass


def _pair(fuse_shared: bool = True, router: str = "fused"):
    """(layer, full): the same weights and table; ``full`` never takes the fast path."""
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(HashMoE(CONFIG, backend="triton", router=router, fuse_shared=fuse_shared).eval())
    layers[1]._hash_decode = _Never()
    return layers[0], layers[1]


def _inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, K, generator=g), torch.randint(0, V, shape, generator=g)


@pytest.mark.parametrize("fuse_shared", [True, False])
@pytest.mark.parametrize("shape", [(1,), (8,), (2, 3)])
def test_served_equal_to_full_forward(hits, fuse_shared, shape):
    layer, full = _pair(fuse_shared)
    with torch.no_grad():
        for seed in range(3):
            x, ids = _inputs(shape, seed)
            got = layer(x, token_ids=ids)
            assert torch.equal(got, full(x, token_ids=ids))
    ref = hash_layer_loop(layer, x, ids)  # a served call's output
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert hits[0] == 2  # the first call keeps, the others are served


def _new_table(layer, full, ids):
    t = torch.randint(0, CONFIG.num_experts, (V, CONFIG.top_k))
    layer.tid2eid, full.tid2eid = t, t.clone()
    return ids


def _table_loaded(layer, full, ids):
    t = torch.randint(0, CONFIG.num_experts, (V, CONFIG.top_k))
    layer.load_table_(t), full.load_table_(t)
    return ids


def _int32_ids(layer, full, ids):
    return ids.int()


def _strided_ids(layer, full, ids):
    return torch.stack([ids, ids], dim=1)[:, 0]  # [M], stride 2


def _new_w13(layer, full, ids):
    w = layer.w13.detach() * 2
    layer.w13, full.w13 = torch.nn.Parameter(w), torch.nn.Parameter(w.clone())
    return ids


def _w2_in_place(layer, full, ids):
    layer.w2.mul_(2), full.w2.mul_(2)
    return ids


@pytest.mark.parametrize("change, served", [(_new_table, False), (_table_loaded, True), (_int32_ids, False),
                                            (_strided_ids, False), (_new_w13, False), (_w2_in_place, True)])
def test_steps_aside_when_its_entry_is_stale(hits, change, served):
    layer, full = _pair()
    with torch.no_grad():
        for seed in range(2):
            layer(*_inputs((3,), seed))
        x, ids = _inputs((3,), 2)
        before = full(x, token_ids=ids)
        ids = change(layer, full, ids)
        want = full(x, token_ids=ids)
        if change not in (_int32_ids, _strided_ids):
            assert not torch.equal(want, before)  # the change matters
        hit = hits[0]
        assert torch.equal(layer(x, token_ids=ids), want)
        assert (hits[0] > hit) is served
        assert torch.equal(layer(x, token_ids=ids), want) and hits[0] == hit + 1 + served  # kept again: served


def test_bad_ids_and_logits_on_a_served_call_still_raise(hits):
    layer, full = _pair()
    x, ids = _inputs((2,), 0)
    with torch.no_grad():
        layer(x, token_ids=ids), layer(x, token_ids=ids)
        assert hits[0] == 1
        with pytest.raises(ValueError, match="token_ids"):
            layer(x, token_ids=torch.tensor([0, V]))
        with pytest.raises(ValueError, match="token_ids"):
            layer(x, token_ids=torch.tensor([-1, 0]))
        with pytest.raises(ValueError, match="NaN"):
            layer(torch.full_like(x, float("nan")), token_ids=ids)
        with pytest.raises(TypeError, match="token_ids is required"):
            layer(x)
        with pytest.raises(ValueError, match="shape"):
            layer(x, token_ids=ids[:1])
        assert torch.equal(layer(x, token_ids=ids), full(x, token_ids=ids))  # the flags set back
    assert hits[0] == 2  # the raising calls that reached it were its own: none returned


def test_torch_router_switch_off_and_a_cast_never_serve(hits, monkeypatch):
    layer, full = _pair(router="torch")
    x, ids = _inputs((2,), 0)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(layer(x, token_ids=ids), full(x, token_ids=ids))
        assert not layer._hash_decode._entries
        fused, full = _pair()
        fused(x, token_ids=ids)
        assert len(fused._hash_decode._entries) == 1
        fused.bfloat16(), full.bfloat16()
        assert not fused._hash_decode._entries
        monkeypatch.setattr(layer_fast, "ENABLED", False)
        for _ in range(2):
            assert torch.equal(fused(x.bfloat16(), token_ids=ids), full(x.bfloat16(), token_ids=ids))
    assert hits[0] == 0


def test_tried_first_it_misses_what_forward_refuses(hits):
    """The fast path runs before forward's argument checks: a call those checks refuse misses it and gets their error
    (ids of another shape, x of another width or dtype); a 3-D x and its ids are served once flattened."""
    layer, full = _pair()
    x, ids = _inputs((2,), 0)
    with torch.no_grad():
        layer(x, token_ids=ids)
        layer._hash_decode._entries[2].ok = None  # as a compiled kernel asserting: no host check of the ids after it
        with pytest.raises(ValueError, match="token_ids must have x's shape"):
            layer(x, token_ids=ids[:1])  # [1]: the launch would read past it
        with pytest.raises(ValueError, match="token_ids must have x's shape"):
            layer(x, token_ids=ids[:, None])  # [2, 1]: another shape, the same M
        with pytest.raises(ValueError, match="token_ids must have x's shape"):
            layer(x, token_ids=ids[None, :])  # [1, 2]
        with pytest.raises(ValueError, match="x"):
            layer(torch.randn(2, K + 1), token_ids=ids)
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            layer(x.to(torch.int32), token_ids=ids)
        assert hits[0] == 0
        x3, ids3 = x[None], ids[None]  # [1, 2, K], [1, 2]
        assert torch.equal(layer(x3, token_ids=ids3), full(x3, token_ids=ids3)) and hits[0] == 1


def test_the_gate_kernel_in_both_paths(hits, monkeypatch):
    """With the one-launch hash router the gate of up to 8 rows is the gate kernel (``gate.gate_logits``) in the full
    forward and on the fast path alike: its logits within fp32 rounding of a float64 x @ W^T, equal to the kernel's
    called directly; 9 rows gate through F.linear; the torch router's layer never launches it."""
    from moekit.routing import gate

    launches = count_calls(monkeypatch, {"gate": 0}, [(gate._BoundGate, "__call__", "gate")])
    layer, _ = _pair()
    torch_routed, _ = _pair(router="torch")
    with torch.no_grad():
        for m, kernel in ((1, True), (8, True), (9, False)):
            x, ids = _inputs((m,), m)
            before = launches["gate"]
            logits = layer(x, token_ids=ids, return_aux_loss=True).router_logits  # the full forward's
            assert (launches["gate"] > before) is kernel
            ref = x.double() @ layer.gate.weight.double().t()
            assert ((logits.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
            if kernel:
                assert torch.equal(logits, gate.gate_logits(x, layer.gate.weight))
            layer(x, token_ids=ids)  # kept
            before = launches["gate"]
            layer(x, token_ids=ids)  # served
            assert (launches["gate"] > before) is kernel
        before = launches["gate"]
        torch_routed(*_inputs((2,), 0))
        assert launches["gate"] == before
    assert hits[0] == 3


@pytest.mark.parametrize("fuse_shared", [True, False])
def test_joined_gate_router_and_experts(hits, fuse_shared, monkeypatch):
    """Where the router asserts in its kernel (compiled: no flags) the entry joins the gate launch, the router launch
    (the call's token ids in the aux slot) and the experts' kept call (``KeptCall.joined``; batched only on a GPU);
    a served call through the joint adds the separate shared MLP and equals the full forward. The interpreter keeps
    flags: its routers are made to look compiled (``ok`` None) for the keep, and the joint is a stand-in."""
    from moekit.experts.triton_lean import MAP, X
    from moekit.routing import hash_fused

    layer, full = _pair(fuse_shared)
    x, ids = _inputs((2,), 0)
    with torch.no_grad():
        layer(x, token_ids=ids)
        assert layer._hash_decode._entries[2].joint is None  # interpreted: flags to assert after the launch
        for bound in hash_fused._BOUND.values():
            monkeypatch.setattr(bound, "ok", None)  # set back after the test: the module's bound launches
        layer._hash_decode.clear()
        layer(x, token_ids=ids)
        entry = layer._hash_decode._entries[2]
        (gate, gate_args), (route, route_args) = entry.joint.leads
        assert gate is entry.gate.launch and gate_args[0].index == X and gate_args[3] is entry.logits
        assert route is entry.launch and route_args[0] is entry.logits and route_args[1].index == MAP
        assert route_args[2] is layer.tid2eid and route_args[3:] == (entry.ids, entry.weights, entry.ids)
        seen = []

        def stand_in(x2d, w13, w2, ids_buf, weights_buf, b13, b2, aux):
            seen.append(aux)
            entry.gate(x2d, layer.gate.weight, None, entry.logits)
            entry.launch(entry.logits, aux, layer.tid2eid, ids_buf, weights_buf, entry.ids)
            return layer._experts_call(layer._experts_fn, x2d, w13, w2, ids_buf, weights_buf,
                                       activation=layer.config.activation)

        entry.joint = stand_in
        x2, ids2 = _inputs((2,), 1)
        assert torch.equal(layer(x2, token_ids=ids2), full(x2, token_ids=ids2))
    assert seen == [ids2] and hits[0] == 1


def test_two_threads_calling_in_turn_each_keep_their_own_call(hits):
    """Two request threads calling one hash layer in turn: each thread's first call keeps, its others are served,
    bit-equal to the full forward (session 54: keyed by M alone, each call replaced the other thread's entry and
    none was served)."""
    layer, full = _pair()
    x, ids = _inputs((2,), 0)
    with torch.no_grad():
        want = full(x, token_ids=ids)
    outs = in_turn(lambda: layer(x, token_ids=ids), rounds=3)
    assert len(outs) == 6 and all(torch.equal(out, want) for out in outs)
    assert hits[0] == 4 and len(layer._hash_decode._kept) == 2
