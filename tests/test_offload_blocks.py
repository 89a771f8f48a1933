"""The expert cache's byte blocks, on a CPU-only machine: every part's view (float weights, each
quantized scheme's q / scale / zero, expert biases) equals the layer's own tensor on the host and, once
fetched, in the slots; the weight views keep the plain contiguous strides; a miss is one ``copy_`` per
block group (recorded by a stub around ``torch.Tensor.copy_``) and consecutive experts into
consecutive slots share one copy per group; the CPU-miss path copies x / ids / weights once each; the
per-layer routing count never calls an op that syncs on CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moekit import MoE, MoEConfig
from moekit.offload import ExpertCache, OffloadStats, OffloadedMoE, link_layers
from moekit.offload import staging
from moekit.routing import route

E, K, N = 8, 64, 32
CASES = {  # name -> (scheme or None, options, expert biases)
    "float": (None, {}, False),
    "float+bias": (None, {}, True),
    "fp8_block": ("fp8_block", {"block_shape": (16, 16)}, False),
    "int8_w8a16+bias": ("int8_w8a16", {}, True),
    "int4_w4a16": ("int4_w4a16", {"group_size": 32}, False),
    "int4_w4a16+bias": ("int4_w4a16", {"group_size": 32}, True),
    "mxfp4": ("mxfp4", {}, False),
}


def _moe(case: str, seed: int = 0) -> MoE:
    scheme, options, bias = CASES[case]
    torch.manual_seed(seed)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, expert_bias=bias),
              backend="grouped_mm", router="torch")
    if bias:
        with torch.no_grad():
            moe.b13.normal_()
            moe.b2.normal_()
    return moe.quantize_(scheme, **options) if scheme else moe


def _reference_parts(moe: MoE) -> dict[str, torch.Tensor]:
    """The layer's own per-part tensors [E, ...], named as the cache names them."""
    parts = {}
    for name, w in (("w13", moe.w13), ("w2", moe.w2)):
        if isinstance(w, torch.Tensor):
            parts[name] = w.detach()
        else:
            parts.update({f"{name}.{field}": t for field, t in w.tensors().items()})
    parts.update({n: b.detach() for n, b in (("b13", moe.b13), ("b2", moe.b2)) if b is not None})
    return parts


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` has no fp8 on the CPU)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _groups(parts: dict[str, torch.Tensor]) -> int:
    """Copies one expert needs: w13 and w2 (or their q) each, plus one for every other part together."""
    return 2 + any(name not in ("w13", "w2", "w13.q", "w2.q") for name in parts)


class _CopyRecorder:
    """Stands in for ``torch.Tensor.copy_`` and records (destination bytes, source bytes) of each call."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[int, int]] = []
        real = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            self.calls.append((dst.numel() * dst.element_size(), src.numel() * src.element_size()))
            return real(dst, src, non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


@pytest.mark.parametrize("case", sorted(CASES))
def test_views_equal_the_parts_on_the_host_and_in_the_slots(case):
    moe = _moe(case)
    reference = _reference_parts(moe)
    off = OffloadedMoE.from_moe(moe, cache_experts=5)
    cache, stats = off.cache, OffloadStats()
    host = cache.host(off.layer_id).parts
    assert sorted(host) == sorted(reference)
    for name, t in reference.items():
        assert _same(host[name], t), name
    cache.ensure(off.layer_id, [6, 1, 2, 4, 7], stats)
    cache.release(off.layer_id, [6, 1, 2, 4, 7])
    w13, w2, b13, b2 = cache.slot_weights
    slots = {}
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, torch.Tensor):
            slots[name] = w
        else:
            slots.update({f"{name}.{field}": t for field, t in w.tensors().items()})
    slots.update({n: b for n, b in (("b13", b13), ("b2", b2)) if b is not None})
    assert sorted(slots) == sorted(reference)
    for expert, slot in cache.cached(off.layer_id).items():
        for name, t in reference.items():
            assert _same(slots[name][slot], t[expert]), (name, expert)
    for name, t in slots.items():
        assert t.shape == (5, *reference[name].shape[1:]) and t.dtype == reference[name].dtype
        if name in ("w13", "w2", "w13.q", "w2.q"):  # the plain tensors the kernels' fast paths take
            assert t.is_contiguous(), name
        else:
            base = t.untyped_storage().data_ptr()  # the block's start (CUDA allocations: 512-byte aligned)
            assert all((t[s].data_ptr() - base) % 256 == 0 for s in range(5)), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_miss_is_one_copy_per_group(case, monkeypatch):
    moe = _moe(case)
    off = OffloadedMoE.from_moe(moe, cache_experts=4)
    cache, stats = off.cache, OffloadStats()
    groups = _groups(_reference_parts(moe))
    assert groups == (3 if case != "float" else 2)
    recorder = _CopyRecorder(monkeypatch)
    cache.ensure(off.layer_id, [5], stats)
    assert len(recorder.calls) == groups
    copied = sum(d for d, _ in recorder.calls)
    assert copied == cache.slot_bytes and all(d == s for d, s in recorder.calls)
    assert cache.expert_bytes <= copied < cache.expert_bytes + 256 * len(_reference_parts(moe))
    small = [t[0].numel() * t.element_size() for name, t in _reference_parts(moe).items()
             if name not in ("w13", "w2", "w13.q", "w2.q")]
    assert copied == cache.expert_bytes + sum(-b % 256 for b in small)  # each small part rounded up to 256
    assert stats.bytes_transferred == cache.expert_bytes


@pytest.mark.parametrize("case", ["float", "int4_w4a16+bias"])
def test_consecutive_experts_into_consecutive_slots_coalesce(case, monkeypatch):
    moe = _moe(case)
    off = OffloadedMoE.from_moe(moe, cache_experts=6)
    cache, stats, layer = off.cache, OffloadStats(), off.layer_id
    groups = _groups(_reference_parts(moe))
    recorder = _CopyRecorder(monkeypatch)
    cache.ensure(layer, [6, 3, 1, 2], stats)  # fresh cache: slots 0..3 take experts 1, 2, 3, 6
    assert cache.cached(layer) == {1: 0, 2: 1, 3: 2, 6: 3}
    assert len(recorder.calls) == 2 * groups  # runs (1, 2, 3) -> slots 0..2 and (6) -> slot 3
    assert [d for d, _ in recorder.calls[:groups]] == [3 * d for d, _ in recorder.calls[groups:]]
    cache.release(layer, [6, 3, 1, 2])
    recorder.calls.clear()
    cache.ensure(layer, [0, 7], stats)  # slots 4 and 5, experts 0 and 7: two runs
    assert len(recorder.calls) == 2 * groups
    reference = _reference_parts(moe)
    parts = cache.host(layer).parts
    for expert, slot in cache.cached(layer).items():
        fetched = off.cache.slot_weights[0]
        w13 = fetched if isinstance(fetched, torch.Tensor) else fetched.q
        assert _same(w13[slot], reference["w13" if "w13" in parts else "w13.q"][expert])


def test_staging_copies_each_input_once_into_one_buffer(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    ids = torch.randint(-1, E, (5, 3), generator=g, dtype=torch.int32)
    weights = torch.rand(5, 3, generator=g)
    recorder = _CopyRecorder(monkeypatch)
    views, event = staging.to_host([x, ids, weights.t()], pin=False)  # a transposed input is packed too
    assert recorder.calls == [(35 * 2, 35 * 2), (15 * 4, 15 * 4), (15 * 4, 15 * 4)] and event is None  # no cat
    for got, want in zip(views, [x, ids, weights.t()]):
        assert got.dtype == want.dtype and torch.equal(got, want) and got.is_contiguous()
    assert views[0].untyped_storage().data_ptr() == views[1].untyped_storage().data_ptr()
    assert staging.to_device(x, torch.device("cpu"), pin=False) is x


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("prefetch", ["router", None])
def test_routing_counts_call_no_op_that_syncs_on_cuda(prefetch):
    cache = ExpertCache(4, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe("float", seed), cache=cache, prefetch=prefetch) for seed in (0, 1)]
    link_layers(layers)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        routing, nxt = _route(layers[0], x), _route(layers[1], x)
        with _OpRecorder() as router_ops:
            _route(layers[1], x)  # the next layer's router, which "router" prefetch runs inside the count
        with _OpRecorder() as recorder:
            tokens, predicted = layers[0]._touched(x, routing)
    syncing = {"aten.bincount", "aten.min", "aten.max", "aten.nonzero", "aten._local_scalar_dense", "aten.unique"}
    extra = [op for op in recorder.ops if op in syncing]
    assert extra == ([op for op in router_ops.ops if op in syncing] if prefetch else []), recorder.ops
    reference = routing.topk_ids.reshape(-1).tolist()
    assert tokens == {e: reference.count(e) for e in set(reference) if e >= 0}
    assert predicted == (sorted(set(nxt.topk_ids.reshape(-1).tolist())) if prefetch else [])


def _route(layer: OffloadedMoE, x: torch.Tensor):
    return route(layer.gate(x), layer.config, layer.e_score_correction_bias)


def test_routing_counts_under_deterministic_algorithms():
    cache = ExpertCache(4, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe("float", seed), cache=cache) for seed in (0, 1)]
    link_layers(layers)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        routing, nxt = _route(layers[0], x), _route(layers[1], x)
        fast = layers[0]._touched(x, routing)
        torch.use_deterministic_algorithms(True)
        try:
            exact = layers[0]._touched(x, routing)
        finally:
            torch.use_deterministic_algorithms(False)
    reference = routing.topk_ids.reshape(-1).tolist()
    assert fast == exact == ({e: reference.count(e) for e in set(reference) if e >= 0},
                             sorted(set(nxt.topk_ids.reshape(-1).tolist())))

