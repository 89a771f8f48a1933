"""The Gluon paths' lean launch (``triton_gluon_lean``) on the CPU: the alignment, gather and combine kernels run
under Triton's interpreter, the Gluon GEMMs as torch stand-ins (``_gluon_fakes``: Gluon does not run in the
interpreter). The lean launch hands every kernel what the plain launch hands it (outputs equal bit for bit, the
GEMMs' arguments equal), at each alignment plan, with an expert map, above the pool's size (the branch a CUDA
graph capture takes); and what it keeps is rebuilt when it must: a new weight tensor, another device in the
descriptor key, a retune (an in-place update keeps it: addresses, never values, and the output follows the update). The
kernels themselves: ``benchmarks/gluon_lean_device_check.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from _fp8_cases import block_experts
from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _helpers import experts_loop, rel_l2
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)

E, N, K = 4, 128, 128  # the smallest N and K the Gluon paths take (fp8: K = 256, two scale groups)


def _lean():
    from moekit.experts import triton_gluon_lean

    return triton_gluon_lean


def _bf16_problem(m, k=2, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * N, K, generator=g) * K**-0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) * N**-0.5).to(dtype)
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.rand(m, k, generator=g), dim=1)
    return x, w13, w2, ids, weights


def _fp8_problem(m, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * K, generator=g).bfloat16()
    q = block_experts(g, E, N, 2 * K)
    ids = torch.rand(m, E, generator=g).topk(k, dim=1).indices.int()
    return x, q, ids, torch.rand(m, k, generator=g)


def _fp8_f64(x, q, ids, weights):
    """The fp8 recipe in float64: x and h through e4m3 per 128 columns, dequantized weights, y rounded to bf16."""
    def groups(v):
        v = v.double().view(v.shape[0], -1, 128)
        amax = v.abs().amax(dim=2, keepdim=True)
        s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        return ((v / s).float().clamp(-448, 448).to(torch.float8_e4m3fn).double() * s).view(v.shape[0], -1)

    w13 = q[0].double() * q[1].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    w2 = q[2].double() * q[3].repeat_interleave(128, 1).repeat_interleave(128, 2).double()
    xq, out = groups(x), torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate_up = w13[int(ids[t, j])] @ xq[t]
            h = groups((torch.nn.functional.silu(gate_up[:N]) * gate_up[N:])[None])[0]
            out[t] += float(weights[t, j]) * (w2[int(ids[t, j])] @ h).bfloat16().double()
    return out


# M = 40, k = 2: A = 80, one alignment launch; M = 100, k = 4: A = 400 over four 128-id chunks, past the plan's
# two-launch limit lowered to 256 (the default 4096 would need M = 1100: 11x the interpreted gather and combine
# programs for the same launches), hist + scan on kept counters + scatter
@pytest.mark.parametrize("m, k, two_launch_max", [(40, 2, None), (100, 4, 256)])
def test_bf16_lean_equals_plain_and_a_float64_loop(fake_gemms, launched, monkeypatch, m, k, two_launch_max):
    from moekit.experts import triton_gluon_lean
    from moekit.experts.triton_gluon import experts_gluon
    from moekit.experts.triton_launch import LaunchOptions

    if two_launch_max is not None:
        lowered = LaunchOptions(align_one_launch_max=two_launch_max, align_two_launch_max=two_launch_max)
        monkeypatch.setattr(triton_gluon_lean, "LaunchOptions", lambda: lowered)
        monkeypatch.setattr(triton_gluon_lean, "_PLANS", {})  # no plan of this kind from the default limits
    x, w13, w2, ids, weights = _bf16_problem(m, k)
    plain = experts_gluon(x, w13, w2, ids, weights, lean=False)
    first = experts_gluon(x, w13, w2, ids, weights)  # compiles: the bound launches
    again = experts_gluon(x, w13, w2, ids, weights)  # the recorded sequence
    assert launched[0] == 1
    assert torch.equal(first, plain) and torch.equal(again, plain)
    assert rel_l2(again, experts_loop(x, w13, w2, ids, weights)) < 1e-2
    x2, _, _, ids2, weights2 = _bf16_problem(m, k, seed=5)  # new call tensors through the same sequence
    assert torch.equal(experts_gluon(x2, w13, w2, ids2, weights2),
                       experts_gluon(x2, w13, w2, ids2, weights2, lean=False)) and launched[0] == 2
    align = next(iter(triton_gluon_lean._PLANS.values())).align if two_launch_max else None
    assert align is None or (align.hist_scan is not None and align.scatter is not None)


def test_fp8_lean_equals_plain_and_a_float64_loop(fake_gemms, launched):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    x, q, ids, weights = _fp8_problem(48)
    plain = experts_gluon_fp8(x, *q, ids, weights, lean=False)
    assert torch.equal(experts_gluon_fp8(x, *q, ids, weights), plain)
    assert torch.equal(experts_gluon_fp8(x, *q, ids, weights), plain) and launched[0] == 1
    assert rel_l2(plain, _fp8_f64(x, q, ids, weights)) < 2e-2


def test_expert_map_skips_other_ranks_experts(fake_gemms, launched):
    from moekit.experts.triton_gluon import experts_gluon

    x, w13, w2, _, weights = _bf16_problem(30, 2)
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1, -1], dtype=torch.int32)  # 8 global experts, 4 here
    ids = torch.rand(30, 8, generator=torch.Generator().manual_seed(9)).topk(2, dim=1).indices.int()
    outs = [experts_gluon(x, w13, w2, ids, weights, expert_map=expert_map, lean=lean) for lean in (False, True, True)]
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0]) and launched[0] == 1
    assert rel_l2(outs[2], experts_loop(x, w13, w2, ids, weights, expert_map)) < 1e-2


def test_gemm_arguments_equal_the_plain_launches(fake_gemms, monkeypatch):
    """Each GEMM launch gets the plain launch's grid, scalars, constexprs, options and descriptor geometry."""
    from moekit.experts import triton_gluon_launch
    from moekit.experts.triton_gluon import experts_gluon
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    def geometry(log):
        def arg(v):
            if hasattr(v, "block_shape"):  # a descriptor: what its TMA encoding holds but the address
                return ("desc", tuple(v.shape), tuple(v.strides), tuple(v.block_shape), v.base.dtype, repr(v.layout))
            return ("tensor", v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v

        return [(grid, {k: arg(v) for k, v in bound.items()}, options) for grid, bound, options in log]

    def logged(names):
        return geometry([entry for n in names for entry in fake_gemms[n].log])

    def clear():
        for fake in fake_gemms.values():
            fake.log.clear()

    x, w13, w2, ids, weights = _bf16_problem(40)
    xq, q, ids_q, weights_q = _fp8_problem(40)
    bf16 = lambda lean: experts_gluon(x, w13, w2, ids, weights, lean=lean)  # noqa: E731
    # bf16: the gate-up GEMM gathering in its loader (N = 128, the default's narrow experts), then the gather kernel
    for name, call, max_inter in (("gather", bf16, None), ("bf16", bf16, 0),
                                  ("fp8", lambda lean: experts_gluon_fp8(xq, *q, ids_q, weights_q, lean=lean), None)):
        if max_inter is not None:
            monkeypatch.setattr(triton_gluon_launch, "LOADER_GATHER_MAX_INTER", max_inter)
        names = ("gather", "bf16") if name == "gather" else (name,)
        logs = []
        for lean in (False, True):  # the lean path's compiling call: the one whose options Triton compiles with
            clear()
            call(lean)
            logs.append(logged(names))
        assert len(logs[0]) == 2 and logs[1] == logs[0], name
        clear()
        call(True)  # the recorded sequence: the same arguments (its options were fixed by the compile)
        assert [entry[:2] for entry in logged(names)] == [entry[:2] for entry in logs[0]], name


def test_above_the_pool_size_fresh_buffers_give_the_same_output(fake_gemms, launched, monkeypatch):
    """Above ``GLUON_REUSE_MAX_BYTES`` (and while a CUDA graph captures) the call runs the bound launches on
    fresh regions with descriptors built per call: the same output."""
    from moekit.experts.triton_gluon import experts_gluon

    monkeypatch.setattr(_lean()._WORKSPACES, "max_bytes", 1024)
    x, w13, w2, ids, weights = _bf16_problem(40)
    plain = experts_gluon(x, w13, w2, ids, weights, lean=False)
    for _ in range(2):
        assert torch.equal(experts_gluon(x, w13, w2, ids, weights), plain)
    assert launched[0] == 0


def test_kept_state_is_rebuilt_when_its_inputs_change(fake_gemms, launched):
    """A new weight tensor, a retune: new descriptors / plan / sequence; an in-place update keeps the descriptors;
    never stale output."""
    from moekit.experts.configs import clear_config_cache
    from moekit.experts.triton_gluon import experts_gluon

    lean = _lean()
    x, w13, w2, ids, weights = _bf16_problem(40)
    experts_gluon(x, w13, w2, ids, weights)
    experts_gluon(x, w13, w2, ids, weights)
    plan = next(iter(lean._PLANS.values()))
    pair = lean._DESCRIPTORS.get(w13, w2, plan.weight_key, lean.weight_pair)

    w13_new = w13.clone()  # a new tensor: its own descriptors
    assert lean._DESCRIPTORS.get(w13_new, w2, plan.weight_key, lean.weight_pair) is not pair
    assert torch.equal(experts_gluon(x, w13_new, w2, ids, weights),
                       experts_gluon(x, w13_new, w2, ids, weights, lean=False))

    w13.mul_(2)  # in place: _version moves, the address stays (the same descriptors); the output follows the new values
    assert lean._DESCRIPTORS.get(w13, w2, plan.weight_key, lean.weight_pair) is pair
    updated = experts_gluon(x, w13, w2, ids, weights)
    assert torch.equal(updated, experts_gluon(x, w13, w2, ids, weights, lean=False))
    assert rel_l2(updated, experts_loop(x, w13, w2, ids, weights)) < 1e-2

    clear_config_cache()  # a retune drops the plans and their sequences
    assert not lean._PLANS and not lean._SEQUENCES
    before = launched[0]
    assert torch.equal(experts_gluon(x, w13, w2, ids, weights), updated)  # rebuilt: the bound launches first
    assert experts_gluon(x, w13, w2, ids, weights) is not None and launched[0] == before + 1
    assert next(iter(lean._PLANS.values())) is not plan


def test_descriptor_key_names_the_device_and_blocks(fake_gemms):
    """The weights' descriptors are kept per (weights, key); the key names the device, dtype and block shapes, so a
    call on another device (or with other tiles) never gets a descriptor built for this one."""
    from moekit.experts.triton_gluon import experts_gluon

    lean = _lean()
    x, w13, w2, ids, weights = _bf16_problem(40)
    experts_gluon(x, w13, w2, ids, weights)
    plan = next(iter(lean._PLANS.values()))
    assert plan.weight_key[:3] == ("gluon", x.device, torch.bfloat16)
    built = []

    def build(a, b, key):
        built.append(key)
        return lean.weight_pair(a, b, key)

    other = ("gluon", torch.device("meta"), *plan.weight_key[2:])
    first = lean._DESCRIPTORS.get(w13, w2, other, build)
    assert lean._DESCRIPTORS.get(w13, w2, other, build) is first and built == [other]
    assert lean._DESCRIPTORS.get(w13, w2, plan.weight_key, build) is not first  # the cpu key's own pair, kept
    assert built == [other]


def test_sequence_and_descriptors_go_with_their_weights(fake_gemms):
    from moekit.experts.triton_gluon import experts_gluon

    lean = _lean()
    x, w13, w2, ids, weights = _bf16_problem(40)
    for _ in range(2):
        experts_gluon(x, w13, w2, ids, weights)
    assert len(lean._SEQUENCES) == 1 and len(lean._DESCRIPTORS) == 1
    del w13
    gc.collect()
    assert not lean._SEQUENCES and not len(lean._DESCRIPTORS)


def test_one_workspace_is_kept_and_reused(fake_gemms):
    from moekit.experts.triton_gluon import experts_gluon

    lean = _lean()
    x, w13, w2, ids, weights = _bf16_problem(40)
    experts_gluon(x, w13, w2, ids, weights)
    held = lean._WORKSPACES.held()
    experts_gluon(x, w13, w2, ids, weights)
    assert len(held) == 1 and lean._WORKSPACES.held() == held
    plan = next(iter(lean._PLANS.values()))
    assert next(iter(held.values())).numel() == plan.workspace.nbytes  # its size, not the next power of two


def test_skipped_slots_never_read_a_stale_dst(fake_gemms):
    """The lean launch does not fill dst with -1: the combine reads it only for slots routed here. With the pooled
    dst holding another call's rows (here: all 0, a real row), skipped ids (< 0, >= E, a map's -1) still add 0."""
    from moekit.experts.triton_gluon import experts_gluon

    lean = _lean()
    x, w13, w2, ids, weights = _bf16_problem(40)
    experts_gluon(x, w13, w2, ids, weights)
    skipped = ids.clone()
    skipped[::3, 0], skipped[1::5, 1] = -1, E  # dropped, another rank's (transformers' sentinel)
    plan = next(iter(lean._PLANS.values()))
    lean._WORKSPACES.pooled(plan.workspace, x.device)["dst"].fill_(0)
    out = experts_gluon(x, w13, w2, skipped, weights)
    assert torch.equal(out, experts_gluon(x, w13, w2, skipped, weights, lean=False))
    assert rel_l2(out, experts_loop(x, w13, w2, skipped, weights)) < 1e-2


def test_backend_repeated_call_takes_the_fast_path(fake_gemms, monkeypatch):
    """``experts_triton_gluon``: a repeated call with the same weights launches from its kept sequence (no checks,
    no plan lookup), an in-place update too (with the new values); another choice or a map miss it and still give the
    plain path's output."""
    import moekit.experts.triton_fast as fast
    from moekit.experts.triton_gluon import GluonChoice, experts_gluon, experts_triton_gluon

    hits, real = [0], fast.launch_lean

    def counted(*args):
        hits[0] += 1
        return real(*args)

    monkeypatch.setattr(fast, "launch_lean", counted)
    x, w13, w2, ids, weights = _bf16_problem(40)
    everywhere = GluonChoice(min_tokens=1, min_tokens_wide=1)
    plain = experts_gluon(x, w13, w2, ids, weights, lean=False)
    outs = [experts_triton_gluon(x, w13, w2, ids, weights, choice=everywhere) for _ in range(3)]
    assert all(torch.equal(out, plain) for out in outs) and hits[0] == 1  # compile, record + keep, then the hit
    w13.mul_(2)
    updated = experts_triton_gluon(x, w13, w2, ids, weights, choice=everywhere)
    assert hits[0] == 2 and torch.equal(updated, experts_gluon(x, w13, w2, ids, weights, lean=False))
    assert not torch.equal(updated, plain)
    other = GluonChoice(min_tokens=2, min_tokens_wide=2)
    experts_triton_gluon(x, w13, w2, ids, weights, choice=other)
    assert hits[0] == 2  # another choice: its own key
    experts_triton_gluon(x, w13, w2, ids, weights, choice=everywhere)
    assert hits[0] == 3


def test_fp8_repeated_call_takes_the_fast_path(fake_gemms, monkeypatch):
    """The ``triton`` backend on fp8_block weights (the choice lowered to this tiny call): a repeated call launches
    from its kept sequence, which holds the scales by address: an in-place scale update is seen (a hit, new values),
    a new scale tensor misses; every output the plain path's."""
    import dataclasses

    import moekit.experts.triton_fast as fast
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts.triton import experts_triton_unchecked
    from moekit.quant.fp8_block import Fp8BlockWeight

    hits, real = [0], fast.launch_lean

    def counted(*args):
        hits[0] += 1
        return real(*args)

    monkeypatch.setattr(fast, "launch_lean", counted)
    monkeypatch.setattr(tgf, "DEFAULT_FP8_CHOICE", tgf.Fp8GluonChoice(min_flops=1, min_rows_per_expert=0))
    x, q, ids, weights = _fp8_problem(16)
    w13 = Fp8BlockWeight(q=q[0], scale=q[1], dtype=torch.bfloat16)
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], dtype=torch.bfloat16)

    def plain(w13, w2):
        return tgf.experts_gluon_fp8(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, lean=False)

    outs, want = [experts_triton_unchecked(x, w13, w2, ids, weights) for _ in range(3)], plain(w13, w2)
    assert all(torch.equal(out, want) for out in outs) and hits[0] == 1
    w2.scale.mul_(0.5)  # in place: the same address, the kernels read the new values
    assert torch.equal(experts_triton_unchecked(x, w13, w2, ids, weights), plain(w13, w2)) and hits[0] == 2
    w2_new = dataclasses.replace(w2, scale=w2.scale * 2)  # a new scale tensor: another address, a miss
    assert torch.equal(experts_triton_unchecked(x, w13, w2_new, ids, weights), plain(w13, w2_new)) and hits[0] == 2


def test_triton_backend_takes_the_gluon_path_where_the_default_choice_wants_it(fake_gemms, launched, monkeypatch):
    """The ``triton`` backend (default options) hands a call ``DEFAULT_CHOICE`` wants to the Gluon path (its output
    the plain Gluon launch's, within bf16 rounding of a float64 loop), repeats it from the kept sequence, and keeps
    the fused kernels below the choice's sizes, for its own options and where ``triton_gluon``'s choice says no."""
    import moekit.experts.triton_gluon as tg
    from moekit.experts.triton import LaunchOptions, experts_triton_unchecked

    x, w13, w2, ids, weights = _bf16_problem(40)
    plain = tg.experts_gluon(x, w13, w2, ids, weights, lean=False)
    gemms = len(fake_gemms["bf16"].log)
    fused = experts_triton_unchecked(x, w13, w2, ids, weights)  # the default choice wants 4096+ tokens
    assert len(fake_gemms["bf16"].log) == gemms
    monkeypatch.setattr(tg, "DEFAULT_CHOICE", tg.GluonChoice(min_tokens=40, min_tokens_wide=40))
    outs = [experts_triton_unchecked(x, w13, w2, ids, weights) for _ in range(3)]
    assert all(torch.equal(out, plain) for out in outs) and launched[0] == 2  # recorded, then twice from what it kept
    assert rel_l2(outs[0].double(), experts_loop(x, w13, w2, ids, weights)) < 1e-2
    gemms = len(fake_gemms["bf16"].log)
    never = tg.GluonChoice(min_tokens=10**9, min_tokens_narrow=10**9, min_tokens_wide=10**9)
    for out in (experts_triton_unchecked(x, w13, w2, ids, weights, options=LaunchOptions()),
                tg.experts_triton_gluon(x, w13, w2, ids, weights, choice=never),
                experts_triton_unchecked(x[:39], w13, w2, ids[:39], weights[:39])):
        assert torch.equal(out, fused[: out.shape[0]])
    assert len(fake_gemms["bf16"].log) == gemms  # none of the three reached the Gluon GEMMs
