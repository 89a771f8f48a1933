"""mxfp4 on the words decode (``_kernels/words_mx.py``, host side ``triton_wo_words_mx``): the decode's bit operations
(mirrored in torch) against the OCP definition for all 16 codes in every position of a word and a range of e8m0
scales, the pairs' columns against the packing (low nibble first), the scales' range refused by name, the call's
refusals and its empty batch, and the kernels compiled for sm_90 (the mxfp4 loop: no operand hop, its loads)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _words_fakes import E2M1
from moekit.experts.triton_wo_plan import weight_args
from moekit.experts.triton_wo_words_mx import check_mx_scales, mx_pairs_torch, mx_values_torch

ROOT = Path(__file__).resolve().parents[1]
SCALES = (0, 1, 2, 60, 100, 119, 126, 127, 128)  # e8m0 bytes the decode holds (<= 128)


def _words(code: int, position: int, seed: int) -> torch.Tensor:
    """Random words (int64 holding uint32) with ``code`` at nibble ``position``."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64)
    return (words & ~(0xF << 4 * position)) | (code << 4 * position)


@pytest.mark.parametrize("s", SCALES)
def test_every_code_in_every_position_decodes_to_its_ocp_value(s):
    for code in range(16):
        for position in range(8):
            words = _words(code, position, 16 * code + position)
            pairs = mx_pairs_torch(words, torch.full_like(words, s))  # 4 x [64, 2]: (code t, code t + 4)
            got = pairs[position % 4][:, position // 4]
            want = torch.full_like(got, E2M1[code] * 2.0 ** (s - 127))
            assert torch.equal(got, want), (code, position, s)
            assert torch.equal(torch.signbit(got), torch.full_like(got, code >= 8, dtype=torch.bool))  # -0 too


def test_a_row_decodes_in_column_order():
    """Word i's pair t holds columns 8 i + t (low half) and 8 i + t + 4 (high): the row's values in column order,
    against each column's nibble read by index (low nibble first) and its group's scale."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 256, (128,), generator=g, dtype=torch.uint8)  # 256 columns
    scale = torch.randint(100, 129, (8,), generator=g, dtype=torch.uint8)
    got = mx_values_torch(q, scale)
    want = torch.tensor([E2M1[(int(q[c // 2]) >> 4 * (c % 2)) & 15] * 2.0 ** (int(scale[c // 32]) - 127)
                         for c in range(256)], dtype=torch.float64)
    assert torch.equal(got, want)


def test_scales_past_the_decodes_range_are_refused_by_name():
    scale = torch.full((2, 4, 8), 128, dtype=torch.uint8)
    check_mx_scales(scale, "w13")  # 2^(128 - 1) = 2^127: still a normal bf16
    scale[1, 2, 3] = 129
    with pytest.raises(ValueError, match=r"w13\.scale e8m0 bytes <= 128.*got 129"):
        check_mx_scales(scale, "w13")


def _mx(rows: int, cols: int) -> object:
    q = torch.zeros(4, rows, cols // 2, dtype=torch.uint8)
    return weight_args(q, torch.full((4, rows, cols // 32), 120, dtype=torch.uint8), None, 32)


@pytest.mark.parametrize("case, named", [
    ("gpt-oss", "K a multiple of 256"), ("map", "without an expert_map"), ("gelu", "gated silu"),
    ("ungated", "gated silu"),
])
def test_what_the_mxfp4_words_do_not_run_is_refused_by_name(case, named):
    """The kernels at gpt-oss's shape unpadded (K = N = 2880, no multiple of 256: the route pads), an expert map,
    an activation other than gated SiLU (gpt-oss's clamped one runs: ``test_triton_wo_words_lean``)."""
    from moekit.activations import ActivationSpec
    from moekit.experts.triton_wo import run_experts_wo
    from moekit.experts.triton_wo_words import check_words

    if case == "gpt-oss":
        with pytest.raises(ValueError, match=named):
            check_words(torch.zeros(1, 2880, dtype=torch.bfloat16), _mx(2 * 2880, 2880), 4)
        return
    n, k = 256, 512
    x, ids, weights = torch.zeros(1, k, dtype=torch.bfloat16), torch.tensor([[0, 1]]), torch.ones(1, 2)
    activation = {"gelu": ActivationSpec("gelu"), "ungated": ActivationSpec("silu", gated=False)}.get(case, "silu")
    with pytest.raises(ValueError, match=named):
        run_experts_wo(x, _mx(2 * n, k), _mx(k, n), ids, weights, torch.arange(4) if case == "map" else None,
                       "mxfp4", activation, decode="gluon_words")


def test_an_empty_batch_returns_zeros():
    from moekit.experts.triton_wo import run_experts_wo

    x = torch.zeros(0, 512, dtype=torch.bfloat16)
    out = run_experts_wo(x, _mx(512, 512), _mx(512, 256), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2),
                         None, "mxfp4", decode="gluon_words")
    assert out.shape == (0, 512) and out.dtype == torch.bfloat16


def test_the_mxfp4_kernels_compile_for_sm90_without_an_operand_hop():
    """Both kernels' mxfp4 loop through Triton's whole pipeline (a subprocess, the interpreter's patches out): no
    spill, no STS / LDS / SHFL / local memory in the loop, the words and x by 16-byte loads (12 a step), the scales
    by one byte load a group (4 a step: a thread's 2 rows x 2 groups), at most 3 instructions a weight (2.89 on
    Triton 3.6 and 3.9)."""
    pytest.importorskip("triton.experimental.gluon._runtime", reason="no GluonASTSource in this Triton")
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere", reason="no Gluon mma_v2 in this Triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    cases = ("naive", "aligned", "down")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "w4g45_sass_cpu.py"), "--mxfp4", *cases],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(tuple(f"{c} mxfp4 ahead 1:" for c in cases))]
    assert run.returncode == 0 and len(lines) == len(cases), run.stdout + run.stderr[-3000:]
    for line in lines:
        assert "stack 0 B" in line and "local in the loop 0;" in line, line
        assert float(line.split(" instructions, ")[1].split(" a weight")[0]) <= 3.0, line
        assert "'LDG.E.128': 24" in line and "'LDG.E.U8': 8" in line, line  # the loop runs two steps
