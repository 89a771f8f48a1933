"""``moekit.offload`` on a CPU-only machine: the "GPU" cache and the host store are both the CPU, so
every path (hits, fetches, evictions, rounds, CPU compute of misses, prefetch) runs its real
bookkeeping; the reference is the plain ``MoE`` the offloaded layer was built from, and the cache's
hit/miss counts are checked against an eviction simulation written here."""

from __future__ import annotations

import warnings

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.activations import ActivationSpec
from moekit.offload import EvictionPolicy, ExpertCache, MissCosts, OffloadedMoE, OffloadStats, link_layers
from moekit.routing import route

from _helpers import TOLERANCE, rel_l2

E, K, N = 8, 32, 16


def _moe(seed: int = 0, **config) -> MoE:
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, **config)
    return MoE(cfg, backend="grouped_mm", router="torch")


def _x(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("place", ["gpu", "cpu", "auto"])
@pytest.mark.parametrize("slots", [1, 3, 8])
def test_offloaded_layer_equals_the_plain_layer(place, slots):
    moe = _moe()
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" mixes the two
    off = OffloadedMoE.from_moe(moe, cache_experts=slots, compute_misses_on=place, costs=costs)
    for seed in range(3):  # later batches meet a warm cache: hits and evictions
        x = _x(13, seed)
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    stats = off.cache.stats
    assert stats.touched == stats.hits + stats.fetched + stats.cpu_experts
    assert stats.bytes_transferred == (stats.fetched + stats.admitted) * 3 * N * K * 4
    if place == "cpu":  # nothing fetched for a forward; the busiest CPU expert is admitted for the next
        assert stats.fetched == 0 and stats.cpu_experts > 0 and stats.admitted > 0 and stats.hits > 0
    if place == "gpu":
        assert stats.cpu_experts == 0 and stats.admitted == 0


@pytest.mark.parametrize("config", [
    {"shared_expert_intermediate_size": 2 * N, "shared_expert_gate": True},
    {"scoring": "sigmoid", "use_correction_bias": True, "n_group": 4, "topk_group": 2},
    {"router_bias": True},  # gpt-oss: the gate's bias (nn.Linear's random init) must carry over
    # session 34's router options: LongCat-Flash's identity experts (gate and bias over E + Z), Cohere2-MoE's averaged
    # shared expert, Llama-4's input-weighted experts (one cached experts call a slot), Laguna's cap with Kolibri's bias
    {"use_correction_bias": True, "num_identity_experts": 3},
    {"shared_expert_intermediate_size": N, "shared_expert_combine": "average"},
    {"shared_expert_intermediate_size": N, "expert_weight_on": "input"},
    {"scoring": "sigmoid", "use_correction_bias": True, "router_logit_softcap": 1.0, "correction_bias_on": "logits"},
    # fam34b: Phi-MoE's sparsemixer (eval mode: its training samples), Inkling's router-weighted shared experts
    {"renormalize": False, "sparsemixer_jitter_eps": 0.3},
    {"scoring": "sigmoid", "use_correction_bias": True, "shared_expert_intermediate_size": 2 * N,
     "shared_expert_combine": "router"},
])
def test_shared_expert_and_correction_bias_carry_over(config):
    moe = _moe(**config).eval()
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias.copy_(torch.randn(moe.e_score_correction_bias.shape))
    off = OffloadedMoE.from_moe(moe, cache_experts=4).eval()
    x = _x(9)
    assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("place", ["gpu", "cpu"])
def test_expert_biases_travel_with_their_experts(place):
    moe = _moe(expert_bias=True)
    with torch.no_grad():
        moe.b13.normal_()
        moe.b2.normal_()
    off = OffloadedMoE.from_moe(moe, cache_experts=3, compute_misses_on=place)
    x = _x(9)
    assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.cache.expert_bytes == (3 * N * K + 2 * N + K) * 4


def test_capacity_drops_are_reported_like_the_plain_layer():
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
              capacity_factor=0.5)
    off = OffloadedMoE.from_moe(moe, cache_experts=2)
    x = _x(20)
    ref, got = moe(x, return_stats=True), off(x, return_stats=True)
    assert got.stats.dropped == ref.stats.dropped > 0
    assert rel_l2(got.out, ref.out) < TOLERANCE[torch.float32]



def test_return_aux_loss_is_the_plain_layers():
    """OffloadedMoE takes MoE.forward's return_aux_loss: no stats, the plain layer's aux loss and gate gradient."""
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, aux_loss_coef=0.01,
                        z_loss_coef=0.001), backend="grouped_mm")
    off = OffloadedMoE.from_moe(moe, cache_experts=2)
    x = _x(20)
    ref, got = moe(x, return_aux_loss=True), off(x, return_aux_loss=True)
    assert got.stats is None and rel_l2(got.out, ref.out) < TOLERANCE[torch.float32]
    torch.testing.assert_close(got.aux_loss, ref.aux_loss)
    torch.testing.assert_close(torch.autograd.grad(got.aux_loss, [off.gate.weight])[0],
                               torch.autograd.grad(ref.aux_loss, [moe.gate.weight])[0])

def _simulate(batches: list[list[int]], slots: int, policy: str) -> tuple[int, int]:
    """(hits, misses) of an eviction cache over ``batches`` of touched experts, written independently:
    a batch's experts are all needed at once (never evicted for each other); LRU evicts the oldest
    use, LFU the fewest uses since insertion (ties: oldest use). Batches never exceed ``slots``."""
    cache: dict[int, list[int]] = {}  # expert -> [uses, last tick]
    hits = misses = 0
    for tick, batch in enumerate(batches, start=1):
        for e in batch:
            if e in cache:
                hits += 1
                cache[e][0] += 1
                cache[e][1] = tick
        for e in batch:
            if e in cache:
                continue
            misses += 1
            if len(cache) == slots:
                pool = [v for v in cache if v not in batch]
                rank = (lambda v: cache[v][1]) if policy == "lru" else (lambda v: (cache[v][0], cache[v][1]))
                del cache[min(pool, key=rank)]
            cache[e] = [1, tick]
    return hits, misses


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hits_and_misses_follow_the_policy(policy):
    moe = _moe(3)
    off = OffloadedMoE.from_moe(moe, cache_experts=4, policy=policy, prefetch=None)
    gen = torch.Generator().manual_seed(5)
    batches, x = [], []
    for _ in range(12):  # 1-2 tokens, skewed towards experts 0-2: reuse and evictions both happen
        m = int(torch.randint(1, 3, (1,), generator=gen))
        xb = _x(m, int(torch.randint(0, 1000, (1,), generator=gen)))
        ids = moe.route_tokens(xb).routing.topk_ids
        batches.append(sorted(set(ids.flatten().tolist())))
        x.append(xb)
    for xb in x:
        off(xb)
    hits, misses = _simulate(batches, 4, policy)
    assert (off.cache.stats.hits, off.cache.stats.fetched) == (hits, misses)


def test_layers_share_one_budget_and_prefetch_the_next_layer():
    moes = [_moe(seed) for seed in range(3)]
    cache = ExpertCache(6, device="cpu", policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="router") for m in moes]
    link_layers(layers)
    x = _x(2)
    y_ref = x
    for moe in moes:
        y_ref = moe(y_ref)
    # Layer 0 predicts layer 1's experts from its own input; check the prefetched set before layer 1 runs.
    h = layers[0](x)
    predicted = set(moes[1].route_tokens(x).routing.topk_ids.flatten().tolist())
    assert predicted <= set(cache.cached(layers[1].layer_id))
    assert layers[0].last_stats.prefetched == len(predicted)
    h = layers[2](layers[1](h))
    assert rel_l2(h, y_ref) < TOLERANCE[torch.float32]
    used = set(layers[1]._last_touched) & predicted
    assert layers[1].last_stats.prefetch_used == len(used)
    assert cache.stats.prefetch_used == sum(layer.last_stats.prefetch_used for layer in layers)


def test_previous_step_prediction_prefetches_the_last_touched_set():
    moes = [_moe(seed) for seed in range(2)]
    cache = ExpertCache(2, device="cpu")  # one token touches 2 experts: each layer evicts the other's
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="previous") for m in moes]
    link_layers(layers)
    layers[1](layers[0](_x(1)))  # step 1: layer 1 records what it touched
    first = set(layers[1]._last_touched)
    layers[0](_x(1, seed=7))  # evicts layer 1's experts, then prefetches them back
    assert first == set(cache.cached(layers[1].layer_id))
    assert layers[0].last_stats.prefetched == len(first) == 2


def test_bad_arguments_name_themselves():
    moe = _moe()
    with pytest.raises(ValueError, match="cache_experts"):
        OffloadedMoE.from_moe(moe, cache_experts=0)
    with pytest.raises(ValueError, match="exactly one of cache_experts"):
        OffloadedMoE.from_moe(moe)
    with pytest.raises(ValueError, match="compute_misses_on"):
        OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="disk")
    with pytest.raises(ValueError, match="prefetch"):
        OffloadedMoE.from_moe(moe, cache_experts=2, prefetch="oracle")
    with pytest.raises(ValueError, match="policy"):
        OffloadedMoE.from_moe(moe, cache_experts=2, policy="fifo")
    if not torch.cuda.is_available():  # a CPU machine: the GPU cache is refused naming device, not torch's Stream error
        with pytest.raises(RuntimeError, match="device='cuda': the expert cache's slots live on a CUDA GPU"):
            OffloadedMoE.from_moe(moe, cache_experts=2, device="cuda")
    cache = ExpertCache(2, device="cpu")
    OffloadedMoE.from_moe(moe, cache=cache)
    other = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=2 * N, num_experts=E, top_k=2))
    with pytest.raises(ValueError, match="every layer of one ExpertCache"):
        OffloadedMoE.from_moe(other, cache=cache)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policy_victims_match_a_full_scan(policy):
    """The lazy heap names the victims a scan of every key names: lowest (last use) or (uses, last use),
    then the key cached first; several uses in one tick, protected keys and re-insertions included."""
    gen = torch.Generator().manual_seed(3)
    p, state, inserted = EvictionPolicy(policy), {}, 0  # key -> [uses, last use, insertion order]
    for tick in range(300):
        for key in torch.randint(0, 40, (3,), generator=gen).tolist():
            if key in state:
                p.touch(key, tick)
                state[key][:2] = [state[key][0] + 1, tick]
            else:
                p.insert(key, tick)
                state[key], inserted = [0, tick, inserted], inserted + 1
        if tick % 3 == 0:
            protected = set(torch.randint(0, 40, (8,), generator=gen).tolist())
            rank = (lambda k: (state[k][1], state[k][2])) if policy == "lru" else (lambda k: tuple(state[k]))
            expected = sorted((k for k in state if k not in protected), key=rank)[:2]
            assert p.victims(2, protected) == expected
            for key in expected:
                p.remove(key)
                del state[key]


def test_hits_compute_while_the_misses_are_fetched():
    """A forward with hits and misses makes two experts calls: the hits first, issued after the misses'
    copies were started (so on CUDA the copies overlap it), then the fetched misses; the sum is the
    plain layer's output."""
    moe = _moe()
    off = OffloadedMoE.from_moe(moe, cache_experts=6)
    x = _x(5)
    touched = sorted(set(_routing_ids(moe, x)))
    warm = touched[: len(touched) // 2]
    off.cache.ensure(off.layer_id, warm, OffloadStats())
    off.cache.release(off.layer_id, warm)
    calls, real = [], off._experts_fn

    def record(x2d, w13, w2, topk_ids, topk_weights, *, expert_map, **kwargs):
        slots = {s: e for e, s in off.cache.cached(off.layer_id).items()}
        calls.append((sorted(slots[s] for s in expert_map.tolist() if s >= 0), sorted(off.cache.cached(off.layer_id))))
        return real(x2d, w13, w2, topk_ids, topk_weights, expert_map=expert_map, **kwargs)

    off._experts_fn = record
    assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert [c[0] for c in calls] == [warm, touched[len(warm):]]
    assert set(touched) <= set(calls[0][1])  # the misses were in their slots (copies issued) before the hits ran


def _routing_ids(moe: MoE, x: torch.Tensor) -> list[int]:
    return [e for e in route(moe.gate(x), moe.config, moe.e_score_correction_bias).topk_ids.reshape(-1).tolist()
            if e >= 0]


def test_auto_takes_the_gpu_path_where_no_forward_of_that_size_can_use_the_cpu(monkeypatch):
    """"auto" with a CPU side dearer than fetching every expert a batch of M tokens can touch plans by "gpu"
    itself (``cost.cpu_never_wins``, asked once per costs and M): no search, no reuse estimate, the same
    output and counts as the "gpu" layer; where the CPU can win at M (cheap CPU) it plans by "auto"."""
    from moekit.offload import CpuRate, layer as layer_mod, plan as plan_mod
    from _helpers import count_calls

    dear = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1.0, cpu_token_s=0.0, cpu_step_s=1.0)
    gpu = OffloadedMoE.from_moe(_moe(), cache_experts=3, compute_misses_on="gpu", costs=dear)
    auto = OffloadedMoE.from_moe(_moe(), cache_experts=3, compute_misses_on="auto", costs=dear, cpu_rate=CpuRate())
    places = []
    real = layer_mod.plan_forward
    monkeypatch.setattr(layer_mod, "plan_forward", lambda cache, layer, place, *a: places.append(place)
                        or real(cache, layer, place, *a))
    seen = count_calls(monkeypatch, {"never": 0, "split": 0, "room": 0}, [
        (plan_mod, "cpu_never_wins", "never"), (plan_mod, "split_misses", "split"),
        (plan_mod, "room_of", "room")])
    for seed in range(6):  # M = 1: misses, hits and evictions in a 3-slot cache
        x = _x(1, seed)
        torch.testing.assert_close(auto(x), gpu(x), rtol=0, atol=0)
        assert auto.last_stats == gpu.last_stats
    assert set(places) == {"gpu"} and seen == {"never": 1, "split": 0, "room": 0}
    cheap = MissCosts(link_bytes_per_s=1e3, cpu_expert_s=1e-9, cpu_token_s=0.0)
    auto.costs = cheap
    places.clear()
    auto(_x(4, 9))
    assert places == ["auto"] and seen["never"] == 2 and auto.last_stats.cpu_experts > 0


@pytest.mark.parametrize("options", [dict(num_identity_experts=4, renormalize=False, use_correction_bias=True),
                                     dict(scoring="sigmoid", shared_expert_intermediate_size=N,
                                          shared_expert_combine="router")], ids=["identity", "inkling"])
def test_router_prefetch_predicts_the_next_layers_routed_experts_only(options):
    """The next layer's router over E + Z (LongCat-Flash) or E + S (Inkling): the prefetch takes its routed choice,
    never an identity id (no expert) nor a shared slot."""
    moes = [_moe(seed, **options) for seed in range(2)]
    cache = ExpertCache(16, device="cpu")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="router") for m in moes]
    link_layers(layers)
    x = _x(6)
    h = layers[0](x)
    ids = moes[1].route_tokens(x).selected_ids.flatten().tolist()  # the router's choice, identity ids included
    predicted = {i for i in ids if i < E}
    assert set(cache.cached(layers[1].layer_id)) >= predicted and layers[0].last_stats.prefetched == len(predicted)
    assert rel_l2(layers[1](h), moes[1](moes[0](x))) < TOLERANCE[torch.float32]


def test_forward_under_autograd_gives_the_values_and_backward_says_why_it_cannot():
    """Without no_grad the forward runs as before (a plain MoE's values); its backward is refused naming the layer,
    not autograd's "modified by an inplace operation" about a cache slot the next fetch overwrote."""
    moe = _moe()
    layer = OffloadedMoE.from_moe(moe, cache_experts=4)
    x = _x(5).requires_grad_()
    out = layer(x)
    assert rel_l2(out, moe(x)) < TOLERANCE[torch.float32]
    with pytest.raises(RuntimeError, match="OffloadedMoE has no backward: its experts are cache slots"):
        out.sum().backward()
    with torch.no_grad():
        assert not layer(x).requires_grad


def test_quantize_and_a_cast_are_refused_where_they_would_not_reach_the_cached_experts():
    """``quantize_`` of an OffloadedMoE quantized its empty own w13 (the repr said quant=int8_w8a16) while the cache
    kept serving the float experts: the output stayed the float layer's. ``.to(torch.bfloat16)`` cast the gate and the
    shared expert, not the cached experts, and the forward failed on "x, w13 and w2 must share a dtype". Both are
    refused naming the order that works; a move, a same-dtype call and a quantized layer's cast (quantized experts
    take any x dtype, as the plain layer's) still work."""
    moe = _moe(shared_expert_intermediate_size=N)
    off = OffloadedMoE.from_moe(moe, cache_experts=3, device="cpu")
    x = _x(7)
    want = off(x)
    with pytest.raises(ValueError, match=r"quantize the MoE, then offload it: OffloadedMoE.from_moe\(moe.quantize_\("):
        off.quantize_("int8_w8a16")
    with pytest.raises(TypeError, match="its experts are torch.float32 in its ExpertCache, which a cast of the layer"):
        off.to(torch.bfloat16)
    assert off.quant_scheme is None and off.gate.weight.dtype == torch.float32
    assert torch.equal(off.to("cpu").float()(x), want)
    assert rel_l2(want, moe(x)) < TOLERANCE[torch.float32]
    quantized = _moe().quantize_("int8_w8a16")
    off_q = OffloadedMoE.from_moe(quantized, cache_experts=3, device="cpu").to(torch.bfloat16)
    assert rel_l2(off_q(x.bfloat16()).float(), quantized.to(torch.bfloat16)(x.bfloat16()).float()) < 1e-2


def test_a_private_cache_is_capped_at_the_layers_experts():
    """cache_experts=99 on E = 8 held 99 slots ([99, 2N, K]: 91 no expert can fill); capped at E with one warning,
    the outputs those of a shared cache of 99 slots (what the private one was) and of the plain layer."""
    moe, x = _moe(), _x(13)
    with pytest.warns(UserWarning, match=r"^cache_experts=99 asks for 99 expert slots, more than the 8 experts that "
                                         r"can register: the cache holds 8") as caught:
        off = OffloadedMoE.from_moe(moe, cache_experts=99)
    assert len(caught) == 1 and off.cache.cache_experts == E
    assert off.cache.slot_weights[0].shape == (E, 2 * N, K) and off.cache.slot_weights[1].shape == (E, K, N)
    wide = OffloadedMoE.from_moe(moe, cache=ExpertCache(99, device="cpu"))  # a shared cache is taken as given
    assert wide.cache.slot_weights[0].shape == (99, 2 * N, K)
    with torch.no_grad():
        for seed in range(2):
            x = _x(13, seed)
            assert torch.equal(off(x), wide(x)) and rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OffloadedMoE.from_moe(moe, cache_experts=E).cache.cache_experts == E  # E itself: no warning


def test_a_fused_shared_expert_with_an_interleaved_activation_is_unfused_in_its_row_order():
    """gpt-oss's interleaved activation (row 2i gate i, row 2i+1 up i) on a fused shared expert: from_moe's separate
    shared MLP keeps each slot's interleaved rows (the fuzzer's offloaded layers found it split them as gate rows
    then up rows: 70% off, fuz44); the plain activation's split is unchanged."""
    gpt_oss = ActivationSpec(name="silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
    for activation in ("silu", gpt_oss):
        cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2,
                        shared_expert_intermediate_size=16, activation=activation)
        torch.manual_seed(0)
        moe = MoE(cfg, fuse_shared=True).eval()
        off = OffloadedMoE.from_moe(moe, cache_experts=2, device="cpu")
        x = torch.randn(5, 16)
        with torch.no_grad():
            assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32], activation


def test_from_moe_keeps_the_layers_mode():
    """from_moe's layer is in ``moe``'s mode (moe_from_hf sets it from the HF block): an eval Phi-MoE layer (its
    router refuses training) offloaded runs at once; it came back in training mode and raised (fuz44)."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2, renormalize=False,
                    sparsemixer_jitter_eps=0.01)
    torch.manual_seed(0)
    moe = MoE(cfg).eval()
    off = OffloadedMoE.from_moe(moe, cache_experts=2, device="cpu")
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert not off.training and rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert OffloadedMoE.from_moe(moe.train(), cache_experts=2, device="cpu").training
