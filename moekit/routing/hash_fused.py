"""Hash routing in one Triton launch: ``hash_route`` (and the ungated shared slots) fused, ``HashMoE``'s on CUDA
(``router="auto"``, its default; ``"fused"`` anywhere Triton runs).

    Gate -> [Route: tid2eid[token_ids], weighted by the scores (+ shared slots), 1 launch] -> Group -> Experts
      -> Combine

Same contract as ``moekit.routing.hash_route``, its torch twin: ids [M, k] int32 in the table's order, fp32 weights
within fp32 rounding of its; a NaN or infinite logit and a token id outside [0, V) raise as there (a ``ValueError``
naming them on the CPU, a device-side assert on the GPU: no host sync): on the GPU the compiled kernel's own
``tl.device_assert``s (``assert_in_kernel``, the default since session 49: no launch after the kernel), else, and
always interpreted, two flags the kernel clears, asserted after it. Why: the twin is ~22 small torch ops a call, each
a few µs of host time (a CPU profile of one ``HashMoE`` call, session 48); here the argument checks, two allocations
and one launch (H100, V4's hash layer at M = 1, with the flags' two asserts then: 407 -> 126 µs of host a call,
``benchmarks/v4r48_device_check.py``). Under ``torch.compile``, with autograd or a torch.func transform, the twin
runs.

Shapes: M tokens, E experts, k = top_k, S shared slots, V table rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.config import MoEConfig
from moekit.func_ops import transforming
from moekit.routing.fused import ELEMENTS_PER_PROGRAM, MAX_EXPERTS, MAX_TOP_K, _launch_options, kernels
from moekit.routing.hash_route import check_hash_eps, check_token_ids, hash_route
from moekit.routing.route import Routing, assert_logits_finite
from moekit.routing.router_math import RouterMath
from moekit.routing.shared import append_shared_slots
from moekit.triton_bind import BoundLaunch, interpreting, next_pow2, triton_runs_on


def computes(config: MoEConfig) -> bool:
    """Whether the kernel computes ``config``'s hash routing: a table (``hash_table_size``), E and k + S within the
    fused router's limits, no router option but the soft cap (V4's hash layers have none)."""
    options = set(config.changed_router_options()) - {"router_logit_softcap"}
    return (config.hash_table_size is not None and config.num_experts <= MAX_EXPERTS and not options
            and config.top_k + config.num_shared_slots <= MAX_TOP_K)


@dataclass(frozen=True, eq=False)
class _Plan:
    """What a launch needs that depends only on the config (and whether the shared slots are appended); cached per
    config, compared by identity."""

    constexprs: dict  # the kernel's constexprs of the config
    num_slots: int  # k + S: columns of the outputs
    block_m: int  # BM: rows per program, max(1, elements_per_program // E_PAD)
    scaling: float  # routed_weight_scale


@functools.lru_cache(maxsize=None)
def _plan(config: MoEConfig, num_shared: int, elements_per_program: int) -> _Plan:
    math = RouterMath.of(config)
    e_pad = next_pow2(config.num_experts)
    constexprs = dict(NUM_EXPERTS=config.num_experts, E_PAD=e_pad, TOP_K=config.top_k, NUM_SHARED=num_shared,
                      SLOTS_PAD=next_pow2(config.top_k + num_shared), SIGMOID=config.scoring == "sigmoid",
                      SQRT_SOFTPLUS=math.sqrt_softplus, RENORMALIZE=config.renormalize,
                      SHARED_SCALE=config.shared_weight, SOFTCAP=math.softcap,
                      SOFTCAP_INV=math.constexprs()["SOFTCAP_INV"])
    return _Plan(constexprs, config.top_k + num_shared, max(1, elements_per_program // e_pad),
                 float(config.routed_weight_scale))


class _Bound:
    """One kind of call (plan, M, the pointers' dtypes, strides, alignment, device, assert mode), decided on its first
    call: the bound launch and, where the kernel does not assert itself, its two flags ([2] int32, 1 = fine; only ever
    cleared, and a clear is fatal on the GPU)."""

    __slots__ = ("launch", "shape", "device", "ok")

    def __init__(self, plan: _Plan, logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor,
                 assert_in_kernel: bool) -> None:
        self.shape, self.device = (logits.shape[0], plan.num_slots), logits.device  # [M, k+S]
        scalars = (logits.shape[0], table.shape[0], logits.stride(0), logits.stride(1), table.stride(0), plan.scaling)
        options = {k: v for k, v in _launch_options(logits.device).items() if k in ("PRECISE", "enable_reflect_ftz",
                                                                                     "num_warps")}
        in_kernel = assert_in_kernel and options["PRECISE"]  # interpreted (no PRECISE): the flags
        if in_kernel:  # Triton compiles tl.device_assert only with debug=True; its overflow checks stay off
            options.update(ASSERT_IN_KERNEL=True, debug=True, sanitize_overflow=False)
        grid = (-(-logits.shape[0] // plan.block_m),)
        self.launch = BoundLaunch(kernels("hash_route_kernel").hash_route_kernel, grid, 6, scalars, True,
                                  **plan.constexprs, BLOCK_M=plan.block_m, **options)
        # [2]: logits finite, token ids inside; None where the kernel asserts them itself
        self.ok = None if in_kernel else torch.ones(2, dtype=torch.int32, device=self.device)

    def __call__(self, logits, token_ids, table) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.empty(self.shape, dtype=torch.int32, device=self.device)  # [M, k+S]
        weights = torch.empty(self.shape, dtype=torch.float32, device=self.device)  # [M, k+S]
        self.launch(logits, token_ids, table, ids, weights, ids if self.ok is None else self.ok)
        return ids, weights


# (the kernel module, plan, M, pointer facts, device) -> its bound launch; the module in the key: a test that imports
# the kernels again (interpreted or compiled) binds anew
_BOUND: dict[tuple, _Bound] = {}
MAX_BOUND = 1024  # kinds of call kept bound; the oldest goes first


def clear_launch_caches() -> None:
    """Drop the bound launches (they hold the kernel they were bound to)."""
    _BOUND.clear()


class FusedHashRouter:
    """``hash_route`` for one config on the fused kernel: ``router(logits [M, E], token_ids [M], table [V, k],
    append_shared=False) -> Routing [M, k(+S)]`` (the table checked at load: ``check_table``)."""

    def __init__(self, config: MoEConfig, elements_per_program: int = ELEMENTS_PER_PROGRAM,
                 assert_in_kernel: bool = True) -> None:
        """``assert_in_kernel``: the two checks as the compiled kernel's own device-side asserts (default: one launch,
        nothing after it), else its flags and two ``torch._assert_async`` (the interpreter always: its flags)."""
        if not computes(config):
            raise ValueError(f"the fused hash router needs hash_table_size, num_experts <= {MAX_EXPERTS}, top_k + "
                             f"shared slots <= {MAX_TOP_K} and no router option but the soft cap; got "
                             f"{config.hash_table_size}, {config.num_experts}, {config.top_k} + "
                             f"{config.num_shared_slots}, {config.changed_router_options()} (router='torch' routes it)")
        check_hash_eps(config)
        self.config, self.assert_in_kernel = config, bool(assert_in_kernel)
        slots = 0 if config.shared_expert_gate else config.num_shared_slots  # a gated shared expert: the twin
        self._plans = (_plan(config, 0, elements_per_program), _plan(config, slots, elements_per_program) if slots
                       else None)

    def __call__(self, logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor,
                 append_shared: bool = False) -> Routing:
        plan = self._plans[1 if append_shared else 0]
        if plan is None or torch.compiler.is_compiling() or transforming() or (
                torch.is_grad_enabled() and logits.requires_grad) or not triton_runs_on(logits.device):
            routing = hash_route(logits, token_ids, table, self.config)  # the twin: gradients, tracing, the CPU
            return append_shared_slots(routing, self.config) if append_shared else routing
        self._check(logits, token_ids)
        bound = _bound(plan, logits, token_ids, table, self.assert_in_kernel)
        ids, weights = bound(logits, token_ids, table) if logits.shape[0] else (
            torch.empty(0, plan.num_slots, dtype=torch.int32, device=logits.device),
            torch.empty(0, plan.num_slots, device=logits.device))
        if logits.shape[0] and bound.ok is not None:
            assert_flags(bound.ok, logits, token_ids, table.shape[0])
        return Routing(topk_ids=ids, topk_weights=weights, masked_tokens=None)

    def bind(self, logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor,
             append_shared: bool) -> _Bound | None:
        """The bound launch a call with these arguments makes (``moekit.layer_hash_fast`` keeps it: the same launch
        into its own buffers), or None where the call takes the twin or has no rows."""
        plan = self._plans[1 if append_shared else 0]
        if plan is None or not logits.shape[0] or not triton_runs_on(logits.device):
            return None
        self._check(logits, token_ids)
        return _bound(plan, logits, token_ids, table, self.assert_in_kernel)

    def _check(self, logits: torch.Tensor, token_ids: torch.Tensor) -> None:
        """hash_route's checks the kernel does not make (its flags: the values), with their messages."""
        e = self.config.num_experts
        if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
            raise TypeError(f"router_logits must be a floating-point torch.Tensor, got {type(logits).__name__}")
        if logits.dim() != 2 or logits.shape[1] != e:
            raise ValueError(f"router_logits must have shape [M, num_experts={e}], got {tuple(logits.shape)}")
        if not isinstance(token_ids, torch.Tensor) or token_ids.shape != (logits.shape[0],) or \
                token_ids.is_floating_point() or token_ids.dtype == torch.bool or token_ids.device != logits.device:
            check_token_ids(token_ids, logits.shape[0], self.config.hash_table_size)  # its TypeError / ValueError
            raise ValueError(f"token_ids must be on {logits.device} like router_logits, got {token_ids.device}")


def _bound(plan: _Plan, logits: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor,
           assert_in_kernel: bool) -> _Bound:
    """The bound launch of this kind of call, bound on its first."""
    key = (kernels("hash_route_kernel"), plan, logits.shape[0], logits.dtype, logits.stride(),
           logits.data_ptr() % 16 == 0, logits.device, token_ids.dtype, token_ids.stride(),
           token_ids.data_ptr() % 16 == 0, table.dtype, table.shape, table.stride(), table.data_ptr() % 16 == 0,
           assert_in_kernel)
    bound = _BOUND.get(key)
    if bound is None:
        bound = put_bounded(_BOUND, key, _Bound(plan, logits, token_ids, table, assert_in_kernel), MAX_BOUND)
    return bound


def assert_flags(ok: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor, table_rows: int) -> None:
    """The kernel's two flags as hash_route's errors: device-side asserts on the GPU (fatal: the flags never need
    setting back there), on the CPU the twin's own errors, the flags set back for the next call."""
    if logits.device.type != "cpu" and not interpreting():
        torch._assert_async(ok[0], "router_logits contains NaN or infinite values")
        torch._assert_async(ok[1], "token_ids outside [0, hash_table_size)")
        return
    try:
        assert_logits_finite(ok[0].bool(), logits)
        check_token_ids(token_ids, logits.shape[0], table_rows)
    finally:
        ok.fill_(1)
