"""The weight-only path's packed-half word decode (``decode="gemv_half"``, ``_kernels/gemm_wo_half.py``) on the
CPU under Triton's interpreter, tiny shapes: the kernels against the float64 loop of ``test_triton_wo``
(1- and 2-row blocks, the tiny-batch shortcut, odd K and group tails, steps inside one group and holding
several, activations far from 1 in both directions (the prescale), split-K, an expert map with -1, M = 0)
and its errors. The interpreter runs the plain-Triton twin of the decode; the inline PTX (NVIDIA only)
is checked against ``reference`` at the real shapes by ``benchmarks/wo_decode_device_check.py``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreted  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from test_triton_wo import POISON, loop64, problem, rel  # noqa: E402


@pytest.fixture(scope="module")
def wo():
    with interpreted("moekit.experts", "moekit.experts.triton_wo") as module:
        yield module


def config(block_m: int, words: int, rows: int = 16) -> KernelConfig:
    tile = GemmTile(rows, words * 8, 1, 1, 1)
    return KernelConfig(block_m, tile, tile)


def run(wo, x, w13, w2, ids, weights, cfg=None, expert_map=None, split_k=None):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, config=cfg, options=POISON,
                             split_k=split_k, decode="gemv_half")


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("int4_w4a16", 128), ("mxfp4", 32)])
@pytest.mark.parametrize("block_m,words", [(1, 4), (2, 8)])
def test_kernels_match_loop(wo, scheme, group, block_m, words):
    # K = 96, N = 64; M = 5, k = 2 over 4 experts: aligned blocks of block_m rows. 4 words (32 values) a
    # step: one group a step at g = 32, inside a group at g = 128; 8 words: two groups a step at g = 32
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=96, n=64, seed=block_m + words)
    out = run(wo, x, w13, w2, ids, weights, config(block_m, words))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 2e-3


@pytest.mark.parametrize("scale", [1e-4, 3e3])
@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 32), ("mxfp4", 32)])
def test_odd_k_group_tails_bf16_shortcut_and_prescale(wo, scheme, group, scale):
    # K = 95 (48 bytes a row: the last high nibble is padding), N = 40 (down's last group holds 8 of 32);
    # M = 2, k = 1 over 8 experts: the tiny-batch shortcut. x far from 1: fp16 would overflow (3e3 * 15 per
    # product summed) or lose it (1e-4 * 2^-14) without the per-row prescale
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=1, e=8, hidden=95, n=40, dtype=torch.bfloat16,
                                       seed=7)
    x = (x.float() * scale).to(torch.bfloat16)
    x[1, :40] *= 1e-3  # one row's elements spanning 3 decades more
    out = run(wo, x, w13, w2, ids, weights, config(1, 4))
    want = loop64(x, w13, w2, ids, weights)
    assert torch.isfinite(out).all()
    assert rel(out, want) < 1e-2


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 64), ("mxfp4", 32)])
def test_expert_map_skipped_ids_and_split_k(wo, scheme, group):
    # 6 global experts, this rank holds 4 (global 1, 2, 4, 5); token 4 routes nowhere here; N = 160 in
    # three splits of the down GEMM
    x, w13, w2, _, weights = problem(wo, scheme, group, m=6, k=2, hidden=64, n=160, seed=3)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [-1, 2], [3, 0], [5, 7]], dtype=torch.int32)
    expert_map = torch.tensor([-1, 0, 1, -1, 2, 3], dtype=torch.int32)
    out = run(wo, x, w13, w2, ids, weights, config(2, 4), expert_map=expert_map, split_k=3)
    assert torch.all(out[4] == 0)
    assert rel(out, loop64(x, w13, w2, ids, weights, expert_map)) < 2e-3


def test_one_token_and_empty_batch(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=1, k=2, e=4, hidden=96, seed=2)
    assert rel(run(wo, x, w13, w2, ids, weights), loop64(x, w13, w2, ids, weights)) < 2e-3  # the heuristic config
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 32, m=0, k=1, hidden=96, seed=1)
    assert run(wo, x, w13, w2, ids, weights).shape == (0, 96)


def test_errors(wo):
    x, w13, w2, ids, weights = problem(wo, "int8_w8a16", 0, m=2, k=1, hidden=96, seed=1)
    with pytest.raises(ValueError, match="decode='gemv_half' takes the 4-bit schemes"):
        run(wo, x, w13, w2, ids, weights)
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 64, m=2, k=1, hidden=96, seed=1)
    with pytest.raises(ValueError, match="up.BLOCK_K must divide or be a multiple of the group size 64"):
        run(wo, x, w13, w2, ids, weights, KernelConfig(1, GemmTile(16, 96, 1, 1, 1),
                                                       GemmTile(16, 32, 1, 1, 1)))


def test_inline_ptx_compiles_for_sm90():
    """The kernels with their inline PTX (1- and 2-row blocks, both schemes) through Triton's pipeline and
    the bundled ptxas to sm_90 SASS (the PTX cannot run here; a syntax or operand error fails here, not on
    the device). In a process of its own: this module's interpreted kernels patch Triton's frontend."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "wo_half_sass_cpu.py"), "--quick"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("OK", "FAIL"))]
    assert done.returncode == 0 and len(lines) == 4 and all(line.startswith("OK") for line in lines), done.stdout + done.stderr
