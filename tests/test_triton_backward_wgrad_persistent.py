"""The persistent weight-gradient GEMM (``_kernels/wgrad_persistent.py`` through ``weight_grad``) under
Triton's interpreter, tiny shapes, against a float64 per-expert sum written here: 3 programs walk every
tile of every expert (odd R and C: tails clipped; an expert with no rows: a zero grad; experts with more
rows than one step), with pointer and TMA stores, and the same result as the contiguous kernel.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int, empty: int) -> torch.Tensor:
    """[M, k] int32 distinct experts per token; expert ``empty`` never chosen."""
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(num_experts) if e != empty]
    picks = [torch.randperm(len(pool), generator=g)[:top_k] for _ in range(num_tokens)]
    return torch.tensor([[pool[i] for i in p] for p in picks], dtype=torch.int32)


def _want(left, right, r_div, ids, num_experts) -> torch.Tensor:
    """float64 [E, R, C]: per expert, the sum over its assignments a of left[a]^T right[a // r_div]."""
    out = torch.zeros(num_experts, left.shape[1], right.shape[1], dtype=torch.float64)
    for a, e in enumerate(ids.reshape(-1).tolist()):
        out[e] += torch.outer(left[a].double(), right[a // r_div].double())
    return out


def _tile(bl, store_desc: bool, group: int = 2, flat: bool = True):
    return bl.KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True, group=group, persistent=1,
                          store_desc=store_desc, flat=flat)


@pytest.mark.parametrize("top_k,store_desc,empty,flat", [(1, False, 0, True), (2, True, 2, True), (6, False, 6, True),
                                                         (6, True, 3, True), (2, True, 1, False), (6, False, 4, False)])
def test_persistent_weight_grad(interpreter, top_k, store_desc, empty, flat):
    """R=24, C=40 (last tiles cut short), 7 experts, 3 programs; bf16 operands (16-byte rows: TMA); the
    flat loop (tiles x steps) and the nested one."""
    import moekit.experts.triton_backward_launch as bl

    num_tokens, num_experts = 29, 7
    ids = _routing(num_tokens, top_k, num_experts, top_k, empty)
    g = torch.Generator().manual_seed(top_k + 10)
    left = torch.randn(num_tokens * top_k, 24, generator=g).to(torch.bfloat16)  # like dh, per assignment
    right = torch.randn(num_tokens, 40, generator=g).to(torch.bfloat16)  # like x, per token
    layout = bl.align(ids, None, num_experts, 16)
    got = bl.weight_grad(left, 1, right, top_k, num_experts, torch.float32, layout, _tile(bl, store_desc, flat=flat))
    want = _want(left, right, top_k, ids, num_experts)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))
    assert float((got.double() - want).norm() / want.norm()) < 1e-6
    plain = bl.KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True, group=2)
    assert torch.equal(got, bl.weight_grad(left, 1, right, top_k, num_experts, torch.float32, layout, plain))


def test_persistent_runs_the_persistent_kernel(interpreter, monkeypatch):
    """``persistent`` launches the persistent kernel (3 programs), float32 operands (no TMA) the contiguous one."""
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_wgrad as tw

    ids = _routing(20, 2, 5, 0, 1)
    left = torch.randn(40, 16).to(torch.bfloat16)
    right = torch.randn(20, 16).to(torch.bfloat16)
    layout = bl.align(ids, None, 5, 16)
    calls = []
    real = tw.weight_grad_persistent
    monkeypatch.setattr(bl, "weight_grad_persistent", lambda *a: (calls.append(a[-1]), real(*a))[1])
    bl.weight_grad(left, 1, right, 2, 5, torch.float32, layout, _tile(bl, False))
    bl.weight_grad(left.float(), 1, right.float(), 2, 5, torch.float32, layout, _tile(bl, False))
    assert len(calls) == 1 and calls[0].persistent == 1


def test_persistent_needs_programs(interpreter):
    import moekit.experts.triton_wgrad as tw

    with pytest.raises(ValueError, match="persistent >= 1"):
        tw.weight_grad_persistent(None, None, 16, 16, torch.zeros(2, dtype=torch.int32), 16,
                                  torch.empty(2, 16, 16), type("T", (), {"persistent": 0})())
