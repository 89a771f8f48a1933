"""The fused router: ``route`` (and optionally ``append_shared_slots``) as one Triton kernel.

    Gate -> [Route: score -> (grouped) top-k -> weights (+ shared), 1 launch] -> Capacity -> Group -> Experts -> Combine

Same contract and semantics as ``moekit.routing.route``, its torch twin: int32 ids [M, k] in descending
score order, fp32 weights [M, k]; ids equal to route's bit for bit where no two candidates tie, weights
within fp32 rounding; equal scores: the lower expert id (and group id) wins. ``nonfinite="mask"``
masks an expert with a non-finite logit (see ``route_kernel``); ``nonfinite="raise"`` is a device-side
assert on the GPU, no host sync: the kernel's own ``tl.device_assert`` (``debug=True``), eager and under
``torch.compile`` (one launch; ``FusedRouter(assert_in_kernel=False)``: a one-element flag the kernel clears, filled
before and checked by ``torch._assert_async`` after, three launches compiled); on the CPU (interpreted) the flag,
and a ``ValueError`` naming the bad rows (``torch._assert_async``'s error while compiling).

Why: eagerly, route is ~15 small torch ops, each a few µs of host time (Qwen3 M=1 measured 1237 µs for the whole MoE
layer against an 18 µs floor). Here the host path is the argument checks, two or three allocations and one launch;
everything that depends only on the config is decided once, in a ``FusedRouter`` (``_Plan``). Eager calls launch
directly; under ``torch.compile`` the same launch runs behind ``torch.ops.moekit.route_fused`` (an op with a fake and no
autograd layer, ``op_library``), so ``fullgraph=True`` and CUDA graphs work. The weights carry no gradient: a call whose
logits, bias or shared gate logits need one is routed by ``route`` (the op refuses it).

Shapes: M tokens, E experts, k = top_k, S shared slots, BM rows per program.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import weakref
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from moekit._bounded import put_bounded
from moekit.config import MoEConfig
from moekit.experts.op_library import define_inference_op
from moekit.func_ops import transforming
from moekit.routing import gate
from moekit.triton_bind import COMPILE_OPTIONS, BoundLaunch, interpreting, next_pow2, triton_runs_on
from moekit.routing.route import Routing, assert_logits_finite, check_bias, route
from moekit.routing.router_math import RouterMath, computed_options
from moekit.routing.shared import append_shared_slots

RouterChoice = Literal["auto", "torch", "fused"]

# Limits of the kernel as written: a row's E scores sit in one warp's registers (E = 1024: 32 values
# per lane), and the k and topk_group rounds are unrolled. Larger configs fall back to ``route``.
MAX_EXPERTS, MAX_TOP_K, MAX_GROUPS = 1024, 32, 64
# One warp per program, holding BM = max(1, 128 // C) rows of C padded columns: 4 values per lane. A
# warp's instructions grow with the rows it holds (sm_90 PTX: one Qwen3 row 411, two rows 765), so more
# rows per warp only pay where a row is narrower than the warp: Mixtral's 8 columns, 4 rows: 199
# instructions against 174 for one. Two warps on one E=512 row: 889 instructions against 1236, but the
# cross-warp reductions go through shared memory with a barrier each; one warp is kept.
ELEMENTS_PER_PROGRAM = 128  # the default of FusedRouter(elements_per_program=)
_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_BOUND = 4096  # kinds of eager call whose launch is kept bound (~1 KB each); the oldest goes first


def computes(config: MoEConfig) -> bool:
    """Whether the kernel computes ``config`` (MAX_EXPERTS, MAX_TOP_K, MAX_GROUPS; the router options of
    ``router_math.COMPUTED``, the others route with ``route``): what ``router="fused"`` takes, and ``"auto"`` on CUDA
    (every computed option checked on a GPU: session 34's by ``benchmarks/rfast34_device_check.py``, ERNIE-4.5's
    renorm_clamp by ``ern49_device_check.py`` in session 50)."""
    return (config.num_experts <= MAX_EXPERTS and config.top_k + config.num_shared_slots <= MAX_TOP_K
            and config.n_group <= MAX_GROUPS and computed_options(config))


@dataclass(frozen=True, eq=False)
class _Plan:
    """What a launch needs that depends only on the config (and whether shared slots are appended)."""

    constexprs: dict  # the kernel's constexprs that depend on the config only
    top2: tuple[bool, bool]  # TOP2 without / with a bias: a group scores its best two (group_score; >= 2 a group)
    num_slots: int  # k + S: columns of the outputs
    cols: int  # C = G_PAD * P_PAD: tile columns per row
    check_finite: bool  # nonfinite="raise"
    scaling: float  # routed_weight_scale: routed_scaling_factor, halved where the shared expert is averaged in
    block_m: int  # BM: rows per program, max(1, elements_per_program // C)


@functools.lru_cache(maxsize=None)
def _plan(num_experts: int, top_k: int, n_group: int, topk_group: int, sigmoid: bool, renormalize: bool,
          scaling: float, check_finite: bool, num_shared: int, elements_per_program: int,
          math: RouterMath = RouterMath()) -> _Plan:
    # topk_group == n_group keeps every group: plain top-k over one flat row of next_pow2(E) columns.
    grouped = n_group > 1 and topk_group < n_group
    groups = n_group if grouped else 1
    per_group = num_experts // groups
    g_pad, p_pad = next_pow2(groups), next_pow2(per_group)
    constexprs = dict(
        NUM_EXPERTS=num_experts, PER_GROUP=per_group, G_PAD=g_pad, P_PAD=p_pad, TOP_K=top_k,
        TOPK_GROUP=topk_group, NUM_SHARED=num_shared, SLOTS_PAD=next_pow2(top_k + num_shared),
        GROUPED=grouped, SIGMOID=sigmoid, RENORMALIZE=renormalize, CHECK_FINITE=check_finite, ASSERT_FINITE=False,
        **math.constexprs())
    two = grouped and per_group >= 2
    top2 = (two and math.group_score == "top2_sum", two and math.group_score != "max")
    return _Plan(constexprs=constexprs, top2=top2, num_slots=top_k + num_shared, cols=g_pad * p_pad,
                 check_finite=check_finite, scaling=float(scaling),
                 block_m=max(1, elements_per_program // (g_pad * p_pad)))


def _plan_of(config: MoEConfig, num_shared: int, elements_per_program: int) -> _Plan:
    return _plan(config.num_experts, config.top_k, config.n_group, config.topk_group, config.scoring == "sigmoid",
                 config.renormalize, config.routed_weight_scale, config.nonfinite == "raise", num_shared,
                 elements_per_program, RouterMath.of(config))


@functools.lru_cache(maxsize=None)
def _launch_options(device: torch.device) -> dict:
    """Launch keywords that depend on the device only (decided once per device):
    - programmatic dependent launch (``PDL``, ``launch_pdl``) on NVIDIA GPUs of compute capability 9.0
      and later: the kernel may launch while the gate matmul drains, and waits for it before reading
      the logits; never on ROCm or under the interpreter;
    - ``PRECISE``: libdevice's expf / log1p, except under the interpreter, which has no libdevice;
    - ``enable_reflect_ftz=False``: Triton links libdevice with flush-to-zero by default, torch keeps
      denormals; with ftz a softmax score below 1.2e-38 is 0 here and a denormal in route, and such
      zeros tie where route's scores do not."""
    precise = not interpreting()
    pdl = (device.type == "cuda" and torch.version.hip is None and precise
           and torch.cuda.get_device_capability(device)[0] >= 9)
    return dict(PRECISE=precise, PDL=pdl, launch_pdl=pdl, enable_reflect_ftz=False, num_warps=1)


def kernels(name: str):
    """The kernel module ``moekit.routing._kernels.<name>``, imported on first use: Triton decides at
    decoration time whether a kernel is compiled or interpreted."""
    return importlib.import_module(f"moekit.routing._kernels.{name}")


def _scalars_and_constexprs(plan: _Plan, logits, bias, gate_logits, assert_in_kernel: bool = False):
    """(grid, scalar arguments, constexprs and launch options) of one launch: all fixed for a kind of call.
    ``assert_in_kernel``: nonfinite="raise" as a ``tl.device_assert`` (which Triton compiles only with
    ``debug=True``; its integer-overflow checks stay off) instead of the flag."""
    block_m, programs = plan.block_m, -(-logits.shape[0] // plan.block_m)
    scalars = (logits.shape[0], logits.stride(0), logits.stride(1), 0 if bias is None else bias.stride(0),
               0 if gate_logits is None else gate_logits.stride(0), plan.scaling)
    constexprs = dict(**plan.constexprs, TOP2=plan.top2[bias is not None], HAS_BIAS=bias is not None,
                      HAS_GATE=gate_logits is not None, BLOCK_M=block_m, **_launch_options(logits.device))
    if assert_in_kernel and plan.check_finite:
        constexprs.update(CHECK_FINITE=False, ASSERT_FINITE=True, debug=True, sanitize_overflow=False)
    return (programs,), scalars, constexprs


def _flagged(check_finite: bool, device: torch.device, assert_in_kernel: bool) -> bool:
    """Whether nonfinite="raise" uses the flag: not where a compiled kernel is asked to assert itself."""
    return check_finite and not (assert_in_kernel and _launch_options(device)["PRECISE"])


def _launch(plan: _Plan, logits: torch.Tensor, bias: torch.Tensor | None, gate_logits: torch.Tensor | None,
            assert_in_kernel: bool = False):
    """The kernel through ``kernel[grid]`` (the op's path; arguments checked) -> (ids [M, k+S], weights [M, k+S], ok).
    ok: [1] int32, 1 unless a logit is NaN or infinite, where ``_flagged``; else [0] (nothing to fill)."""
    num_tokens, device = logits.shape[0], logits.device
    ids = torch.empty(num_tokens, plan.num_slots, dtype=torch.int32, device=device)  # [M, k+S]
    weights = torch.empty(num_tokens, plan.num_slots, dtype=torch.float32, device=device)  # [M, k+S]
    flag = _flagged(plan.check_finite, device, assert_in_kernel)
    ok = torch.ones(1, dtype=torch.int32, device=device) if flag else ids.new_empty(0)  # [1] or [0]
    if num_tokens == 0:
        return ids, weights, ok
    grid, scalars, constexprs = _scalars_and_constexprs(plan, logits, bias, gate_logits, not flag)
    kernels("route_kernel").route_kernel[grid](
        logits, logits if bias is None else bias, logits if gate_logits is None else gate_logits, ids, weights,
        ids if ok.numel() == 0 else ok, *scalars, **constexprs, **COMPILE_OPTIONS)
    return ids, weights, ok


class _BoundRoute:
    """One kind of eager call (plan, M, the pointers' dtypes, strides, 16-byte alignment, device), decided
    on its first call: the bound launch (``BoundLaunch``: after its first call the compiled kernel's own
    launcher, without Triton's binder), the output sizes, and with check_finite either the kernel's own
    assert (``assert_in_kernel``, compiled kernels only) or a flag of its own."""

    __slots__ = ("launch", "shape", "device", "ok")

    def __init__(self, plan: _Plan, logits: torch.Tensor, bias, gate_logits, assert_in_kernel: bool) -> None:
        self.shape, self.device, self.launch = (logits.shape[0], plan.num_slots), logits.device, None  # [M, k+S]
        flag = _flagged(plan.check_finite, logits.device, assert_in_kernel)  # the interpreter: the flag
        if logits.shape[0]:
            grid, scalars, constexprs = _scalars_and_constexprs(plan, logits, bias, gate_logits, not flag)
            self.launch = BoundLaunch(kernels("route_kernel").route_kernel, grid, 6, scalars, True, **constexprs)
        # The kernel only ever clears the flag, on a non-finite logit; that is a device-side assert, fatal
        # to the CUDA context, and on the CPU ``_assert_finite`` sets it back before raising. So one flag
        # serves every call of this kind, instead of an allocation and a fill per call.
        self.ok = torch.ones(1, dtype=torch.int32, device=self.device) if flag else None  # [1]

    def __call__(self, logits: torch.Tensor, bias, gate_logits, out=None):
        if out is None:
            ids = torch.empty(self.shape, dtype=torch.int32, device=self.device)  # [M, k+S]
            weights = torch.empty(self.shape, dtype=torch.float32, device=self.device)  # [M, k+S]
        else:
            ids, weights = out
        ok = self.ok
        if self.launch is not None:
            self.launch(logits, logits if bias is None else bias, logits if gate_logits is None else gate_logits,
                        ids, weights, ids if ok is None else ok)
        return ids, weights, ok


# (plan, M, pointer facts, device) -> its bound launch; a plan is cached per config, compared by identity.
_BOUND: dict[tuple, _BoundRoute] = {}


def clear_launch_caches() -> None:
    """Drop the bound launches of eager calls, the gate's and the one-launch gate and router's too (they hold
    the kernel they were bound to)."""
    _BOUND.clear()
    gate.clear_launch_caches()
    importlib.import_module("moekit.routing.gate_route").clear_launch_caches()  # it imports this module


def _pointer_key(t: torch.Tensor | None):
    """What Triton specialises a pointer argument on, beyond the plan: dtype, leading stride, alignment."""
    return None if t is None else (t.dtype, t.stride(0), t.data_ptr() % 16 == 0)


def _launch_eager(plan: _Plan, logits: torch.Tensor, bias: torch.Tensor | None, gate_logits: torch.Tensor | None,
                  assert_in_kernel: bool, out=None):
    """``_launch`` for eager calls: the same kernel and arguments, decided once per kind of call; ok is None
    where the kernel asserts itself."""
    return bound_route(plan, logits, bias, gate_logits, assert_in_kernel)(logits, bias, gate_logits, out)


def bound_route(plan: _Plan, logits: torch.Tensor, bias: torch.Tensor | None, gate_logits: torch.Tensor | None,
                assert_in_kernel: bool) -> _BoundRoute:
    """This kind of eager call's bound launch, made on its first call (kept by ``moekit.layer_fast`` too)."""
    key = (plan, logits.shape[0], logits.dtype, logits.stride(), logits.data_ptr() % 16 == 0, logits.device,
           _pointer_key(bias), _pointer_key(gate_logits), assert_in_kernel)
    bound = _BOUND.get(key)
    if bound is None:
        bound = put_bounded(_BOUND, key, _BoundRoute(plan, logits, bias, gate_logits, assert_in_kernel), MAX_BOUND)
    return bound


def _route_kernel(logits: torch.Tensor, bias: Optional[torch.Tensor], gate_logits: Optional[torch.Tensor], top_k: int,
                  n_group: int, topk_group: int, sigmoid: bool, renormalize: bool, scaling: float, check_finite: bool,
                  num_shared: int, elements_per_program: int, softcap: float, bias_on_logits: bool, group_score: str,
                  fill_zero: bool, shared_weight: float, sqrt_softplus: bool = False, renorm_eps: float = 0.0,
                  renorm_clamp: float = 0.0,
                  assert_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's body: logits [M, E], bias [E] / gate_logits [M, 1] or None, config fields -> ``_launch``'s."""
    plan = _op_plan(logits.size(1), top_k, n_group, topk_group, sigmoid, renormalize, scaling, check_finite, num_shared,
                    elements_per_program, softcap, bias_on_logits, group_score, fill_zero, shared_weight, sqrt_softplus,
                    renorm_eps, renorm_clamp)  # the last eight: RouterMath's fields
    return _launch(plan, logits, bias, gate_logits, assert_in_kernel)


@functools.lru_cache(maxsize=256)
def _op_plan(num_experts: int, top_k: int, n_group: int, topk_group: int, sigmoid: bool, renormalize: bool,
             scaling: float, check_finite: bool, num_shared: int, elements_per_program: int, *math) -> _Plan:
    """``_plan`` of the op's primitives (``math``: RouterMath's fields), kept: no RouterMath built every call."""
    return _plan(num_experts, top_k, n_group, topk_group, sigmoid, renormalize, scaling, check_finite, num_shared,
                 elements_per_program, RouterMath(*math))


def _route_fake(logits, bias, gate_logits, top_k, n_group, topk_group, sigmoid, renormalize, scaling, check_finite,
                num_shared, elements_per_program, softcap, bias_on_logits, group_score, fill_zero, shared_weight,
                sqrt_softplus=False, renorm_eps=0.0, renorm_clamp=0.0, assert_in_kernel=False):
    ids = logits.new_empty(logits.shape[0], top_k + num_shared, dtype=torch.int32)  # [M, k+S]
    flag = _flagged(check_finite, logits.device, assert_in_kernel)
    return ids, torch.empty_like(ids, dtype=torch.float32), ids.new_empty(1 if flag else 0)  # weights [M, k+S], ok


define_inference_op("route_fused", _route_kernel, _route_fake)


def _assert_finite(ok: torch.Tensor, logits: torch.Tensor) -> None:
    """route's nonfinite="raise" contract on the kernel's flag ``ok`` [] (cleared where a logit is not
    finite); a flag kept for the next call (``_BoundRoute``) starts from "all finite" again."""
    try:
        assert_logits_finite(ok, logits)
    except ValueError:
        ok.fill_(1)
        raise


class FusedRouter:
    """``route`` for one config on the fused kernel, with the per-config work done here, once.

    ``router(logits [M, E], correction_bias [E] | None, shared_gate_logits [M, 1] | None,
    append_shared=False) -> Routing [M, k(+S)]``. With ``append_shared`` the S shared slots come last,
    exactly as ``append_shared_slots`` appends them (``shared_gate_logits`` for a gated shared expert).
    """

    def __init__(self, config: MoEConfig, elements_per_program: int = ELEMENTS_PER_PROGRAM,
                 assert_in_kernel: bool = True) -> None:
        """``elements_per_program``: tile elements one program holds (rows = this // padded row width); the default is
        what the sm_90 instruction counts above chose, tests raise it to run fewer programs. ``assert_in_kernel``:
        nonfinite="raise" on the GPU, eager and compiled, as the kernel's own assert, else the flag (module docs)."""
        if not computes(config):
            raise ValueError(f"the fused router supports num_experts <= {MAX_EXPERTS}, top_k + shared slots <= "
                             f"{MAX_TOP_K}, n_group <= {MAX_GROUPS} and the router options it computes; got "
                             f"{config.num_experts}, {config.top_k} + {config.num_shared_slots}, {config.n_group}, "
                             f"{config.changed_router_options()} (router='torch' routes it)")
        self.config, self.assert_in_kernel = config, bool(assert_in_kernel)
        slots = config.num_shared_slots
        self._plans = (_plan_of(config, 0, elements_per_program),
                       _plan_of(config, slots, elements_per_program) if slots else None)
        self._elements_per_program = elements_per_program
        self._op_args = (config.top_k, config.n_group, config.topk_group, config.scoring == "sigmoid",
                         config.renormalize, float(config.routed_weight_scale), config.nonfinite == "raise")
        self._math_args = dataclasses.astuple(RouterMath.of(config))  # the op's last arguments
        # (a weak reference to the last bias that passed, its _version then): a weak reference, not id(),
        # since a freed tensor's id is reused by the next one (a test caught an unchecked bias that way)
        self._bias_checked: tuple[weakref.ref, int] | None = None

    def __call__(self, logits: torch.Tensor, correction_bias: torch.Tensor | None = None,
                 shared_gate_logits: torch.Tensor | None = None, append_shared: bool = False, out=None) -> Routing:
        """``out``: (ids, weights) [M, k(+S)] int32 / float32 contiguous on the logits' device, written by
        eager calls instead of fresh tensors (``moekit.routing.workspace``; the caller vouches for them)."""
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (logits, correction_bias, shared_gate_logits)) or transforming():
            # weights that need a gradient, or a torch.func transform: the launch computes none (nor takes wrappers)
            return self._twin(logits, correction_bias, shared_gate_logits, append_shared)
        plan = self._plans[1 if append_shared else 0]
        if plan is None:
            return self._twin(logits, correction_bias, shared_gate_logits, append_shared)  # raises append's error
        logits = self._check(logits, correction_bias)
        gate = self._check_gate(logits, shared_gate_logits) if append_shared else None
        if torch.compiler.is_compiling():
            ids, weights, ok = torch.ops.moekit.route_fused(
                logits, correction_bias, gate, *self._op_args, plan.num_slots - self.config.top_k,
                self._elements_per_program, *self._math_args, self.assert_in_kernel)
        else:  # eager: the bound launch, without the op's dispatch (host time is the point here)
            ids, weights, ok = _launch_eager(plan, logits, correction_bias, gate, self.assert_in_kernel, out)
        if plan.check_finite and ok is not None and ok.numel() and logits.shape[0]:  # [0]: the kernel asserts
            _assert_finite(ok, logits)
        # With nonfinite="raise" no token can lack a finite logit; "mask" counts them as route does.
        masked = None if plan.check_finite else (~torch.isfinite(logits).any(dim=1)).sum()
        return Routing(topk_ids=ids, topk_weights=weights, masked_tokens=masked)

    def _twin(self, logits, correction_bias, shared_gate_logits, append_shared) -> Routing:
        routing = route(logits, self.config, correction_bias)
        return append_shared_slots(routing, self.config, shared_gate_logits) if append_shared else routing

    def _check(self, logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """route's argument checks, with route's messages; returns the logits in a dtype Triton loads."""
        num_experts = self.config.num_experts
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"router_logits must be a torch.Tensor, got {type(logits).__name__}")
        if logits.dim() != 2 or logits.shape[1] != num_experts:
            raise ValueError(f"router_logits must have shape [M, num_experts={num_experts}], got {tuple(logits.shape)}")
        if not logits.is_floating_point():
            raise TypeError(f"router_logits must be a floating-point tensor, got {logits.dtype}")
        if not logits.is_cuda and not triton_runs_on(logits.device):
            raise RuntimeError(f"the fused router needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got "
                               f"{logits.device}")
        if bias is not None:
            self._check_bias(bias, logits.device)
        return logits if logits.dtype in _LOGIT_DTYPES else logits.float()

    def _check_bias(self, bias: torch.Tensor, device: torch.device) -> None:
        """route's bias checks (shape, device, dtype, finite values), run again only when the bias is a
        new tensor or was updated in place (its version moved): a buffer between updates costs nothing."""
        checked = self._bias_checked
        if checked is None or checked[0]() is not bias or checked[1] != bias._version:
            check_bias(bias, self.config, device)  # raises for a non-tensor before ._version is read below
            self._bias_checked = (weakref.ref(bias), bias._version)

    def _check_gate(self, logits: torch.Tensor, gate_logits: torch.Tensor | None) -> torch.Tensor | None:
        if not self.config.shared_expert_gate:
            return None  # an ungated shared expert: weight 1, as append_shared_slots ignores the logits
        num_tokens = logits.shape[0]
        if gate_logits is None or gate_logits.shape != (num_tokens, 1):
            raise ValueError(f"shared_gate_logits must have shape [M={num_tokens}, 1] for a gated shared expert, got "
                             f"{None if gate_logits is None else tuple(gate_logits.shape)}")
        return gate_logits


@functools.lru_cache(maxsize=None)
def _router_of(config: MoEConfig, elements_per_program: int = ELEMENTS_PER_PROGRAM) -> FusedRouter:
    return FusedRouter(config, elements_per_program)


def route_fused(router_logits: torch.Tensor, config: MoEConfig, correction_bias: torch.Tensor | None = None, *,
                elements_per_program: int = ELEMENTS_PER_PROGRAM) -> Routing:
    """``route`` on the fused kernel: CUDA, or the CPU under ``TRITON_INTERPRET=1`` (tests). Hot paths
    should hold a ``FusedRouter`` (``fused_router``) and skip this function's lookup by config."""
    return _router_of(config, elements_per_program)(router_logits, correction_bias)


def fused_router(config: MoEConfig, device: torch.device | str, choice: RouterChoice = "auto") -> FusedRouter | None:
    """The fused router to use on ``device``, or None for ``route``. ``"auto"``: fused on CUDA where
    Triton imports and ``computes(config)``; ``"fused"``: always (raises where it cannot run);
    ``"torch"``: never."""
    if choice not in ("auto", "torch", "fused"):
        raise ValueError(f"router must be 'auto', 'torch' or 'fused', got {choice!r}")
    if choice == "torch":
        return None
    if choice == "fused":
        if not triton_runs_on(device):
            raise RuntimeError(f"the fused router needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {device}")
        return _router_of(config)
    usable = torch.device(device).type == "cuda" and triton_runs_on(device) and computes(config)
    return _router_of(config) if usable else None
