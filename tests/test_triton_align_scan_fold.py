"""The alignment's histogram and scan in one launch (``align_hist_scan_kernel``, ``LaunchOptions.align_scan_fold``)
under Triton's interpreter: its histogram rows, chunk bases, counts, padded offsets and row count equal a
reference written here on random routings with empty experts, -1 ids and an expert map; it leaves its
arrival counter at 0; and an experts call with it equals the call without, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import make_problem  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.triton_launch import ALIGN_CHUNK, LaunchOptions, cdiv, kernels, next_pow2  # noqa: E402

E, K, N = 8, 40, 24


def _reference(local: list[int], num_experts: int, e_pad: int, block: int) -> dict:
    """hist [chunks, EP] (bin E: not routed here, and the last chunk's lanes past A), chunk_base (exclusive per expert
    over chunks), counts, offsets (padded to block, exclusive; [E] = rows used) and num_padded, by plain loops."""
    chunks = cdiv(len(local), ALIGN_CHUNK)
    hist = [[0] * e_pad for _ in range(chunks)]
    # the last chunk's padding lanes: bin E
    for a, e in enumerate(local + [num_experts] * (chunks * ALIGN_CHUNK - len(local))):
        hist[a // ALIGN_CHUNK][e] += 1
    base, running = [[0] * e_pad for _ in range(chunks)], [0] * e_pad
    for c in range(chunks):
        for e in range(e_pad):
            base[c][e], running[e] = running[e], running[e] + hist[c][e]
    padded = [(-(-running[e] // block) * block if e < num_experts else 0) for e in range(e_pad)]
    offsets, total = [], 0
    for p in padded:
        offsets.append(total)
        total += p
    return dict(hist=hist, chunk_base=base, counts=running[:num_experts], offsets=offsets, num_padded=[total])


@pytest.mark.parametrize("num_assignments, with_map", [(300, False), (1000, True), (129, False)])
def test_hist_scan_equals_reference(interpreter, num_assignments, with_map):
    g = torch.Generator().manual_seed(num_assignments)
    num_global = 12
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1], dtype=torch.int32) if with_map else None
    high = num_global if with_map else E - 2  # without a map experts 6 and 7 stay empty
    ids = torch.randint(-1, high, (num_assignments,), generator=g, dtype=torch.int32)
    local = []
    for i in ids.tolist():
        e = int(expert_map[i]) if with_map and 0 <= i < num_global else (i if not with_map else -1)
        local.append(e if 0 <= e < E else E)
    e_pad, chunks, block = next_pow2(E + 1), cdiv(num_assignments, ALIGN_CHUNK), 16
    out = {name: torch.full(shape, -7, dtype=torch.int32) for name, shape in
           (("hist", (chunks, e_pad)), ("chunk_base", (chunks, e_pad)), ("counts", (E,)), ("offsets", (e_pad,)),
            ("num_padded", (1,)))}
    arrivals = torch.zeros(3, dtype=torch.int32)
    kernels("align").align_hist_scan_kernel[(chunks,)](
        ids, expert_map if with_map else ids, out["hist"], out["chunk_base"], out["counts"], out["offsets"],
        out["num_padded"], arrivals, num_assignments, E, num_global if with_map else 0, chunks, block, 2,
        CHUNK=ALIGN_CHUNK, E_PAD=e_pad, CHUNK_ROWS=2, HAS_MAP=with_map, PDL=False)
    want = _reference(local, E, e_pad, block)
    for name, value in want.items():
        assert out[name].flatten().tolist() == torch.tensor(value).flatten().tolist(), name
    assert arrivals.tolist() == [0, 0, 0]


@pytest.mark.parametrize("lean", [True, False])
def test_experts_with_fold_equal_without(interpreter, lean):
    """Forced to the three-launch alignment (A = 200): folded, two launches, bit for bit the same output."""
    interpreter.clear_launch_caches()
    three = dict(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0, align_fold_max=0,
                 lean_launch=lean)
    for seed in range(3):
        problem = make_problem(100, 2, E, K, N, torch.bfloat16, seed=seed, skips=True)
        folded = interpreter.experts_triton(*problem, options=LaunchOptions(align_scan_fold=True, **three))
        plain = interpreter.experts_triton(*problem, options=LaunchOptions(**three))
        assert torch.equal(folded, plain)
    from moekit.experts import triton_plan
    from moekit.experts.triton import _WORKSPACES

    assert any(p.align.hist_scan is not None and p.align.launches == 2 for p in triton_plan._PLANS.values())
    assert _WORKSPACES._counters and all(c.eq(0).all() for c in _WORKSPACES._counters.values())  # slot back at 0
