"""The weight-only path's word MMA decode (``decode="mma"``, ``_kernels/gemm_wo_mma.py``, int4) on the CPU under
Triton's interpreter, tiny shapes: the kernels against the float64 loop of ``test_triton_wo`` (both operand orders,
odd K with a group tail, split-K down, an expert map with -1), its Triton twin of the bit placement against a
decoder written here, and its refusals by name. The inline PTX (NVIDIA only) is checked against the torch twin at
real shapes by ``benchmarks/wo_tc_device_check.py``.
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


def config(rows: int = 32, swap: bool = False, block_k: int = 128) -> KernelConfig:
    tile = GemmTile(rows, block_k, 1, 1, 1)
    return KernelConfig(16, tile, tile, swap_ab=swap)


def run(wo, x, w13, w2, ids, weights, cfg, expert_map=None, split_k=None):
    args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
    return wo.run_experts_wo(x, *args, ids, weights, expert_map, w13.scheme, config=cfg, options=POISON,
                             split_k=split_k, decode="mma")


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("scheme,hidden,group", [("int4_w4a16", 256, 128), ("int4_w4a16", 200, 128),
                                                 ("int4_w4a16", 256, 256), ("mxfp4", 256, 32), ("mxfp4", 200, 32)])
def test_mma_matches_float64_loop(wo, swap, scheme, hidden, group):
    # K = 200: the last step's words past the row (25 words) load as 0, x past K as 0, the tail group is 72 (int4)
    # or 8 (mxfp4) wide; mxfp4 scales 2^-5 .. 2^-1 (``make_weight``), each weight scaled in the decode
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=5, k=2, hidden=hidden, n=128, seed=hidden + group)
    out = run(wo, x, w13, w2, ids, weights, config(swap=swap))
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


@pytest.mark.parametrize("scheme,group", [("int4_w4a16", 128), ("mxfp4", 32)])
@pytest.mark.parametrize("split_k", [2, 3])
def test_mma_split_down_and_expert_map(wo, scheme, group, split_k):
    # N = 384: three 128-wide steps in 2 (one of 256, one of 128) or 3 splits; global expert 2 lives elsewhere
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=3, k=2, hidden=128, n=384, seed=40 + split_k)
    expert_map = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    ids[0, 0] = 2
    out = run(wo, x, w13, w2, ids, weights, config(rows=16), expert_map=expert_map, split_k=split_k)
    assert rel(out, wo.fused_experts_wo_torch(x, w13, w2, ids, weights, expert_map=expert_map)) < 1e-3


def test_mma_heuristic_config_runs(wo):
    x, w13, w2, ids, weights = problem(wo, "int4_w4a16", 128, m=2, k=2, hidden=128, n=128, seed=3)
    out = run(wo, x, w13, w2, ids, weights, None)
    assert rel(out, loop64(x, w13, w2, ids, weights)) < 1e-3


_KERNELS = {}  # the interpreted wo_mma_values module (a Triton kernel reads module globals only)


@triton.jit
def value_kernel(w_ptr, out_ptr):
    tl = triton.language
    i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]  # [16, 16]: word i
    v = _KERNELS["mma"].pair_values(tl.load(w_ptr + i), i, tl.float32, 1, False)
    for t in tl.static_range(8):
        tl.store(out_ptr + i * 8 + t, v[t])


def test_twin_placement_is_128_plus_each_nibble(wo):
    import sys

    _KERNELS["mma"] = sys.modules["moekit.experts._kernels.wo_mma_values"]
    words = torch.randint(-2**31, 2**31 - 1, (256,), dtype=torch.int32)
    words[:16] = torch.tensor([0, -1, 0x12345678, -0x789ABCDF] * 4, dtype=torch.int32)
    out = torch.empty(256 * 8, dtype=torch.float32)
    value_kernel[(1,)](words, out)
    codes = [(int(w) >> (4 * t)) & 0xF for w in words.tolist() for t in range(8)]
    assert out.tolist() == [128.0 + c for c in codes]


@pytest.mark.parametrize("scheme,group,block_k,match", [
    ("int8_w8a16", 0, 128, "int4_w4a16 and mxfp4"), ("int4_w4a16", 64, 128, "BLOCK_K must be 128"),
    ("int4_w4a16", 128, 64, "BLOCK_K must be 128"), ("mxfp4", 32, 256, "BLOCK_K must be 128")])
def test_mma_refusals_name_the_problem(wo, scheme, group, block_k, match):
    x, w13, w2, ids, weights = problem(wo, scheme, group, m=2, k=2, hidden=128, n=128)
    with pytest.raises(ValueError, match=match):
        run(wo, x, w13, w2, ids, weights, config(block_k=block_k))


def test_chooser_mma_falls_back_where_the_groups_do_not_fit(wo, monkeypatch):
    # a measured "mma" entry for the call's shape: taken with g = 128, the register decode with g = 64 (steps of
    # 128 columns would straddle two groups); a caller's decode="mma" there is refused (above)
    from moekit.experts import triton_wo_plan as plan

    for group, want in ((128, "mma"), (64, "register")):
        x, w13, w2, ids, weights = problem(wo, "int4_w4a16", group, m=2, k=2, hidden=128, n=128, e=4)
        monkeypatch.setitem(plan.DECODE_MEASURED, ("int4_w4a16", 4, 128, 128), {2: "mma"})
        args = [wo.weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2)]
        built = plan.build_wo_plan(x, *args, ids, None, "int4_w4a16", "silu", None, POISON)
        assert built.decode == want


def test_inline_ptx_compiles_for_sm90():
    """The mma kernels with their inline PTX (both schemes, both GEMMs, the default tiles) through Triton's pipeline
    and the bundled ptxas to sm_90 SASS (the PTX cannot run here: a syntax or operand error fails here, not on the
    device). In a process of its own: this module's interpreted kernels patch Triton's frontend."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "wo_reg_sass_cpu.py"), "--quick"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("OK", "FAIL"))]
    assert done.returncode == 0 and len(lines) == 4 and all(line.startswith("OK") for line in lines), done.stdout + done.stderr
