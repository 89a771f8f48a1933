"""The lean eager path of the quantized Triton experts (``triton_quant_fast``) under Triton's interpreter:
fp8_block and every weight-only scheme. A repeated call is served from its kept entry with the plain
path's output bit for bit (``lean_launch=False``), without the argument checks or the plan lookup, also after an
in-place weight update (the launches hold addresses; the kernels read the new values); it misses, running the plain
path, with new weight objects or tensors moved under the same object, new workspaces, a retune, autograd (the custom
op's path), or an expert map;
M = 0 and bad arguments still take the plain path.
"""

from __future__ import annotations

import pytest
import torch

from _helpers import bf16_quantized_pair, bf16_routing, count_calls, quantized_experts_loop, rel_l2

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import clear_config_cache  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N, TOP_K = 4, 64, 32, 2
PLAIN = LaunchOptions(lean_launch=False)
SCHEMES = {"fp8_block": dict(block_shape=(32, 32)), "int8_w8a16": {}, "int4_w4a16": dict(group_size=32),
           "mxfp4": {}}
# fp8 quantizes the activations too (e4m3, ~2^-4 relative per value); the weight-only paths keep bf16 x and h
TOL = {"fp8_block": 8e-2, "int8_w8a16": 2e-2, "int4_w4a16": 2e-2, "mxfp4": 2e-2}


@pytest.fixture
def counts(interpreter, monkeypatch):
    """Counts the calls the quantized fast path served, and the plain path's checks and plan lookups."""
    from moekit.experts import triton_fp8, triton_quant_fast, triton_wo

    seen = count_calls(monkeypatch, {"hits": 0, "checks": 0, "plans": 0}, [
        (triton_quant_fast, "_launch", "hits"), (triton_fp8, "check_fp8_args", "checks"),
        (triton_wo, "check_wo_args", "checks"), (triton_fp8, "plan_for", "plans"), (triton_wo, "wo_plan_for", "plans")])
    interpreter.clear_launch_caches()
    return seen


def _weights(scheme: str, seed: int = 0):
    return bf16_quantized_pair(scheme, E, N, K, SCHEMES[scheme], seed)


def _routing(m: int, seed: int):
    return bf16_routing(m, K, E, TOP_K, seed)


def _same_as_plain(tri, x, q13, q2, ids, weights, plain=None, **kwargs) -> torch.Tensor:
    """The call's output, asserted equal to the plain path's (``plain``: that output, computed before for these
    very inputs; the plain path keeps nothing, so a repeat of it would only cost an interpreted call)."""
    got = tri.experts_triton(x, q13, q2, ids, weights, **kwargs)
    want = tri.experts_triton(x, q13, q2, ids, weights, options=PLAIN, **kwargs) if plain is None else plain
    assert torch.equal(got, want)
    return got


def _kept(tri, scheme: str, m: int = 2):
    """(q13, q2, x, ids, weights): ``scheme``'s weights and an m-row call run twice, each equal to the plain path's
    (the first keeps the entry, the second is served from it)."""
    q13, q2 = _weights(scheme)
    x, ids, weights = _routing(m, 0)
    for _ in range(2):
        _same_as_plain(tri, x, q13, q2, ids, weights)
    return q13, q2, x, ids, weights


# every scheme at one token; one scheme at 5 (several rows a block): M changes only the grids, not the kernels
@pytest.mark.parametrize("scheme, m", [(scheme, 1) for scheme in SCHEMES] + [("int8_w8a16", 5)])
def test_repeated_call_served_equal_to_plain_path(interpreter, counts, scheme, m):
    q13, q2 = _weights(scheme)
    x, ids, weights = _routing(m, 0)
    _same_as_plain(interpreter, x, q13, q2, ids, weights)  # compiles; the entry is recorded after
    assert counts["hits"] == 0
    before = dict(counts)
    for seed in (1, 2):  # new activations and routings of the same kind: served
        x, ids, weights = _routing(m, seed)
        got = _same_as_plain(interpreter, x, q13, q2, ids, weights)
        assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights)) < TOL[scheme]
    assert counts["hits"] - before["hits"] == 2
    assert counts["checks"] - before["checks"] == 2  # the plain calls' only: a served call checks nothing
    assert counts["plans"] - before["plans"] == 2


@pytest.mark.parametrize("scheme", ["fp8_block", "int4_w4a16"])
def test_empty_batch_and_expert_map_take_the_plain_path(interpreter, counts, scheme):
    q13, q2 = _weights(scheme)
    x, ids, weights = _routing(0, 0)
    for _ in range(3):
        assert torch.equal(_same_as_plain(interpreter, x, q13, q2, ids, weights), torch.zeros(0, K).bfloat16())
    x, ids, weights = _routing(3, 1)
    expert_map = torch.tensor([0, -1, 2, 3], dtype=torch.int32)  # expert 1 not local
    plain = interpreter.experts_triton(x, q13, q2, ids, weights, options=PLAIN, expert_map=expert_map)
    for _ in range(3):
        got = _same_as_plain(interpreter, x, q13, q2, ids, weights, plain, expert_map=expert_map)
    assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights, expert_map)) < TOL[scheme]
    assert counts["hits"] == 0


@pytest.mark.parametrize("scheme", ["fp8_block", "mxfp4"])
def test_misses_when_the_weights_change(interpreter, counts, scheme):
    q13, q2 = _weights(scheme)
    x, ids, weights = _routing(4, 0)
    plain = interpreter.experts_triton(x, q13, q2, ids, weights, options=PLAIN)
    for _ in range(3):
        first = _same_as_plain(interpreter, x, q13, q2, ids, weights, plain)
    hits = counts["hits"]
    q13.scale.mul_(2) if scheme == "fp8_block" else q2.q.copy_(q2.q.flip(0))  # in place: the same addresses
    updated = _same_as_plain(interpreter, x, q13, q2, ids, weights)  # served: the kernels read the new values
    assert not torch.equal(updated, first) and counts["hits"] == hits + 1
    want = quantized_experts_loop(x, q13, q2, ids, weights)  # the float64 loop on the updated weights
    assert rel_l2(updated, want) < TOL[scheme] < rel_l2(first, want)
    hits = counts["hits"]
    new13, new2 = _weights(scheme, seed=1)  # new weight objects of the same kind
    _same_as_plain(interpreter, x, new13, new2, ids, weights)
    assert counts["hits"] == hits
    object.__setattr__(new2, "q", new2.q.clone())  # the same object, its tensor moved to new storage
    moved = _same_as_plain(interpreter, x, new13, new2, ids, weights)
    assert counts["hits"] == hits
    assert torch.equal(interpreter.experts_triton(x, new13, new2, ids, weights), moved)
    assert counts["hits"] == hits + 1


def test_misses_after_new_workspaces_a_retune_or_with_autograd(interpreter, counts):
    from moekit.experts import triton_quant_fast, triton_wo

    q13, q2 = _weights("int4_w4a16")
    x, ids, weights = _routing(3, 0)
    want = interpreter.experts_triton(x, q13, q2, ids, weights, options=PLAIN)
    for _ in range(3):
        _same_as_plain(interpreter, x, q13, q2, ids, weights, want)
    hits = counts["hits"]
    triton_wo.LEAN_WORKSPACES.clear()  # the recorded addresses are stale
    _same_as_plain(interpreter, x, q13, q2, ids, weights, want)
    clear_config_cache()  # a retune: every entry dropped
    assert triton_quant_fast.kept_entries() == 0
    _same_as_plain(interpreter, x, q13, q2, ids, weights, want)
    with torch.enable_grad():  # through the custom op (the traced path): the same output
        x_grad = x.clone().requires_grad_()
        got = interpreter.experts_triton(x_grad, q13, q2, ids, weights)
        assert torch.equal(got.detach(), want)
    assert counts["hits"] == hits
    _same_as_plain(interpreter, x, q13, q2, ids, weights, want)
    assert counts["hits"] == hits + 1


def test_fp8_custom_op_equals_served_call(interpreter, counts):
    """The fp8 custom op (what torch.compile and CUDA graphs run) against the fast path's output."""
    q13, q2 = _weights("fp8_block")
    x, ids, weights = _routing(4, 2)
    for _ in range(3):
        served = interpreter.experts_triton(x, q13, q2, ids, weights)
    assert counts["hits"] == 2  # the first call compiles, then is kept
    op = torch.ops.moekit.triton_experts_fp8(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, None, 32, 32,
                                              True, False, False)
    assert torch.equal(op, served)


def test_public_call_checks_what_only_unchecked_calls_kept(interpreter, counts):
    from moekit.experts.triton import experts_triton_unchecked

    q13, q2 = _weights("int8_w8a16")
    x, ids, weights = _routing(2, 0)
    for _ in range(3):
        experts_triton_unchecked(x, q13, q2, ids, weights)
    assert counts["hits"] == 2
    interpreter.experts_triton(x, q13, q2, ids, weights)  # public: the entry vouches for nothing, checked once
    assert counts["hits"] == 2
    with pytest.raises(ValueError, match="topk_ids"):
        interpreter.experts_triton(x, q13, q2, ids[:1], weights[:1])


def test_quantized_layer_served_equal_to_plain_path(interpreter, counts):
    """``MoE.quantize_`` then repeated forwards (``ExpertsCallCache`` tries the fast path first): served, equal."""
    from moekit import MoE, MoEConfig

    config = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K)
    torch.manual_seed(1)
    layer = MoE(config, backend="triton", dtype=torch.bfloat16).eval().quantize_("int4_w4a16", group_size=32)
    x = torch.randn(3, K).bfloat16()
    with torch.no_grad():
        outs = [layer(x) for _ in range(3)]
    assert counts["hits"] == 2 and all(torch.equal(out, outs[0]) for out in outs)


def test_misses_on_another_device_or_stream(interpreter, counts, monkeypatch):
    """An entry kept for another device (its key) or another CUDA stream (its record) never serves."""
    from moekit.experts import triton_quant_fast

    q13, q2, x, ids, weights = _kept(interpreter, "int8_w8a16")
    assert counts["hits"] == 1
    other = torch.device("cuda", 0)  # the kept entry as if it had been kept on a GPU
    memo = triton_quant_fast._MEMO
    for key in list(memo):
        memo[tuple(other if part == x.device else part for part in key)] = memo.pop(key)
    _same_as_plain(interpreter, x, q13, q2, ids, weights)  # misses, kept again for the CPU
    assert counts["hits"] == 1
    for key, entry in memo.items():
        entry.stream = 7  # kept on stream 7; this call's is None
    _same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert counts["hits"] == 1


def test_fp8_entry_misses_under_a_new_default_gluon_choice(interpreter, counts, monkeypatch):
    """An fp8 call kept off the Gluon path is not served once the default choice changes (it may want Gluon)."""
    import moekit.experts.triton_gluon_fp8 as gluon_fp8

    q13, q2, x, ids, weights = _kept(interpreter, "fp8_block")
    assert counts["hits"] == 1
    monkeypatch.setattr(gluon_fp8, "DEFAULT_FP8_CHOICE", gluon_fp8.Fp8GluonChoice(min_flops=None))
    _same_as_plain(interpreter, x, q13, q2, ids, weights)  # misses, kept again under the new choice
    assert counts["hits"] == 1
    _same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert counts["hits"] == 2


@pytest.mark.parametrize("fold,down_split", [(False, 2), (True, 1)])
def test_split_gate_up_served_equal_to_plain_path(interpreter, counts, monkeypatch, fold, down_split):
    # a measured row (``triton_wo_word_winners``) for this tiny shape: the gemv with its gate-up split in 2 (steps
    # of 4 and 2 words: 2 steps each), so the plan has the activation launch (``_kernels/wo_split``), the down GEMM
    # split in 2; or the activation folded into the down GEMM, unsplit, so the lean calls fold the k-sum too
    import importlib

    plans = importlib.import_module("moekit.experts.triton_wo_plan")
    winners = importlib.import_module("moekit.experts.triton_wo_word_winners")
    monkeypatch.setitem(plans.DECODE_MEASURED, ("int4_w4a16", E, N, K), {1: "gemv"})
    monkeypatch.setitem(winners.WORD_WINNERS, ("int4_w4a16", E, N, K, 1),
                        winners.WordPick("gemv", 2, down_split, (64, 4, 2, 0), (64, 2, 2, 0), fold))
    clear_config_cache()
    q13, q2 = _weights("int4_w4a16")
    for seed in (0, 1, 2):  # the first compiles and records; the next two are served
        x, ids, weights = _routing(1, seed)
        got = _same_as_plain(interpreter, x, q13, q2, ids, weights)
        assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights)) < TOL["int4_w4a16"]
    assert counts["hits"] == 2
    assert [(plan.glu is None, plan.glu_fold, plan.split_k) for plan in plans._WO_PLANS.values()] == [
        (fold, fold, down_split)]
    clear_config_cache()


@pytest.mark.parametrize("scheme, field", [("int4_w4a16", "zero"), ("int8_w8a16", "scale")])
def test_misses_when_any_tensor_of_the_layout_moves(interpreter, counts, scheme, field):
    """Every tensor field is in the compared state (int4's three, the others' two): ``.data`` swapped for new storage
    under the same tensor object, or another tensor put on the weight object, misses and runs the plain path."""
    q13, q2, x, ids, weights = _kept(interpreter, scheme)
    hits = counts["hits"]
    t = getattr(q2, field)
    t.data = t.data.clone()  # the same object, new storage: its address moved, its _version did not
    _same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert counts["hits"] == hits
    _same_as_plain(interpreter, x, q13, q2, ids, weights)  # kept again at the new address
    assert counts["hits"] == hits + 1
    object.__setattr__(q13, field, getattr(q13, field).clone())
    _same_as_plain(interpreter, x, q13, q2, ids, weights)
    assert counts["hits"] == hits + 1


def test_batched_hit_hands_the_call_addresses_to_its_one_c_call(interpreter, counts):
    """A hit on a batched sequence (``batch_launch.Batch``, CUDA only) hands its C call the stream, x's, ids' and
    weights' addresses and out, in the order the sequence's launch hands them."""
    from moekit.experts import triton_quant_fast

    q13, q2, x, ids, weights = _kept(interpreter, "fp8_block", 3)
    got = []

    class Batch:
        blob = bytearray(b"blob")

        @staticmethod
        def launch_all(*args):
            got.append(args)

    (entry,) = triton_quant_fast._MEMO.values()
    entry.sequence.batch = Batch
    out = interpreter.experts_triton(x, q13, q2, ids, weights)
    (args,) = got
    assert args[:5] == (Batch.blob, None, x.data_ptr(), ids.data_ptr(), weights.data_ptr())
    assert args[5] is out and out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("scheme,options", [("int4_w4a16", dict(group_size=128)), ("mxfp4", {}), ("int8_w8a16", {})])
def test_mma_decode_served_equal_to_plain_path(interpreter, counts, monkeypatch, scheme, options):
    # a measured entry for this tiny shape picking the word MMA decode (as Mixtral int4 M=8's): its kept calls (the
    # gate-up's split_words argument, SCALE_WORD / PAIRS constexprs) served bit-equal to the plain path
    import importlib

    plans = importlib.import_module("moekit.experts.triton_wo_plan")
    monkeypatch.setitem(plans.DECODE_MEASURED, (scheme, E, N, K), {1: "mma"})
    monkeypatch.setitem(SCHEMES, scheme, options)
    clear_config_cache()
    q13, q2 = _weights(scheme)
    for seed in (0, 1, 2):  # the first compiles and records; the next two are served
        x, ids, weights = _routing(1, seed)
        got = _same_as_plain(interpreter, x, q13, q2, ids, weights)
        assert rel_l2(got, quantized_experts_loop(x, q13, q2, ids, weights)) < TOL[scheme]
    assert counts["hits"] == 2
    assert {plan.decode for plan in plans._WO_PLANS.values()} == {"mma"}
    clear_config_cache()
