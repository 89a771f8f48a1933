"""Expert computation behind one signature:

    fn(x [M, K], w13, w2 [E, K, N], topk_ids [M, k], topk_weights [M, k],
       *, activation: str | ActivationSpec = "silu", expert_map=None,
       b13: [E, 2N] | [E, N] | None = None, b2: [E, K] | None = None) -> out [M, K] (x.dtype)

out[t] = sum_j topk_weights[t, j] * (w2[e] @ glu(w13[e] @ x[t] + b13[e]) + b2[e]), e = topk_ids[t, j],
glu = ``moekit.activations.apply_glu`` of the ``ActivationSpec`` (a str names a plain gated one). w13 is
[E, 2N, K] for a gated spec (gate rows then up rows, or alternating when ``interleaved``), [E, N, K]
for an ungated one; b13 follows w13's rows. Weights may be strided views (transformers' transposed
storage passed as ``gate_up_proj.transpose(1, 2)``): backends read them through their strides.
An id that is < 0 or >= E, or whose ``expert_map`` entry is -1, is skipped (contributes 0): that
covers moekit's -1, capacity drops, transformers' EP sentinel (id >= E) and vLLM's expert map.

Backends: ``reference`` (the float32 oracle), ``grouped_mm`` (torch), ``triton`` (fused kernels, CUDA; on Hopper at
prefill, warp-specialized Gluon GEMMs on the contiguous layout where they measured faster, for bf16/fp16 and
block-scaled fp8 weights), ``triton_gluon`` (``triton`` with the caller's ``GluonChoice``; never picked by
``auto``). ``backend="auto"`` picks the best available for the device; on CUDA a call that records gradients trains
where ``moekit.experts.auto_train``'s rules say. ``backend_fn(name, device)`` is the one resolver that ``MoE``,
``EPMoE`` and ``moekit.hf`` use: resolved once per (name, device type), then a dictionary lookup. A backend function
assumes ``check_experts_args`` has passed (it runs once, in ``call_backend``); only a backend's own requirements
(dtypes, activations) are its own. ``call_backend`` passes ``b13``/``b2`` only when one is set, so a backend's
defaults must be None.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from typing import Callable

import torch

from moekit.activations import ActivationSpec, as_spec

ExpertsFn = Callable[..., torch.Tensor]

# name -> "module:function"; imported on first use so that optional dependencies stay optional.
_BACKENDS = {
    "reference": "moekit.experts.reference:experts_reference",
    "grouped_mm": "moekit.experts.grouped_mm:experts_grouped_mm",
    "triton": "moekit.experts.triton:experts_triton_unchecked",  # experts_triton checks, then calls it
    "triton_gluon": "moekit.experts.triton_gluon:experts_triton_gluon",  # triton with the caller's GluonChoice
}
# Preference order of "auto", best first. Off CUDA, Triton only runs interpreted (TRITON_INTERPRET=1,
# for tests), so "auto" never picks it there; it stays available by name.
_AUTO_ORDER = {"cuda": ("triton", "grouped_mm", "reference")}
_AUTO_ORDER_OTHER = ("grouped_mm", "reference")

# (backend name, device type) -> its resolved function. A plain dict, not functools.lru_cache: on a hit
# torch.compile traces a dict lookup, while it traces through an lru_cache wrapper into the resolution
# itself (module imports), which fullgraph=True cannot take.
_RESOLVED: dict[tuple[str, str], ExpertsFn] = {}


def backend_names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> ExpertsFn:
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {backend_names()} or 'auto', got {name!r}")
    module, fn = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), fn)


def backend_available(name: str, device: torch.device | str) -> bool:
    """Whether ``name`` can run on ``device`` here (its dependencies import and it supports the device)."""
    try:
        module = importlib.import_module(_BACKENDS[name].split(":")[0])
    except ImportError:
        return False
    check = getattr(module, "is_available", None)
    return True if check is None else bool(check(torch.device(device)))


def available_backends(device: torch.device | str) -> list[str]:
    """The backends "auto" chooses from on ``device``, best first."""
    order = _AUTO_ORDER.get(torch.device(device).type, _AUTO_ORDER_OTHER)
    return [name for name in order if backend_available(name, device)]


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The concrete backend name for ``backend`` ("auto" or a name) on ``device``. Every backend computes every
    ``ActivationSpec`` (the clamp after the activation included), so the activation never changes the answer."""
    if backend == "auto":
        return available_backends(device)[0]
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {backend_names()} or 'auto', got {backend!r}")
    if not backend_available(backend, device):
        raise RuntimeError(f"backend {backend!r} is not available on {device}; auto would use: "
                           f"{available_backends(device)}")
    return backend


def backend_fn(name: str, device: torch.device | str) -> ExpertsFn:
    """The experts function of backend ``name`` ("auto" or a name) on ``device``'s type, resolved on
    the first call per (name, device type) and cached. A cached call imports nothing, so it traces under
    ``torch.compile(fullgraph=True)``; resolve once outside the trace (as ``MoE`` does on construction)."""
    key = (name, device.type if isinstance(device, torch.device) else torch.device(device).type)
    fn = _RESOLVED.get(key)
    if fn is None:  # "auto" on triton: ``auto_train``'s dispatcher (a call that records gradients may train elsewhere)
        resolved = resolve_backend(name, device)
        auto = importlib.import_module("moekit.experts.auto_train") if (name, resolved) == ("auto", "triton") else None
        fn = _RESOLVED[key] = get_backend(resolved) if auto is None else auto.auto_dispatcher(resolved)
    return fn


def run_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Check the arguments, then run the chosen backend. See the module docstring for the contract."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor [M, K], got {type(x).__name__}")
    fn = backend_fn(backend, x.device)
    return call_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                        b13=b13, b2=b2)


def bind_options(fn: ExpertsFn, options: dict) -> ExpertsFn:
    """``fn`` with backend-specific keyword ``options`` bound once (``functools.partial``, which
    ``torch.compile`` traces); a name ``fn`` does not take raises here, naming it and what it takes."""
    if not options:
        return fn
    fn = getattr(fn, "inference_fn", fn)  # "auto"'s dispatcher (auto_train): the options are its inference pick's
    contract = {"x", "w13", "w2", "topk_ids", "topk_weights", "activation", "expert_map", "b13", "b2"}
    taken = [p for p in inspect.signature(fn).parameters if p not in contract]
    unknown = sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"backend_options {unknown} are not options of {fn.__name__}; it takes {taken}")
    return functools.partial(fn, **options)


def call_backend(
    fn: ExpertsFn,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check the arguments and run an already resolved backend function. Unlike ``run_experts`` it
    imports nothing, so ``torch.compile(fullgraph=True)`` traces through it. ``activation`` reaches
    the backend as given (a str stays a str). Under ``torch.autocast`` an x whose dtype is not the weights' takes
    autocast's, the weights too (``autocast_operands``)."""
    if (isinstance(x, torch.Tensor) and x.dtype is not getattr(w13, "dtype", x.dtype)
            and torch.is_autocast_enabled(x.device.type)):  # bad arguments fall through to the check's own errors
        x, w13, w2, b13, b2 = autocast_operands(x, w13, w2, b13, b2)
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation=activation, b13=b13, b2=b2)
    return call_checked_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                                b13=b13, b2=b2)


def autocast_operands(x: torch.Tensor, w13, w2, b13: torch.Tensor | None, b2: torch.Tensor | None) -> tuple:
    """(x, w13, w2, b13, b2) as ``torch.autocast`` would cast a matmul's operands on x's device type, for a call whose
    x and weights differ in dtype: autocast never reaches moekit's backends (its lists name torch's ops), so a float32
    model's layer under bf16 autocast met a bf16 x from the ops before it and float32 weights, and refused the pair.
    Float16/32 tensors go to autocast's dtype (differentiable casts: float32 parameters get their gradients), float64
    ones stay; quantized weights keep their format and take x in their logical dtype. A call whose x has the weights'
    dtype runs in it, autocast or not (so the kept fast paths, which serve such calls, never differ)."""
    if not isinstance(w13, torch.Tensor):  # a QuantizedWeight: its kernels run in its logical dtype
        return (x if x.dtype in (w13.dtype, torch.float64) else x.to(w13.dtype)), w13, w2, b13, b2
    dtype = torch.get_autocast_dtype(x.device.type)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or t.dtype in (dtype, torch.float64) else t.to(dtype)

    return cast(x), cast(w13), cast(w2), cast(b13), cast(b2)


def autocast_input(x: torch.Tensor) -> bool:
    """x is of an enabled ``torch.autocast``'s dtype on its device type: an x the experts take in that dtype whatever
    the weights' (``autocast_operands``; ``EPMoE`` accepts it so)."""
    kind = x.device.type
    return torch.is_autocast_enabled(kind) and x.dtype == torch.get_autocast_dtype(kind)


def call_checked_backend(
    fn: ExpertsFn,
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``call_backend`` without ``check_experts_args``, for a caller that knows its arguments pass it
    (``MoE``'s own forward: weights it checked before, the routing its router made); public entry points
    call ``call_backend``."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    if b13 is None and b2 is None:
        return fn(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map)
    return fn(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map, b13=b13, b2=b2)


# backend function -> its fast path for a repeated call without an expert map: (x, w13, w2, topk_ids, topk_weights,
# activation, *, b13=None, b2=None) -> out, or None where it does not apply (then the backend runs as usual).
# ``ExpertsCallCache`` tries it first: the triton backend's (``triton_fast``) skips the argument check, the
# plan and workspace lookups of a call it has seen.
_FAST_PATHS: dict[ExpertsFn, Callable] = {}


def register_fast_path(fn: ExpertsFn, fast: Callable) -> None:
    _FAST_PATHS[fn] = fast


def fast_path_of(fn: ExpertsFn) -> Callable | None:
    """The fast path ``fn``'s backend registered (``register_fast_path``), or None."""
    return _FAST_PATHS.get(fn)


# backend function -> its keeper of one kind of call: (x, w13, w2, topk_ids, topk_weights, activation, *, b13=None,
# b2=None) -> a kept call (x, w13, w2, topk_ids, topk_weights, b13=None, b2=None) -> out | None for a caller that
# checks on every call what the backend's keeper says (triton's ``triton_fast.KeptCall``: the decode fast path
# ``moekit.layer_fast``), or None.
_KEEPERS: dict[ExpertsFn, Callable] = {}


def register_keeper(fn: ExpertsFn, keep: Callable) -> None:
    _KEEPERS[fn] = keep


def keeper_of(fn: ExpertsFn) -> Callable | None:
    """The keeper ``fn``'s backend registered (``register_keeper``), or None."""
    return _KEEPERS.get(fn)


# backend function -> its entry while torch.compile traces a call with plain (unquantized) weights and no expert map:
# (x, w13, w2, topk_ids, topk_weights, activation, b13, b2) -> out. Whatever a backend's eager path checks and
# branches on (fast paths, routes, caches) is Python that dynamo traces and then guards on every compiled call;
# the triton backend's entry is its custom op with the default options, what that path reaches under tracing.
_TRACED_PATHS: dict[ExpertsFn, Callable] = {}


def register_traced_path(fn: ExpertsFn, traced: Callable) -> None:
    _TRACED_PATHS[fn] = traced


def traced_path_of(fn: ExpertsFn) -> Callable | None:
    """The traced entry ``fn``'s backend registered (``register_traced_path``), or None."""
    return _TRACED_PATHS.get(fn)


class ExpertsCallCache:
    """``call_backend`` for a caller that makes the same call again and again with its own weight tensors and
    a routing its own router made from x (``MoE``'s forward): ``check_experts_args`` runs in full (raising
    for bad input) on the first call and whenever a weight or bias tensor, its shape or dtype, or x's dtype
    or device or hidden size differs from the last call that passed it; otherwise the backend runs directly
    (``call_checked_backend``). The routing is not checked again: the caller vouches for it (ids and weights
    [M, k] of this x, on its device, ids int32/int64). Quantized weights are checked on every call. Before
    all that, a call goes to the backend's fast path where it registered one
    (``register_fast_path``; triton's ``triton_fast``), which serves only calls it has kept, with these
    weight tensors unchanged. A copy or a pickle of the cache is a new, empty one (weak references do not pickle:
    ``torch.save`` of a ``MoE`` after a forward raised on them)."""

    __slots__ = ("_refs", "_shapes", "_dtype", "_device", "_hidden")

    def __init__(self) -> None:
        self.clear()

    def __reduce__(self):
        return ExpertsCallCache, ()

    def clear(self) -> None:
        """Forget the last call that passed (``MoE._apply``: a move or cast keeps the Parameter objects)."""
        self._refs: tuple | None = None  # weakref.ref of w13, w2, b13, b2 (None where absent)

    def __call__(self, fn: ExpertsFn, x, w13, w2, topk_ids, topk_weights, *, activation, b13=None, b2=None):
        if x.dtype is not w13.dtype and torch.is_autocast_enabled(x.device.type):  # new tensors: checked in full
            x, w13, w2, b13, b2 = autocast_operands(x, w13, w2, b13, b2)
        if not torch.compiler.is_compiling():  # traced: the check as before
            fast = _FAST_PATHS.get(fn)
            if fast is not None:  # the backend's own record of this call (it checks the weights are the same)
                out = (fast(x, w13, w2, topk_ids, topk_weights, activation) if b13 is None and b2 is None
                       else fast(x, w13, w2, topk_ids, topk_weights, activation, b13=b13, b2=b2))
                if out is not None:
                    return out
            if self._passed(x, (w13, w2, b13, b2)):
                return call_checked_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13,
                                            b2=b2)
        out = call_backend(fn, x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)
        if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and not torch.compiler.is_compiling():
            tensors = (w13, w2, b13, b2)
            self._refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
            self._shapes = tuple(None if t is None else t.shape for t in tensors)
            self._dtype, self._device, self._hidden = x.dtype, x.device, x.shape[-1]
        return out

    def _passed(self, x, tensors: tuple) -> bool:
        refs, dtype = self._refs, x.dtype
        if refs is None or dtype != self._dtype or x.device != self._device or x.shape[-1] != self._hidden:
            return False
        for ref, shape, t in zip(refs, self._shapes, tensors):
            if t is None:
                if ref is not None:
                    return False
            elif ref is None or ref() is not t or t.dtype != dtype or t.shape != shape:
                return False
        return True


_ID_DTYPES = (torch.int32, torch.int64)


def check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map=None, *, activation="silu", b13=None,
                       b2=None) -> None:
    """Raise a clear error naming the argument when shapes, dtypes or devices do not fit together.
    On every eager call: each attribute is read once and the common case costs a few comparisons.
    Weights are not asked to be contiguous: a strided (transposed) view is a valid weight."""
    try:
        gated = as_spec(activation).gated
        x_shape, w13_shape, ids_shape = x.shape, w13.shape, topk_ids.shape
        if len(x_shape) != 2:
            raise ValueError(f"x must have shape [M, K], got {tuple(x_shape)}")
        if len(w13_shape) != 3 or w13_shape[2] != x_shape[1] or (gated and w13_shape[1] % 2):
            rows = "2N" if gated else "N (ungated activation)"
            raise ValueError(f"w13 must have shape [E, {rows}, K={x_shape[1]}], got {tuple(w13_shape)}")
        num_experts, rows, hidden = w13_shape
        n = rows // 2 if gated else rows
        if w2.shape != (num_experts, hidden, n):
            raise ValueError(f"w2 must have shape [E={num_experts}, K={hidden}, N={n}], got {tuple(w2.shape)}")
        if len(ids_shape) != 2 or ids_shape[0] != x_shape[0]:
            raise ValueError(f"topk_ids must have shape [M={x_shape[0]}, k], got {tuple(ids_shape)}")
        if topk_ids.dtype not in _ID_DTYPES:
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if topk_weights.shape != ids_shape:
            raise ValueError(f"topk_weights must have the shape of topk_ids {tuple(ids_shape)}, got "
                             f"{tuple(topk_weights.shape)}")
        dtype, device = x.dtype, x.device
        if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):  # moekit.quant's: any x dtype
            from moekit.quant import check_quantized_pair  # imported on this path only (keeps the top import-free)

            check_quantized_pair(w13, w2)  # both QuantizedWeights of one scheme, or a TypeError naming the other
        elif w13.dtype != dtype or w2.dtype != dtype:
            raise TypeError(f"x, w13 and w2 must share a dtype, got x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: "
                            "cast x to the weights' dtype, or the weights to x's (moe.to(dtype) for an MoE module)")
        if w13.device != device or w2.device != device or topk_ids.device != device or topk_weights.device != device:
            for name, t in (("w13", w13), ("w2", w2), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
                if t.device != device:
                    raise ValueError(f"{name} must be on {device} like x, got {t.device}")
        if expert_map is not None and (expert_map.dim() != 1 or expert_map.device != device):
            raise ValueError(f"expert_map must be 1-D on {device}, got {tuple(expert_map.shape)} on "
                             f"{expert_map.device}")
        if b13 is not None:
            _check_bias("b13", b13, (num_experts, rows), f"{'2N' if gated else 'N'}={rows}", x)
        if b2 is not None:
            _check_bias("b2", b2, (num_experts, hidden), f"K={hidden}", x)
    except AttributeError:  # an argument that is no tensor (None, a list): say which
        _check_tensor_types(x=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights, expert_map=expert_map)
        raise


def _check_tensor_types(**args) -> None:
    """Raise a TypeError naming the first argument that is not a tensor (w13 / w2 may be a moekit.quant
    QuantizedWeight, expert_map None): the error path of ``check_experts_args``, which reads attributes unguarded."""
    from moekit.quant import is_quantized  # the error path only (keeps the top import-free)

    for name, value in args.items():
        if isinstance(value, torch.Tensor) or (name == "expert_map" and value is None):
            continue
        if name in ("w13", "w2") and is_quantized(value):
            continue
        kind = "a torch.Tensor or a moekit.quant QuantizedWeight" if name in ("w13", "w2") else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")


def _check_bias(name: str, bias, shape: tuple[int, int], rows: str, x: torch.Tensor) -> None:
    """A bias must be a tensor of ``shape`` ([E, ``rows`` of its weight]) in x's dtype, on x's device."""
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(bias).__name__}")
    if bias.shape != shape:
        raise ValueError(f"{name} must have shape [E={shape[0]}, {rows}], got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {bias.dtype}")
    if bias.device != x.device:
        raise ValueError(f"{name} must be on {x.device} like x, got {bias.device}")
