"""bf16 experts against float64 at tiny widths: where the error comes from, and what design.md's bf16 contract
(relative L2 against a float64 reference < 1e-2) bounds.

fuzz37 measured grouped_mm at 1.6e-2 on one token of a layer 8 wide with expert biases. ``emulate`` below runs the
experts in float64 and rounds to bf16 only at the points it is told; with the points each backend rounds at, it
equals the backend bit for bit, so those roundings are the whole error (no other source, no bug):

| point                 | grouped GEMM path (1) | its masked layout | CPU loop (default) | transformers (2) | ref.    |
| --------------------- | --------------------- | ----------------- | ------------------ | ---------------- | ------- |
| h = x w13^T           | rounded (bf16 GEMM)   | -                 | -                  | rounded          | -       |
| h + b13               | - (float32)           | rounded (baddbmm) | rounded (fused)    | rounded again    | -       |
| act(gate)             | - (float32)           | - (float32)       | - (float32)        | rounded          | -       |
| a = act(gate) * up    | rounded (3)           | rounded           | rounded            | rounded          | -       |
| y = a w2^T            | rounded               | -                 | -                  | rounded          | -       |
| y + b2                | - (float32)           | rounded (baddbmm) | rounded (fused)    | rounded again    | -       |
| out (float32 combine) | rounded               | rounded           | rounded            | rounded          | rounded |

(1) ``cpu_gemm="grouped_mm"`` and CPU autograd (on CUDA without Triton it keeps h + b13 and the activation in bf16:
``CUDA`` below). (On the CPU ``F.grouped_mm`` refuses a float32 ``out_dtype`` for bf16 operands, torch 2.13: "output
dtype must match `mat_a` dtype", so h and y stay rounded.)
(2) transformers' ``grouped_mm_experts_forward``, and moekit's grouped path up to session 38 (rnd39 took out the
three roundings a bf16 GEMM does not force: both biases and the activation in float32; and the CPU loops' rounded
act(gate)). (3) the second GEMM's operand.

An output element that is a cancelling sum (the k slots, the biases) carries its terms' rounding errors relative to
a small result, and over 8 values one such element sets the relative L2: a statistic of the roundings, not a bound.
On one token of 8, 1500 draws below: rounding where transformers does passes 1e-2 in 28 (up to 1.57e-2), the grouped
path now in 3 (up to 1.08e-2), as the GEMMs' bf16 outputs remain; rounding only the second GEMM's operand and the
output, in none (up to 5.6e-3). Over a batch the errors average: on 64 tokens of the same width, 200 draws, up to
6.8e-3 where transformers rounds.

Shapes: M tokens, K hidden (8), N expert intermediate, E experts, k = top_k.
"""

from __future__ import annotations

import pytest
import torch

from moekit.experts import grouped_mm as grouped_mm_module
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.experts.reference import experts_reference

K, N, E, TOP_K = 8, 8, 4, 2
TRANSFORMERS = ("h", "h+b13", "act", "a", "y", "y+b2", "out")  # every point (the table above)
GROUPED = ("h", "a", "y", "out")  # the grouped GEMM path: its GEMMs' bf16 outputs, the operand, the output
CUDA = ("h", "h+b13", "act", "a", "y", "out")  # the grouped path on CUDA (off FLOAT32_GLU_DEVICES): b2 alone float32
MASKED = ("h+b13", "a", "y+b2", "out")  # its masked layout: baddbmm adds the bias before it rounds
LOOP = ("h+b13", "a", "y+b2", "out")  # the CPU loops: their GEMMs add the bias before they round (= MASKED)
REFERENCE = ("out",)
NEEDED = ("a", "out")  # what any bf16 pipeline rounds: the second GEMM's bf16 operand, the bf16 output


def draw(g: torch.Generator, m: int):
    """x [M, K], w13 [E, 2N, K], w2 [E, K, N], b13 [E, 2N], b2 [E, K] in bf16 at the fuzzer's scales (weights
    1/sqrt(fan_in), biases 0.3), distinct ids [M, k] and float32 softmax weights [M, k]."""
    x = torch.randn(m, K, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) / K**0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) / N**0.5).bfloat16()
    b13 = (torch.randn(E, 2 * N, generator=g) * 0.3).bfloat16()
    b2 = (torch.randn(E, K, generator=g) * 0.3).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).int()
    weights = torch.softmax(torch.randn(m, TOP_K, generator=g), dim=-1)
    return x, w13, w2, b13, b2, ids, weights


def emulate(x, w13, w2, b13, b2, ids, weights, rounds=()) -> torch.Tensor:
    """sum_j w_j (w2[e] @ (silu(g) * u) + b2[e]), [g, u] = w13[e] @ x + b13[e], in float64 -> [M, K] float64,
    rounded to bf16 at each point named in ``rounds`` (``GROUPED``' names)."""
    def at(t, point):
        return t.bfloat16().double() if point in rounds else t

    e = ids.long()  # [M, k]
    h = at(torch.einsum("mk,mjrk->mjr", x.double(), w13.double()[e]), "h")  # [M, k, 2N]
    h = at(h + b13.double()[e], "h+b13")
    gate, up = h[..., :N], h[..., N:]
    a = at(at(gate * torch.sigmoid(gate), "act") * up, "a")  # [M, k, N]
    y = at(torch.einsum("mjn,mjkn->mjk", a, w2.double()[e]), "y")  # [M, k, K]
    y = at(y + b2.double()[e], "y+b2")
    return at((y * weights.double()[..., None]).sum(dim=1), "out")  # [M, K]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def grouped(x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    return experts_grouped_mm(x, w13, w2, ids, weights, b13=b13, b2=b2, cpu_gemm="grouped_mm")


def masked(x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    return experts_grouped_mm(x, w13, w2, ids, weights, b13=b13, b2=b2, cpu_gemm="grouped_mm",
                              layout="masked_measured_cap")


def cpu_loop(x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    return experts_grouped_mm(x, w13, w2, ids, weights, b13=b13, b2=b2)


def mm_loop(x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    return experts_grouped_mm(x, w13, w2, ids, weights, b13=b13, b2=b2, cpu_gemm="mm_loop")


def reference(x, w13, w2, b13, b2, ids, weights) -> torch.Tensor:
    return experts_reference(x, w13, w2, ids, weights, b13=b13, b2=b2)


@pytest.mark.parametrize("backend, rounds", [(grouped, GROUPED), (masked, MASKED), (cpu_loop, LOOP), (mm_loop, LOOP),
                                             (reference, REFERENCE)])
def test_the_emulation_is_the_backend(backend, rounds):
    """Each backend's one-token output is its roundings' emulation: bit for bit in (nearly) every draw, and never
    an ulp apart (a float32 sum of 8 exact bf16 products may round once before bf16 does)."""
    g = torch.Generator().manual_seed(0)
    equal = 0
    with torch.no_grad():
        for _ in range(200):
            args = draw(g, 1)
            got, want = backend(*args).double(), emulate(*args, rounds=rounds)
            equal += torch.equal(got, want)
            assert ((got - want).abs() <= want.abs() * 2.0**-8).all()  # within one bf16 ulp
    assert equal >= 198


def test_transformers_grouped_mm_rounds_at_every_point():
    """transformers' grouped_mm experts on the same weights (a module of its experts flags; the gate written as its
    default: silu(gate) * up) equal the emulation rounding at all seven points bit for bit at one token (moekit's
    grouped GEMM path rounded there too up to session 38)."""
    moe = pytest.importorskip("transformers.integrations.moe")

    class Experts(torch.nn.Module):  # what grouped_mm_experts_forward reads of a transformers experts module
        def __init__(self, w13, w2, b13, b2):
            super().__init__()
            self.num_experts, self._is_expert_parallel, self.has_gate, self.has_bias = E, False, True, True
            self.is_transposed, self.has_post_expert_norm = False, False
            self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias = w13, w2, b13, b2

        def _apply_gate(self, h):
            gate, up = h.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(50):
            x, w13, w2, b13, b2, ids, weights = draw(g, 1)
            theirs = moe.grouped_mm_experts_forward(Experts(w13, w2, b13, b2), x, ids.long(), weights)
            assert torch.equal(theirs.double(), emulate(x, w13, w2, b13, b2, ids, weights, rounds=TRANSFORMERS))


def test_one_token_of_eight_is_a_statistic_of_the_roundings():
    """Over 1500 one-token draws: rounding where transformers does passes 1e-2 in some (fuzz37's finding); at the
    grouped path's points, which a bf16 GEMM forces, still in some, fewer; rounding only the second GEMM's operand
    and the output, never; and on 64 tokens (512 values) transformers' points stay under 1e-2 in nearly every
    draw."""
    g = torch.Generator().manual_seed(2)
    errors = {name: [] for name in ("transformers", "grouped", "needed")}
    for _ in range(1500):
        args = draw(g, 1)
        exact = emulate(*args)
        for name, rounds in (("transformers", TRANSFORMERS), ("grouped", GROUPED), ("needed", NEEDED)):
            errors[name].append(rel_l2(emulate(*args, rounds=rounds), exact))
    over = {name: sum(e > 1e-2 for e in errs) for name, errs in errors.items()}
    assert over["transformers"] >= 10 and 0 < over["grouped"] < over["transformers"] and over["needed"] == 0, over
    batch = [rel_l2(emulate(*args, rounds=TRANSFORMERS), emulate(*args)) for args in (draw(g, 64) for _ in range(200))]
    assert sum(e > 1e-2 for e in batch) <= 2 and sorted(batch)[100] < 6e-3, sorted(batch)[-3:]


@pytest.mark.parametrize("backend, most", [(grouped, 8), (masked, 4), (cpu_loop, 4)])
def test_each_path_passes_1e_2_on_one_token_of_eight_rarely(backend, most):
    """The backend itself against the float64 experts (``emulate`` rounding nowhere), 1500 seeded one-token draws
    with biases: the grouped path's contiguous layout passes 1e-2 in 3 (up to 1.08e-2), its masked layout and the CPU
    loop (the same points) in 2 (up to 1.08e-2). Up to session 38 they passed it in 28 (up to 1.57e-2;
    transformers' points) and 7 (up to 1.13e-2; fused biases, a rounded activation): ``most`` sits between."""
    g = torch.Generator().manual_seed(2)
    errors = []
    with torch.no_grad():
        for _ in range(1500):
            args = draw(g, 1)
            errors.append(rel_l2(backend(*args), emulate(*args)))
    over = sum(e > 1e-2 for e in errors)
    assert over <= most and max(errors) < 1.2e-2, (over, max(errors))


def test_off_the_float32_devices_the_grouped_path_rounds_as_on_cuda(monkeypatch):
    """Off ``FLOAT32_GLU_DEVICES`` (CUDA: there float32 elementwise passes cost twice the bytes) the grouped path keeps
    h + b13 and the activation in bf16 and adds b2 in float32 only. Run on the CPU with the CPU taken off the list:
    the emulation of those points bit for bit, and over 1500 one-token draws 1e-2 passed in fewer draws than at
    transformers' points (28) and more than on the CPU (3)."""
    monkeypatch.setattr(grouped_mm_module, "FLOAT32_GLU_DEVICES", ())
    g = torch.Generator().manual_seed(2)
    over = {"cuda": 0, "transformers": 0}
    with torch.no_grad():
        for _ in range(1500):
            args = draw(g, 1)
            got, exact = grouped(*args).double(), emulate(*args)
            assert torch.equal(got, emulate(*args, rounds=CUDA))
            over["cuda"] += rel_l2(got, exact) > 1e-2
            over["transformers"] += rel_l2(emulate(*args, rounds=TRANSFORMERS), exact) > 1e-2
    assert 3 < over["cuda"] < over["transformers"], over
