"""gpt-oss's interleaved gate/up rows through TMA on the fused fp8 gate-up GEMM (issue #15, session 41: ``gemm_fp8``'s
W_DESC with INTERLEAVED), on the CPU under Triton's interpreter, tiny shapes with K and N tails.

Chain: the kernels with TMA weights (the prefill 64-row tile, the tiny-batch 16-row one, swapped, with x quantized
inside gate-up; gpt-oss's spec with a clamp that bites, b13, b2) against a float64 emulation of the recipe
(``_fp8_cases.emulation_f64``) and against the same call on pointer weights (session 40's route); shapes whose last
tile's second row tile lies past the expert's 2N rows (its scale block clamped, its columns zeroed) and whose first row
tile already crosses 2N; M = 0, M = 1 (the shortcut), an expert map with -1; the plan's rules (tiles that do not fit
keep pointer loads, PAIR_DOT refused by name); the route's switch ``INTERLEAVED_TMA_FROM_M`` (off: pointer loads at
every M; set: TMA from that M), through ``run_experts`` against the reference backend's fp8 recipe.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, emulation_f64, problem  # noqa: E402
from _helpers import partial_expert_map, rel_l2  # noqa: E402
from _triton_helpers import fp8, interpreter  # noqa: E402, F401  (fixtures)

from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402

SPEC = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=1.0, up_shift=1.0)  # the clamp bites here
BLOCK = (128, 128)
# (E, K, N): N 192 (2N = 3 row blocks: tile 1's second row tile is block 3, past the expert's rows), N 48 (2N = 96:
# tile 0's first row tile already holds the next expert's rows); K 160 and 144: a K tail each
SHAPES = [(4, 160, 192), (3, 144, 48)]
PREFILL = KernelConfig(64, GemmTile(128, 128, 8, 8, 2), GemmTile(128, 128, 8, 4, 2))
TINY = KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(128, 128, 1, 4, 2))
CONFIGS = {"prefill": (PREFILL, None), "tiny": (TINY, None), "swap_ab": (replace(TINY, swap_ab=True), None),
           "x_in_gate_up": (TINY, True)}  # (config, x_in_gate_up)


def _biases(shape, seed: int):
    (num_experts, hidden, inter), g = shape, torch.Generator().manual_seed(seed)
    return torch.randn(num_experts, 2 * inter, generator=g), torch.randn(num_experts, hidden, generator=g) * 0.3


def _gate_up_flags(plan) -> tuple:
    """(W_DESC, ONE_BLOCK, INTERLEAVED) of a plan's gate-up launch (the arguments after its pointers, by name)."""
    launch = plan.gate_up
    names = list(inspect.signature(launch.kernel.fn).parameters)
    first = len(names) - len(launch.tail)
    return tuple(launch.tail[names.index(n) - first] for n in ("W_DESC", "ONE_BLOCK", "INTERLEAVED"))


def _plan(fp8, x, quantized, ids, weights, config, weight_tma, b13, b2, block=BLOCK, **kw):
    from moekit.experts.triton_fp8_variant import Fp8Variant

    return fp8.plan_for(x, *quantized, ids.contiguous(), weights.contiguous(), None, block, config, POISON,
                        weight_tma=weight_tma, variant=Fp8Variant.of(SPEC, b13, b2), **kw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_interleaved_rows_by_tma_match_float64_and_the_pointer_loads(fp8, shape, config):
    x, _, quantized, ids, weights = problem(12, 2, shape, BLOCK, seed=3)
    b13, b2 = _biases(shape, 5)
    config, x_in = CONFIGS[config]
    flags = {tma: _gate_up_flags(_plan(fp8, x, quantized, ids, weights, config, tma, b13, b2, x_in_gate_up=x_in))
             for tma in (True, False)}
    assert flags == {True: (True, True, True), False: (False, False, True)}
    want = emulation_f64(x, *quantized, ids, weights, BLOCK, b13=b13, b2=b2, spec=SPEC)
    tma, pointers = (fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, config, POISON,
                                                  x_in_gate_up=x_in, weight_tma=w, activation=SPEC, b13=b13, b2=b2)
                     for w in (True, False))
    assert rel_l2(tma, want) < FLIP_TOL and rel_l2(pointers, want) < FLIP_TOL
    assert rel_l2(tma, pointers) < FLIP_TOL
    assert want.abs().max() > 0.1


@pytest.mark.parametrize("m,k", [(0, 2), (1, 1), (1, 2), (9, 2)])
def test_expert_map_with_unrouted_slots_and_tiny_batches(fp8, m, k):
    # ids into 8 global experts (20% of slots -1), 4 of them local; M = 1, k = 1 with local ids takes the shortcut
    shape = SHAPES[0]
    x, _, quantized, ids, weights = problem(m, k, shape, BLOCK, seed=m + 30, num_global=8)
    b13, b2 = _biases(shape, 31)
    for expert_map in (partial_expert_map(8, 4, seed=m), None):
        if expert_map is None:
            ids = torch.where(ids < 4, ids, -1)
        out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, expert_map, BLOCK, TINY, POISON,
                                           weight_tma=True, activation=SPEC, b13=b13, b2=b2)
        want = emulation_f64(x, *quantized, ids, weights, BLOCK, expert_map, b13=b13, b2=b2, spec=SPEC)
        assert out.shape == x.shape
        assert rel_l2(out, want) < FLIP_TOL if m else out.numel() == 0


def test_tiles_that_do_not_fit_keep_pointer_loads_and_pair_dot_is_refused(fp8):
    shape = SHAPES[0]
    x, _, quantized, ids, weights = problem(12, 2, shape, BLOCK, seed=4)
    b13, b2 = _biases(shape, 6)
    h_fp32 = KernelConfig(16, GemmTile(64, 128, 1, 4, 2), GemmTile(128, 128, 1, 4, 2))  # BN 64: h float32
    plan = _plan(fp8, x, quantized, ids, weights, h_fp32, True, b13, b2)
    assert plan.descriptor_key is None and _gate_up_flags(plan) == (False, False, True)
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, h_fp32, POISON, weight_tma=True,
                                       activation=SPEC, b13=b13, b2=b2)
    assert rel_l2(out, emulation_f64(x, *quantized, ids, weights, BLOCK, b13=b13, b2=b2, spec=SPEC)) < FLIP_TOL
    # scale blocks 64 rows high: a 128-row tile spans two, so no scale a row tile
    x, _, quantized, ids, weights = problem(12, 2, shape, (64, 128), seed=4)
    plan = _plan(fp8, x, quantized, ids, weights, PREFILL, True, b13, b2, block=(64, 128))
    assert plan.descriptor_key is None
    with pytest.raises(ValueError, match="pair_dot does not take interleaved gate/up rows"):
        _plan(fp8, x, quantized, ids, weights, PREFILL, True, b13, b2, pair_dot=True)


def test_the_route_switch_takes_tma_from_its_m_and_matches_the_reference(fp8, monkeypatch):
    """``INTERLEAVED_TMA_FROM_M``: None keeps pointer loads at every M; set (1 by default since session 41's H100
    run), interleaved calls from that M take TMA (smaller ones pointers); ``run_experts`` on the triton backend equals
    the reference backend's fp8 recipe either way."""
    import moekit.quant as Q
    from moekit.experts import run_experts, triton_fp8_plan

    shape = SHAPES[0]
    (e, hidden, n), g = shape, torch.Generator().manual_seed(40)
    q13 = Q.quantize((torch.randn(e, 2 * n, hidden, generator=g) / hidden**0.5).bfloat16(), "fp8_block")
    q2 = Q.quantize((torch.randn(e, hidden, n, generator=g) / n**0.5).bfloat16(), "fp8_block")
    b13, b2 = (b.bfloat16() for b in _biases(shape, 41))
    seen = []
    monkeypatch.setattr(triton_fp8_plan, "build_plan", _recording(triton_fp8_plan.build_plan, seen))
    for from_m, m, tma in ((None, 12, False), (8, 12, True), (8, 4, False)):
        monkeypatch.setattr(triton_fp8_plan, "INTERLEAVED_TMA_FROM_M", from_m)
        fp8.clear_launch_caches()
        x = torch.randn(m, hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(m)]).int()
        weights = torch.rand(m, 2, generator=g)
        got = run_experts(x, q13, q2, ids, weights, activation=SPEC, b13=b13, b2=b2, backend="triton")
        want = run_experts(x, q13, q2, ids, weights, activation=SPEC, b13=b13, b2=b2, backend="reference")
        assert rel_l2(got, want) < 1e-2 and want.abs().max() > 0.1
        assert (seen[-1].descriptor_key is not None) == tma  # 16-row tiles here: a plain call would take TMA
        assert _gate_up_flags(seen[-1]) == (tma, tma, True)


def _recording(build, seen: list):
    def build_and_keep(*args, **kwargs):
        seen.append(build(*args, **kwargs))
        return seen[-1]

    return build_and_keep


@pytest.mark.parametrize("activation", ["spec", "gelu"])
def test_persistent_gemms_take_variant_calls_where_asked(fp8, activation):
    """The persistent GEMMs with b13, b2 and gpt-oss's spec (interleaved rows through TMA) or GELU (rows apart, pointer
    loads): bit-equal to the one-tile programs (the same products in the same order) and to the float64 emulation;
    interleaved rows on pointer loads are refused by name, and a tuned entry's persistent GEMMs never reach a variant
    call (only an asked-for one does)."""
    from moekit.experts.triton_fp8_persistent import Persistent, choose_persistent

    shape = SHAPES[0]
    x, _, quantized, ids, weights = problem(13, 2, shape, BLOCK, seed=7)
    b13, b2 = _biases(shape, 8)
    spec, tma = (SPEC, True) if activation == "spec" else ("gelu", False)
    unfolded = replace(POISON, align_fold_max=0)  # the persistent kernels read the aligned layout's launch

    def call(persistent):
        return fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, TINY, unfolded, False, tma, True,
                                            persistent, activation=spec, b13=b13, b2=b2)

    out, base = call(Persistent(1, 2)), call(None)
    assert torch.equal(out, base)
    want = emulation_f64(x, *quantized, ids, weights, BLOCK, b13=b13, b2=b2, spec=None if spec == "gelu" else spec)
    if spec == "gelu":  # emulation_f64's default is silu-and-mul: the GELU twin instead
        want = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, activation="gelu", block_shape=BLOCK, b13=b13,
                                           b2=b2)
    assert rel_l2(out, want) < FLIP_TOL
    with pytest.raises(ValueError, match="do not take interleaved gate/up rows on pointer loads"):
        fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, TINY, unfolded, False, False, True,
                                     Persistent(), activation=SPEC, b13=b13, b2=b2)
    assert choose_persistent(None, Persistent(), False, False, False, False, plain=False) is None

