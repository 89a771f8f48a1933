"""The k-sum folded into the quantized paths' down GEMMs (fp8_block ``gemm_fp8.down_fp8_kernel``, weight-only
tile / register / gemv ``gemm_wo*``; ``LaunchOptions.sum_fold_max``, the bf16 path's ``combine.ksum_epilogue``)
under Triton's interpreter: with the pool's kept counters the down GEMM writes out itself, one launch fewer;
the result equals the separate (ordered) k-sum bit for bit, as the bf16 fold's test asserts, a float64 loop
written here and the torch twins; the counters are back at zero; an expert map with -1 entries; the lean
recorded sequences of eager calls hold one launch fewer. fp8_block past the fold: the k-sum in sum programs after
the down GEMM's (``LaunchOptions.sum_tail_max``), bit-equal to the separate k-sum too."""

from __future__ import annotations

import pytest
import torch

from _helpers import bf16_quantized_pair, quantized_experts_loop, rel_l2

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.triton_cache import WorkspacePool  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N, TOP_K = 4, 64, 32, 2
FOLD = LaunchOptions(poison_workspace=True, sum_fold_max=8)
SEP = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=0)
TAIL = LaunchOptions(poison_workspace=True, sum_fold_max=0, sum_tail_max=64)  # fp8: the sum programs (SUM_AFTER)
# (scheme, decode): every weight-only decode that fuses (scratch runs the bf16 GEMMs), fp8 its one
CASES = [("fp8_block", None), ("int8_w8a16", "tile"), ("int4_w4a16", "register"), ("int4_w4a16", "gemv"),
         ("mxfp4", "tile"), ("mxfp4", "register")]
SCHEMES = {"fp8_block": dict(block_shape=(32, 32)), "int8_w8a16": {}, "int4_w4a16": dict(group_size=32),
           "mxfp4": {}}
TOL = {"fp8_block": 8e-2, "int8_w8a16": 2e-2, "int4_w4a16": 2e-2, "mxfp4": 2e-2}  # fp8 quantizes x and h too
MAP = torch.tensor([2, -1, 0, -1, 3, 1], dtype=torch.int32)  # 6 global experts, 4 here; 1 and 3 elsewhere


def _weights(scheme: str, seed: int = 0):
    return bf16_quantized_pair(scheme, E, N, K, SCHEMES[scheme], seed)


def _routing(m: int, seed: int, with_map: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    experts = MAP.numel() if with_map else E
    ids = torch.rand(m, experts, generator=g).argsort(dim=1)[:, :TOP_K].int()  # distinct experts per token
    if m > 2:
        ids[1] = -1  # a token with every slot skipped: the fold's zero-fill programs write it
    weights = torch.softmax(torch.rand(m, TOP_K, generator=g), dim=1)
    return x, ids, weights, (MAP if with_map else None)


def _launch(scheme, decode, q13, q2, x, ids, weights, expert_map, options, pool):
    """(out, launches, counters) of one call by the path's own plan and launch list, on ``pool``'s buffers
    (its kept counters: the fold) or a fresh workspace (None: no counters, the separate k-sum)."""
    if scheme == "fp8_block":
        from moekit.experts.triton_fp8 import _DESCRIPTORS, fp8_launches
        from moekit.experts.triton_fp8_plan import plan_for

        plan = plan_for(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, expert_map, tuple(q13.block_shape), None,
                        options)
        w13_arg, w2_arg = q13.q, q2.q
        if plan.descriptor_key is not None:  # the weights' TMA descriptors, as the path's own call takes them
            pair = _DESCRIPTORS.get(q13.q, q2.q, plan.descriptor_key)
            w13_arg, w2_arg = pair.w13, pair.w2

        def make(b, out):
            return fp8_launches(plan, b, x, w13_arg, q13.scale, w2_arg, q2.scale, ids, weights, expert_map, out)
    else:
        from moekit.experts.triton_quant import _wo
        from moekit.experts.triton_wo import wo_launches
        from moekit.experts.triton_wo_plan import weight_args, wo_plan_for

        a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (_wo(q13), _wo(q2)))
        plan = wo_plan_for(x, a13, a2, ids, weights, expert_map, scheme, "silu", None, options, None, decode)
        assert plan.decode == decode and plan.split_k == 1

        def make(b, out):
            return wo_launches(plan, b, x, a13, a2, ids, weights, expert_map, out)
    b = plan.workspace.allocate(x.device) if pool is None else pool.buffers(plan.workspace, x.device)
    for region in ("h", "h_q", "h_s", "y"):  # a read of a row no kernel wrote shows up as NaN
        if region in b:
            b[region].fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    launches = make(b, out)
    for launch, pointers in launches:
        launch(*pointers)
    return out, [launch.kernel.fn.__name__ for launch, _ in launches], b.get("counters")


def _twin(scheme, q13, q2, x, ids, weights, expert_map):
    if scheme == "fp8_block":
        from moekit.experts.triton_fp8 import fused_experts_fp8_torch

        return fused_experts_fp8_torch(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, expert_map=expert_map,
                                       block_shape=tuple(q13.block_shape))
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import fused_experts_wo_torch

    return fused_experts_wo_torch(x, _wo(q13), _wo(q2), ids, weights, expert_map=expert_map)


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("scheme,decode", CASES)
def test_folded_equals_separate_sum_loop_and_twin(interpreter, scheme, decode, m, with_map):
    q13, q2 = _weights(scheme)
    x, ids, weights, expert_map = _routing(m, m * 7 + with_map, with_map)
    pool = WorkspacePool()
    folded, ran, counters = _launch(scheme, decode, q13, q2, x, ids, weights, expert_map, FOLD, pool)
    sums = [name for name in ran if name == "sum_slots_kernel"]
    assert not sums and counters is not None and bool((counters == 0).all())  # the last arrivals set them back
    separate, ran_sep, _ = _launch(scheme, decode, q13, q2, x, ids, weights, expert_map, FOLD, None)
    assert ran_sep.count("sum_slots_kernel") == 1 and len(ran_sep) == len(ran) + 1
    unfolded, ran_off, _ = _launch(scheme, decode, q13, q2, x, ids, weights, expert_map, SEP, pool)
    assert ran_off == ran_sep  # sum_fold_max=0: the pool's workspace, still the separate k-sum
    assert torch.equal(folded, separate) and torch.equal(folded, unfolded)
    assert not folded.isnan().any()
    if m > 2:
        assert bool((folded[1] == 0).all())  # no slot routed here
    want = quantized_experts_loop(x, q13, q2, ids, weights, expert_map)
    assert rel_l2(folded, want) < TOL[scheme]
    assert rel_l2(folded, _twin(scheme, q13, q2, x, ids, weights, expert_map)) < 1e-2


def _kept_launches(tri, q13, q2, m: int, options: LaunchOptions) -> tuple[int, torch.Tensor]:
    """(launches of the lean sequence kept for this kind of eager call, a served call's output)."""
    from moekit.experts import triton_quant_fast

    tri.clear_launch_caches()
    triton_quant_fast.clear_quant_fast()
    for seed in range(3):  # compiles, records, then served
        x, ids, weights, _ = _routing(m, seed, False)
        out = tri.experts_triton(x, q13, q2, ids, weights, options=options)
    (entry,) = triton_quant_fast._MEMO.values()
    return len(entry.sequence.steps), out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_lean_sequence_has_one_launch_fewer(interpreter, scheme):
    """At M = 1 (the default sum_fold_max) the recorded sequence folds the k-sum; sum_fold_max=0 keeps its
    launch; both serve the same output bit for bit, the plain path's."""
    q13, q2 = _weights(scheme, seed=3)
    folded, out = _kept_launches(interpreter, q13, q2, 1, LaunchOptions())
    separate, out_sep = _kept_launches(interpreter, q13, q2, 1, LaunchOptions(sum_fold_max=0, sum_tail_max=0))
    assert folded == separate - 1
    assert torch.equal(out, out_sep)
    x, ids, weights, _ = _routing(1, 2, False)
    assert torch.equal(out,
                       interpreter.experts_triton(x, q13, q2, ids, weights, options=LaunchOptions(lean_launch=False)))
    assert rel_l2(out, quantized_experts_loop(x, q13, q2, ids, weights, None)) < TOL[scheme]


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m", [1, 5, 13])
def test_fp8_sum_after_equals_separate_sum_loop_and_twin(interpreter, m, with_map):
    """fp8_block with the sum programs after the down GEMM's: one launch fewer, bit-equal to the separate k-sum
    (tails: M not a multiple of the sum tile's 4 tokens; a token with every slot skipped; map entries -1)."""
    q13, q2 = _weights("fp8_block", seed=m)
    x, ids, weights, expert_map = _routing(m, m * 5 + with_map, with_map)
    pool = WorkspacePool()
    after, ran, counters = _launch("fp8_block", None, q13, q2, x, ids, weights, expert_map, TAIL, pool)
    assert "sum_slots_kernel" not in ran and counters.numel() >= 2 and bool((counters == 0).all())
    separate, ran_sep, _ = _launch("fp8_block", None, q13, q2, x, ids, weights, expert_map, SEP, pool)
    assert ran_sep.count("sum_slots_kernel") == 1 and len(ran_sep) == len(ran) + 1
    assert torch.equal(after, separate) and not after.isnan().any()
    if m > 2:
        assert bool((after[1] == 0).all())  # no slot routed here
    assert rel_l2(after, quantized_experts_loop(x, q13, q2, ids, weights, expert_map)) < TOL["fp8_block"]
    assert rel_l2(after, _twin("fp8_block", q13, q2, x, ids, weights, expert_map)) < 1e-2
