"""Fused Triton experts: the default backend on CUDA.

    [Route] -> [Align (GPU, no sync)] -> [gate-up GEMM + b13, glu] -> [down GEMM + b2, x routed weight] -> [sum over k]
    (eager, M <= LaunchOptions.sum_fold_max: the sum over k in the down GEMM's epilogue, one launch fewer; up to
    sum_tail_max: in programs after the down GEMM's, in its grid)

Activations are never permuted: each M-block of the block-aligned layout belongs to one expert and gathers its rows
through ``sorted_ids // k``. The [A, 2N] gate-up product is never written (the activation is fused into that GEMM's
epilogue); the routed weight is applied in the down GEMM's epilogue; the k-sum reads the [A, K] per-slot rows once. At
A*4 <= E with no expert map, up to ``LaunchOptions.shortcut_max_tokens`` tokens (vLLM's tiny-batch shortcut) no
alignment runs: block a is assignment a. Every experts variant runs fused: the ``ActivationSpec`` (gated or not,
interleaved gate/up, alpha/limit/up_shift) becomes constexprs of the gate-up kernel, resolved once per plan; the biases
are pointers (``_kernels/gemm.py``); weights are read through their strides (transposed storage: pointer loads, no
copy; TMA where contiguous).

No host synchronisation anywhere: every size is derived from shapes, so the path is CUDA-graph capturable and replays
correctly with new routing. How it launches is chosen by a ``LaunchOptions`` passed down to every launch
(``triton_launch``; e.g. programmatic dependent launch on compute capability 9.0 and later, the waits in
``_kernels._common``, so each grid launches while the one before it drains). ``torch.ops.moekit.triton_experts``
(autograd) and its inference twin ``triton_experts_infer`` (``triton_op``), and ``torch.ops.moekit.align_block_triton``
(``triton_align``) are ``torch.library`` ops with fakes, so ``torch.compile(fullgraph=True)`` traces through them.

The host path of a call (eager; budgeted like GPU time, see ``benchmarks/host_time.py``). Everything
that does not depend on the call's data is decided once per kind of call and cached (each switchable
in ``LaunchOptions`` for an A/B):

    a repeated call (``LaunchOptions.fast_path``, ``triton_fast``): the same weight tensors unchanged, the same
      shapes, dtypes and devices, no map or biases -> out (fresh), its kept sequence launched; nothing below
    call_backend: check_experts_args (the one check) -> experts_triton_unchecked
      -> eager and nothing tracing? fused_experts directly : the op (``triton_op.experts_op``) -> fused_experts
      -> plan_for(key) [triton_plan: variant constexprs, config, shortcut or alignment, workspace regions,
         bound launches]
      -> lean (``LaunchOptions.lean_launch``, ``triton_lean``): out (fresh), the plan's recorded LaunchSequence
         (rebuilt if the pooled workspace or the weights' descriptors changed), the call's tensors filled into
         argument lists built once (as addresses: ``triton_bind.PASS_ADDRESSES``), each launched through the C
         entry; or, on the first call of a plan and wherever lean does not apply (graph capture, poisoned
         workspaces, a
         caller's counters, a launch hook):
      -> out (fresh), workspace (reused views; above the pool's max_bytes all but the alignment's regions
         fresh per call; all fresh while a graph captures), TMA descriptors (per weight)
      -> plan_launches: align launches, gate-up, down, k-sum (or down with the k-sum folded in): each a BoundLaunch
         (``triton_bind``: the C launch under the compiled kernel's launcher, weight descriptors encoded once;
         else the compiled kernel's runner)

``clear_launch_caches()`` drops the plans, launch sequences, descriptors and workspaces (``configs.clear_config_cache``
clears the plans too). What is returned never aliases a workspace: ``out`` is allocated per call.

Torch twins: ``moekit.layouts.block_aligned.align_block`` (alignment, equal element for element) and
``moekit.experts.reference`` (the GEMMs). The kernels are in ``moekit.experts._kernels``.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, read when a kernel is
decorated, so the kernel modules are imported lazily). The interpreter's bf16 ``tl.dot`` is wrong, so
there the operands are upcast to float32 first; and its float -> bf16 conversion truncates instead of
rounding (measured: 2x the rounding error), so there the [A, N] and [A, K] workspaces are float32.
Everything else runs as on the GPU.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, B = BLOCK_M.
"""

from __future__ import annotations

import functools

import torch

from moekit.experts import check_experts_args, register_fast_path, register_keeper
from moekit.activations import ACTIVATIONS, ActivationSpec, spec_fields
from moekit.experts.configs import KernelConfig
from moekit.experts.triton_align import clear_op_plans
from moekit.experts.triton_cache import WeightDescriptors, WorkspacePool, descriptor_pair
from moekit.experts.triton_fast import clear_fast, fast_stamp, keep_call, remember, run_fast
from moekit.func_ops import transforming as _transforming
from moekit.experts.triton_quant_fast import clear_quant_fast
from moekit.experts.triton_lean import clear_sequences, launch_lean, lean_sequence
from moekit.experts.triton_launch import LaunchOptions, is_available  # noqa: F401  (is_available: the backend hook)
from moekit.experts.triton_plan import DTYPES, Plan, check_triton_args, clear_plans, plan_for, plan_launches
from moekit.experts.triton_quant import is_quantized, run_quantized_triton
from moekit.quant.fp8_block import Fp8BlockWeight

_DESCRIPTORS = WeightDescriptors()  # the weights' TMA descriptors, per weight tensor (weakly)
_WORKSPACES = WorkspacePool()  # reused h, y and alignment buffers, per (device, stream, thread)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types the direct eager path takes (no subclass)
# every entry point's default: one object, so a fast-path key (``triton_fast``) matches by identity, no __eq__
_DEFAULT_OPTIONS = LaunchOptions()
# the defaults for a caller that has decided against the Gluon route (the ``triton_gluon`` backend, whose
# choice said no): only the ``_DEFAULT_OPTIONS`` object takes that route
FUSED_OPTIONS = LaunchOptions()


def clear_launch_caches() -> None:
    """Drop every plan, weight descriptor and reused workspace (the next call builds them again), the
    Gluon paths' too (``triton_gluon_lean``)."""
    from moekit.experts.triton_gluon_lean import clear_gluon_caches
    from moekit.experts.triton_wo_scratch_plan import clear_scratch_plans

    clear_gluon_caches()
    clear_scratch_plans()
    clear_plans()
    clear_sequences()
    clear_op_plans()  # the alignment op's (``triton_align``)
    clear_fast()
    clear_quant_fast()
    _DESCRIPTORS.clear()
    _WORKSPACES.clear()


def held_workspaces() -> dict[tuple, torch.Tensor]:
    """The reused workspaces kept now: (device, stream, thread) -> byte buffer. For checks and memory
    accounting; ``clear_launch_caches`` frees them."""
    return _WORKSPACES.held()


# ---------------------------------------------------------------------------------------------------
# The fused experts path
# ---------------------------------------------------------------------------------------------------


def fused_experts(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    expert_map: torch.Tensor | None = None,
    activation: str | ActivationSpec = "silu",
    config: KernelConfig | None = None,
    options: LaunchOptions = _DEFAULT_OPTIONS,
    *,
    b13: torch.Tensor | None = None,  # [E, 2N] gated (w13's row order), [E, N] ungated
    b2: torch.Tensor | None = None,  # [E, K]
    counters: torch.Tensor | None = None,  # int32, all 0, >= M * K tiles: the folded k-sum's, kept by the caller
) -> torch.Tensor:
    """The kernels, launched (arguments already checked). ``config`` overrides the tuned lookup;
    ``options`` are resolved for x's device in the plan. Not a custom op: for tools that pick configs
    or options per call (tuning, A/B benchmarks); models go through ``experts_triton``. ``counters``:
    where the plan folds the k-sum (``LaunchOptions.sum_fold_max``), it runs with these instead of the
    workspace's, e.g. inside a CUDA graph capture (which otherwise runs the separate k-sum); every call
    leaves them at 0."""
    return _fused(x, w13, w2, topk_ids, topk_weights, expert_map, activation, config, options, b13, b2, counters)


def _fused(x, w13, w2, topk_ids, topk_weights, expert_map, activation, config, options, b13, b2, counters=None,
           checked: bool | None = None) -> torch.Tensor:
    """``fused_experts``; with ``checked`` (True: ``check_experts_args`` passed, False: the caller vouches) a
    call that launches lean keeps its entry for the fast path (``triton_fast``)."""
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # the kernels read them flat: [A]
    if ids.numel() == 0:
        return x.new_zeros(x.shape)
    if expert_map is not None:
        expert_map = expert_map.contiguous()
    plan = plan_for(x, w13, w2, ids, weights, expert_map, activation, config, options, b13, b2)
    if counters is not None and (counters.dtype != torch.int32 or counters.device != x.device
                                 or counters.numel() < plan.workspace.counters):
        raise ValueError(f"counters must be int32 on {x.device} with >= {plan.workspace.counters} elements, got "
                         f"{counters.dtype} on {counters.device} with {counters.numel()}")
    if counters is None and plan.options.lean_ready:
        stamp = fast_stamp(_WORKSPACES)  # before: a clear or a new buffer from here on makes the entry stale
        sequence = lean_sequence(plan, _WORKSPACES, _DESCRIPTORS, x.device, w13, w2, expert_map, b13, b2)
        if sequence is not None:
            if (checked is not None and options.fast_ready and config is None and expert_map is None
                    and ids is topk_ids and weights is topk_weights):
                remember(stamp, x, w13, w2, ids, weights, activation, options, plan, sequence, checked, b13, b2)
            return launch_lean(sequence, x, ids, weights, expert_map, b13, b2, w13, w2)
    return _run(plan, x, w13, w2, ids, weights, expert_map, b13, b2, counters)


def _run(plan: Plan, x, w13, w2, ids, weights, expert_map, b13, b2, counters=None) -> torch.Tensor:
    """Launch ``plan`` through its ``BoundLaunch`` calls: the alignment (unless the naive shortcut skips it),
    gate-up, down, the k-sum."""
    options = plan.options
    # [M, K], row-major, never a workspace; empty_like is the cheapest allocation (H200: 1.9 µs against 4.6
    # for torch.empty(shape, dtype, device)) and keeps a contiguous x's layout
    out = torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)
    if options.reuse_workspace:
        b = _WORKSPACES.buffers(plan.workspace, x.device)
    else:
        b = plan.workspace.allocate(x.device)
    if options.poison_workspace:  # a read of a row no kernel wrote shows up as NaN in the output
        b["h"].fill_(float("nan"))
        b["y"].fill_(float("nan"))
    if plan.descriptor_key is None:
        w13_arg, w13_up_arg, w2_arg = w13, None, w2
    else:
        pair = (_DESCRIPTORS.get(w13, w2, plan.descriptor_key) if options.cache_plans
                else descriptor_pair(w13, w2, plan.descriptor_key))
        w13_arg, w13_up_arg, w2_arg = pair.w13, pair.w13_up, pair.w2
    if counters is None:
        counters = b.get("counters")  # only a pool's workspace has them (never while a graph captures)
    for launch, pointers in plan_launches(plan, b, x, w13_arg, w13_up_arg, w2_arg, b13, b2, ids, weights, expert_map,
                                          out, counters):
        launch(*pointers)
    return out


def _runs_directly(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   b13, b2) -> bool:
    """Whether an eager call may skip the custom op. The op matters to torch.compile's and torch.jit's
    tracing, to dispatch modes (FakeTensor, make_fx), tensor subclasses and functorch transforms, and to
    autograd (the op's backward is ``triton_backward``'s; the routed weights count too, and a bias that
    needs a gradient gets one there, by recomputation); else it is only the dispatcher's cost (on the CPU here,
    stubbed launches: ~100 µs of a ~250 µs call)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or torch._C._is_tracing():
        return False
    if type(x) not in _PLAIN or type(w13) not in _PLAIN or type(w2) not in _PLAIN:
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    grad = torch.is_grad_enabled()
    if b13 is not None or b2 is not None:
        for bias in (b13, b2):
            if bias is not None and (type(bias) not in _PLAIN or (grad and bias.requires_grad)):
                return False
    return not (grad and (x.requires_grad or w13.requires_grad or w2.requires_grad
                          or topk_weights.requires_grad))


def experts_triton(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K] gated, [E, N, K] ungated; any strides (transposed storage is a view)
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, 2N] gated (w13's row order), [E, N] ungated
    b2: torch.Tensor | None = None,  # [E, K]
    options: LaunchOptions = _DEFAULT_OPTIONS,
) -> torch.Tensor:
    """The experts contract (see ``moekit.experts``) on fused Triton kernels; returns [M, K] in x.dtype.
    Every ``ActivationSpec`` runs fused (biases, interleaved gate/up, ungated, clamped SwiGLU).
    ``options``: how to launch (``LaunchOptions``; the defaults are what the H200 measurements picked)."""
    if expert_map is None:  # a repeated call: kept, checked before (triton_fast; its biases the kept ones)
        out = run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, activation, options, checked=True, b13=b13,
                       b2=b2)
        if out is not None:
            return out
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation=activation, b13=b13, b2=b2)
    return _unchecked(x, w13, w2, topk_ids, topk_weights, activation, expert_map, b13, b2, options, checked=True)


def experts_triton_unchecked(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, activation: str | ActivationSpec = "silu", expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, options: LaunchOptions = _DEFAULT_OPTIONS,
) -> torch.Tensor:
    """``experts_triton`` for a caller that has run ``check_experts_args`` (``moekit.experts.call_backend``,
    which resolves the "triton" backend to this): only this backend's own checks, then the kernels,
    directly in eager mode, else through the custom op. A spec's own checks ran when it was built; its
    kernel constexprs are resolved once per plan, so a variant adds no per-call work here. A repeated call
    (same weights, same kind) launches from what its first lean call kept (``triton_fast``, ``triton_quant_fast``;
    then the Gluon paths': ``triton_gluon_fp8.run_fast_fp8`` on fp8_block weights, else
    ``triton_gluon.run_fast_default_gluon``). On Hopper, bf16/fp16 calls that ``triton_gluon.DEFAULT_CHOICE`` wants
    (prefill sizes where the Gluon GEMMs measured faster for the whole call) take the Gluon path, as
    ``fp8_block`` calls take the fp8 one."""
    if expert_map is None:
        out = _run_kept(x, w13, w2, topk_ids, topk_weights, activation, options, b13, b2)
        if out is not None:
            return out
    return _unchecked(x, w13, w2, topk_ids, topk_weights, activation, expert_map, b13, b2, options, checked=False)


_GLUON: list = []  # [triton_gluon, triton_gluon_fp8], imported on first use (both import this module)


def _run_kept(x, w13, w2, topk_ids, topk_weights, activation, options: LaunchOptions, b13=None,
              b2=None) -> torch.Tensor | None:
    """A repeated call launched from what its path kept, or None: the Triton path's entries (``run_fast``) and the
    Gluon paths' (fp8_block weights, with expert biases too since session 43: ``run_fast_fp8``; bf16 with the default
    options and no biases, which its Gluon path never takes: ``run_fast_default_gluon``), one lookup where one can
    hit. A Gluon entry is keyed by the default choice that took it, so where that choice
    does not want the call's size none can match and its lookup is skipped; where it does, the Gluon lookup goes
    first (on Hopper the Triton path keeps nothing there), then the Triton one (a call the Gluon path did not take:
    another GPU, an unfit shape). Before: the Triton lookup first on every call, a miss at every Gluon-path size
    (H200, benchmarks/host_big_device_check.py: two fast-path lookups a call from M = 4096 fp8, 16384 bf16)."""
    if w13.__class__ is Fp8BlockWeight:
        if not _GLUON:
            _import_gluon()
        gluon_fp8 = _GLUON[1]
        if not gluon_fp8.DEFAULT_FP8_CHOICE.wants(x.shape[0], topk_weights.shape[1], w2.shape[2], x.shape[1],
                                                  w2.shape[0]):
            return run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, activation, options, checked=False,
                            b13=b13, b2=b2)
        out = gluon_fp8.run_fast_fp8(x, w13, w2, topk_ids, topk_weights, activation, None, b13, b2)
    elif options is _DEFAULT_OPTIONS and w13.__class__ in _PLAIN and b13 is None and b2 is None:  # weight-only:
        if not _GLUON:  # bf16 Gluon keeps none (no lookup)
            _import_gluon()
        gluon = _GLUON[0]
        if not gluon.DEFAULT_CHOICE.wants(x.shape[0], w2.shape[-1], topk_weights.shape[1], w2.shape[0]):
            return run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, activation, options, checked=False)
        out = gluon.run_fast_default_gluon(x, w13, w2, topk_ids, topk_weights, activation)
    else:  # the Gluon route takes the default options and plain tensors only (bf16: no biases)
        return run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, activation, options, checked=False, b13=b13,
                        b2=b2)
    if out is not None:
        return out
    return run_fast(_WORKSPACES, x, w13, w2, topk_ids, topk_weights, activation, options, checked=False, b13=b13,
                    b2=b2)


def _import_gluon() -> None:
    import moekit.experts.triton_gluon as gluon
    import moekit.experts.triton_gluon_fp8 as gluon_fp8

    _GLUON[:] = [gluon, gluon_fp8]


def _unchecked(x, w13, w2, topk_ids, topk_weights, activation, expert_map, b13, b2, options: LaunchOptions,
               checked: bool) -> torch.Tensor:
    """``experts_triton_unchecked`` past the fast path; ``checked``: whether ``check_experts_args`` passed."""
    if (w13.__class__ not in _PLAIN or w2.__class__ not in _PLAIN) and is_quantized(w13, w2):  # fp8, weight-only
        return run_quantized_triton(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                                    b13=b13, b2=b2, options=options, checked=checked)
    if x.dtype not in DTYPES or (activation.__class__ is str and activation not in ACTIVATIONS):
        check_triton_args(x, activation, b13, b2)  # raises, naming the argument
    if options is _DEFAULT_OPTIONS:  # prefill on Hopper: the Gluon GEMMs where they measured faster
        from moekit.experts.triton_gluon import run_default_gluon

        out = run_default_gluon(x, w13, w2, topk_ids, topk_weights, activation, expert_map, b13, b2)
        if out is not None:
            return out
    if options.direct_eager and _runs_directly(x, w13, w2, topk_weights, b13, b2):
        return _fused(x, w13, w2, topk_ids, topk_weights, expert_map, activation, None, options, b13, b2,
                      checked=checked)
    if torch.compiler.is_compiling() or not _transforming():
        op = _triton_op.experts_op(x, w13, w2, topk_weights, b13, b2)  # the twin unless a gradient is needed
    else:  # torch.func: the op as an autograd.Function functorch can lift (func_ops)
        op = _triton_op.TRANSFORM_FUNCTION.apply
    return op(x, w13, w2, topk_ids, topk_weights, expert_map, b13, b2, *spec_fields(activation), *options.as_op_args())


# experts_triton_unchecked's fast path with its default options (``ExpertsCallCache`` tries it first): a partial,
# no Python frame of its own
register_fast_path(experts_triton_unchecked,
                   functools.partial(run_fast, _WORKSPACES, options=_DEFAULT_OPTIONS, checked=False))
# and its keeper for the layer's decode fast path (``triton_fast.KeptCall``): the same entries, fewer checks per call
register_keeper(experts_triton_unchecked, functools.partial(keep_call, _WORKSPACES, options=_DEFAULT_OPTIONS))


# the ops (``triton_op``: the custom op, its inference twin, the traced entry), defined on this module's functions
import moekit.experts.triton_op as _triton_op  # noqa: E402  (imports this module: here at the end, no cycle)
