"""The words decode's call as a plan and its lean launch (``triton_wo_words_lean``) on the CPU: the two Gluon kernels
as torch stand-ins (``_words_fakes``), the x reorder, the alignment and the k-sum interpreted. A repeated call of a
kind is served from its recorded sequence with the first call's output bit for bit, and both match a float64 loop
written here; a new shape, a new weight tensor or (mxfp4) an in-place scale update misses and records again; while a
graph would capture the call runs the plan's launches on fresh regions (no pooled buffer), with the same output."""

from __future__ import annotations

import pytest
import torch

from _words_fakes import E, GROUP, K, N, dequant, rel, routing, stand_ins  # noqa: F401  (a fixture)
from moekit.experts.triton_lean import LaunchSequence
from moekit.experts.triton_wo_plan import weight_args
import moekit.experts.triton_wo_words_lean as lean

MX = {"int4_w4a16": False, "mxfp4": True}


def _weight(rows: int, cols: int, seed: int, mx: bool):
    """int4 (groups of GROUP, zero points) or mxfp4 (e8m0 scales 118-126) ``WeightArgs`` [E, rows, cols]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    if mx:
        scale = torch.randint(118, 127, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        return weight_args(q, scale, None, 32)
    scale = (torch.rand(E, rows, cols // GROUP, generator=g) + 0.5) / (4.6 * cols**0.5)
    zero = torch.randint(0, 16, (E, rows, cols // GROUP), generator=g, dtype=torch.uint8)
    return weight_args(q, scale, zero, GROUP)


def loop64(x, w13, w2, ids, weights) -> torch.Tensor:
    """out [M, K] float64: each token's slots, one at a time, from the weights dequantized in float64 (h rounded to
    bf16 as the kernels store it)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    n, k = w13.q.shape[1] // 2, x.shape[1]
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            v = dequant(w13.q, w13.scale, w13.zero, e, k) @ x[t].double()
            h = (torch.nn.functional.silu(v[:n]) * v[n:]).bfloat16().double()
            out[t] += float(weights[t, slot]) * (dequant(w2.q, w2.scale, w2.zero, e, n) @ h)
    return out


@pytest.fixture
def launched(monkeypatch):
    """Counts the sequences' launches (lean calls) and the plans built."""
    seen = {"lean": 0, "plans": 0}
    launch, plan = LaunchSequence.launch, lean._plan

    def counted_launch(self, values, stream=None):
        seen["lean"] += 1
        return launch(self, values, stream)

    def counted_plan(*key):
        seen["plans"] += 1
        return plan(*key)

    monkeypatch.setattr(LaunchSequence, "launch", counted_launch)
    monkeypatch.setattr(lean, "_plan", counted_plan)
    return seen


@pytest.mark.parametrize("scheme, m", [("int4_w4a16", 1), ("int4_w4a16", 5), ("mxfp4", 1), ("mxfp4", 5)])
def test_the_repeated_call_is_lean_and_equal_to_the_first(stand_ins, launched, scheme, m):
    """M = 1: the tiny-batch shortcut (A * 4 <= E); M = 5: 8-row blocks by the Triton alignment."""
    w13, w2 = _weight(2 * N, K, 1, MX[scheme]), _weight(K, N, 2, MX[scheme])
    x, ids, weights = routing(m, m)
    assert lean.words_lean_call(x, w13, w2, ids, weights) is None  # no plan of this kind yet: the caller checks
    first = lean.run_words(x, w13, w2, ids, weights)  # compiles the launches (the interpreter's / stand-ins')
    assert launched == {"lean": 0, "plans": 1}
    second = lean.run_words(x, w13, w2, ids, weights)  # records the sequence and launches it
    third = lean.words_lean_call(x, w13, w2, ids, weights)  # served from the kept sequence
    assert launched == {"lean": 2, "plans": 1}
    assert torch.equal(first, second) and torch.equal(first, third)
    assert rel(first, loop64(x, w13, w2, ids, weights)) < 1e-2
    x2, ids2, weights2 = routing(m, m + 10)  # new activations and routing of the same kind: served
    got = lean.words_lean_call(x2, w13, w2, ids2, weights2)
    assert launched["lean"] == 3 and rel(got, loop64(x2, w13, w2, ids2, weights2)) < 1e-2
    (_, up, _), *_ = stand_ins["gate_up"].log
    assert up["MXFP4"] == MX[scheme] and up["GROUP"] == (32 if MX[scheme] else GROUP) and up["H_ORDER"]


def test_a_new_shape_or_weight_records_again(stand_ins, launched):
    w13, w2 = _weight(2 * N, K, 1, True), _weight(K, N, 2, True)
    x, ids, weights = routing(5, 1)
    for _ in range(2):
        lean.run_words(x, w13, w2, ids, weights)
    assert lean.words_lean_call(x, w13, w2, ids, weights) is not None
    x3, ids3, weights3 = routing(3, 2)  # another M: another plan, nothing kept yet
    assert lean.words_lean_call(x3, w13, w2, ids3, weights3) is None
    moved = weight_args(w13.q.clone(), w13.scale, None, 32)  # the same values at another address
    assert lean.words_lean_call(x, moved, w2, ids, weights) is None
    w2.scale.add_(1)  # in place: the scales' version moved (their range is read again by the caller's check)
    assert lean.words_lean_call(x, w13, w2, ids, weights) is None
    got = lean.run_words(x, w13, w2, ids, weights)  # records for the updated scales
    assert lean.words_lean_call(x, w13, w2, ids, weights) is not None
    assert rel(got, loop64(x, w13, w2, ids, weights)) < 1e-2


def test_while_a_graph_captures_the_call_takes_fresh_regions(stand_ins, launched, monkeypatch):
    """What a capture sees (``torch.cuda.is_current_stream_capturing`` on a CUDA x; here its answer patched in): the
    plan's launches on fresh regions, none of the pool's views (a graph must own its buffers), the same output."""
    w13, w2 = _weight(2 * N, K, 1, False), _weight(K, N, 2, False)
    x, ids, weights = routing(5, 3)
    for _ in range(2):
        want = lean.run_words(x, w13, w2, ids, weights)
    monkeypatch.setattr(lean, "_capturing", lambda device: True)
    pool = lean.LEAN_WORKSPACES.pooled(lean.words_plan(x, w13, w2, ids).workspace, x.device)
    lean_before = launched["lean"]
    assert lean.words_lean_call(x, w13, w2, ids, weights) is None
    got = lean.run_words(x, w13, w2, ids, weights)
    assert launched["lean"] == lean_before and torch.equal(got, want)
    h = stand_ins["gate_up"].log[-1][1]["h_ptr"]
    assert h.data_ptr() != pool["h"].data_ptr()


def test_routed_weights_in_bf16_are_not_lean_but_equal(stand_ins, launched):
    w13, w2 = _weight(2 * N, K, 1, False), _weight(K, N, 2, False)
    x, ids, weights = routing(1, 4)
    for _ in range(2):
        want = lean.run_words(x, w13, w2, ids, weights)
    half = weights.bfloat16()
    assert lean.words_lean_call(x, w13, w2, ids, half) is None  # the down GEMM reads float32: a copy a call
    assert rel(lean.run_words(x, w13, w2, ids, half), want) < 1e-2


@pytest.mark.parametrize("n, k", [(320, 320), (512, 320), (224, 512)])
def test_mxfp4_off_the_256_grid_runs_on_a_kept_padded_copy(stand_ins, launched, n, k):
    """gpt-oss's K = N = 2880 in miniature: the words run a copy padded to multiples of 256 (``triton_wo_words_pad``:
    zero codes past K and N, made once, kept), x reordered with zeros past K; against the float64 loop of the
    originals, lean from the third call."""
    from moekit.experts.triton_wo_words import check_words, check_words_down
    from moekit.experts.triton_wo_words_pad import needs_padding, words_weights

    w13, w2 = _weight(2 * n, k, 5, True), _weight(k, n, 6, True)
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(5, k, generator=g).bfloat16()
    _, ids, weights = routing(5, 9)
    assert needs_padding(x, w13)
    p13, p2, _ = words_weights(w13, w2)
    assert words_weights(w13, w2) == (p13, p2, None)  # kept: the same copy
    check_words(x, p13, 2, cols=2 * p13.q.shape[2])  # what the route checks of the copy passes
    check_words_down(p2, 1)
    assert p13.q.shape == (E, 2 * -(-n // 256) * 256, -(-k // 256) * 128) and p2.q.shape == (E, k, -(-n // 256) * 128)
    outs = [lean.run_words(x, p13, p2, ids, weights) for _ in range(2)]
    outs.append(lean.words_lean_call(x, p13, p2, ids, weights))
    assert launched["lean"] == 2 and all(torch.equal(o, outs[0]) for o in outs)
    assert rel(outs[0], loop64(x, w13, w2, ids, weights)) < 1e-2
    w13.scale.add_(1)  # an original updated in place: a new copy
    assert words_weights(w13, w2)[0].q.data_ptr() != p13.q.data_ptr()


GPT_OSS = dict(interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)  # its ActivationSpec's fields


def loop64_variant(x, w13, w2, ids, weights, b13, b2, interleaved, alpha, limit, up_shift) -> torch.Tensor:
    """out [M, K] float64 by gpt-oss's definition written here: v = w13 x + b13; gate, up its even / odd rows
    (interleaved) or halves; gate <= limit, |up| <= limit; h = gate sigmoid(alpha gate) (up + up_shift) rounded to
    bf16; out += weight (w2 h + b2)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    n, k = w13.q.shape[1] // 2, x.shape[1]
    for t in range(x.shape[0]):
        for slot, e in enumerate(ids[t].tolist()):
            v = dequant(w13.q, w13.scale, w13.zero, e, k) @ x[t].double() + b13[e].double()
            gate, up = (v[0::2], v[1::2]) if interleaved else (v[:n], v[n:])
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (gate * torch.sigmoid(alpha * gate) * (up + up_shift)).bfloat16().double()
            out[t] += float(weights[t, slot]) * (dequant(w2.q, w2.scale, w2.zero, e, n) @ h + b2[e].double())
    return out


@pytest.mark.parametrize("mx, n, k, interleaved", [(True, 512, 512, True), (False, 512, 512, False),
                                                   (True, 320, 320, True), (True, 224, 512, False)])
def test_gpt_oss_biases_and_clamped_swiglu(stand_ins, launched, mx, n, k, interleaved):
    """The words' epilogues with b13 / b2 and the clamped SwiGLU (interleaved rows or not; off the 256 grid on the
    padded copy, b13 padded with it) against the definition's float64 loop, lean from the third call; a new b2
    misses."""
    from moekit.activations import ActivationSpec
    from moekit.experts.triton_wo_words_route import words_variant
    from moekit.experts.triton_wo_words_pad import needs_padding, words_weights

    w13, w2 = _weight(2 * n, k, 7, mx), _weight(k, n, 8, mx)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, k, generator=g).bfloat16() * 4  # sums past the limit: the clamp matters
    b13, b2 = torch.randn(E, 2 * n, generator=g), torch.randn(E, k, generator=g)
    _, ids, weights = routing(5, 11)
    spec = dict(GPT_OSS, interleaved=interleaved)
    variant = words_variant(ActivationSpec("silu", **spec), b13, b2)
    p13, p2, pb13 = words_weights(w13, w2, interleaved, b13) if needs_padding(x, w13) else (w13, w2, b13)
    outs = [lean.run_words(x, p13, p2, ids, weights, variant=variant, b13=pb13, b2=b2) for _ in range(2)]
    outs.append(lean.words_lean_call(x, p13, p2, ids, weights, variant, pb13, b2))
    assert launched["lean"] == 2 and all(torch.equal(o, outs[0]) for o in outs)
    assert rel(outs[0], loop64_variant(x, w13, w2, ids, weights, b13, b2, **spec)) < 1e-2
    assert lean.words_lean_call(x, p13, p2, ids, weights, variant, pb13, b2.clone()) is None
