"""The clamp after the activation (``ActivationSpec.limit_after_act``, the kernels' LIMIT_AFTER constexpr; session 48)
on every Triton kernel family that runs in the interpreter, tiny shapes, CPU: the bf16 / fp32 gate-up
(``_kernels/gemm``), the fp8 ones (pointer loads, interleaved rows through TMA, the persistent GEMMs) and the
weight-only decodes (tile, register, mma unsplit and split along K into the split_glu launch, gemv), each with the
clamp after and before the activation, against the float64 loop of ``_limit_after`` (its limit checked to cut both
gate and up values, the other placement checked to differ). The Gluon kernels (fp8 ``_variant_h``, the words
decode's ``store_h``) do not run in the interpreter: ``benchmarks/act48_device_check.py`` checks them on a GPU.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, emulation_f64, problem as fp8_problem  # noqa: E402
from _helpers import make_problem, rel_l2  # noqa: E402
from _limit_after import both, loop64, want  # noqa: E402
from _triton_helpers import fp8, interpreter  # noqa: E402, F401  (fixtures)
from test_triton_wo import dequant64, problem as wo_problem, wo  # noqa: E402, F401  (wo: fixture)

from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402

CONCATENATED = ActivationSpec("silu", limit=1.0)  # Step-3.7's form: gate rows, then up rows
GPT_OSS_FORM = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=1.0, up_shift=1.0)
SPECS = {"concatenated": CONCATENATED, "interleaved_alpha_shift": GPT_OSS_FORM}
AFTER = {"before": 0, "after": 1}  # index into ``both``


@pytest.mark.parametrize("form", list(SPECS))
@pytest.mark.parametrize("place", list(AFTER))
@pytest.mark.parametrize("m,k", [(1, 1), (6, 2)])  # the tiny-batch shortcut (A * 4 <= E), aligned blocks
def test_gate_up_kernel(interpreter, form, place, m, k):
    spec = both(SPECS[form])[AFTER[place]]
    x, w13, w2, ids, weights = make_problem(m, k, 8, 33, 17, seed=m + 3 * k)  # gate-up outputs ~ N(0, 1)
    g = torch.Generator().manual_seed(5)
    b13 = torch.randn(8, 34, generator=g) * 0.5 if k == 2 else None
    out = interpreter.experts_triton(x, w13, w2, ids, weights, activation=spec, b13=b13, options=POISON)
    if m == 1:  # one token's slot cannot cut both clamps: its output checked, the clamps' cuts by the M = 6 cases
        assert rel_l2(out, loop64(x, w13, w2, ids, weights, spec, b13)[0]) < 1e-5
    else:
        assert rel_l2(out, want(x, w13, w2, ids, weights, spec, b13)) < 1e-5


FP8_SHAPE, FP8_BLOCK = (3, 144, 48), (128, 128)  # K: a tail step; 2N = 96: tile 0 holds the next expert's rows
TINY = KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(128, 128, 1, 4, 2))


@pytest.mark.parametrize("place", list(AFTER))
def test_fp8_pointer_loads(fp8, place):
    spec = both(CONCATENATED)[AFTER[place]]
    x, (w13, w2), quantized, ids, weights = fp8_problem(6, 2, FP8_SHAPE, FP8_BLOCK, seed=11)
    want(x, w13, w2, ids, weights, spec)  # the clamps bite (unquantized weights: the same gate-up values to 1e-2)
    out = fp8.fused_experts_fp8(x, *quantized, ids, weights, activation=spec, block_shape=FP8_BLOCK, options=POISON)
    assert rel_l2(out, emulation_f64(x, *quantized, ids, weights, FP8_BLOCK, spec=spec)) < FLIP_TOL


@pytest.mark.parametrize("persistent", [False, True])
def test_fp8_interleaved_rows_by_tma(fp8, persistent):
    # gpt-oss's row order read through TMA (``gemm_fp8_interleaved.variant_h``), one-tile programs or persistent ones
    from moekit.experts.triton_fp8_persistent import Persistent

    spec = both(GPT_OSS_FORM)[1]
    x, (w13, w2), quantized, ids, weights = fp8_problem(13, 2, FP8_SHAPE, FP8_BLOCK, seed=7)
    want(x, w13, w2, ids, weights, spec)
    unfolded = replace(POISON, align_fold_max=0)  # the persistent kernels read the aligned layout's launch
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, FP8_BLOCK, TINY, unfolded, False, True,
                                       True, Persistent(1, 2) if persistent else None, activation=spec)
    assert rel_l2(out, emulation_f64(x, *quantized, ids, weights, FP8_BLOCK, spec=spec)) < FLIP_TOL


def _word_config(**word):
    from moekit.experts.triton_wo_gemv import WordConfig

    tile = GemmTile(32, 128, 1, 1, 1)
    return WordConfig(16, tile, tile, **word) if word else KernelConfig(16, tile, tile)


WO_CASES = [  # (decode, spec form, place, config)
    ("tile", "concatenated", "after", None), ("tile", "concatenated", "before", None),
    ("register", "interleaved_alpha_shift", "after", None),
    ("mma", "interleaved_alpha_shift", "after", "unsplit"), ("mma", "concatenated", "after", "up_split"),
    ("mma", "concatenated", "before", "up_split"), ("gemv", "interleaved_alpha_shift", "after", None),
]


@pytest.mark.parametrize("decode,form,place,config", WO_CASES)
def test_weight_only_decodes(wo, decode, form, place, config):
    # int4 g128, K = 200 (a tail step), N = 64; the mma's split gate-up runs the glu in the split_glu launch
    spec = both(SPECS[form])[AFTER[place]]
    x, w13, w2, ids, weights = wo_problem(wo, "int4_w4a16", 128, m=5, k=2, hidden=200, n=64, seed=21)
    x = x * 2  # int4's decoded weights are smaller than N(0, 1 / K): gate-up outputs ~ N(0, 1) again
    forced = {None: None, "unsplit": _word_config(), "up_split": _word_config(up_split=2)}[config]
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    out = wo.run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", spec, config=forced, options=POISON,
                            decode=decode)
    if config == "up_split":  # the plan the call ran: gate-up partials, the glu in the split_glu launch
        from moekit.experts.triton_wo_plan import wo_plan_for

        assert wo_plan_for(x, *args, ids, weights, None, "int4_w4a16", spec, forced, POISON, decode=decode).glu
    reference = want(x, dequant64(w13, 200), dequant64(w2, 64), ids, weights, spec)
    assert rel_l2(out, reference) < 1e-3  # fp16 in and out
