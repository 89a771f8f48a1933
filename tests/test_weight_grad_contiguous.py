"""The weight-gradient GEMMs of the Triton backward under Triton's interpreter, tiny shapes: the gathering
kernel and the contiguous one (operands permuted into the layout's rows, pointer or TMA loads, split over
an expert's rows, grouped tile order), each against a float64 per-expert sum written here; and the
row permutation against torch indexing.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, spy_desc  # noqa: E402, F401  (interpreter: fixture)


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int, empty: int | None = None) -> torch.Tensor:
    """[M, k] int32 distinct experts per token; expert ``empty`` never chosen."""
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(num_experts) if e != empty]
    picks = [torch.randperm(len(pool), generator=g)[:top_k] for _ in range(num_tokens)]
    return torch.tensor([[pool[i] for i in p] for p in picks], dtype=torch.int32)


def _want(left, l_div, right, r_div, ids, num_experts) -> torch.Tensor:
    """float64 [E, R, C]: per expert, the sum over its assignments a of left[a // l_div]^T right[a // r_div]."""
    out = torch.zeros(num_experts, left.shape[1], right.shape[1], dtype=torch.float64)
    for a, e in enumerate(ids.reshape(-1).tolist()):
        out[e] += torch.outer(left[a // l_div].double(), right[a // r_div].double())
    return out


def _case(block_m: int, num_tokens=37, top_k=3, num_experts=5, rows=48, cols=40, dtype=torch.float32, seed=0):
    import moekit.experts.triton_backward_launch as bl

    ids = _routing(num_tokens, top_k, num_experts, seed, empty=2)
    g = torch.Generator().manual_seed(seed + 1)
    left = torch.randn(num_tokens * top_k, rows, generator=g).to(dtype)  # per assignment, like dh
    right = torch.randn(num_tokens, cols, generator=g).to(dtype)  # per token, like x
    layout = bl.align(ids, None, num_experts, block_m)
    return bl, ids, left, right, layout


@pytest.mark.parametrize("contiguous,desc,split,group", [
    (False, False, 1, 1), (False, False, 3, 1), (True, False, 1, 1), (True, False, 3, 2),
    (True, True, 1, 2), (True, True, 2, 1)])
def test_weight_grad_variants(interpreter, contiguous, desc, split, group):
    """dW = sum over each expert's rows, R=48 / C=40 with 32-wide tiles (tails masked, TMA reads 0 past
    the columns), an expert with no rows (a zero grad), bf16 operands with 16-byte rows (TMA allowed)."""
    bl, ids, left, right, layout = _case(32, dtype=torch.bfloat16)
    tile = bl.KernelTiles(32, 16, 1, 1, rows=32, split=split, desc=desc, contiguous=contiguous, group=group)
    got = bl.weight_grad(left, 1, right, ids.shape[1], 5, torch.float32, layout, tile)
    want = _want(left, 1, right, ids.shape[1], ids, 5)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


def test_weight_grad_contiguous_takes_the_descriptor(interpreter, monkeypatch):
    """With bf16 operands and ``desc`` the contiguous kernel gets TMA descriptors (DESC), float32 ones not."""
    bl, ids, left, right, layout = _case(16, dtype=torch.bfloat16, seed=3)
    seen = spy_desc(monkeypatch, bl)
    tile = bl.KernelTiles(16, 16, 1, 1, rows=16, split=1, desc=True, contiguous=True)
    bl.weight_grad(left, 1, right, 3, 5, torch.float32, layout, tile)
    bl.weight_grad(left.float(), 1, right.float(), 3, 5, torch.float32, layout, tile)
    assert [desc for name, desc in seen if name == "weight_grad_contiguous_kernel"] == [True, False]


def test_contiguous_step_must_divide_the_block(interpreter):
    bl, ids, left, right, layout = _case(16)
    tile = bl.KernelTiles(16, 32, 1, 1, rows=16, split=1, contiguous=True)
    with pytest.raises(ValueError, match="red=32"):
        bl.weight_grad(left, 1, right, 3, 5, torch.float32, layout, tile)


def test_permute_rows(interpreter):
    """Row p of the permutation = src[sorted_ids[p] // div] on real rows, 0 on padding rows (C=300 spans
    two 256-column programs)."""
    bl, ids, _, _, layout = _case(16)
    src = torch.randn(37, 300, generator=torch.Generator().manual_seed(5))
    out = bl.permute_rows(src, 3, layout)
    used = int(layout.num_padded)
    sorted_ids = layout.sorted_ids[:used].long()
    real = sorted_ids < ids.numel()
    assert torch.equal(out[:used][real], src[sorted_ids[real] // 3])
    assert torch.equal(out[:used][~real], torch.zeros(int((~real).sum()), 300))
