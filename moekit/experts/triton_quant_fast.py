"""The fast path of eager Triton experts calls on quantized weights (fp8_block off the Gluon path,
int8_w8a16, int4_w4a16, mxfp4): the bf16 path's lean machinery (``triton_fast``'s entries, ``triton_lean``'s
recorded launch sequences, ``triton_bind``'s raw launches) over ``moekit.quant``'s weight objects.

    key:   id(w13), id(w2) (the QuantizedWeight objects); x, ids, weights: shape, dtype, device; activation,
           options (as asked), thread
    entry: w13 and w2 (weakly) with each of their tensors' data_ptr (``state_reader``); the expert biases b13 / b2
           (``kept_biases``: weakly, with address, layout, device, version); the plan's launches
           recorded once as a LaunchSequence (weights, descriptors, pooled workspace, grids, scalars fixed; x,
           ids, weights, out and the regions allocated per call as stand-ins); the pool's generation, the
           CUDA stream, the epoch; whether ``check_experts_args`` passed on a call of this key
    a hit: what ``triton_fast.run_fast`` asks of a bf16 hit (eager, no autograd graph, x/ids/weights contiguous
           and 16-byte aligned, no capture, the same stream, the pool's buffers kept, no retune or clear since,
           no launch hook; fp8: the default Gluon choice the entry was kept under), the call's biases the entry's
           unchanged (bound into the sequence as the weights are: a new tensor, a move, an in-place update each
           misses), and every weight tensor at
           the address it had (a tensor replaced on the object, a move: each misses; an in-place update hits, as
           in the bf16 entries: the sequence holds addresses and descriptors, never values)
      -> out = empty_like(x), the sequence launched: the plain path's kernels, grids and arguments (bit-equal)

An entry is kept by ``run_quantized_triton`` after a plain call of the fused (non-Gluon) kernels with no expert map,
biases on the weight-only fused decodes (gpt-oss's; not the scratch decode) and the fused fp8 kernels (session 41), the
default fp8 choice, M >= 1;
the plain call compiled the launches, so the second call of a kind records and the third launches lean. A
weight-only call the Gluon path takes (``triton_gluon_wo.GLUON_WO_CELLS``) is kept the same way, from that path's
lean plan on its pool (``triton_gluon_wo_lean.wo_gluon_lean_inputs``: the GEMMs' TMA descriptors over the pooled
regions, recorded). The weight-only "scratch" decode (from SCRATCH_MIN_TOKENS, chunks of experts) is
kept too, from its plan (``triton_wo_scratch_plan``: the dequant and k-sum launches, chunk maps) on a kept scratch
buffer (``SCRATCH_WORKSPACES``; h and y with it up to 256 MiB, else per call); its decode choice is cached per kind
(``triton_wo_plan.chosen_decode``). Not kept: inference-mode weights (no version counter), calls whose plan has not
compiled. The weight-only plain path allocates its workspace per call; its lean calls take theirs from a reused pool
(``triton_wo.LEAN_WORKSPACES``), as the bf16 and fp8 eager paths do. A call the words decode's default runs
(``triton_wo_words_default``) is kept as a words entry, no recorded sequence: a hit launches the words decode's own
kept sequence (``triton_wo_words_lean.words_lean_call``, which asks what it recorded under; its miss is this path's
miss). ``clear_quant_fast``
(``triton.clear_launch_caches``, a retune) drops every entry; an entry goes when its w13 is freed.
"""

from __future__ import annotations

import threading
import weakref
from threading import get_ident

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import on_config_cache_clear
from moekit.experts.kept_biases import fits, keepable, kept_biases
from moekit.experts.triton_lean import LaunchSequence, _Slot, record_steps
from moekit.experts.triton_wo_words import WordsVariant
from moekit.quant import QuantizedWeight
from moekit.triton_bind import current_stream

X, IDS, WEIGHTS, OUT = range(4)  # the call's values; then one per region allocated per call (FRESH + i)
FRESH = 4
MAX_ENTRIES = 4096
_PLAIN = (torch.Tensor, torch.nn.Parameter)

_MEMO: dict[tuple, "QuantEntry"] = {}
_epoch = [0]
_lock = threading.Lock()
_dispatching = torch._C._len_torch_dispatch_stack
_tracing = torch._C._is_tracing
_transforming = torch._C._are_functorch_transforms_active
_grad = torch.is_grad_enabled


def clear_quant_fast() -> None:
    _epoch[0] += 1
    _MEMO.clear()


on_config_cache_clear(clear_quant_fast)  # a retune drops the plans: the entries hold their launches


class QuantEntry:
    """One kept call: its weight objects as they were, the recorded launches, what they were recorded under."""

    __slots__ = ("w13", "w2", "read", "state", "biases", "sequence", "fresh", "pool", "generation", "stream", "epoch",
                 "checked", "choice", "words")

    def __init__(self, w13_ref, w2, sequence: LaunchSequence | None, fresh, pool, stamp: tuple, stream, checked: bool,
                 choice, biases, words=None):
        self.words = words  # the words default's ``WordsVariant`` (sequence None: ``words_lean_call`` launches)
        self.biases = biases  # kept_biases' (None: the call had none); the sequence holds their addresses
        self.w13, self.w2, self.read = w13_ref, weakref.ref(w2), state_reader(w13_ref(), w2)
        self.state = self.read(w13_ref(), w2)
        self.sequence, self.fresh, self.pool, self.checked = sequence, fresh, pool, checked
        self.generation, self.epoch = stamp
        self.stream = stream
        # fp8: (triton_gluon_fp8, its DEFAULT_FP8_CHOICE then): the call stayed off the Gluon path under that
        # choice, so a new default (it may send this kind to Gluon) makes the entry stale; None: weight-only
        self.choice = choice


def _addresses_q_scale(w13, w2) -> tuple:  # fp8_block, int8_w8a16, mxfp4
    return w13.q.data_ptr(), w13.scale.data_ptr(), w2.q.data_ptr(), w2.scale.data_ptr()


def _addresses_q_scale_zero(w13, w2) -> tuple:  # int4_w4a16
    return (w13.q.data_ptr(), w13.scale.data_ptr(), w13.zero.data_ptr(), w2.q.data_ptr(), w2.scale.data_ptr(),
            w2.zero.data_ptr())


def _addresses(w13, w2) -> tuple:  # any other layout
    return tuple(getattr(w, name).data_ptr() for w in (w13, w2) for name in w.tensor_fields)


_ADDRESSES = {("q", "scale"): _addresses_q_scale, ("q", "scale", "zero"): _addresses_q_scale_zero}


def state_reader(w13: QuantizedWeight, w2: QuantizedWeight):
    """The function ``(w13, w2) -> tuple`` whose value a hit compares with the kept one: the address of each tensor
    of both weights (a tensor replaced on the object, a move), by one expression for their layout. Not the _version:
    nothing kept is derived from the values (as in the bf16 entries, ``triton_fast._weight_state``). Before: each
    tensor's id, _version and data_ptr in a loop over ``tensor_fields`` (H200 cProfile 3.4-5.3 µs a call, branch
    host7); with the stream and x's, ids' and weights' addresses read once and a batched sequence launched inline
    (``_launch``), host_rest -3 to -6 µs on the quantized cells (benchmarks/triton-notes.md, branch host8)."""
    fields = w13.tensor_fields
    return _ADDRESSES.get(fields, _addresses) if w2.tensor_fields == fields else _addresses


def _stream(device: torch.device):
    """The current stream (CUDA: the current device's, the one the launches take), else None."""
    return current_stream() if device.type == "cuda" else None


def run_quant_fast(x, w13, w2, ids, weights, activation, options, checked: bool, b13=None,
                   b2=None) -> torch.Tensor | None:
    """out [M, K] launched from the kept entry of this call, or None (a miss: the full path runs). Called
    by ``triton_fast.run_fast`` for weights that are not plain tensors; its eager/tracing tests have run."""
    if x.__class__ not in _PLAIN:  # w13 a QuantizedWeight: an entry's is (``entry.w13() is w13`` below)
        return None
    if _grad() and (x.requires_grad or weights.requires_grad):
        return None
    if not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous()):
        return None
    pointers = x.data_ptr(), ids.data_ptr(), weights.data_ptr()
    if (pointers[0] | pointers[1] | pointers[2]) & 15:
        return None
    entry = _MEMO.get((id(w13), id(w2), x.shape, ids.shape, weights.shape, x.dtype, ids.dtype, weights.dtype, x.device,
                       ids.device, weights.device, activation, options, get_ident()))
    if (entry is None or (checked and not entry.checked) or entry.epoch != _epoch[0] or entry.w13() is not w13
            or entry.w2() is not w2 or entry.generation != entry.pool.generation
            or entry.read(w13, w2) != entry.state):
        return None
    if (entry.biases is not None or b13 is not None or b2 is not None) and not fits(entry.biases, b13, b2):
        return None
    stream = None
    if entry.stream is not None:
        stream = _stream(x.device)
        if stream != entry.stream or torch._C._cuda_isCurrentStreamCapturing():
            return None
    if entry.choice is not None and entry.choice[0].DEFAULT_FP8_CHOICE is not entry.choice[1]:
        return None
    if entry.words is not None:  # the words default's call: its own kept sequence, its own checks (None: a miss)
        from moekit.experts.triton_wo_words_lean import words_lean_call

        from moekit.experts.triton_align import shortcut_allowed

        return words_lean_call(x, w13, w2, ids, weights, entry.words, b13, b2,
                               shortcut=shortcut_allowed(x.shape[0], options))
    sequence = entry.sequence
    if sequence.raw and not sequence.hooks.idle():
        return None
    return _launch(entry, x, ids, weights, stream, pointers)


def _launch(entry: QuantEntry, x, ids, weights, stream, pointers: tuple) -> torch.Tensor:
    """out [M, K]; ``stream``: the current stream (None off CUDA), ``pointers``: x's, ids' and weights' addresses."""
    out = torch.empty_like(x)  # [M, K]; x is contiguous here
    sequence, fresh = entry.sequence, entry.fresh
    if fresh is None:
        batch = sequence.batch
        if batch is not None:  # one C call: LaunchSequence.launch's, inline
            batch.launch_all(batch.blob, stream, *pointers, out)
        else:
            sequence.launch((x, ids, weights, out), stream)
        return out
    buffer = torch.empty(fresh.nbytes, dtype=torch.uint8, device=x.device)  # held until the launches are queued
    if sequence.addressed is not None:  # every launch raw: the regions as addresses
        base = buffer.data_ptr()
        regions = tuple(base + offset for offset in fresh.offsets)
    else:
        regions = tuple(fresh.carve(buffer).values())
    sequence.launch((x, ids, weights, out, *regions), stream)
    return out


def remember_quant(x, w13, w2, ids, weights, activation, options, checked: bool, b13=None, b2=None) -> None:
    """Keep the entry of a plain fused call that just ran (``run_quantized_triton``; no map or Gluon choice; biases
    ``kept_biases.keepable``), where the fast path could serve it and its launches have compiled."""
    if not options.fast_ready or torch.compiler.is_compiling() or _dispatching() or _tracing() or _transforming():
        return
    if x.__class__ not in _PLAIN or ids.numel() == 0 or x.shape[1] == 0:
        return
    if _grad() and (x.requires_grad or weights.requires_grad):
        return
    if (b13 is not None or b2 is not None) and not keepable(b13, b2):
        return
    if (not (x.is_contiguous() and ids.is_contiguous() and weights.is_contiguous())
            or (x.data_ptr() | ids.data_ptr() | weights.data_ptr()) & 15):
        return
    tensors = [getattr(w, name) for w in (w13, w2) for name in w.tensor_fields]
    if any(t.is_inference() or t.requires_grad for t in tensors):  # no version counter / an autograd graph
        return
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    inputs = _lean_inputs(x, w13, w2, ids, weights, activation, options, b13, b2)
    if inputs is None:
        return
    if isinstance(inputs, WordsVariant):  # the words default ran it (``wo_lean_inputs``)
        from moekit.experts.triton_wo import LEAN_WORKSPACES

        stamp = (LEAN_WORKSPACES.generation, _epoch[0])
        _keep(x, w13, w2, ids, weights, activation, options, (None, None), LEAN_WORKSPACES, stamp, checked,
              kept_biases(b13, b2), inputs)
        return
    plan, pool, make_launches = inputs
    for _ in range(2):  # again where the views grew the pool's buffer (a new generation) as they were carved
        stamp = (pool.generation, _epoch[0])  # before the views: a clear or a new buffer from here on makes it stale
        recorded = _record(plan.workspace, pool, x.device, make_launches)
        if recorded is None:
            return
        if pool.generation == stamp[0]:
            break
    _keep(x, w13, w2, ids, weights, activation, options, recorded, pool, stamp, checked, kept_biases(b13, b2))


def _lean_inputs(x, w13, w2, ids, weights, activation, options, b13, b2):
    """(plan, pool, launches(b, x, ids, weights, out)) of the scheme's plain path for this call, the words default's
    ``WordsVariant`` where it runs the call, or None."""
    from moekit.activations import plan_activation, spec_fields

    if w13.scheme == "fp8_block":
        from moekit.experts.triton_fp8 import fp8_lean_inputs

        return fp8_lean_inputs(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, tuple(w13.block_shape), options,
                               plan_activation(*spec_fields(activation)), b13, b2)
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import wo_lean_inputs

    return wo_lean_inputs(x, _wo(w13), _wo(w2), ids, weights, plan_activation(*spec_fields(activation)), options,
                          b13, b2)


def _record(spec, pool, device: torch.device, make_launches) -> tuple | None:
    """(sequence, the per-call regions' spec or None) of one plan on the pool's buffers; None while a
    launch has not compiled."""
    fresh = None
    if spec.nbytes > pool.max_bytes:  # the pool's policy: the alignment's regions kept, the rest per call
        parts = spec.parts()
        views, fresh = dict(pool.pooled(parts.pooled, device)), parts.fresh if parts.fresh.names else None
        views.update({name: _Slot(FRESH + i) for i, name in enumerate(parts.fresh.names)})
    else:
        views = pool.pooled(spec, device)
    recorded = record_steps(make_launches(views, _Slot(X), _Slot(IDS), _Slot(WEIGHTS), _Slot(OUT)))
    if recorded is None:
        return None
    steps, hooks = recorded
    return LaunchSequence(steps, hooks, None, None, None), fresh


def _keep(x, w13, w2, ids, weights, activation, options, recorded: tuple, pool, stamp: tuple, checked: bool,
          biases, words=None) -> None:
    key = (id(w13), id(w2), x.shape, ids.shape, weights.shape, x.dtype, ids.dtype, weights.dtype, x.device,
           ids.device, weights.device, activation, options, get_ident())

    def forget(ref: weakref.ref) -> None:  # w13 freed: its entry goes with it
        entry = _MEMO.get(key)
        if entry is not None and entry.w13 is ref:
            _MEMO.pop(key, None)

    sequence, fresh = recorded
    choice = None
    if w13.scheme == "fp8_block":
        import moekit.experts.triton_gluon_fp8 as gluon_fp8

        choice = (gluon_fp8, gluon_fp8.DEFAULT_FP8_CHOICE)
    entry = QuantEntry(weakref.ref(w13, forget), w2, sequence, fresh, pool, stamp, _stream(x.device), checked, choice,
                       biases, words)
    with _lock:
        _MEMO.pop(key, None)
        put_bounded(_MEMO, key, entry, MAX_ENTRIES)


def kept_entries() -> int:
    """How many calls are kept (for tests)."""
    return len(_MEMO)
