"""The eager ``MoE`` layer's decode fast path: a repeated forward of up to MAX_ROWS tokens goes straight to its
launches, past ``route_tokens`` and the experts step's generic code.

    first call of a kind (M rows; dtype, device, stream, thread; the layer's weights and router): the full
      forward, then ``DecodeFast.keep``: its route buffers, the gate + router bound launch (up to the one
      launch's rows, ``gate_route``; above, ``torch.mm`` into the kept logits and the router's bound launch,
      as ``MoE._gate`` and ``FusedRouter`` run them), the experts backend's kept call (``register_keeper``:
      triton's ``triton_fast.KeptCall``), else its fast path (``register_fast_path``; None: ``MoE._experts_call``),
      and what they were made for
    a repeated call that fits the kept entry:
      [Gate -> Route, into the kept buffers] -> [Experts: the kept call (the checks below are its own), else
      the backend's fast path (its own checks)]; where the kept call's launches are batched, the one gate + router
      launch and the experts' in one C call (``JOINED``, ``triton_fast.JointCall``; H200, merged main 392c1c5, layer
      host µs 19-38 at every M <= 256 on Qwen3, DeepSeek-V3, Mixtral, 5-18 below the launch on its own:
      ``benchmarks/layer3_device_check.py``)

What a hit checks (else the full forward runs): no autograd (grad mode off), nothing compiling or tracing, no
dispatch mode or functorch transform, no CUDA graph capturing; x a plain tensor [M, K] (the forward's own
checks, which it tries this before), contiguous, 16-byte aligned, of the entry's dtype and device, on its
stream and thread;
the layer's gate weight, gate bias, correction bias, w13, w2 and the expert biases b13 / b2 the same tensors (weakly
held; None where the layer has none) and the first three's address, shape, strides and dtype unchanged (what the
bound launches specialised on); the router,
gate+router function, experts function, route workspace, config, capacity factor (None), eager graphs (None)
the same objects. The correction bias is checked as ``gate_route`` checks it (again when its version moves);
w13 and w2 as the same tensors here, their addresses and layouts by the kept call (a move: it misses, and the
experts run through ``MoE._experts_call`` on the routing just made; an in-place update hits: the kernels read the
new values); b13 and b2 as the same tensors here, their addresses, layouts and versions by the kept call (a move or an
in-place update: it misses, and ``MoE._experts_call`` runs them; ``moekit.experts.kept_biases``). gpt-oss's layer
(the router Linear's bias, expert biases, the clamped interleaved SwiGLU in ``config.activation``) is kept so.
Quantized experts (``MoE.quantize_``: QuantizedWeight objects, the same ones by identity) have no kept call (the keeper
takes plain tensors): the experts go to the backend's fast path (triton's ``run_fast``, its quantized entries).
A separate shared MLP (``fuse_shared=False``, and every quantized layer with a shared expert: ``quantize_`` un-fuses
it), Qwen2-MoE's sigmoid gate on it included, runs after the experts as ``MoE._experts_and_shared`` runs it
(``with_shared``: ``shared_mlp`` on the tensors the layer holds now; nothing of it is kept, so nothing to check).
Outputs are the full forward's bit for bit: the same launches with the same arguments. A router dtype other than x's
or the gate weight's (``router_dtype`` float32 over bf16: Kolibri, Lara-Mini, the privacy filter, LongCat-Flash; V3's
float32 gate weight) is kept too (session 50, fix50; H200, layer host µs at M = 1, Qwen3-30B-A3B shapes with
router_dtype float32: 115.6 -> 60.5, DeepSeek-V3's with a float32 gate: 89.2 -> 40.7;
``benchmarks/fix50_device_check.py``): the gate + router launch reads x and the gate weights as stored and upcasts
them in registers (``gate.reads_as``, session 51, as the full forward; H100, M = 1: 35.6 -> 21.1 µs of host, bf16
routing's 20.8: ``benchmarks/rtr51_device_check.py``), else ``RouterCasts`` casts them into kept
buffers on every call, as ``router_inputs`` does for the full forward. Not kept: a gated shared expert in fused slots
(its gate logits feed the router), router-weighted shared slots (Inkling), capacity dropping. ``MoE._apply`` (a move
or cast) drops the entries.

H200, layer host µs per call, full forward -> this path (``f6f35e93:benchmarks/host_trim2_device_check.py``, raw
``NVIDIA_H200-2026-12-02-22eddcd-host_trim2.log``, calls after the first of each sample): Qwen3-30B-A3B
47.2 -> 37.9 at M = 1, 76.3 -> 61.3 at M = 8; DeepSeek-V3 48.3 -> 39.8 and 83.5 -> 67.1. With the experts' kept
call (``benchmarks/layer_host2_device_check.py``, another host): Qwen3 30.4 / 30.7, DeepSeek-V3 31.8 / 47.5 (two
launches for its gate and router at 8 rows then), Mixtral-8x7B 33.4 / 42.8 at M = 1 / 8.

Shapes: M tokens, K hidden, E experts, k + S slots.
"""

from __future__ import annotations

import weakref
from threading import get_ident

import torch

from moekit._bounded import put_bounded
from moekit.experts import fast_path_of, keeper_of
from moekit.routing import fused
from moekit.routing import gate_route
from moekit.routing.gate import router_dtype_of, takes_stored
from moekit.routing.gate_route import MAX_TOKENS, bound_launch
from moekit.routing.shared import shared_mlp
from moekit.triton_bind import LEAD_X, current_stream

ENABLED = True  # the A/B switch of ``f6f35e93:benchmarks/host_trim2_device_check.py``
# The one gate + router launch in the experts' one C call (``triton_fast.JointCall``), where the kept call's launches
# are batched; read when an entry is kept. False: its own raw launch (the A/B of ``benchmarks/layer3_device_check.py``)
JOINED = True
# Batches up to the memory-bound ones (issue 13: B <= 256). Above 8 rows an entry holds nothing the route workspace
# does not keep already (its buffers, the router's bound launch), so a larger limit costs no memory; the CPU harness
# (f6f35e93:benchmarks/layer_host_cpu.py, kernels stubbed) measured the forward at M = 256 11-12 µs cheaper on the
# fast path. Above 256 rows a call's GPU time dwarfs the Python skipped here.
MAX_ROWS = 256
MAX_ENTRIES = 32  # kinds (M, thread) kept per layer, as ``RouteWorkspace``; the oldest goes first

_grad = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_dispatching = torch._C._len_torch_dispatch_stack
_tracing = torch._C._is_tracing
_transforming = torch._C._are_functorch_transforms_active
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)  # read only for CUDA x


def _none() -> None:
    return None


def _ref(t):
    """A weak reference to ``t``; for None a callable that returns None (so a check is one call either way)."""
    return _none if t is None else weakref.ref(t)


def _spec(t) -> tuple | None:
    """What a bound launch specialised on besides the object: address, shape, strides, dtype."""
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


class _Entry:
    """One kept kind of decode call."""

    __slots__ = ("hidden", "dtype", "device", "device_index", "stream", "thread", "refs", "objects", "specs", "buffers",
                 "bound", "route", "fast", "kept", "joint", "activation", "append_shared", "cuda", "casts")

    def __init__(self, layer, x2d, tensors: tuple, buffers, bound, route, fast, kept, joint, append_shared: bool,
                 casts: "RouterCasts | None"):
        self.hidden, self.dtype, self.device, self.device_index = x2d.shape[1], x2d.dtype, x2d.device, x2d.get_device()
        self.cuda = x2d.is_cuda
        self.stream = current_stream() if self.cuda else 0
        self.thread = get_ident()
        self.refs = tuple(_ref(t) for t in tensors)  # gate weight, gate bias, correction bias, w13, w2, b13, b2
        self.objects = _objects(layer)
        self.specs = (_spec(tensors[0]), _spec(tensors[1]), _spec(tensors[2]))
        self.buffers, self.fast, self.kept = buffers, fast, kept  # kept: the backend's kept call (keeper_of), else None
        self.joint = joint  # the one launch and the kept call in one C call (``KeptCall.joined``), else None
        self.bound, self.route = bound, route  # the one launch (M <= gate_route.ROWS), else the router's bound launch
        self.activation, self.append_shared = layer.config.activation, append_shared
        self.casts = casts  # the gate's inputs cast to the router dtype (kept buffers), where not read as stored


class RouterCasts:
    """The gate's inputs in the router dtype, where it differs from x's or the gate weight's and the launch does not
    read them as stored (``gate.takes_stored``: a downcast; ``gate.READ_STORED`` off, the A/B of session 50's copies
    for every float32 router over bf16): kept buffers x [M, K], W [E, K], b [E] in that dtype, filled by ``copy_`` on
    every call (the values ``router_inputs`` makes for the full forward, and the same bound launch runs on them: the
    same bits). W and b are copied again on every call, not kept by version: an update through
    ``.data`` moves no version counter, and a stale routing would be silent. A tensor already in the dtype is read as
    it is (None here). ``peer``: another kind's casts of the layer on the same stream and thread, whose W and b buffers
    this one shares (its calls run in stream order, each filling them before its launch): one W copy a layer and
    stream, not one per kept M (up to MAX_ENTRIES)."""

    __slots__ = ("x", "weight", "linear_bias")

    def __init__(self, x2d: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None, dtype: torch.dtype,
                 peer: "RouterCasts | None" = None):
        kept_weight, kept_bias = (None, None) if peer is None else (peer.weight, peer.linear_bias)
        self.x = None if x2d.dtype == dtype else _shared(None, x2d, dtype)  # [M, K]
        self.weight = None if weight.dtype == dtype else _shared(kept_weight, weight, dtype)  # [E, K]
        self.linear_bias = (None if linear_bias is None or linear_bias.dtype == dtype
                            else _shared(kept_bias, linear_bias, dtype))  # [E]

    def __call__(self, x2d: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None) -> tuple:
        """(x, W, b) in the router dtype: the kept buffers, filled now, where a cast is needed."""
        gx = x2d if self.x is None else self.x.copy_(x2d)
        gw = weight if self.weight is None else self.weight.copy_(weight)
        return gx, gw, linear_bias if self.linear_bias is None else self.linear_bias.copy_(linear_bias)


def _shared(kept: torch.Tensor | None, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of t's shape in ``dtype`` on t's device: ``kept`` (a peer's) where it is one, else a new one."""
    if kept is not None and kept.shape == t.shape and kept.dtype == dtype and kept.device == t.device:
        return kept
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def _tensors(layer) -> tuple:
    """(gate weight, gate bias, correction bias, w13, w2, b13, b2) as forward reads them (``layer._param``): quantized
    experts (``MoE.quantize_``) are attributes, not Parameters."""
    gate = layer._modules["gate"]._parameters
    params = layer._parameters
    w13, w2 = params.get("w13"), params.get("w2")
    if w13 is None:
        d = layer.__dict__
        w13, w2 = d.get("w13"), d.get("w2")
    return (gate["weight"], gate.get("bias"), layer._buffers.get("e_score_correction_bias"), w13, w2,
            params.get("b13"), params.get("b2"))


def _objects(layer) -> tuple:
    """What else the forward's path depends on, compared by identity."""
    d = layer.__dict__
    return (d["_fused_router"], d["_gate_route"], d["_experts_fn"], d["_route_ws"], d["config"], d["capacity_factor"],
            d["fuse_shared"], d["_plain_routing"], d["eager_graphs"])


def run_experts(layer, entry, x2d: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, b13, b2):
    """[Experts] on a hit's routing (ids, weights [M, k(+S)]): ``entry.kept`` (the backend's kept call: what it relies
    on the caller checked), else ``entry.fast`` (the backend's fast path, its own checks), else or on their miss the
    layer's experts call; then the separate shared MLP (``with_shared``). -> out [M, K]"""
    kept, fast = entry.kept, entry.fast
    if kept is not None:
        out = kept(x2d, w13, w2, ids, weights, b13, b2)
    else:
        out = None if fast is None else fast(x2d, w13, w2, ids, weights, entry.activation, b13=b13, b2=b2)
    if out is None:
        out = layer._experts_call(layer._experts_fn, x2d, w13, w2, ids, weights, activation=entry.activation,
                                  b13=b13, b2=b2)
    return with_shared(layer, x2d, out)


def with_shared(layer, x2d: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, K] plus the separate shared MLP where the layer has one: ``MoE._experts_and_shared``'s own ops on the
    tensors it reads now (nothing of them is kept: a new, moved or updated one is read as the full forward reads it)."""
    params = layer._parameters
    shared_w13 = params.get("shared_w13")
    if shared_w13 is None:
        return out
    return out + shared_mlp(x2d, shared_w13, params["shared_w2"], layer._modules.get("shared_gate"), layer.config)


class KeptCalls:
    """A layer's kept decode calls by M and thread (``DecodeFast``'s, ``layer_hash_fast.HashDecodeFast``'s entries).
    By thread too since session 54: keyed by M alone, two request threads of a server calling one model in turn
    replaced each other's entry on every call (each call a miss: the full forward, then ``keep`` again; 0 hits in 12
    alternating calls at M = 1 under the interpreter, 10 of 12 after: each thread's first keeps). The key costs ~40
    ns of CPython a hit (a tuple: timeit on the 2-core CPU host, 66 -> 92-131 ns for the lookup and the thread
    compare it replaces). At most MAX_ENTRIES over all threads, the oldest going first."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict = {}  # (M, thread) -> the subclass's entry for that many rows on that thread

    @property
    def _entries(self) -> dict:
        """This thread's entries by M (a new dict of the kept entries: what tests and device checks read)."""
        me = get_ident()
        return {m: entry for (m, thread), entry in self._kept.items() if thread == me}

    def clear(self) -> None:
        self._kept.clear()


class DecodeFast(KeptCalls):
    """A layer's kept decode calls, one per M and thread (at most MAX_ROWS rows, MAX_ENTRIES kinds)."""

    __slots__ = ()

    def __call__(self, layer, x2d: torch.Tensor) -> torch.Tensor | None:
        """out [M, K] of a repeated decode call, or None (the caller runs the full forward). ``x2d``: what the caller
        was given (``MoE.forward`` tries this first): anything but a plain 2-D tensor of a kept kind misses here."""
        if _compiling() or x2d.__class__ is not torch.Tensor or x2d.dim() != 2:  # first: a trace never reads M here
            return None
        shape = x2d.shape
        entry = self._kept.get((shape[0], get_ident()))
        if entry is None or not ENABLED or _grad() or _dispatching() or _tracing() or _transforming():
            return None
        if (shape[1] != entry.hidden or x2d.dtype is not entry.dtype or x2d.get_device() != entry.device_index
                or not x2d.is_contiguous() or x2d.data_ptr() & 15):
            return None
        if entry.cuda and (_capturing() or current_stream() != entry.stream):
            return None
        weight, linear_bias, bias, w13, w2, b13, b2 = _tensors(layer)
        gate_ref, linear_ref, bias_ref, w13_ref, w2_ref, b13_ref, b2_ref = entry.refs
        if (gate_ref() is not weight or linear_ref() is not linear_bias or bias_ref() is not bias
                or w13_ref() is not w13 or w2_ref() is not w2 or b13_ref() is not b13 or b2_ref() is not b2):
            return None
        objects = _objects(layer)  # none of them a tensor: == is identity, else a value compare
        if objects != entry.objects or entry.specs != (_spec(weight), _spec(linear_bias), _spec(bias)):
            return None
        buffers, router = entry.buffers, objects[0]
        if bias is not None:
            router._check_bias(bias, entry.device)
        casts = entry.casts  # the gate reads its inputs in the router dtype (kept buffers filled here), the experts x2d
        gx, gweight, glinear = (x2d, weight, linear_bias) if casts is None else casts(x2d, weight, linear_bias)
        joint = entry.joint
        if joint is not None:  # the one launch and the experts' in one C call (no flag: the router asserts in its
            out = joint(x2d, w13, w2, buffers.ids, buffers.weights, b13, b2)  # kernel); None: they go one by one below
            if out is not None:  # the routed experts: the separate shared MLP after them, as run_experts adds it
                return with_shared(layer, x2d, out)
        bound = entry.bound
        if bound is not None:
            bound(gx, gweight, glinear, bias, None, buffers)
            ok = bound.ok
        elif gx.shape[0] <= MAX_TOKENS:  # a call the one launch does not take: MoE._gate (its kernel), the router
            layer._gate(gx, gweight, glinear, buffers.logits)
            ok = entry.route(buffers.logits, bias, None, (buffers.ids, buffers.weights))[2]
        else:  # MoE._gate's linear_into, then FusedRouter's eager launch
            if glinear is None:
                torch.mm(gx, gweight.t(), out=buffers.logits)
            else:
                torch.addmm(glinear, gx, gweight.t(), out=buffers.logits)
            ok = entry.route(buffers.logits, bias, None, (buffers.ids, buffers.weights))[2]
        if ok is not None:
            fused._assert_finite(ok, buffers.logits)
        return run_experts(layer, entry, x2d, w13, w2, buffers.ids, buffers.weights, b13, b2)

    def keep(self, layer, x2d: torch.Tensor) -> None:
        """Keep this call's kind, where the fast path can serve it (the full forward has just run it)."""
        m = x2d.shape[0]
        if (m > MAX_ROWS or not ENABLED or _grad() or _compiling() or layer.capacity_factor is not None
                or _transforming()):
            return
        c = layer.config
        if ((layer.shared_w13 is not None and c.shared_expert_combine == "router")  # Inkling's: weights the kept
                # buffers do not hold (its fused router is refused today: a guard for when it is not)
                or (layer.fuse_shared and layer.shared_gate is not None) or layer._gate_route is None):
            return
        tensors = _tensors(layer)
        weight, linear_bias, bias, w13, w2, b13, b2 = tensors
        fast = fast_path_of(layer._experts_fn)
        if not x2d.is_contiguous() or x2d.data_ptr() & 15 or w13 is None or w2 is None:
            return
        if x2d.is_cuda and _capturing():
            return
        dtype = router_dtype_of(weight, c.router_dtype)  # the logits' (as MoE._gate_inputs)
        casts = None
        cast = x2d.dtype != dtype or weight.dtype != dtype or (linear_bias is not None and linear_bias.dtype != dtype)
        stored = cast and m <= gate_route.ROWS and takes_stored(x2d, weight, linear_bias, dtype)
        if cast and not stored:  # the launch reads what it is given: the casts into kept buffers
            stream, thread = current_stream() if x2d.is_cuda else 0, get_ident()  # a peer's W buffer: same order
            peer = next((e.casts for e in self._kept.values()
                         if e.casts is not None and e.stream == stream and e.thread == thread), None)
            casts = RouterCasts(x2d, weight, linear_bias, dtype, peer)
        gx, gweight, glinear = (x2d, weight, linear_bias) if casts is None else casts(x2d, weight, linear_bias)
        append_shared = layer.fuse_shared  # capacity_factor is None: the kernel appends the shared slots
        buffers = layer._route_ws.get(x2d, c.num_experts, c.top_k + c.num_shared_slots * append_shared, dtype)
        if buffers is None:
            return
        router, bound, route = layer._fused_router, None, None
        if m <= gate_route.ROWS:
            bound = bound_launch(router, gx, gweight, glinear, bias, None, append_shared, buffers)
        if bound is None:  # above the one launch's rows, or a call it does not take (gate._applies)
            plan = router._plans[1 if append_shared else 0]
            if plan is None or layer._gate_mm is None or buffers.logits.dtype != dtype or stored:
                return  # stored: torch.mm would need the casts (a layout the kernels refuse: the full forward)
            route = fused.bound_route(plan, buffers.logits, bias, None, router.assert_in_kernel)
        keeper = keeper_of(layer._experts_fn)
        kept = None if keeper is None else keeper(x2d, w13, w2, buffers.ids, buffers.weights, c.activation, b13=b13,
                                                  b2=b2)
        joint = None  # the one launch joined to the kept call's batched launches, where both exist (no flag to read)
        if JOINED and bound is not None and bound.ok is None and hasattr(kept, "joined"):  # the gate reads x, else
            lead_x = LEAD_X if casts is None or casts.x is None else casts.x  # the kept cast, filled before the call
            joint = kept.joined(bound.launch, bound.pointers(lead_x, gweight, glinear, bias, None, buffers))
        entry = _Entry(layer, x2d, tensors, buffers, bound, route, fast, kept, joint, append_shared, casts)
        put_bounded(self._kept, (m, entry.thread), entry, MAX_ENTRIES)
