"""The gate GEMM and the fused router in one launch for decode and memory-bound batches: x [M, K] (M <= ROWS = 256)
-> router logits [M, E] and ``Routing`` [M, k(+S)], written into a caller's kept buffers. Up to MAX_TOKENS = 8 rows
the row-loop gate's launch (below); above, the tensor-core gate's (``gate_mma``: tiles, split-K, a counter per tile
and per row block), whose logits differ from cuBLAS's in the last bits, so every path takes it there.

    [Gate -> Route (+ shared slots), one launch] -> Capacity (opt-in) -> Group -> Experts -> Combine

Why: a decode step's gate and router are two launches of a few µs of GPU work each, and on the H200's
host a raw launch costs ~6 µs plus the Python around it (``benchmarks/gate_route_device_check.py``).
Here the gate kernel's programs each store a tile of the logits, count themselves done on a one-element
counter kept with the buffers, and the last one routes every row (``_kernels/gate_route_kernel.py``):
the same code as ``gate_kernel`` and ``route_kernel``, so the results are those of the two launches.
Torch twin: ``F.linear`` then ``moekit.routing.route`` (the tests check both).

Only where the two launches would run on the kernels anyway (``moekit.routing.gate``'s conditions, the
fused router's plan) and with buffers of the call's own (``moekit.routing.workspace``: kept ones, keyed by
stream and thread, or fresh ones for a CUDA graph capture or a call that returns its routing, ``wants_fresh``),
whose counter no other launch shares. ``gate_route`` returns None elsewhere. Eager ``MoE`` calls take it; calls
without kept buffers too, unless the two launches were measured bit-equal (``wants_fresh``): every path agrees.

Shapes: M tokens, K hidden, E experts, k + S slots.
"""

from __future__ import annotations

import importlib

import torch

from moekit._bounded import put_bounded
from moekit.func_ops import transforming
from moekit.routing import fused, gate, gate_mma
from moekit.routing.route import Routing
from moekit.routing.workspace import RouteBuffers
from moekit.triton_bind import BoundLaunch, triton_runs_on

MAX_TOKENS = gate.MAX_TOKENS  # rows up to which the one launch is the row-loop gate's (``gate_route_kernel``)
# Rows up to which gate and router are one launch: above MAX_TOKENS the tensor-core gate's (``gate_mma``). Read at
# call time by ``MoE`` and ``layer_fast`` (the device check's A/B sets MAX_TOKENS: torch.mm and the router's launch).
ROWS = gate_mma.MAX_ROWS
# Where the one launch and the two launches (the gate kernel, then the router's) were measured bit-equal on the H200:
# ungrouped softmax plans with renormalisation (Qwen3-30B-A3B, Mixtral-8x7B, every M <= 8). A sigmoid or grouped plan
# differs in the weights' last bits (DeepSeek-V3 at 5-8 rows; logits and ids equal):
# benchmarks/layer_host2_device_check.py. A call without kept buffers (a CUDA graph capture, a call with stats) takes
# the one launch too, into fresh buffers (``wants_fresh``), for every plan but those, so eager, captured and stats calls
# compute the same bits; those keep the two launches, which replay 0-7 µs faster in a graph (Qwen3 at M = 1 / 2 / 4 / 8:
# one launch 32.7 / 58.1 / 89.6 / 129.1 µs against 30.7 / 50.7 / 85.9 / 123.7; DeepSeek-V3 +0 to +7 µs of 205-1177).
MAX_BOUND = 4096  # kinds of call whose launch is kept bound; the oldest goes first
NUM_WARPS = 4  # the gate kernel's: its tiles hold 16 values a thread at 4 warps; the routing then runs on 4 warps too


def kernels():
    """The kernel module, imported on first use (Triton decides at decoration whether it is interpreted)."""
    return importlib.import_module("moekit.routing._kernels.gate_route_kernel")


class _BoundGateRoute:
    """One kind of call (plan, shapes, strides, dtypes, alignment, device, assert mode), decided once: the
    bound launch and, with nonfinite="raise" where the kernel cannot assert itself, a flag (``_BoundRoute``)."""

    __slots__ = ("launch", "ok", "check_finite")

    def __init__(self, plan, x, weight, linear_bias, bias, gate_logits, assert_in_kernel: bool,
                 num_warps: int = NUM_WARPS, dtype: torch.dtype | None = None) -> None:
        del dtype  # the logits' dtype (``gate_mma.BoundGateMma``'s argument): this kernel reads it from their pointer
        num_tokens, num_experts, hidden = x.shape[0], weight.shape[0], weight.shape[1]
        tiles = gate._tiles(num_tokens, num_experts, hidden)
        options = fused._launch_options(x.device)
        in_kernel = assert_in_kernel and options["PRECISE"]  # the interpreter: the flag
        scalars = (num_tokens, hidden, x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
                   0 if gate_logits is None else gate_logits.stride(0), plan.scaling)
        constexprs = dict(**plan.constexprs, BLOCK_M=tiles.block_m, BLOCK_E=tiles.block_e, BLOCK_K=tiles.block_k,
                          HAS_LINEAR_BIAS=linear_bias is not None, TOP2=plan.top2[bias is not None],
                          HAS_BIAS=bias is not None, HAS_GATE=gate_logits is not None, PRECISE=options["PRECISE"],
                          PDL=options["PDL"], enable_reflect_ftz=False, num_warps=num_warps)  # not launched with PDL
        if in_kernel and plan.check_finite:
            constexprs.update(CHECK_FINITE=False, ASSERT_FINITE=True, debug=True, sanitize_overflow=False)
        grid = (-(-num_experts // tiles.block_e),)
        self.launch = BoundLaunch(kernels().gate_route_kernel, grid, 10, scalars, True, **constexprs)
        self.check_finite = plan.check_finite  # nonfinite="raise": no token can lack a finite logit
        flag = plan.check_finite and not in_kernel
        self.ok = torch.ones(1, dtype=torch.int32, device=x.device) if flag else None  # [1], as _BoundRoute's

    def __call__(self, x, weight, linear_bias, bias, gate_logits, buffers: RouteBuffers) -> None:
        self.launch(*self.pointers(x, weight, linear_bias, bias, gate_logits, buffers))

    def pointers(self, x, weight, linear_bias, bias, gate_logits, buffers: RouteBuffers) -> tuple:
        """The launch's pointer arguments (``moekit.layer_fast`` records them once for a joined launch)."""
        ids, ok = buffers.ids, self.ok
        return (x, weight, weight if linear_bias is None else linear_bias, buffers.logits,
                x if bias is None else bias, x if gate_logits is None else gate_logits, ids, buffers.weights,
                ids if ok is None else ok, buffers.count)


# kind of call -> its bound launch, or _SEPARATE where the one launch does not apply
_BOUND: dict[tuple, object] = {}
_SEPARATE = object()


def clear_launch_caches() -> None:
    """Drop the bound launches (they hold the kernel they were bound to)."""
    _BOUND.clear()


def _tensor_key(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)


def gate_route(router: fused.FusedRouter, x: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None,
               correction_bias: torch.Tensor | None, shared_gate_logits: torch.Tensor | None, append_shared: bool,
               buffers: RouteBuffers) -> Routing | None:
    """``router(gate_logits(x, weight, linear_bias), correction_bias, shared_gate_logits, append_shared)`` in one
    launch, the logits in ``buffers.logits`` and the routing in ``buffers.ids`` / ``buffers.weights``; None
    where it does not apply (the caller runs the two steps). The caller vouches that ``buffers`` are this
    kind of call's own (``RouteWorkspace.get`` for x's rows, the router dtype and k(+S) slots)."""
    if not runs(x, weight, linear_bias):
        return None
    bound = bound_launch(router, x, weight, linear_bias, correction_bias, shared_gate_logits, append_shared, buffers)
    if bound is None:
        return None
    if correction_bias is not None:
        router._check_bias(correction_bias, x.device)
    gate_in = router._check_gate(x, shared_gate_logits) if append_shared else None
    bound(x, weight, linear_bias, correction_bias, gate_in, buffers)
    if bound.ok is not None:
        fused._assert_finite(bound.ok, buffers.logits)
    # As FusedRouter: with nonfinite="raise" no token can lack a finite logit; "mask" counts them as route does.
    masked = None if bound.check_finite else (~torch.isfinite(buffers.logits).any(dim=1)).sum()
    return Routing(topk_ids=buffers.ids, topk_weights=buffers.weights, masked_tokens=masked)


def runs(x: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None) -> bool:
    """Whether ``gate_route`` may launch at all for these tensors: nothing compiling, no autograd graph to record
    (the caller's check before it makes buffers for the call, ``moekit.routing.workspace.fresh_buffers``), no
    torch.func transform (its tensors have no storage to launch on)."""
    return not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (linear_bias is not None and linear_bias.requires_grad))
    ) and not transforming()


def wants_fresh(router: fused.FusedRouter, append_shared: bool, x: torch.Tensor, weight: torch.Tensor,
                linear_bias: torch.Tensor | None) -> bool:
    """Whether a call without kept buffers (up to ROWS rows, the caller's check) makes fresh ones for the one
    launch: above MAX_TOKENS always (the two launches would gate on cuBLAS, other bits), up to it every plan but an
    ungrouped softmax one with renormalisation (measured bit-equal to the two launches)."""
    plan = router._plans[1 if append_shared else 0]
    if plan is None:
        return False
    c = plan.constexprs
    # the measured plans only: a soft-capped one (Laguna's option) or a sqrt(softplus) one (DeepSeek-V4) was not
    # measured, so it takes the one launch too
    two_equal = (not c["SIGMOID"] and not c["SQRT_SOFTPLUS"] and not c["GROUPED"] and c["RENORMALIZE"]
                 and not c["SOFTCAP"] and x.shape[0] <= MAX_TOKENS)
    return not two_equal and runs(x, weight, linear_bias)


def bound_launch(router: fused.FusedRouter, x: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None,
                 correction_bias: torch.Tensor | None, shared_gate_logits: torch.Tensor | None, append_shared: bool,
                 buffers: RouteBuffers) -> _BoundGateRoute | None:
    """This kind of call's bound launch (``gate_route``'s arguments), made on its first call; None where the
    one launch does not apply. Kept by ``moekit.layer_fast`` for a repeated decode call."""
    plan = router._plans[1 if append_shared else 0]
    # x and weight inline (the common call has no other tensor): each function call is host time here
    key = (plan, x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0, weight.shape, weight.stride(),
           weight.dtype, weight.get_device(), weight.data_ptr() % 16 == 0,
           None if linear_bias is None else _tensor_key(linear_bias),
           None if correction_bias is None else fused._pointer_key(correction_bias),
           None if shared_gate_logits is None else fused._pointer_key(shared_gate_logits), router.assert_in_kernel,
           buffers.logits.dtype)
    bound = _BOUND.get(key)
    if bound is None:
        m = x.shape[0]
        dtype = buffers.logits.dtype  # the router dtype: x and the weights read as stored where gate.reads_as
        applies = (plan is not None and 0 < m <= ROWS and gate._applies(x, weight, linear_bias, ROWS, dtype)
                   and triton_runs_on(x.device))
        gate_in = router._check_gate(x, shared_gate_logits) if applies and append_shared else None
        kind = _BoundGateRoute if m <= MAX_TOKENS else gate_mma.BoundGateMma
        bound = put_bounded(_BOUND, key, _SEPARATE if not applies else kind(
            plan, x, weight, linear_bias, correction_bias, gate_in, router.assert_in_kernel, dtype=dtype), MAX_BOUND)
    return None if bound is _SEPARATE else bound

