"""The per-call fast path of an eager Triton experts call: what a repeated call of one kind with one
weight set needs is kept once, found by a key of cheap attributes, so that the call skips the argument
check, the plan lookup, the workspace, descriptor and sequence lookups and goes straight to its launches.

    key:   id(w13), id(w2); x, ids, weights: shape, dtype, device; activation, options (as asked), thread
    entry: w13 and w2 (weakly) with their data_ptr, shape, strides and dtype when kept; the expert biases b13 /
           b2 (``kept_biases``: weakly, with their address, layout, device and version); the plan; its
           recorded LaunchSequence (``triton_lean``); the pool's generation; the CUDA stream; the epoch;
           whether ``check_experts_args`` passed on a call of this key
    a hit: nothing traces and autograd needs no graph (``triton._runs_directly``'s rules); x, ids and
           weights contiguous and 16-byte aligned; the entry's weights are these ones at the same addresses
           and layout (a new tensor, ``.data`` swapped, a move: each misses; an in-place update hits, since
           the sequence holds addresses and descriptors, never values: the kernels read the new ones); no
           graph capture, the same stream, the pool's buffers not replaced, no retune or cache clear since;
           no Triton launch hook
      -> out = empty_like(x), the sequence launched: the same launches with the same arguments as the full
         path (outputs equal bit for bit); the biases fill the sequence's B13 / B2 slots. A call's biases must be
         the entry's, unchanged (a new tensor, a move, an in-place update each misses: ``kept_biases``); the
         activation spec (gpt-oss's clamped, interleaved SwiGLU too) is in the key.

Calls on quantized weights (``moekit.quant`` objects) go to their own entries (``triton_quant_fast``).
Anything else misses and runs the full path (``triton.fused_experts``), which keeps an entry when its
call launched lean. Only calls without an expert map are kept (biases: plain, contiguous, not inference-mode
ones), and never weights that are views
(transformers' transposed storage, a new view per call: never the same object twice); the others take the
full path.
A public ``experts_triton`` call skips its check only on an entry whose check passed (a call through
``experts_triton_unchecked`` vouches for nothing). ``clear_fast`` (``triton.clear_launch_caches``, a
retune) drops every entry; an entry goes when its w13 is freed.
"""

from __future__ import annotations

import threading
import weakref
from threading import get_ident

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import on_config_cache_clear
from moekit.experts.kept_biases import fits, keepable, kept_biases
from moekit.batch_launch import Batch
from moekit.experts.triton_lean import MAP, X, LaunchSequence, _Slot, launch_lean, record_steps
from moekit.experts.triton_plan import Plan
from moekit.experts.triton_quant_fast import run_quant_fast
import moekit.triton_bind as triton_bind
from moekit.triton_bind import LEAD_AUX, LEAD_X, current_stream

MAX_ENTRIES = 4096  # (weights, kind of call, thread) kept; the oldest goes first
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_MEMO: dict[tuple, "FastEntry"] = {}
_epoch = [0]  # moves on every clear: an entry from before is never used
_lock = threading.Lock()
# A hit reads the current stream and x's, ids' and weights' addresses once and hands them to the launches (before:
# the stream once for its check, on x's device, and once more in ``LaunchSequence.launch``; the addresses once for
# the alignment check and once more there). H200, the call with no-op launches (host_pyhost_device_check, medians of
# 3 interleaved rounds, raw/NVIDIA_H200-2026-12-03-26f5379-pyhost.*): Qwen3 bf16 M = 1 20.6 -> 19.6 µs, 4096 24.1 ->
# 22.1, 16384 24.2 -> 23.2, fp8 4096 34.6 -> 31.1 (M = 1024, DeepSeek-V3 4096: rounds 13-29 µs either way); outputs
# bit-equal. False: the reads of before (that script's A/B only).
READ_ONCE = True


def clear_fast() -> None:
    _epoch[0] += 1
    _MEMO.clear()


on_config_cache_clear(clear_fast)  # a retune drops the plans: the entries hold them


class FastEntry:
    """One kept call: its weights as they were, its plan and sequence, and what they were recorded under."""

    __slots__ = ("w13", "w2", "state", "biases", "plan", "sequence", "generation", "stream", "epoch", "checked")

    def __init__(self, w13_ref, w2, plan: Plan, sequence: LaunchSequence, stamp: tuple, stream, checked: bool,
                 biases):
        self.w13, self.w2, self.state = w13_ref, weakref.ref(w2), _weight_state(w13_ref(), w2)
        self.biases = biases  # kept_biases' (None: the call had none)
        self.plan, self.sequence, self.stream, self.checked = plan, sequence, stream, checked
        self.generation, self.epoch = stamp


def fast_stamp(pool) -> tuple:
    """(the pool's generation, the epoch), read before a sequence is looked up: an entry built from it is
    stale if either moved in between (a clear, a new buffer), and the next call then keeps it again."""
    return pool.generation, _epoch[0]


def _weight_state(w13, w2) -> tuple:
    """What a kept call's plan and sequence assumed of the weights besides their identity: an address (a
    move, ``.data`` swapped), shapes, strides and dtypes (``.data`` swapped for another view of the same
    memory). Not the ``_version``: nothing kept is derived from the values (``triton_cache.WeightDescriptors``)."""
    return (w13.data_ptr(), w2.data_ptr(), w13.shape, w2.shape, w13.stride(), w2.stride(), w13.dtype, w2.dtype)


def _key(x, w13, w2, ids, weights, activation, options) -> tuple:
    return (id(w13), id(w2), x.shape, ids.shape, weights.shape, x.dtype, ids.dtype, weights.dtype, x.device,
            ids.device, weights.device, activation, options, get_ident())


_dispatching = torch._C._len_torch_dispatch_stack
_tracing = torch._C._is_tracing
_transforming = torch._C._are_functorch_transforms_active
_grad = torch.is_grad_enabled


def _call_fits(x, w13, w2, ids, weights) -> bool:
    """What a call must be for the fast path whatever is kept: eager, no autograd graph, plain tensors,
    x, ids and weights contiguous and 16-byte aligned (what their plan was built for). ``run_fast`` has it
    inline (a function call is host time)."""
    if _dispatching() or _tracing() or _transforming():
        return False
    if x.__class__ not in _PLAIN or w13.__class__ not in _PLAIN or w2.__class__ not in _PLAIN:  # quantized, subclasses
        return False
    if _grad() and (x.requires_grad or w13.requires_grad or w2.requires_grad or weights.requires_grad):
        return False
    return (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()
            and not (x.data_ptr() | ids.data_ptr() | weights.data_ptr()) & 15)


def _stream(device: torch.device):
    """The current stream (CUDA: the current device's, the one the launches take), else None."""
    return current_stream() if device.type == "cuda" else None


def run_fast(pool, x, w13, w2, ids, weights, activation, options, checked: bool, b13=None,
             b2=None) -> torch.Tensor | None:
    """out [M, K] launched from the kept entry of this call, or None (a miss: run the full path).
    ``checked``: the caller skips ``check_experts_args`` on a hit, so only an entry that passed it serves.
    ``b13`` [E, 2N] / ``b2`` [E, K]: the call's expert biases (the entry's, unchanged, or a miss)."""
    if torch.compiler.is_compiling() or not options.fast_ready:
        return None
    # _call_fits, inline
    if _dispatching() or _tracing() or _transforming():
        return None
    if x.__class__ not in _PLAIN or w13.__class__ not in _PLAIN or w2.__class__ not in _PLAIN:  # quantized, subclasses
        return run_quant_fast(x, w13, w2, ids, weights, activation, options, checked, b13, b2)
    if _grad() and (x.requires_grad or w13.requires_grad or w2.requires_grad or weights.requires_grad):
        return None
    if not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
        return None
    pointers = x.data_ptr(), ids.data_ptr(), weights.data_ptr()
    if (pointers[0] | pointers[1] | pointers[2]) & 15:
        return None
    entry = _MEMO.get((id(w13), id(w2), x.shape, ids.shape, weights.shape, x.dtype, ids.dtype, weights.dtype, x.device,
                       ids.device, weights.device, activation, options, get_ident()))  # _key, inline
    if (entry is None or (checked and not entry.checked) or entry.epoch != _epoch[0] or entry.w13() is not w13
            or entry.w2() is not w2 or entry.generation != pool.generation or entry.state != _weight_state(w13, w2)):
        return None
    if (entry.biases is not None or b13 is not None or b2 is not None) and not fits(entry.biases, b13, b2):
        return None
    stream = None
    if entry.stream is not None:
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = current_stream()
        if stream != entry.stream:
            return None
    sequence = entry.sequence
    if sequence.raw and not sequence.hooks.idle():
        return None
    batch = sequence.batch
    if batch is not None and sequence.large is None:  # one C call (``triton_lean.BATCHED``): launch_lean's, inline
        out = torch.empty_like(x)  # [M, K]
        batch.launch_all(batch.blob, stream, *pointers, out, None, b13, b2, w13, w2)
        return out
    if not READ_ONCE:
        return launch_lean(sequence, x, ids, weights, None, b13, b2, w13, w2)
    # the launches take addresses where every one is raw (``LaunchSequence.addressed``): these ones, read above
    return launch_lean(sequence, x, ids, weights, None, b13, b2, w13, w2, stream,
                       pointers if sequence.addressed is not None and triton_bind.PASS_ADDRESSES else None)


class KeptCall:
    """One kind of call kept for a caller that checks on every call what ``run_fast`` checks before its lookup
    (``moekit.layer_fast``): no tracing, dispatch mode or functorch transform, no autograd graph, not compiling,
    no graph capture, the stream and thread of ``keep_call``'s, x contiguous and 16-byte aligned in the kept
    shape and dtype, ids and weights the same contiguous aligned buffers, w13, w2, b13 and b2 the kept tensors
    (the biases None or not as kept). It holds the kind's key and the entry last found under it; a call checks only
    what can move under such a caller: the entry superseded (a clear, the pool's buffers replaced), the weights moved
    or ``.data`` swapped, a bias moved or updated in place (``kept_biases``), a launch hook. Where the entry fails,
    or none was kept yet (the full path keeps one once its kernels are compiled), it looks the key up again; None
    where that fails too (the caller runs the full path)."""

    __slots__ = ("key", "entry", "pool", "stream")

    def __init__(self, key: tuple, pool, stream) -> None:
        self.key, self.entry, self.pool, self.stream = key, None, pool, stream

    def __call__(self, x, w13, w2, ids, weights, b13=None, b2=None) -> torch.Tensor | None:
        sequence = self.sequence(w13, w2, b13, b2)
        return None if sequence is None else launch_lean(sequence, x, ids, weights, None, b13, b2, w13, w2)

    def sequence(self, w13, w2, b13=None, b2=None) -> LaunchSequence | None:
        """The kept entry's sequence where it still serves this call (see the class), else None."""
        entry = self.entry
        if (entry is None or entry.epoch != _epoch[0] or entry.generation != self.pool.generation
                or entry.state != _weight_state(w13, w2)
                or ((entry.biases is not None or b13 is not None or b2 is not None)
                    and not fits(entry.biases, b13, b2))):
            entry = _MEMO.get(self.key)
            if (entry is None or entry.epoch != _epoch[0] or entry.generation != self.pool.generation
                    or entry.w13() is not w13 or entry.w2() is not w2 or entry.stream != self.stream
                    or entry.state != _weight_state(w13, w2) or not fits(entry.biases, b13, b2)):
                return None
            self.entry = entry
        sequence = entry.sequence
        return None if sequence.raw and not sequence.hooks.idle() else sequence

    def joined(self, launch, pointers: tuple, then: tuple = ()) -> "JointCall":
        """This call with ``launch`` (a ``BoundLaunch`` whose ``pointers`` are fixed but for x, ``LEAD_X``) before its
        launches, in the one C call of a batched sequence (``moekit.layer_fast``: the gate + router launch); ``then``:
        more (launch, pointers) after it, in order, whose pointers may hold ``LEAD_AUX`` too (``layer_hash_fast``: the
        gate, then the hash router reading the call's token ids)."""
        return JointCall(self, ((launch, pointers), *then))


class JointCall:
    """A ``KeptCall`` whose launches follow lead launches in one C call (``batch_launch.Batch``): the leads' steps
    recorded once, joined to the kept entry's sequence (again whenever the entry's sequence is another object). A call
    returns out [M, K], or None where the sequence is not batched (a step not raw, no C module, workspace allocated per
    call) or the kept call misses: the caller then launches the leads and the kept call itself. ``aux`` (a call's
    tensor a lead reads, ``LEAD_AUX``) travels in the expert map's slot, which a kept call never fills (it keeps only
    calls without a map)."""

    __slots__ = ("kept", "leads", "sequence", "batch")

    def __init__(self, kept: KeptCall, leads: tuple) -> None:
        self.kept, self.sequence, self.batch = kept, None, None
        slots = {id(LEAD_X): _Slot(X), id(LEAD_AUX): _Slot(MAP)}
        self.leads = [(launch, tuple(slots.get(id(p), p) for p in pointers)) for launch, pointers in leads]

    def __call__(self, x, w13, w2, ids, weights, b13=None, b2=None, aux=None) -> torch.Tensor | None:
        sequence = self.kept.sequence(w13, w2, b13, b2)
        if sequence is None or sequence.batch is None or sequence.large is not None:
            return None
        if sequence is not self.sequence:
            leads = record_steps(self.leads)
            self.sequence = sequence
            self.batch = None if leads is None else Batch.of(leads[0] + sequence.steps)
        batch = self.batch
        if batch is None:
            return None
        out = torch.empty_like(x)  # [M, K]
        batch.launch_all(batch.blob, self.kept.stream, x, ids, weights, out, aux, b13, b2, w13, w2)
        return out


def keep_call(pool, x, w13, w2, ids, weights, activation, options, b13=None, b2=None) -> KeptCall | None:
    """This kind of call's ``KeptCall`` (its entry found on first use), or None where the fast path never serves it."""
    if not options.fast_ready or not _call_fits(x, w13, w2, ids, weights) or not keepable(b13, b2):
        return None
    return KeptCall(_key(x, w13, w2, ids, weights, activation, options), pool, _stream(x.device))


def remember(stamp: tuple, x, w13, w2, ids, weights, activation, options, plan: Plan, sequence: LaunchSequence,
             checked: bool, b13=None, b2=None) -> None:
    """Keep the entry of a call that just launched lean from ``sequence`` (the full path's), where the
    fast path could serve it (``_call_fits``, ``kept_biases.keepable``; the caller passes only calls without a map).
    ``stamp``: ``fast_stamp`` of the pool, read before the sequence was looked up."""
    if torch.compiler.is_compiling() or not _call_fits(x, w13, w2, ids, weights) or not keepable(b13, b2):
        return
    if w13._base is not None or w2._base is not None:  # a view (transformers' transposed storage) is made anew
        return  # per call: an entry would never serve, only churn
    key = _key(x, w13, w2, ids, weights, activation, options)

    def forget(ref: weakref.ref) -> None:  # w13 freed: its entry goes with it
        entry = _MEMO.get(key)
        if entry is not None and entry.w13 is ref:
            _MEMO.pop(key, None)

    entry = FastEntry(weakref.ref(w13, forget), w2, plan, sequence, stamp, _stream(x.device), checked,
                      kept_biases(b13, b2))
    with _lock:
        _MEMO.pop(key, None)
        put_bounded(_MEMO, key, entry, MAX_ENTRIES)
