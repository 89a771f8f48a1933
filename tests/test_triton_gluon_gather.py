"""The bf16 Gluon route with the gather in the gate-up GEMM's loader (``_kernels/gluon_gemm_gather.py``, issue 19), on
the CPU: the alignment and combine kernels under Triton's interpreter, the Gluon GEMMs as torch stand-ins
(``_gluon_fakes``). What is checked here: the plan (no gather launch, no x_perm region, the GEMM's arguments), the
output against the gather-kernel route (bit for bit: the same rows reach the same products) and a float64 loop,
dst written by the GEMM for the combine, and which x the route sends where. The kernel itself (cp.async rows,
its barriers): compiled for sm_90 by ``benchmarks/gather_compile_cpu.py``; on the H200 it ran as the "lean gather"
variant of ``prefill_device_check.py`` (removed: ``git show 87f368f6:benchmarks/prefill_device_check.py``).
"""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import experts_loop, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)

E, N, K = 4, 128, 128


def _problem(m, k=2, seed=0, width=K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, width, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).bfloat16()
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).bfloat16()
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return x, w13, w2, ids, weights


def _run(x, w13, w2, ids, weights, in_loader):
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile
    from moekit.experts.triton_gluon_lean import run_lean

    return run_lean(x, w13, w2, ids, weights, None, UP_TILE, down_tile(N), in_loader=in_loader)


@pytest.mark.parametrize("m, k", [(40, 2), (100, 4)])
def test_in_loader_gather_equals_the_gather_kernel_route_and_a_float64_loop(fake_gemms, m, k):
    x, w13, w2, ids, weights = _problem(m, k)
    base = _run(x, w13, w2, ids, weights, False)
    first = _run(x, w13, w2, ids, weights, True)  # compiles: the bound launches
    again = _run(x, w13, w2, ids, weights, True)  # the recorded sequence
    assert torch.equal(first, base) and torch.equal(again, base)
    assert rel_l2(again, experts_loop(x, w13, w2, ids, weights)) < 1e-2
    x2, _, _, ids2, weights2 = _problem(m, k, seed=5)  # new call tensors through the same sequence
    assert torch.equal(_run(x2, w13, w2, ids2, weights2, True), _run(x2, w13, w2, ids2, weights2, False))


def test_plan_has_no_gather_launch_nor_x_perm_and_the_gemm_gets_x(fake_gemms):
    from moekit.experts import triton_gluon_lean as lean
    from moekit.experts.triton_gluon_launch import LOADER_REGS, LOADER_WARPS, UP_TILE

    x, w13, w2, ids, weights = _problem(40)
    _run(x, w13, w2, ids, weights, True)
    plan = next(p for p in lean._PLANS.values())
    assert plan.gather is None and plan.up.kernel is fake_gemms["gather"]
    assert "x_perm" not in plan.workspace.names and "dst" in plan.workspace.names  # dst: written by the GEMM
    (_, bound, options), = fake_gemms["gather"].log
    assert bound["x_ptr"] is x and bound["num_assignments"] == 80 and bound["stride_x"] == K
    assert (bound["TOP_K"], bound["W_ROWS"], bound["GATE_OFFSET"]) == (2, 2 * N, N)
    assert (bound["STAGES"], bound["LOADER_WARPS"], bound["LOADER_REGS"]) == (UP_TILE.stages, LOADER_WARPS, LOADER_REGS)
    assert options.get("maxnreg") and not fake_gemms["bf16"].log[0][1]["GATED"]  # the down GEMM alone on the plain one


def test_strided_x_rows_unaligned_fall_back_or_raise(fake_gemms, monkeypatch):
    """x rows not 16-byte aligned: an explicit request raises, the default (switched on) takes the gather kernel."""
    from moekit.experts import triton_gluon_launch

    wide, w13, w2, ids, weights = _problem(40, width=K + 4)
    x = wide[:, 4:]  # rows K + 4 elements apart: 264 bytes, not a multiple of 16
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        _run(x, w13, w2, ids, weights, True)
    monkeypatch.setattr(triton_gluon_launch, "LOADER_GATHER_MAX_INTER", N)
    out = _run(x, w13, w2, ids, weights, None)
    assert not fake_gemms["gather"].log and torch.equal(out, _run(x.contiguous(), w13, w2, ids, weights, False))
    assert rel_l2(out, experts_loop(x, w13, w2, ids, weights)) < 1e-2
    _run(x.contiguous(), w13, w2, ids, weights, None)  # aligned: the default takes the loader
    assert len(fake_gemms["gather"].log) == 1


def test_switched_on_the_plain_and_lean_launches_both_gather_in_the_loader(fake_gemms, monkeypatch):
    """With ``LOADER_GATHER_MAX_INTER`` >= N, ``experts_gluon`` plain and lean run the gather GEMM with the same
    arguments (the plain launch fills dst with -1 first; the lean one needs no fill) and give the same output."""
    from moekit.experts import triton_gluon_launch
    from moekit.experts.triton_gluon import experts_gluon

    monkeypatch.setattr(triton_gluon_launch, "LOADER_GATHER_MAX_INTER", N)
    x, w13, w2, ids, weights = _problem(40)
    outs, logs = [], []
    for lean in (False, True):
        fake_gemms["gather"].log.clear()
        outs.append(experts_gluon(x, w13, w2, ids, weights, lean=lean))
        (grid, bound, options), = fake_gemms["gather"].log
        logs.append((grid, {k: v for k, v in bound.items() if not hasattr(v, "block_shape")
                            and not isinstance(v, torch.Tensor)}, options))
    assert torch.equal(outs[1], outs[0]) and logs[1] == logs[0]
    assert rel_l2(outs[1], experts_loop(x, w13, w2, ids, weights)) < 1e-2
    monkeypatch.setattr(triton_gluon_launch, "LOADER_GATHER_MAX_INTER", N - 128)  # experts too wide: the kernel
    assert torch.equal(experts_gluon(x, w13, w2, ids, weights, lean=False), outs[0])


def test_the_route_gathers_in_the_loader_for_narrow_experts_only():
    """The default: experts at most 1024 wide (Qwen3's 768) gather in the loader; DeepSeek-V3's 2048 and Mixtral's
    14336 keep the gather kernel (they measured slower with it); x must be 2-byte with 16-byte aligned rows."""
    from moekit.experts.triton_gluon_launch import wants_loader_gather

    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert wants_loader_gather(x, 768) and wants_loader_gather(x, 1024) and wants_loader_gather(x.half(), 768)
    assert not wants_loader_gather(x, 1152) and not wants_loader_gather(x, 2048) and not wants_loader_gather(x, 14336)
    assert not wants_loader_gather(x.float(), 768)  # 4-byte elements
    assert not wants_loader_gather(torch.zeros(4, 260, dtype=torch.bfloat16)[:, :256], 768)  # rows 520 bytes apart
    assert not wants_loader_gather(torch.zeros(4, 264, dtype=torch.bfloat16)[:, 1:257], 768)  # rows start at 2 mod 16
