"""The scratch decode's kept plan and lean eager form (``triton_wo_scratch_plan``, served by ``triton_quant_fast``)
under Triton's interpreter, tiny shapes, the decode's thresholds lowered so the chooser takes it there.

A repeated scratch call (one chunk of all experts, or chunks) is served from its kept entry, bit for bit the plain
path's output (``lean_launch=False``) and close to an independent float loop; the plain path binds its dequant and
k-sum launches once per kind; the kept scratch buffer is reported and released; an in-place weight update is served
with the new values; the entry misses with new weight objects, after a release of the kept buffer or a retune; the
custom op (what CUDA graphs run) and a torch.compile(fullgraph) trace equal the served output.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import bf16_quantized_pair, bf16_routing, count_calls, quantized_experts_loop, rel_l2

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import clear_config_cache  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N, TOP_K = 5, 64, 32, 2
PLAIN = LaunchOptions(lean_launch=False)
SCHEMES = {"int8_w8a16": {}, "int4_w4a16": dict(group_size=32), "mxfp4": {}}
EXPERT_BYTES = 2 * N * K * 4  # one expert's w13 in the interpreter's float32 scratch


@pytest.fixture
def scratch(interpreter, monkeypatch):
    """Every call of M >= 1 takes the scratch decode; counts served calls, plain scratch calls and dequant binds."""
    from moekit.experts import triton_quant_fast, triton_wo, triton_wo_plan, triton_wo_scratch, triton_wo_scratch_plan

    monkeypatch.setattr(triton_wo, "SCRATCH_MIN_TOKENS", 1)
    monkeypatch.setattr(triton_wo_plan, "SCRATCH_MIN_TOKENS", 1)
    monkeypatch.setattr(triton_wo_plan, "DECODE_MEASURED", {})
    triton_wo_plan.chosen_decode.cache_clear()
    seen = count_calls(monkeypatch, {"hits": 0, "plain": 0, "binds": 0}, [
        (triton_quant_fast, "_launch", "hits"), (triton_wo, "run_experts_wo_scratch", "plain"),
        (triton_wo_scratch_plan, "dequant_launch", "binds")])
    interpreter.clear_launch_caches()
    yield seen
    triton_wo_plan.chosen_decode.cache_clear()
    interpreter.clear_launch_caches()


def chunked(monkeypatch, experts: int) -> None:
    """Chunks of ``experts`` experts (the scratch cap read per call)."""
    from moekit.experts import triton_wo_scratch

    monkeypatch.setattr(triton_wo_scratch, "SCRATCH_MAX_BYTES", experts * EXPERT_BYTES)


def weights_of(scheme: str, seed: int = 0):
    return bf16_quantized_pair(scheme, E, N, K, SCHEMES[scheme], seed)


def routing(m: int, seed: int):
    return bf16_routing(m, K, E, TOP_K, seed)


def same_as_plain(tri, x, q13, q2, ids, weights) -> torch.Tensor:
    got = tri.experts_triton(x, q13, q2, ids, weights)
    assert torch.equal(got, tri.experts_triton(x, q13, q2, ids, weights, options=PLAIN))
    return got


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("per_chunk,m", [(None, 3), (2, 3), (3, 40)])  # one chunk; 2+2+1; 3+2 with an alignment
def test_repeated_scratch_call_served_equal_to_plain_path(interpreter, scratch, monkeypatch, scheme, per_chunk, m):
    if per_chunk is not None:
        chunked(monkeypatch, per_chunk)
    q13, q2 = weights_of(scheme)
    x, ids, weights = routing(m, 0)
    same_as_plain(interpreter, x, q13, q2, ids, weights)  # compiles and binds; kept after
    assert scratch["hits"] == 0 and scratch["plain"] == 2
    chunks = 1 if per_chunk is None else -(-E // per_chunk)
    assert scratch["binds"] == 2 * chunks  # w13's and w2's dequant per chunk, once for the kind
    for seed in (1, 2):  # new activations and routings of the same kind: served
        x, ids, weights = routing(m, seed)
        got = same_as_plain(interpreter, x, q13, q2, ids, weights)
        assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights)) < 2e-2
    assert scratch["hits"] == 2 and scratch["plain"] == 4 and scratch["binds"] == 2 * chunks


@pytest.mark.parametrize("small", [True, False])  # h and y kept (at most REUSE_MAX_BYTES) or fresh per call
def test_kept_scratch_is_reported_and_released(interpreter, scratch, monkeypatch, small):
    from moekit.experts import triton_quant_fast, triton_wo_scratch_plan
    from moekit.experts.triton_wo_scratch_plan import held_scratch, release_scratch

    chunked(monkeypatch, 2)
    if not small:
        monkeypatch.setattr(triton_wo_scratch_plan, "REUSE_MAX_BYTES", 0)
    q13, q2 = weights_of("int4_w4a16")
    m = 4
    x, ids, weights = routing(m, 0)
    for _ in range(2):
        want = same_as_plain(interpreter, x, q13, q2, ids, weights)
    held = list(held_scratch().values())
    # one buffer: the scratch of one chunk (2 experts' w13), the alignment's few int32, h and y where small
    h_y = m * TOP_K * (N + K) * 4 if small else 0
    assert len(held) == 1 and 2 * EXPERT_BYTES + h_y <= held[0].numel() < 2 * EXPERT_BYTES + h_y + 4096
    (entry,) = triton_quant_fast._MEMO.values()
    assert (entry.fresh is None) == small  # else h and y: one fresh buffer per call
    hits = scratch["hits"]
    release_scratch()
    assert held_scratch() == {}
    assert torch.equal(same_as_plain(interpreter, x, q13, q2, ids, weights), want)  # stale: plain, kept again
    assert scratch["hits"] == hits
    assert torch.equal(same_as_plain(interpreter, x, q13, q2, ids, weights), want)
    assert scratch["hits"] == hits + 1 and len(held_scratch()) == 1


def test_scratch_entry_misses_when_the_weights_change(interpreter, scratch, monkeypatch):
    chunked(monkeypatch, 3)
    q13, q2 = weights_of("int8_w8a16")
    x, ids, weights = routing(3, 0)
    for _ in range(3):
        first = same_as_plain(interpreter, x, q13, q2, ids, weights)
    hits = scratch["hits"]
    q2.q.copy_(q2.q.flip(0))  # in place: the same addresses, served (the kept dequant launches read the new values)
    updated = same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert not torch.equal(updated, first) and scratch["hits"] == hits + 1
    assert rel_l2(updated, quantized_experts_loop(x, q13, q2, ids, weights)) < 2e-2
    hits = scratch["hits"]
    new13, new2 = weights_of("int8_w8a16", seed=1)  # new weight objects of the same kind
    same_as_plain(interpreter, x, new13, new2, ids, weights)
    assert scratch["hits"] == hits
    same_as_plain(interpreter, x, new13, new2, ids, weights)
    assert scratch["hits"] == hits + 1


def test_retune_drops_scratch_plans_and_entries(interpreter, scratch):
    from moekit.experts import triton_quant_fast, triton_wo_scratch_plan

    q13, q2 = weights_of("mxfp4")
    x, ids, weights = routing(3, 0)
    for _ in range(2):
        want = same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert triton_wo_scratch_plan._SCRATCH_PLANS and triton_quant_fast.kept_entries() == 1
    clear_config_cache()
    assert not triton_wo_scratch_plan._SCRATCH_PLANS and triton_quant_fast.kept_entries() == 0
    binds, hits = scratch["binds"], scratch["hits"]
    assert torch.equal(same_as_plain(interpreter, x, q13, q2, ids, weights), want)
    assert scratch["binds"] == binds + 2 and scratch["hits"] == hits  # rebound, plain


def test_custom_op_equals_served_scratch_call(interpreter, scratch, monkeypatch):
    """The custom op (what torch.compile and CUDA graphs run: a fresh scratch per call) against the served call."""
    chunked(monkeypatch, 2)
    q13, q2 = weights_of("int4_w4a16")
    x, ids, weights = routing(5, 3)
    for _ in range(3):
        served = interpreter.experts_triton(x, q13, q2, ids, weights)
    assert scratch["hits"] == 2
    op = torch.ops.moekit.triton_experts_wo(x, q13.q, q13.scale, q13.zero, 32, q2.q, q2.scale, q2.zero, 32, ids,
                                            weights, None, "int4_w4a16", "silu", True, "")
    assert torch.equal(op, served)


def test_kept_chunk_maps_route_each_expert_to_its_chunk(interpreter, scratch, monkeypatch):
    from moekit.experts import triton_wo_scratch_plan

    chunked(monkeypatch, 2)
    q13, q2 = weights_of("int8_w8a16")
    x, ids, weights = routing(3, 0)
    interpreter.experts_triton(x, q13, q2, ids, weights)
    (plan,) = triton_wo_scratch_plan._SCRATCH_PLANS.values()
    assert [(c.expert0, c.count) for c in plan.chunks] == [(0, 2), (2, 2), (4, 1)]
    for chunk in plan.chunks:
        want = [e - chunk.expert0 if chunk.expert0 <= e < chunk.expert0 + chunk.count else -1 for e in range(E)]
        assert chunk.chunk_map.tolist() == want


def test_compiled_scratch_call_equals_served_call(interpreter, scratch, monkeypatch):
    """torch.compile(fullgraph) traces the call through the custom op (a fresh scratch at run time), equal to the
    served eager call and leaving the kept entry as it was."""
    chunked(monkeypatch, 2)
    q13, q2 = weights_of("mxfp4")
    x, ids, weights = routing(4, 5)
    for _ in range(3):
        served = interpreter.experts_triton(x, q13, q2, ids, weights)
    hits = scratch["hits"]
    compiled = torch.compile(lambda x, ids, weights: interpreter.experts_triton(x, q13, q2, ids, weights),
                             fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ids, weights), served)
    assert scratch["hits"] == hits
    assert torch.equal(interpreter.experts_triton(x, q13, q2, ids, weights), served)
    assert scratch["hits"] == hits + 1


@pytest.mark.parametrize("biased", [False, True])
def test_variant_call_runs_scratch_and_only_an_unbiased_one_is_served(interpreter, scratch, monkeypatch, biased):
    """gpt-oss's spec (interleaved rows, clamp, up + 1) on the scratch decode, in chunks: without biases a repeated
    call is kept and served (its kind keyed by the spec: never a silu entry's launches), bit for bit the plain path's;
    with b13 / b2 nothing is kept (every call plain: the biases are each call's), each close to the float64 loop."""
    from _helpers import experts_loop

    from moekit.activations import ActivationSpec

    spec = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=1.0, up_shift=1.0)
    chunked(monkeypatch, 2)
    q13, q2 = weights_of("mxfp4")
    g = torch.Generator().manual_seed(7)
    b13, b2 = ((torch.randn(E, 2 * N, generator=g).bfloat16(), torch.randn(E, K, generator=g).bfloat16()) if biased
              else (None, None))
    for seed in range(3):
        x, ids, weights = routing(4, seed)
        got = interpreter.experts_triton(x, q13, q2, ids, weights, activation=spec, b13=b13, b2=b2)
        plain = interpreter.experts_triton(x, q13, q2, ids, weights, activation=spec, b13=b13, b2=b2, options=PLAIN)
        assert torch.equal(got, plain)
        want = experts_loop(x, q13.dequantize(torch.float64), q2.dequantize(torch.float64), ids, weights, b13=b13,
                            b2=b2, spec=spec)
        assert rel_l2(got, want) < 2e-2
        assert rel_l2(got, interpreter.experts_triton(x, q13, q2, ids, weights, options=PLAIN)) > 0.05  # not silu's
    assert scratch["plain"] == (9 if biased else 7)  # unbiased: the second and third calls served
    assert scratch["hits"] == (0 if biased else 2)
