"""``HashMoE``'s decode fast path: a repeated eager forward of up to ``layer_fast.MAX_ROWS`` tokens with the one-launch
hash router (``routing.hash_fused``) goes straight to its launches, past forward's argument checks (tried first, as
``MoE.forward`` tries ``layer_fast``), ``route_tokens``, the router's checks and bind lookup and the experts step's
generic code.

    first call of a kind (M rows; x's dtype, device, stream, thread; token_ids' shape, dtype, stride and alignment;
      the layer's weights, table and routers): the full forward, then ``HashDecodeFast.keep``: the gate kernel's bound
      launch (``gate.bound_gate``, up to its 8 rows) and logits [M, E] of its own, the router's bound launch
      (``FusedHashRouter.bind``), ids / weights buffers [M, k(+S)] of its own, the experts backend's kept call or
      fast path (as ``layer_fast``)
    a repeated call that fits the kept entry:
      [Gate: the kept gate launch (above 8 rows ``MoE._gate``, F.linear), as the full forward runs it] -> [Route: the
      bound launch into the kept buffers; its two checks the compiled kernel's device-side asserts (interpreted: its
      flags, checked as the router checks them)] -> [Experts, + the separate shared MLP: ``layer_fast.run_experts``];
      where the kept call's launches are batched (a GPU; ``layer_fast.JOINED``) and the gate is the kernel, the gate,
      the router (the call's token ids in its aux slot) and the experts' launches in one C call
      (``triton_fast.JointCall``), as the top-k layer's gate + router launch joins them

What a hit checks (else the full forward runs, whose checks raise on bad input): ``layer_fast``'s call conditions (no
autograd, compiling, tracing, dispatch mode, functorch transform or CUDA graph capture; x a plain 2-D tensor [M, K],
contiguous, 16-byte aligned, of the entry's dtype and device, on its stream and thread); token_ids a plain tensor of
shape [M] with the entry's dtype and stride on x's device, aligned as then (the bound launch's key); the table
(``tid2eid``) the same tensor at the same address, shape and strides (the launch binds V and its row stride; its values
are read per call: ``load_table_`` in place is served, checked there); the gate weight and bias, w13, w2, b13, b2 the
same tensors, the gate's at the same address, shape, strides and dtype (the gate launch's key); the hash router, gate
function, experts function, config, capacity factor (None), fuse_shared and shared gate the same objects. A token id
outside [0, V) or a non-finite logit still raises: the kernel's device-side asserts on the GPU (or its flags, asserted,
with ``FusedHashRouter(assert_in_kernel=False)``), the twin's errors on the CPU. Outputs are the full forward's bit for
bit: the same gate launch, the same route launch with the same arguments, the same experts.

A router dtype other than x's (a float32 gate weight in a bf16 layer, ``router_dtype="float32"``) is kept where the
gate kernel reads x and the gate weights as stored for float32 logits (``gate.takes_stored``, as the full forward's
``gate.gate_inputs``; session 51, fix51), and above the kernel's 8 rows (``MoE._gate`` casts them as the full forward
does); with ``gate.READ_STORED`` off the full forward gives the kernel casts, and such a call is not kept.

Not kept: the torch router (``router="torch"``, or "auto" off CUDA), capacity dropping, a gated shared expert in fused
slots, input-weighted experts, an eager-graph layer, a subclass that routes or places the experts itself
(``OffloadedHashMoE``, ``EPHashMoE``). A move or cast drops the entries (``MoE._weights_changed``).

Shapes: M tokens, K hidden, E experts, k + S slots, V table rows.
"""

from __future__ import annotations

import weakref
from threading import get_ident

import torch

import moekit.layer_fast as layer_fast
from moekit._bounded import put_bounded
from moekit.experts import fast_path_of, keeper_of
from moekit.layer_fast import _capturing, _compiling, _dispatching, _grad, _ref, _spec, _tracing, _transforming
from moekit.routing.gate import MAX_TOKENS as GATE_ROWS, bound_gate, router_dtype_of, takes_stored
from moekit.routing.hash_fused import assert_flags
from moekit.triton_bind import LEAD_AUX, LEAD_X, current_stream, interpreting


class _Entry:
    """One kept kind of hash decode call."""

    __slots__ = ("hidden", "dtype", "device_index", "stream", "thread", "ids_shape", "ids_dtype", "ids_stride",
                 "ids_aligned", "table", "table_spec", "refs", "gate_specs", "objects", "gate", "logits", "launch",
                 "ok", "flag_arg", "flags", "rows", "ids", "weights", "kept", "fast", "joint", "activation", "cuda")

    def __init__(self, layer, x2d: torch.Tensor, token_ids: torch.Tensor, table: torch.Tensor, tensors: tuple,
                 gate, logits, bound, kept, fast, joint, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.hidden, self.dtype, self.device_index, self.cuda = x2d.shape[1], x2d.dtype, x2d.get_device(), x2d.is_cuda
        self.stream = current_stream() if self.cuda else 0
        self.thread = get_ident()
        self.ids_shape, self.ids_dtype = token_ids.shape, token_ids.dtype  # [M]
        self.ids_stride, self.ids_aligned = token_ids.stride(), _aligned(token_ids)
        self.table, self.table_spec, self.rows = weakref.ref(table), _spec(table), table.shape[0]
        self.refs = tuple(_ref(t) for t in tensors)  # gate weight, gate bias, w13, w2, b13, b2
        self.gate_specs = (_spec(tensors[0]), _spec(tensors[1]))  # what the bound gate launch specialised on
        self.objects = _objects(layer)
        # the gate kernel's bound launch and its logits [M, E] (up to gate.MAX_TOKENS rows), else None: MoE._gate
        self.gate, self.logits = gate, logits
        self.launch, self.ok = bound.launch, bound.ok  # ok [2] int32: the kernel's flags, None: asserted in it
        self.flag_arg = ids if bound.ok is None else bound.ok  # the launch's sixth pointer (unread when asserting)
        # the flags' two asserts without indexing each call; on the CPU (or interpreted) the router's own check
        self.flags = (bound.ok[0], bound.ok[1]) if bound.ok is not None and self.cuda and not interpreting() else None
        self.ids, self.weights = ids, weights  # [M, k(+S)] int32 / fp32, this entry's own
        self.kept, self.fast, self.activation = kept, fast, layer.config.activation
        self.joint = joint  # the gate, the router and the kept call in one C call (``KeptCall.joined``), else None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _tensors(layer) -> tuple:
    """(gate weight, gate bias, w13, w2, b13, b2) as forward reads them (``layer_fast._tensors`` less the correction
    bias, which a layer the hash router computes has none of)."""
    t = layer_fast._tensors(layer)
    return t[0], t[1], *t[3:]


def _objects(layer) -> tuple:
    """What else the forward's path depends on, compared by identity (none a tensor)."""
    d = layer.__dict__
    return (d["_hash_router"], d["_hash_cuda_only"], d["_gate_fn"], d["_experts_fn"], d["config"],
            d["capacity_factor"], d["fuse_shared"], layer._modules.get("shared_gate"), d["eager_graphs"])


class HashDecodeFast(layer_fast.KeptCalls):
    """A ``HashMoE``'s kept decode calls, one per M and thread (at most ``layer_fast.MAX_ROWS`` rows, ``MAX_ENTRIES``
    kinds)."""

    __slots__ = ()

    def __call__(self, layer, x2d, token_ids) -> torch.Tensor | None:
        """out [M, K] of a repeated decode call, or None (the caller runs the full forward). ``x2d``, ``token_ids``:
        what ``HashMoE.forward`` was given (it tries this first) or made of it: anything but a plain [M, K] tensor and
        plain [M] ids of a kept kind misses here."""
        if (_compiling() or x2d.__class__ is not torch.Tensor or token_ids.__class__ is not torch.Tensor
                or x2d.dim() != 2):  # first: a trace never reads M here
            return None
        shape = x2d.shape
        entry = self._kept.get((shape[0], get_ident()))
        if entry is None or not layer_fast.ENABLED or _grad() or _dispatching() or _tracing() or _transforming():
            return None
        if (shape[1] != entry.hidden or x2d.dtype is not entry.dtype or x2d.get_device() != entry.device_index
                or not x2d.is_contiguous() or x2d.data_ptr() & 15
                or token_ids.shape != entry.ids_shape or token_ids.dtype is not entry.ids_dtype
                or token_ids.get_device() != entry.device_index or token_ids.stride() != entry.ids_stride
                or _aligned(token_ids) != entry.ids_aligned):
            return None
        if entry.cuda and (_capturing() or current_stream() != entry.stream):
            return None
        table = layer._buffers["tid2eid"]
        if entry.table() is not table or _spec(table) != entry.table_spec:
            return None
        weight, linear_bias, w13, w2, b13, b2 = _tensors(layer)
        gate_ref, linear_ref, w13_ref, w2_ref, b13_ref, b2_ref = entry.refs
        if (gate_ref() is not weight or linear_ref() is not linear_bias or w13_ref() is not w13 or w2_ref() is not w2
                or b13_ref() is not b13 or b2_ref() is not b2 or _objects(layer) != entry.objects
                or entry.gate_specs != (_spec(weight), _spec(linear_bias))):
            return None
        joint = entry.joint
        if joint is not None:  # the gate, the router and the experts in one C call; None: one by one below
            out = joint(x2d, w13, w2, entry.ids, entry.weights, b13, b2, token_ids)
            if out is not None:
                return layer_fast.with_shared(layer, x2d, out)
        gate = entry.gate
        if gate is not None:  # MoE._gate's kernel launch, into the entry's logits
            logits = gate(x2d, weight, linear_bias, entry.logits)  # [M, E]
        else:  # above the kernel's rows: MoE._gate as the full forward runs it (F.linear)
            logits = layer._gate(x2d, weight, linear_bias, None)  # [M, E]
        entry.launch(logits, token_ids, table, entry.ids, entry.weights, entry.flag_arg)
        if entry.flags is not None:  # FusedHashRouter's asserts on views made once
            torch._assert_async(entry.flags[0], "router_logits contains NaN or infinite values")
            torch._assert_async(entry.flags[1], "token_ids outside [0, hash_table_size)")
        elif entry.ok is not None:  # the CPU (interpreted): the twin's errors
            assert_flags(entry.ok, logits, token_ids, entry.rows)
        return layer_fast.run_experts(layer, entry, x2d, w13, w2, entry.ids, entry.weights, b13, b2)

    def keep(self, layer, x2d: torch.Tensor, token_ids, logits: torch.Tensor) -> None:
        """Keep this call's kind, where the fast path can serve it (the full forward has just run it on ``logits``)."""
        m, c = x2d.shape[0], layer.config
        if (m > layer_fast.MAX_ROWS or not m or not layer_fast.ENABLED or _grad() or _compiling() or _transforming()
                or layer.capacity_factor is not None or layer._hash_router is None or layer.eager_graphs is not None
                or (layer._hash_cuda_only and not x2d.is_cuda) or c.expert_weight_on != "output"
                or not layer._plain_hash or c.num_identity_experts
                or (layer.fuse_shared and layer.shared_gate is not None)
                or (layer.shared_w13 is not None and c.shared_expert_combine == "router")
                or not isinstance(token_ids, torch.Tensor)
                or not x2d.is_contiguous() or x2d.data_ptr() & 15 or (x2d.is_cuda and _capturing())):
            return
        tensors = _tensors(layer)
        weight, linear_bias, w13, w2, b13, b2 = tensors
        dtype = router_dtype_of(weight, c.router_dtype)  # the logits' (MoE._gate's)
        if logits.dtype != dtype or w13 is None or w2 is None:
            return
        gate = None  # the gate kernel where MoE._gate took it (its rows, a kind of call it applies to)
        if layer._gate_fn is not None and m <= GATE_ROWS:
            if not takes_stored(x2d, weight, linear_bias, dtype):  # the full forward gave the kernel casts: not kept
                return
            gate = bound_gate(x2d, weight, linear_bias, dtype)
        kept_logits = None if gate is None else torch.empty_like(logits)  # [M, E], the gate kernel's out
        table = layer._buffers["tid2eid"]
        bound = layer._hash_router.bind(logits if kept_logits is None else kept_logits, token_ids, table,
                                        layer.fuse_shared)
        if bound is None:
            return
        ids = torch.empty(bound.shape, dtype=torch.int32, device=x2d.device)  # [M, k(+S)]
        weights = torch.empty(bound.shape, dtype=torch.float32, device=x2d.device)  # [M, k(+S)]
        keeper = keeper_of(layer._experts_fn)
        kept = None if keeper is None else keeper(x2d, w13, w2, ids, weights, c.activation, b13=b13, b2=b2)
        joint = None  # where the router asserts in its kernel (no flag to read after it) and the gate is the kernel
        if layer_fast.JOINED and gate is not None and bound.ok is None and hasattr(kept, "joined"):
            gate_bias = weight if linear_bias is None else linear_bias  # the gate launch's third pointer
            joint = kept.joined(gate.launch, (LEAD_X, weight, gate_bias, kept_logits),
                                ((bound.launch, (kept_logits, LEAD_AUX, table, ids, weights, ids)),))
        entry = _Entry(layer, x2d, token_ids, table, tensors, gate, kept_logits, bound, kept,
                       fast_path_of(layer._experts_fn), joint, ids, weights)
        put_bounded(self._kept, (m, entry.thread), entry, layer_fast.MAX_ENTRIES)
