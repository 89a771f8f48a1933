"""The Triton experts path's host side, under Triton's interpreter: what is decided once and cached
(plans, bound launches, weight descriptors, workspaces) is invalidated when it must be, and every
shortcut computes what the plain path computes.

Speed is not measured here (``benchmarks/host_time.py`` does, on the GPU); these tests hold the
cached paths against the uncached ones and against the float64 reference.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")

from _helpers import TOLERANCE as TOL, count_op_calls, make_problem, rel_l2  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.configs import GemmTile, KernelConfig, config_file_name, write_configs  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions, kernels  # noqa: E402
from moekit.triton_bind import BoundLaunch  # noqa: E402

POISON = LaunchOptions(poison_workspace=True)
E, K, N = 8, 40, 24  # 16-byte weight rows in bf16: the TMA descriptor path runs


def _ref(x, w13, w2, ids, weights):
    return experts_reference(x.double(), w13.double(), w2.double(), ids, weights)


def _plans():
    from moekit.experts import triton_plan

    return triton_plan._PLANS


@pytest.mark.parametrize("m", [1, 33])  # M=1, k=2, E=8: the naive shortcut; M=33: aligned (one program)
def test_bound_launcher_equals_kernel_grid(interpreter, m):
    """The compiled-launcher path hands the kernels the same arguments as ``kernel[grid](...)``: equal
    outputs, call after call with new tensors (nothing of the first call's tensors is kept)."""
    interpreter.clear_launch_caches()
    for seed in range(2):  # the first call binds the launcher, the second hands it new tensors
        x, w13, w2, ids, weights = make_problem(m, 2, E, K, N, torch.bfloat16, seed=seed)
        outs = [interpreter.experts_triton(x, w13, w2, ids, weights,
                                           options=LaunchOptions(poison_workspace=True, cached_launcher=cached))
                for cached in (False, True)]
        assert torch.equal(outs[0], outs[1])
        assert rel_l2(outs[1], _ref(x, w13, w2, ids, weights)) < TOL[torch.bfloat16]
    launched = {plan.options.cached_launcher: plan.gate_up._launcher is not None for plan in _plans().values()}
    assert launched == {False: False, True: True}  # the cached plan calls its bound launcher


def test_bound_launch_names_missing_arguments(interpreter):
    with pytest.raises(TypeError, match="CHUNK_ROWS"):
        BoundLaunch(kernels("align").align_scan_kernel, (1,), 5, (1, 8, 16), cached=True, E_PAD=16, PDL=False)


def test_direct_eager_equals_the_op_and_skips_it(interpreter, monkeypatch):
    """An eager call runs the implementation directly; one with ``direct_eager=False`` or under a dispatch mode goes
    through the inference twin, one with a weight that needs a gradient through the custom op; all four agree."""
    calls = count_op_calls(monkeypatch, ("triton_experts", "triton_experts_infer"))
    x, w13, w2, ids, weights = make_problem(5, 2, E, K, N, torch.bfloat16)
    with torch.no_grad():
        direct = interpreter.experts_triton(x, w13, w2, ids, weights, options=POISON)
        assert calls == []
        via_op = interpreter.experts_triton(x, w13, w2, ids, weights,
                                            options=LaunchOptions(poison_workspace=True, direct_eager=False))
        assert calls == ["triton_experts_infer"]
    with torch.no_grad(), _PassThrough():  # a dispatch mode (FakeTensor, make_fx) must see the op
        under_mode = interpreter.experts_triton(x, w13, w2, ids, weights, options=POISON)
    assert calls == ["triton_experts_infer"] * 2
    w13.requires_grad_()
    with torch.no_grad():  # no gradient needed: the twin
        interpreter.experts_triton(x, w13, w2, ids, weights, options=LaunchOptions(direct_eager=False))
    with_grad = interpreter.experts_triton(x, w13, w2, ids, weights, options=POISON)
    assert calls == ["triton_experts_infer"] * 3 + ["triton_experts"]
    assert with_grad.requires_grad  # through the custom op, which carries the autograd
    for out in (via_op, under_mode, with_grad.detach()):
        assert torch.equal(direct, out)


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_compiled_graph_holds_the_op(interpreter):
    """torch.compile(fullgraph=True) still sees an op (the direct path is for eager calls only), under no_grad the
    inference twin, and its result equals the eager one."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    x, w13, w2, ids, weights = make_problem(5, 2, E, K, N, torch.bfloat16)
    fn = torch.compile(lambda *t: interpreter.experts_triton(*t, options=POISON), fullgraph=True, backend=backend)
    with torch.no_grad():
        compiled, eager = fn(x, w13, w2, ids, weights), interpreter.experts_triton(x, w13, w2, ids, weights)
    assert [t for t in seen if "moekit" in t] == ["moekit.triton_experts_infer"], seen
    assert torch.equal(compiled, eager)


def test_the_op_never_keeps_a_workspace(interpreter):
    """Through either op (what compiled code runs, inside CUDA-graph trees on the GPU) no workspace
    is kept: a buffer held from a graph's private pool would break the tree."""
    x, w13, w2, ids, weights = make_problem(5, 2, E, K, N, torch.float32)
    interpreter.clear_launch_caches()
    args = (x, w13, w2, ids, weights, None, None, None, "silu", True, False, 1.0, None, 0.0, False,
            *LaunchOptions().as_op_args())
    torch.ops.moekit.triton_experts(*args)
    torch.ops.moekit.triton_experts_infer(*args)
    assert not interpreter.held_workspaces()
    interpreter.experts_triton(x, w13, w2, ids, weights)  # the direct eager path does keep one
    assert interpreter.held_workspaces()


def test_outputs_never_alias_the_reused_workspace(interpreter, launch_log):
    """Two calls of one kind share the workspace (h at one address), yet the first output is still
    right after the second call: outputs are never carved from it."""
    x1, w13, w2, ids1, weights1 = make_problem(33, 2, E, K, N, torch.float32, seed=1)
    x2, _, _, ids2, weights2 = make_problem(33, 2, E, K, N, torch.float32, seed=2)
    out1 = interpreter.experts_triton(x1, w13, w2, ids1, weights1)
    out2 = interpreter.experts_triton(x2, w13, w2, ids2, weights2)
    h_ptrs = {kw["h_ptr"].data_ptr() for name, kw in launch_log.take() if name == "gate_up_kernel"}
    assert len(h_ptrs) == 1  # reused
    assert rel_l2(out1, _ref(x1, w13, w2, ids1, weights1)) < TOL[torch.float32]
    assert rel_l2(out2, _ref(x2, w13, w2, ids2, weights2)) < TOL[torch.float32]
    buffers = list(interpreter.held_workspaces().values())
    for out in (out1, out2):
        assert all(out.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for b in buffers)


def test_poison_reveals_an_unwritten_read_in_a_reused_workspace(interpreter, launch_log):
    """A gate-up kernel that writes nothing: unpoisoned, the reused h still holds the last call's rows
    and the output looks plausible; poisoned, it is NaN."""
    x, w13, w2, ids, weights = make_problem(33, 2, E, K, N, torch.float32, seed=1)
    interpreter.experts_triton(x, w13, w2, ids, weights)  # fills h with real rows
    launch_log.skip.add("gate_up_kernel")
    x2 = torch.randn_like(x)
    stale = interpreter.experts_triton(x2, w13, w2, ids, weights)
    assert not stale.isnan().any() and rel_l2(stale, _ref(x, w13, w2, ids, weights)) < TOL[torch.float32]
    assert interpreter.experts_triton(x2, w13, w2, ids, weights, options=POISON).isnan().any()


def test_retune_clears_the_plans(interpreter, launch_log, tmp_path, monkeypatch):
    """A plan keeps its config; saving a tuned file (``write_configs``, as ``moekit tune`` does) clears
    the plans, so the next call launches with the new tiles."""
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    x, w13, w2, ids, weights = make_problem(33, 2, E, K, N, torch.float32)

    def gate_up_block_n():
        interpreter.experts_triton(x, w13, w2, ids, weights, options=POISON)
        return {kw["BLOCK_N"] for name, kw in launch_log.take() if name == "gate_up_kernel"}

    before = gate_up_block_n()
    tuned = KernelConfig(16, GemmTile(16, 32, 1, 4, 2), GemmTile(32, 16, 1, 4, 2))
    assert before != {16} and gate_up_block_n() == before  # the plan is reused
    write_configs(tmp_path / config_file_name(E, N, K, torch.float32, "cpu"), E, N, K, torch.float32, "cpu",
                  {33: tuned})
    assert not _plans()
    assert gate_up_block_n() == {16}


def test_descriptors_follow_the_weights(interpreter, monkeypatch):
    """The weights' TMA descriptors are built once per weight, and again for a new tensor or after a move to
    new storage; an in-place update (its ``_version``) keeps them (a descriptor holds an address, the kernel
    reads the new values); each result matches the reference. An entry goes with its weight."""
    from moekit.experts import triton_cache

    built, real = [], triton_cache.weight_descriptor
    monkeypatch.setattr(triton_cache, "weight_descriptor", lambda w, *blocks: built.append(1) or real(w, *blocks))
    interpreter.clear_launch_caches()
    x, w13, w2, ids, weights = make_problem(9, 2, E, K, N, torch.bfloat16)

    def run_and_count(w13, w2) -> int:
        built.clear()
        out = interpreter.experts_triton(x, w13, w2, ids, weights, options=POISON)
        assert rel_l2(out, _ref(x, w13, w2, ids, weights)) < TOL[torch.bfloat16]
        return len(built)

    assert run_and_count(w13, w2) == 2 and run_and_count(w13, w2) == 0
    with torch.no_grad():
        w13.add_(0.25)  # in place: same tensor and storage, _version bumped
    assert run_and_count(w13, w2) == 0
    w2.data = w2.data.clone()  # moved to new storage, same tensor
    assert run_and_count(w13, w2) == 2
    other = w13.clone()  # a new tensor
    assert run_and_count(other, w2) == 2 and run_and_count(w13, w2) == 0
    entries = len(interpreter._DESCRIPTORS)
    del other
    gc.collect()
    assert len(interpreter._DESCRIPTORS) == entries - 1


def test_workspace_pool_reuses_per_device_and_grows(interpreter):
    from moekit.experts.triton_cache import REGION_ALIGN, WorkspacePool, WorkspaceSpec

    pool = WorkspacePool(max_bytes=1 << 16)
    small = WorkspaceSpec.of([("h", torch.float32, (3, 5)), ("ids", torch.int32, (7,))])
    big = WorkspaceSpec.of([("h", torch.float32, (300, 5))])
    cpu, meta = torch.device("cpu"), torch.device("meta")
    first = pool.buffers(small, cpu)
    assert pool.buffers(small, cpu) is first  # views carved once
    base = first["h"].data_ptr()  # the buffer's start: the CPU allocator aligns it to 64 bytes, CUDA's to 512
    assert base % 16 == 0 and all((t.data_ptr() - base) % REGION_ALIGN == 0 for t in first.values())
    assert first["h"].shape == (3, 5) and first["ids"].dtype == torch.int32
    on_meta = pool.buffers(small, meta)
    assert on_meta["h"].device == meta and len(pool) == 2  # one workspace per device
    grown = pool.buffers(big, cpu)["h"]
    assert grown.shape == (300, 5) and len(pool) == 2  # the cpu workspace grew in place of the old one
    huge = WorkspaceSpec.of([("y", torch.float32, (1 << 15,))])  # 128 KiB > max_bytes: never kept
    a, b = pool.buffers(huge, cpu)["y"], pool.buffers(huge, cpu)["y"]
    assert a.data_ptr() != b.data_ptr() and len(pool) == 2


@pytest.mark.parametrize("shared", [False, True])
def test_fused_router_bound_launch_equals_kernel_grid_and_route(monkeypatch, shared):
    """The fused router's eager path (a ``BoundLaunch`` per kind of call) hands the kernel what
    ``kernel[grid](...)`` gets (the custom op's path) and routes as ``route``; the binding is kept per
    (M, pointer facts) and its launcher is called from the second call on."""
    from _triton_helpers import LaunchLog
    from moekit import MoEConfig, route
    from moekit.routing import append_shared_slots, fused

    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sigmoid", n_group=4,
                    topk_group=2, use_correction_bias=True, shared_expert_intermediate_size=16 if shared else 0,
                    shared_expert_gate=shared)
    log = LaunchLog(fused.kernels)
    monkeypatch.setattr(fused, "kernels", log)
    fused.clear_launch_caches()
    router, plan = fused.FusedRouter(cfg), fused._plan_of(cfg, cfg.num_shared_slots if shared else 0,
                                                          fused.ELEMENTS_PER_PROGRAM)
    bias = torch.randn(16) * 0.1
    for seed, m in ((0, 3), (1, 3), (2, 5)):
        g = torch.Generator().manual_seed(seed)
        logits, gate = torch.randn(m, 16, generator=g), (torch.randn(m, 1, generator=g) if shared else None)
        got = router(logits, bias, gate, append_shared=shared)
        ids, weights, _ = fused._launch(plan, logits, bias, gate)
        bound_args, grid_args = log.take()
        assert {k: v for k, v in bound_args[1].items() if not torch.is_tensor(v)} == \
            {k: v for k, v in grid_args[1].items() if not torch.is_tensor(v)}
        assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_weights, weights)
        ref = route(logits, cfg, bias)
        ref = append_shared_slots(ref, cfg, gate) if shared else ref
        assert torch.equal(got.topk_ids, ref.topk_ids)
        torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=2e-6, atol=1e-7)
    bound = list(fused._BOUND.values())
    assert len(bound) == 2 and all(b.launch._launcher is not None for b in bound)  # M=3 bound once, reused
    fused.clear_launch_caches()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, running the kernel, on the NaN row
def test_fused_router_flag_is_reset_after_a_nonfinite_error():
    """A kept ``ok`` flag that a bad call cleared must not fail the next, finite call."""
    from moekit import MoEConfig
    from moekit.routing import fused

    router = fused.FusedRouter(MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=8, top_k=2))
    logits = torch.randn(2, 8)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        router(bad)
    assert router(logits).topk_ids.shape == (2, 2)
