"""The words decode's whole call on the CPU (``triton_wo_words.experts_words``, ``gate_up_words``): its two Gluon
kernels replaced by torch stand-ins that write exactly what the kernels write (h in the stored order or a split's
float32 partials; y's split partials times the routed weight), the x reorder and the k-sum / split_glu launches
interpreted, against ``fused_experts_wo_torch``. What this holds: the host plumbing (buffers, their shapes and
dtypes, the split's rows, the stored order the two kernels agree on, the launches' arguments); the kernels' own
arithmetic and operand order are ``test_triton_wo_words.py``'s and the device check's."""

from __future__ import annotations

import pytest
import torch

from _words_fakes import E, GROUP, K, N, rel, routing, stand_ins  # noqa: F401  (a fixture)
from moekit.experts.triton_wo import WoWeight, fused_experts_wo_torch
from moekit.experts.triton_wo_plan import weight_args
from moekit.layouts.block_aligned import align_block


def _weights(rows: int, cols: int, seed: int) -> WoWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (E, rows, cols // 2), generator=g, dtype=torch.uint8)
    scale = (torch.rand(E, rows, cols // GROUP, generator=g) + 0.5) / (4.6 * cols**0.5)
    zero = torch.randint(0, 16, (E, rows, cols // GROUP), generator=g, dtype=torch.uint8)
    return WoWeight("int4_w4a16", q, scale, zero, GROUP)


@pytest.mark.parametrize("m, split", [(1, 1), (1, 2), (5, 1), (5, 2)])  # the tiny-batch shortcut; 8-row blocks
def test_the_words_call_matches_the_twin(stand_ins, m, split):
    from moekit.experts.triton_wo_words import experts_words

    w13, w2 = _weights(2 * N, K, 1), _weights(K, N, 2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    x, ids, weights = routing(m, m + split)
    layout = align_block(ids, E, 8)
    assert layout.naive == (m == 1)
    out = experts_words(x, a13, a2, ids, weights, layout, split)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-2
    (grid_up, up, _), = stand_ins["gate_up"].log
    (grid_down, down, _), = stand_ins["down"].log
    blocks = ids.numel() if m == 1 else layout.expert_ids.numel()
    assert grid_up == (blocks * N // 32, 1, 1) and up["H_ORDER"] and up["SPLIT"] == 1 and up["NAIVE"] == (m == 1)
    assert grid_down == (blocks * K // 64, split, 1) and down["split_steps"] * split * 256 == N
    assert down["y_ptr"].dtype == (torch.float32 if split > 1 else torch.bfloat16)


def test_the_words_in_flight_reach_both_kernels(stand_ins):
    """``ahead`` (the words' steps in flight, ``gluon_wo_words.words_loop``) is each kernel's AHEAD; one step by
    default. (The loop itself runs on the device only: ``benchmarks/w4g45_device_check.py --aheads 1 2``.)"""
    from moekit.experts.triton_wo_words import experts_words

    w13, w2 = _weights(2 * N, K, 1), _weights(K, N, 2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    x, ids, weights = routing(5, 3)
    layout = align_block(ids, E, 8)
    for ahead in (1, 2):
        out = experts_words(x, a13, a2, ids, weights, layout, 1, **({} if ahead == 1 else {"ahead": ahead}))
        assert rel(out, fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-2
        assert stand_ins["gate_up"].log[-1][1]["AHEAD"] == ahead and stand_ins["down"].log[-1][1]["AHEAD"] == ahead


@pytest.mark.parametrize("split", [1, 2])
def test_the_gate_up_alone_and_split_match_the_twin(stand_ins, split):
    from moekit.experts.triton_wo import apply_glu, dequantize_wo
    from moekit.experts.triton_wo_words import gate_up_words

    w13 = _weights(2 * N, K, 3)
    x, ids, _ = routing(5, 7)
    h = gate_up_words(x, weight_args(w13.q, w13.scale, w13.zero, GROUP), ids, align_block(ids, E, 8), split=split)
    flat = ids.reshape(-1).long()
    want = torch.stack([apply_glu(x[a // 2].double() @ dequantize_wo(w13, K, int(e)).double().t(), "silu")
                        for a, e in enumerate(flat)])
    assert h.shape == (10, N) and rel(h, want) < 1e-2
    (grid, bound, _), = stand_ins["gate_up"].log
    assert grid[1] == split and not bound["H_ORDER"]
    assert bound["h_ptr"].shape == ((10, N) if split == 1 else (split * 10, 2 * N))


def test_the_words_layout_matches_align_block_and_the_call_the_twin(stand_ins):
    """``words_layout``: None where A * 4 <= E (the kernels read the experts from ids), else 8-row blocks by the
    Triton alignment (interpreted) holding what ``align_block``'s hold; the call on either matches the twin."""
    from moekit.experts.triton_wo_words import experts_words, words_layout

    w13, w2 = _weights(2 * N, K, 1), _weights(K, N, 2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    x, ids, weights = routing(1, 4)  # A = 2, E = 8: the shortcut
    assert words_layout(ids, E) is None
    out = experts_words(x, a13, a2, ids, weights, None, 1)
    assert rel(out, fused_experts_wo_torch(x, w13, w2, ids, weights)) < 1e-2
    (grid_up, up, _), = stand_ins["gate_up"].log
    assert up["NAIVE"] and grid_up == (ids.numel() * N // 32, 1, 1)

    def blocks(layout, a: int) -> list:  # each used block's expert and its assignments, in no order
        rows = [[r for r in layout.sorted_ids[8 * i:8 * i + 8].tolist() if r < a]
                for i in range(int(layout.num_padded[0]) // 8)]
        return sorted((int(layout.expert_ids[i]), sorted(r)) for i, r in enumerate(rows))

    x, big, weights = routing(5, 5)  # A = 10 > E / 4: 8-row blocks by the Triton alignment, as align_block's
    aligned = words_layout(big, E)
    assert not aligned.naive and blocks(aligned, big.numel()) == blocks(align_block(big, E, 8), big.numel())
    out = experts_words(x, a13, a2, big, weights, aligned, 1)
    assert rel(out, fused_experts_wo_torch(x, w13, w2, big, weights)) < 1e-2
