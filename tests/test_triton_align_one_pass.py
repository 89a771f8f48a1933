"""The alignment in one launch of a persistent grid (``align_one_pass_kernel``, ``LaunchOptions.align_one_pass_from``)
under Triton's interpreter, where the grid is one program (the interpreter runs programs one after another, so
a barrier between programs would wait forever; the device check runs the many-program grid): its layout equals
``align_block`` (the torch twin) and a plain loop's counts on random routings with empty experts, -1 ids, an
expert map, ties of every kind (ids repeated within a token); it leaves its three sync slots at 0; and experts
calls with it (bf16, lean and not; fp8_block; M = 0 included) equal the calls without, bit for bit; the default
options take it from ``align_one_pass_from`` assignments on, not below.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import make_problem  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.triton_launch import (  # noqa: E402
    ALIGN_CHUNK, LaunchOptions, cdiv, next_pow2, resolve_launch_options,
)
from moekit.layouts.block_aligned import align_block  # noqa: E402
from moekit.layouts.grouping import max_padded_rows  # noqa: E402

E, K, N = 8, 40, 24
CHUNKED = dict(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0, align_fold_max=0)  # chunked
ONE, OFF = dict(align_one_pass_from=1), dict(align_one_pass_from=0)  # the one-pass launch at any chunked A; never


def _run_kernel(ids: torch.Tensor, expert_map, block: int, slot: int, limits: dict) -> tuple[dict, torch.Tensor]:
    from moekit.experts.triton_align import align_launches, plan_align

    num_assignments = ids.numel()
    rows = max_padded_rows(num_assignments, E, block)
    plan = plan_align(num_assignments, E, block, None if expert_map is None else expert_map.numel(), rows,
                      resolve_launch_options(LaunchOptions(**ONE, **limits), ids.device), arrival_slot=slot, one_pass=1)
    assert plan.one is not None and plan.launches == 1 and plan.kept_counters == 3
    b = {name: torch.full(shape, -7, dtype=dtype) for name, dtype, shape in plan.regions}
    sync = torch.zeros(slot + 3, dtype=torch.int32)
    launches = align_launches(plan, ids, ids if expert_map is None else expert_map, b, sync)
    assert [launch for launch, _ in launches] == [plan.one]
    for launch, pointers in launches:
        launch(*pointers)
    return b, sync


@pytest.mark.parametrize("num_assignments, with_map, block, limits", [
    (300, False, 16, CHUNKED), (1000, True, 16, CHUNKED), (129, False, 64, CHUNKED), (512, True, 4, CHUNKED)])
def test_one_pass_equals_twin(interpreter, num_assignments, with_map, block, limits):
    g = torch.Generator().manual_seed(num_assignments)
    num_global = 12
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1], dtype=torch.int32) if with_map else None
    high = num_global if with_map else E - 2  # without a map experts 6 and 7 stay empty
    ids = torch.randint(-1, high, (num_assignments // 2, 2), generator=g, dtype=torch.int32)  # [M, 2], ties inside
    b, sync = _run_kernel(ids, expert_map, block, 2, limits)
    want = align_block(ids, E, block, expert_map, allow_naive=False)
    local = []
    for i in ids.flatten().tolist():
        e = int(expert_map[i]) if with_map and 0 <= i < num_global else (i if not with_map else -1)
        local.append(e if 0 <= e < E else E)
    assert b["counts"].tolist() == [local.count(e) for e in range(E)]
    assert b["counts"].tolist() == want.counts.tolist()
    used = int(want.num_padded)
    assert b["num_padded"].tolist() == [used]
    assert torch.equal(b["sorted_ids"][:used], want.sorted_ids[:used])
    assert torch.equal(b["expert_ids"][:cdiv(used, block)], want.expert_ids[:cdiv(used, block)])
    assert (b["expert_ids"][cdiv(used, block):] == -1).all()
    assert (b["sorted_ids"][used:] == ids.numel()).all()
    assert sync.tolist() == [0] * 5
    chunks = cdiv(ids.numel(), ALIGN_CHUNK)
    assert b["hist"].shape == (chunks, next_pow2(E + 1))


@pytest.mark.parametrize("lean, limits", [(True, CHUNKED), (False, CHUNKED)])
def test_experts_with_one_pass_equal_without(interpreter, lean, limits):
    """Forced to the chunked alignment (A = 200 and M = 0): one launch, bit for bit the output of two or three."""
    interpreter.clear_launch_caches()
    for seed, m in ((0, 100), (1, 100), (2, 0), (3, 100)):
        problem = make_problem(m, 2, E, K, N, torch.bfloat16, seed=seed, skips=True)
        one = interpreter.experts_triton(*problem, options=LaunchOptions(lean_launch=lean, **ONE, **limits))
        plain = interpreter.experts_triton(*problem, options=LaunchOptions(lean_launch=lean, **OFF, **limits))
        assert torch.equal(one, plain)
    from moekit.experts import triton_plan
    from moekit.experts.triton import _WORKSPACES

    assert any(p.align is not None and p.align.one is not None and p.align.launches == 1
               for p in triton_plan._PLANS.values())
    assert _WORKSPACES._counters and all(c.eq(0).all() for c in _WORKSPACES._counters.values())  # slots back at 0


def test_fp8_with_one_pass_equal_without(interpreter):
    """The fp8_block path (its plan keeps the one-pass launch's counters too): bit for bit the output without."""
    from _fp8_cases import SHAPES, problem

    import moekit.experts.triton_fp8 as fp8

    shape, block = SHAPES[0]
    for m in (70, 0):
        x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(m, 2, shape, block)
        got = [fp8.fused_experts_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=block,
                                     options=LaunchOptions(**one, **CHUNKED)) for one in (ONE, OFF)]
        assert torch.equal(got[0], got[1])
    from moekit.experts.triton_fp8_plan import _PLANS

    assert any(p.align is not None and p.align.one is not None for p in _PLANS.values())


def test_default_takes_one_pass_from_its_limit(interpreter):
    """The default options plan the one-pass launch from ``align_one_pass_from`` assignments on, not below."""
    from moekit.experts.triton_align import plan_align

    options = resolve_launch_options(LaunchOptions(), torch.device("cpu"))
    limit = options.align_one_pass_from
    for num_assignments, want in ((limit - 1, False), (limit, True)):
        rows = max_padded_rows(num_assignments, E, 64)
        plan = plan_align(num_assignments, E, 64, None, rows, options, arrival_slot=0, one_pass=1)
        assert (plan.one is not None) == want
        assert plan.kept_counters == (3 if want else 1)


def test_too_few_counters_take_the_chunked_launches(interpreter):
    """Counters that do not reach the one-pass launch's three slots (a workspace sized for another plan): the fused
    hist + scan and the scatter instead, never a write past them."""
    from moekit.experts.triton_align import align_launches, plan_align

    options = resolve_launch_options(LaunchOptions(**ONE, **CHUNKED), torch.device("cpu"))
    plan = plan_align(300, E, 16, None, max_padded_rows(300, E, 16), options, arrival_slot=2, one_pass=1)
    b = {name: torch.zeros(shape, dtype=dtype) for name, dtype, shape in plan.regions}
    ids = torch.zeros(300, dtype=torch.int32)
    assert [l for l, _ in align_launches(plan, ids, ids, b, torch.zeros(5, dtype=torch.int32))] == [plan.one]
    assert [l for l, _ in align_launches(plan, ids, ids, b, torch.zeros(4, dtype=torch.int32))] == [plan.hist_scan,
                                                                                                   plan.scatter]


@pytest.mark.parametrize("num_experts, num_assignments", [(128, 32768), (256, 32768), (128, 131072), (256, 65536)])
@pytest.mark.parametrize("one_per_sm", [True, False])
def test_one_pass_grid_one_program_per_sm_while_chunk_programs_fit(interpreter, monkeypatch, num_experts,
                                                                   num_assignments, one_per_sm):
    """The one-pass grid on a 132-SM device (264 programs allowed): one program per SM while its chunk programs of
    >= 2 chunks fit in one per SM (``ONE_PASS_ONE_PER_SM``), else (or switched off) up to two per SM."""
    import moekit.experts.triton_align as talign

    monkeypatch.setattr(talign, "ONE_PASS_ONE_PER_SM", one_per_sm)
    sms, block = 132, 64
    rows = max_padded_rows(num_assignments, num_experts, block)
    options = resolve_launch_options(LaunchOptions(), torch.device("cpu"))
    plan = talign.plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0,
                             one_pass=2 * sms)
    chunks = cdiv(num_assignments, ALIGN_CHUNK)
    per = max(2, cdiv(chunks, 2 * sms))
    chunk_programs = cdiv(chunks, per)
    blocks = cdiv(rows, block)
    e_pad = next_pow2(num_experts + 1)
    items = cdiv(blocks, max(1, min(next_pow2(blocks), 4096 // e_pad)))
    limit = sms if one_per_sm and chunk_programs <= sms else 2 * sms
    assert plan.one.grid[0] == min(limit, chunk_programs + items) >= chunk_programs
    assert plan.one.grid[0] == {(128, 32768): 132 if one_per_sm else 168, (256, 32768): 132 if one_per_sm else 224,
                                (128, 131072): 264, (256, 65536): 264}[(num_experts, num_assignments)]
