"""The backward's tile candidates (``triton_backward_candidates``) under Triton's interpreter: each distinct tile set
through ``experts_backward(tiles=...)`` against the float64 autograd of the per-token loop (bf16, 16-byte rows: the
weights and the permuted dout and x through TMA descriptors), the persistent weight-grad tile they carry against a
float64 per-expert sum, and what the module claims of itself: its GEMM tiles are ``TUNED``'s, its classes are real
``shape_class`` keys, and no default takes a candidate.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, spy_desc  # noqa: E402, F401  (interpreter: fixture)
from _helpers import experts_loop, make_problem, rel_l2  # noqa: E402
from test_triton_backward import NAMES, TOL, grads_of  # noqa: E402


def _distinct() -> dict:
    """name -> tiles, each distinct tile set once (the first candidate naming it)."""
    from moekit.experts.triton_backward_candidates import CANDIDATES

    out = {}
    for c in CANDIDATES:
        if c.tiles not in out.values():
            out[f"{c.shape_class}:{c.name}"] = c.tiles
    return out


@pytest.mark.parametrize("name", list(_distinct()))
def test_candidate_grads_against_the_loop(interpreter, monkeypatch, name):
    """E 4, top-2 over 24 tokens (some slots skipped), K 64 (one 64-wide step; w2's rows a multiple of it, so its
    descriptor serves), N 40 (every N tile cut short): every grad within bf16's tolerance of float64."""
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_backward_sorted as bs

    tiles = _distinct()[name]
    seen = spy_desc(monkeypatch, bs)
    problem = make_problem(24, 2, 4, 64, 40, dtype=torch.bfloat16, seed=50, skips=True)
    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(7))
    want = grads_of(experts_loop, problem, dout, torch.float64, torch.float64)
    x, w13, w2, ids, weights = problem
    g = bl.experts_backward(dout.bfloat16(), x, w13, w2, ids, weights, None, None, "silu", (True,) * 4, tiles=tiles)
    got = {"x": g.x, "w13": g.w13, "w2": g.w2, "topk_weights": g.topk_weights}
    for n in NAMES:
        assert got[n].shape == want[n].shape, n
        assert rel_l2(got[n], want[n]) < TOL[torch.bfloat16], n
    # the permuted-operand grad kernel ran with every operand through TMA (dY @ W2 split off at dg_cols)
    assert ("grad_gate_up_sorted_kernel", True) in seen
    assert (("sorted_gemm_kernel", True) in seen) == (tiles.grad.dg_cols > 0)


def test_candidate_persistent_weight_grad(interpreter, monkeypatch):
    """The candidates' persistent weight-grad tile (128 x 256, 64-row steps) through ``weight_grad`` on bf16
    operands (TMA loads and stores; under the interpreter the backward's dh is float32, so only this call reaches
    it): E 3, R 80, C 72, per-expert sums against float64; an expert no slot picks gets zeros."""
    import moekit.experts.triton_backward_launch as bl
    from moekit.experts.triton_backward_candidates import CANDIDATES

    tiles = {c.tiles.dw13 for c in CANDIDATES if c.tiles.dw13.persistent}
    assert tiles
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0], [0, 2]] * 9, dtype=torch.int32)  # expert 1 never picked
    left = torch.randn(ids.numel(), 80, generator=g).bfloat16()  # per assignment, like dh
    right = torch.randn(ids.shape[0], 72, generator=g).bfloat16()  # per token, like x
    want = torch.zeros(3, 80, 72, dtype=torch.float64)
    for a, e in enumerate(ids.reshape(-1).tolist()):
        want[e] += torch.outer(left[a].double(), right[a // 2].double())
    layout = bl.align(ids, None, 3, 128)
    calls, real = [], bl.weight_grad_persistent
    monkeypatch.setattr(bl, "weight_grad_persistent", lambda *a: (calls.append(a[-1]), real(*a))[1])
    for tile in tiles:
        got = bl.weight_grad(left, 1, right, 2, 3, torch.float32, layout, tile)
        assert calls[-1] == tile  # the persistent kernel ran
        assert torch.equal(got[1], torch.zeros_like(got[1]))
        assert float((got.double() - want).norm() / want.norm()) < 1e-6


def test_candidates_reuse_tuned_tiles_and_are_off_by_default(monkeypatch):
    """Every GEMM tile of a candidate is one ``TUNED`` runs in some class (the module's claim: no new compiled
    kernel); every class is a ``shape_class`` value and each candidate differs from what ``backward_tiles`` gives
    that class on an sm_90 bf16 device; names are unique within a class."""
    import moekit.experts.triton_backward_launch as bl
    from moekit.experts.triton_backward_candidates import CANDIDATES, candidates_for

    tuned = {getattr(t, f) for t in bl.TUNED.values() for f in ("grad", "dx", "dw13", "dw2")}
    monkeypatch.setattr(bl, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # (A, E, N) of a cell of each class the candidates name: Mixtral at 1024 / 4096 tokens
    cells = {"wide/few": (1024 * 2, 8, 14336), "wide/some": (4096 * 2, 8, 14336)}
    for c in CANDIDATES:
        assert {c.tiles.grad, c.tiles.dx, c.tiles.dw13, c.tiles.dw2} <= tuned, c.name
        assert bl.shape_class(*cells[c.shape_class]) == c.shape_class
        assert bl.backward_tiles(*cells[c.shape_class], torch.bfloat16, torch.device("cuda")) != c.tiles, c.name
    for cls in cells:
        names = [c.name for c in CANDIDATES if c.shape_class == cls]
        assert len(names) == len(set(names)) == len(candidates_for(cls)) > 0
    assert candidates_for("narrow/few") == {}
