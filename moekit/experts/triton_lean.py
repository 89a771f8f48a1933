"""The lean launch of an eager Triton experts call (``LaunchOptions.lean_launch``): a plan's launches
recorded once as a ``LaunchSequence``, so that a call only fills in its own tensors and launches.

    per (plan, thread, weights with TMA descriptors; dropped when that w13 is freed):
    plan_launches(stand-ins) --record--> LaunchSequence: for each launch the entry it is called through
    and its full argument list, with the positions of the call's tensors (x, ids, weights, out, map,
    biases, weights without descriptors; h and y above the pool's size)
    per call: pooled workspace and descriptors still the recorded ones? -> fill the positions, launch

What a recorded argument list holds besides the call's tensors: grids, scalars and constexprs (the
plan's), the workspace's regions and the folded k-sum's counters (the pool's, kept by it: a sequence
records them weakly and is rebuilt when the pool hands out other ones), the TMA descriptors' expansions
(a weight's, rebuilt when ``WeightDescriptors`` builds new ones: a new tensor, an in-place update, a
move). Where a launch goes through the C launch under Triton 3.6's launcher (``triton_bind.RawLaunch``)
the sequence calls that C function itself: the stream asked once per call instead of once per launch,
the fixed regions passed as addresses (no ``data_ptr`` call per launch), no per-launch Python layer.
Elsewhere (another Triton, the interpreter) it calls the launch's compiled launcher with the full list,
the same arguments a ``BoundLaunch`` passes. Above the pool's ``max_bytes`` h and y are one fresh byte
buffer per call (``WorkspaceSpec.parts``), passed as two addresses in it (views under the interpreter).

Nothing changes in what runs: the same kernels, grids and arguments as the plan's ``BoundLaunch`` calls
(the tests compare outputs bit for bit). Not used while a CUDA graph captures, with a caller's counters,
with ``poison_workspace``, while a Triton launch hook is installed, or before each launch has been
compiled once (the first call of a plan goes through the ``BoundLaunch`` calls, which compile).
"""

from __future__ import annotations

import threading
import weakref

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import on_config_cache_clear
from moekit.experts.triton_plan import Plan, plan_launches
from moekit.batch_launch import Batch
import moekit.triton_bind as triton_bind
from moekit.triton_bind import current_stream

X, IDS, WEIGHTS, OUT, MAP, B13, B2, W13, W2, H, Y = range(11)  # what a call fills in: its values' order
MAX_SEQUENCES = 4096  # (plan, thread, weights) kept; the oldest goes first
# Where every launch of a sequence is raw, the call's tensors go to the C launch as their addresses, read once
# per call (``triton_bind.PASS_ADDRESSES``, the one switch for both: at M = 512 a call hands eleven pointers
# to five launches, each a data_ptr and a cuPointerGetAttribute in Triton's launcher otherwise).
# Where every launch is raw, the whole sequence in one call into C (``batch_launch.Batch``): the call's values
# written into the launches' recorded parameters there, then every cuLaunchKernelEx, instead of a Python argument
# list and a C launch per launch (H200, session 24: host 3-9 µs lower a call, bit-equal at every cell). Read when a
# sequence is recorded (``clear_launch_caches`` after a switch); a sequence the module refuses, or a machine where it
# cannot be built, launches step by step. False: launch by launch (the A/B of
# ``f6f35e93:benchmarks/host6_device_check.py``).
BATCHED = True


class _Slot:
    """A stand-in for one of the call's values while a sequence is recorded."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class LaunchSequence:
    """The recorded launches of one plan with one workspace and one descriptor pair."""

    __slots__ = ("steps", "raw", "hooks", "anchor", "pair", "large", "owner", "addressed", "batch")

    def __init__(self, steps: list, hooks, anchor, pair, large):
        self.steps = steps  # [(entry, template list, ((position, value index), ...), raw)]
        self.raw = any(step[3] for step in steps)  # some launch takes the stream: asked once per call
        # every launch raw: the value indices its launches read, handed over as addresses (triton_bind.PASS_ADDRESSES)
        self.addressed = (tuple(sorted({index for step in steps for _, index in step[2]}))
                          if steps and all(step[3] for step in steps) else None)
        self.hooks = hooks  # Triton's launch hooks (a raw launch is taken only while none is installed)
        self.anchor = anchor  # weakref to the first pooled region recorded (None: no pooled region)
        self.pair = pair  # weakref to the descriptor pair recorded (None: pointer loads)
        self.large = large  # WorkspaceSpec of h and y, allocated per call; None when pooled
        self.owner = None  # with a pair: weakref to the w13 it was recorded for (its entry goes when w13 does)
        # every launch raw: one C call (built only while BATCHED: a sequence recorded before a switch keeps its way)
        self.batch = Batch.of(steps) if BATCHED and self.addressed is not None else None

    def current(self, views: dict, pair) -> bool:
        """Whether the pool's ``views`` and the descriptor ``pair`` are the ones recorded."""
        if self.anchor is not None and self.anchor() is not next(iter(views.values())):
            return False
        return (pair is None) if self.pair is None else self.pair() is pair

    def launch(self, values: tuple, stream: int | None = None) -> None:
        """Every launch, with the call's ``values`` (X, IDS, ... Y) in their positions; ``stream``: the current
        stream where the caller has read it (``triton_fast.run_fast``: one read a call), else read here."""
        if not self.raw:
            stream = 0
        elif stream is None:
            stream = current_stream()
        batch = self.batch
        if batch is not None:  # it reads a tensor's data_ptr itself
            batch.launch_all(batch.blob, stream, *values)
            return
        if self.addressed is not None and triton_bind.PASS_ADDRESSES:
            values = list(values)
            for index in self.addressed:
                value = values[index]
                if value is not None and value.__class__ is not int:
                    values[index] = value.data_ptr()
        for entry, template, slots, raw in self.steps:
            args = template.copy()  # per call: a sequence is shared by whoever runs its plan on this thread
            for position, index in slots:
                args[position] = values[index]
            if raw:
                args[3] = stream
            entry(*args)


_SEQUENCES: dict[tuple, LaunchSequence] = {}
_lock = threading.Lock()
on_config_cache_clear(_SEQUENCES.clear)  # a retune drops the plans, so their sequences too


def clear_sequences() -> None:
    _SEQUENCES.clear()


def lean_sequence(plan: Plan, pool, descriptors, device, w13, w2, expert_map, b13, b2) -> LaunchSequence | None:
    """The plan's sequence for these weights on this thread, recorded now if the kept one is stale; None
    where the lean launch does not apply (a graph capture, a launch not compiled yet, a launch hook; the
    caller then runs the ``BoundLaunch`` calls). ``pool``: the workspaces (``WorkspacePool``),
    ``descriptors``: the weights' (``WeightDescriptors``)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    spec = plan.workspace
    large = spec.nbytes > pool.max_bytes
    views = pool.pooled(spec.parts().pooled if large else spec, device)
    pair = None if plan.descriptor_key is None else descriptors.get(w13, w2, plan.descriptor_key)
    # per weight set where the sequence holds the weights' descriptors: the layers of a model share a plan
    # (same shapes) but not their descriptors, and one sequence per plan was re-recorded on every call
    key = (plan, threading.get_ident(), None if pair is None else id(w13))
    sequence = _SEQUENCES.get(key)
    if sequence is None or not sequence.current(views, pair):
        sequence = _record(plan, views, pair, spec.parts().fresh if large else None, expert_map, b13, b2)
        if sequence is None:
            return None
        # the sequence holds the descriptors (so w13's storage) where there are any: it goes when w13 is freed
        keep_sequence(_SEQUENCES, _lock, key, sequence, MAX_SEQUENCES, w13 if pair is not None else None)
    if sequence.raw and not sequence.hooks.idle():
        return None
    return sequence


def keep_sequence(store: dict, lock, key: tuple, sequence: LaunchSequence, limit: int, owner=None) -> None:
    """Keep ``sequence`` under ``key`` in ``store`` (at most ``limit`` entries, the oldest goes first); with
    ``owner`` (the weight tensor whose descriptors it holds) the entry goes when ``owner`` is freed."""
    if owner is not None:
        sequence.owner = weakref.ref(owner, _forget(store, key))
    with lock:
        store.pop(key, None)
        put_bounded(store, key, sequence, limit)


def _forget(store: dict, key: tuple):
    """The callback of a sequence's ``owner``: its entry goes (unless a newer sequence holds the key)."""

    def forget(ref: weakref.ref) -> None:
        sequence = store.get(key)
        if sequence is not None and sequence.owner is ref:
            store.pop(key, None)

    return forget


def launch_lean(sequence: LaunchSequence, x, ids, weights, expert_map, b13, b2, w13, w2,
                stream: int | None = None, pointers: tuple | None = None) -> torch.Tensor:
    """out [M, K] (fresh), launched from ``sequence`` (``lean_sequence``'s, still current); ``stream``: the
    current stream where the caller has read it (``LaunchSequence.launch``); ``pointers``: x's, ids' and weights'
    addresses where the caller has read them and the sequence takes addresses (``LaunchSequence.addressed``)."""
    out = torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)  # [M, K]
    buffer = h = y = None
    if sequence.large is not None:  # one fresh byte buffer, held until the launches are queued
        buffer = torch.empty(sequence.large.nbytes, dtype=torch.uint8, device=x.device)
        h, y = _large_regions(sequence.large, buffer, sequence.raw)
    if pointers is not None:
        x, ids, weights = pointers
    sequence.launch((x, ids, weights, out, expert_map, b13, b2, w13, w2, h, y), stream)
    del buffer  # freed in stream order: the caching allocator hands it to later work on this stream only
    return out


def _large_regions(large, buffer: torch.Tensor, raw: bool) -> tuple:
    """h and y of one call in ``buffer``: addresses for the C launch, else views."""
    if raw:
        base = buffer.data_ptr()
        return base + large.offsets[large.names.index("h")], base + large.offsets[large.names.index("y")]
    views = large.carve(buffer)
    return views["h"], views["y"]


def _record(plan: Plan, views: dict, pair, large, expert_map, b13, b2) -> LaunchSequence | None:
    """The plan's launches as a sequence, or None while one of them has not been compiled yet (or never
    keeps a compiled launcher: ``cached_launcher`` off, an asynchronous compile)."""
    b = dict(views)
    if large is not None:
        b["h"], b["y"] = _Slot(H), _Slot(Y)
    if pair is None:
        w13_arg, up_arg, w2_arg = _Slot(W13), None, _Slot(W2)
    else:
        w13_arg, up_arg, w2_arg = pair.w13, pair.w13_up, pair.w2
    ids = _Slot(IDS)
    launches = plan_launches(plan, b, _Slot(X), w13_arg, up_arg, w2_arg, None if b13 is None else _Slot(B13),
                             None if b2 is None else _Slot(B2), ids, _Slot(WEIGHTS),
                             None if expert_map is None else _Slot(MAP), _Slot(OUT), views.get("counters"))
    return record_launches(launches, views, pair, large)


def record_launches(launches: list, views: dict, pair, large=None) -> LaunchSequence | None:
    """``launches`` ([(BoundLaunch, pointers)], the call's values as ``_Slot`` stand-ins) as a sequence, or None
    while one of them has not been compiled yet. ``views``: the pooled regions they read (the first is the
    sequence's anchor), ``pair``: the weight descriptors they hold (or None). The Gluon paths' lean launch
    (``triton_gluon_lean``) records theirs here."""
    recorded = record_steps(launches)
    if recorded is None:
        return None
    steps, hooks = recorded
    anchor = weakref.ref(next(iter(views.values()))) if views else None
    return LaunchSequence(steps, hooks, anchor, None if pair is None else weakref.ref(pair), large)


def record_steps(launches: list) -> tuple[list, object] | None:
    """``launches`` ((BoundLaunch, pointers) in order, stand-ins among the pointers) as a sequence's steps,
    with Triton's launch hooks where a step is raw; None while one of them has not been compiled yet (or
    never keeps a compiled launcher). Shared by the quantized paths' sequences (``triton_quant_fast``)."""
    steps, hooks = [], None
    for launch, pointers in launches:
        raw_launch = launch._raw
        if raw_launch is not None:
            hooks = raw_launch.hooks
            grid = raw_launch.grid
            expanded = raw_launch._expanded(pointers) if raw_launch.desc_positions else list(pointers)
            template = [grid[0], grid[1], grid[2], 0, raw_launch.function, raw_launch.cooperative, raw_launch.pdl,
                        None, None, raw_launch.metadata, None, None, None,
                        *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expanded), *launch.tail]
            entry, raw = raw_launch.c_launch, True
        elif launch._launcher is not None:
            template, entry, raw = [*pointers, *launch.tail], launch._launcher, False
        else:
            return None
        slots = tuple((i, a.index) for i, a in enumerate(template) if a.__class__ is _Slot)
        steps.append((entry, template, slots, raw))
    return steps, hooks
