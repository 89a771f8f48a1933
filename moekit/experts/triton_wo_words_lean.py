"""The words decode's call as a plan, and its lean launch for repeated eager calls (decode "gluon_words", issue #16
target 1, session 46): what ``triton_wo_words.run_experts_words`` built on every call (the alignment's plan lookup
and fresh regions, x_words' buffers, h, y, five cached-launch lookups, each launch through ``BoundLaunch``) built
once per kind of call and, for a repeated eager call, recorded once as a ``triton_lean.LaunchSequence`` over a pooled
workspace (the pick's lean machinery: ``triton_quant_fast`` / ``triton_lean``).

    per kind of call (WordsPlan: shapes, dtypes, device, the weights' strides and scheme, AHEAD; no tensor held):
      the alignment's plan (None at the tiny-batch shortcut), the x reorder, the gate-up, the down GEMM (its split
      by ``down_split``) and the k-sum as BoundLaunches; the workspace's regions (alignment, xw, xs, h, y)
    per (w13.q, w2.q, x / ids shapes and dtypes, device, AHEAD, thread) (Kept; dropped by a retune or a clear):
      the launches recorded over the pool's views (``triton_lean.record_launches``), with what a hit compares: the
      weights' addresses (mxfp4: and its scales' versions, which ``check_mx_scales`` read), the pool's generation,
      the stream
    per call: out, the recorded launches with the call's x, ids, weights, out (one C call where all are raw)

Not lean (the plan's BoundLaunches on fresh regions, as before): while a CUDA graph captures (the graph owns its
buffers), before each launch has compiled once, with a Triton launch hook, above the pool's size, x / ids / weights
not 16-byte aligned (Triton specialises on it; the plan's launches were compiled for aligned pointers), or routed
weights not float32 (the down GEMM reads float32: a copy a call). Outputs equal the plain launches' bit for bit
(the same kernels, grids and arguments).

Shapes: M tokens, k slots, A = M*k, E experts, N intermediate, K hidden, R the alignment's rows.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.experts.triton_cache import WorkspaceSpec
from moekit.experts.triton_lean import IDS, OUT, WEIGHTS, X, _Slot, record_launches
from moekit.experts.triton_wo import LEAN_WORKSPACES
from moekit.experts.triton_wo_words import PLAIN, WordsVariant
from moekit.triton_bind import BoundLaunch, current_stream

MAX_KEPT = 1024  # kinds of call x weights kept; the oldest goes first
MAX_PLANS = 256
_PLANS: dict[tuple, "WordsPlan"] = {}  # by ``_plan_key``
_KEPT: dict[tuple, "Kept"] = {}  # by ``_key``
_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class WordsPlan:
    """What every words call of one kind launches with. Holds no tensor."""

    workspace: WorkspaceSpec  # the alignment's regions, xw [M, K'] x.dtype, xs [M, K' / 128] f32, h [A, N'], y [s A, K]
    align: object  # triton_align.AlignPlan, or None at the tiny-batch shortcut (the kernels read ids)
    x_words: BoundLaunch  # pointers: x, xw, xs
    gate_up: BoundLaunch  # xw, xs, q13, scale, zero, h, ids, sorted_ids, expert_ids, num_padded
    down: BoundLaunch  # h, q2, scale, zero, y, weights, ids, sorted_ids, expert_ids, num_padded
    k_sum: BoundLaunch  # y, ids, ids (no map), out


def _plan_key(x: torch.Tensor, w13, w2, ids: torch.Tensor, ahead: int, variant, shortcut: bool) -> tuple:
    return (x.shape, x.dtype, x.device, ids.shape, ids.dtype, tuple(w13.q.shape), w13.strides, w13.group_size,
            w13.scale.dtype, tuple(w2.q.shape), w2.strides, w2.group_size, w2.scale.dtype, ahead, variant, shortcut)


def words_plan(x: torch.Tensor, w13, w2, ids: torch.Tensor, ahead: int = 1,
               variant: WordsVariant = PLAIN, shortcut: bool = True) -> WordsPlan:
    """The plan of this call's kind (its checks passed: ``triton_wo_words.check_words`` / ``check_words_down``),
    built now if new; ``variant``: the epilogues' (``WordsVariant``); ``shortcut``: the tiny-batch shortcut where
    ``use_naive`` holds (False: aligned blocks there too)."""
    key = _plan_key(x, w13, w2, ids, ahead, variant, shortcut)
    plan = _PLANS.get(key)
    if plan is None:
        plan = put_bounded(_PLANS, key, _plan(*key), MAX_PLANS)
    return plan


def _plan(x_shape, x_dtype, device, ids_shape, ids_dtype, q13_shape, s13, g13, d13, q2_shape, s2, g2, d2,
          ahead: int, variant, shortcut: bool) -> WordsPlan:
    from moekit.experts._kernels.words_x import x_words_kernel
    from moekit.experts.triton_wo_words import (
        _align_plan, _down_bound, _gate_up_bound, _sum_bound, down_split, words_layout_naive, x_words_launch,
    )

    (m, k), top_k = x_shape, ids_shape[1]
    a, num_experts, n = m * top_k, q13_shape[0], q13_shape[1] // 2
    padded = 2 * q13_shape[2]  # the words' reduction: K, or the padded copy's K' (``triton_wo_words_pad``)
    naive = shortcut and words_layout_naive(a, num_experts)
    align = None if naive else _align_plan(a, num_experts, device)
    regions = [] if naive else list(align.regions)
    blocks = a if naive else dict((r[0], r[2]) for r in regions)["expert_ids"][0]
    split = down_split(2 * q2_shape[2], q2_shape[1], blocks)
    regions += [("xw", x_dtype, (m, padded)), ("xs", torch.float32, (m, padded // 128)), ("h", x_dtype, (a, n)),
                ("y", torch.float32 if split > 1 else x_dtype, (split * a, k))]
    mx13, mx2 = d13 == torch.uint8, d2 == torch.uint8  # e8m0 scales: mxfp4
    return WordsPlan(
        WorkspaceSpec.of(regions),
        align,
        x_words_launch(x_words_kernel, m, k, padded),
        _gate_up_bound(q13_shape, s13, g13, a, top_k, blocks, naive, 8, 4, True, 1, ahead, mx13, variant),
        _down_bound(q2_shape, s2, g2, a, blocks, naive, split, 8, 4, ahead, mx2, variant.b2),
        _sum_bound(m, k, top_k, num_experts, split, device))


def words_launches(plan: WordsPlan, b: dict, x, ids, weights, out, w13, w2, b13=None, b2=None) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment (none at the shortcut), x in the
    dot order, the gate-up storing h in it, the down GEMM, the k-sum. ``b``: the workspace's regions; x, ids
    (contiguous [M, k]: the kernels read it flat), weights (float32 [M, k]) and out may be stand-ins; b13 / b2
    (contiguous) where the plan's variant has them."""
    from moekit.experts.triton_align import align_launches

    launches, rows = [], (None, None, None)
    if plan.align is not None:
        launches = align_launches(plan.align, ids, ids, b)
        rows = (b["sorted_ids"], b["expert_ids"], b["num_padded"])
    return launches + [(plan.x_words, (x, b["xw"], b["xs"])),
                       (plan.gate_up, (b["xw"], b["xs"], w13.q, w13.scale, w13.zero, b["h"], ids, *rows, b13)),
                       (plan.down, (b["h"], w2.q, w2.scale, w2.zero, b["y"], weights, ids, *rows, b2)),
                       (plan.k_sum, (b["y"], ids, ids, out))]


class Kept:
    """One kept kind of call on one pair of weights: its recorded launches and what they were recorded under."""

    __slots__ = ("q13", "sequence", "state", "generation", "stream")

    def __init__(self, q13: torch.Tensor, sequence, state: tuple, generation: int, stream):
        self.q13 = weakref.ref(q13)  # the key's id(w13.q) is this tensor's
        self.sequence, self.state, self.generation, self.stream = sequence, state, generation, stream


def _key(x, w13, w2, ids, ahead: int, variant, shortcut: bool) -> tuple:
    return (id(w13.q), id(w2.q), x.shape, ids.shape, x.dtype, ids.dtype, x.device, ahead, variant, shortcut,
            threading.get_ident())


def _state(w13, w2, b13, b2) -> tuple:
    """What a kept sequence holds of the weights and biases: addresses (mxfp4 scales and biases: their versions too,
    what the checks read / what a bias update changes nowhere else)."""
    return (*weight_state(w13), *weight_state(w2), *((None,) if b13 is None else (b13.data_ptr(), b13._version)),
            *((None,) if b2 is None else (b2.data_ptr(), b2._version)))


def words_lean_call(x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor,
                    variant: WordsVariant = PLAIN, b13=None, b2=None, ahead: int = 1,
                    shortcut: bool = True) -> torch.Tensor | None:
    """out [M, K] launched from the kept entry of this call, or None (a miss: the caller checks the call and runs
    ``run_words``, which keeps it). An entry is kept only by a checked call (``run_experts_words``) whose plan's key
    holds what the checks read of the weights (shapes, strides, dtypes, groups: the same tensors at the same
    addresses here); a hit asks what ``triton_quant_fast`` asks: the weights' addresses (mxfp4: its scales'
    versions) unchanged, the pool's buffers kept, the same stream, no capture, no launch hook, x / ids / weights
    contiguous and 16-byte aligned, weights float32."""
    kept = _KEPT.get(_key(x, w13, w2, ids, ahead, variant, shortcut))
    if kept is None or kept.q13() is not w13.q or kept.generation != LEAN_WORKSPACES.generation:
        return None
    if weights.dtype is not torch.float32 or not (x.is_contiguous() and ids.is_contiguous() and
                                                  weights.is_contiguous()):
        return None
    if (x.data_ptr() | ids.data_ptr() | weights.data_ptr()) & 15 or kept.state != _state(w13, w2, b13, b2):
        return None
    stream = None
    if kept.stream is not None:
        stream = current_stream()
        if stream != kept.stream or _capturing_now():
            return None
    elif _capturing(x.device):  # (a CPU entry never is; the tests ask it here)
        return None
    sequence = kept.sequence
    if sequence.raw and not sequence.hooks.idle():
        return None
    out = torch.empty_like(x)  # [M, K]
    sequence.launch((x, ids, weights, out), stream)
    return out


def run_words(x: torch.Tensor, w13, w2, ids: torch.Tensor, weights: torch.Tensor, ahead: int = 1,
              variant: WordsVariant = PLAIN, b13=None, b2=None, shortcut: bool = True) -> torch.Tensor:
    """out [M, K] of a words call (checked by the caller; ids, weights, b13, b2 contiguous): recorded and kept where
    it can be lean (module doc), else the plan's launches on fresh regions."""
    if weights.dtype != torch.float32:
        weights = weights.float()  # the down GEMM's routed weights
    plan = words_plan(x, w13, w2, ids, ahead, variant, shortcut)
    out = torch.empty_like(x)  # [M, K]
    sequence = _record(plan, x, ids, weights, w13, w2, ahead, variant, b13, b2, shortcut)
    if sequence is not None:
        sequence.launch((x, ids, weights, out))
        return out
    b = plan.workspace.allocate(x.device)  # fresh: graph-safe, never aliased by what is returned
    for launch, pointers in words_launches(plan, b, x, ids, weights, out, w13, w2, b13, b2):
        launch(*pointers)
    return out


def _record(plan: WordsPlan, x, ids, weights, w13, w2, ahead: int, variant, b13, b2, shortcut: bool):
    """The plan's launches recorded over this thread's pooled workspace and kept for this call's key, or None where
    the call is not lean (module doc; a launch not compiled yet: this call compiles it)."""
    pool = LEAN_WORKSPACES
    if _capturing(x.device) or plan.workspace.nbytes > pool.max_bytes:
        return None
    if (x.data_ptr() | ids.data_ptr() | weights.data_ptr()) & 15 or weights.dtype != torch.float32:
        return None
    views = pool.pooled(plan.workspace, x.device)
    generation = pool.generation  # after the views: a buffer grown for them is the one recorded
    launches = words_launches(plan, views, _Slot(X), _Slot(IDS), _Slot(WEIGHTS), _Slot(OUT), w13, w2, b13, b2)
    sequence = record_launches(launches, views, None)
    if sequence is None or (sequence.raw and not sequence.hooks.idle()):
        return None
    stream = current_stream() if x.device.type == "cuda" else None
    with _lock:
        put_bounded(_KEPT, _key(x, w13, w2, ids, ahead, variant, shortcut),
                    Kept(w13.q, sequence, _state(w13, w2, b13, b2), generation, stream), MAX_KEPT)
    return sequence


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and _capturing_now()


def _capturing_now() -> bool:
    """Whether the current CUDA stream captures (``torch.cuda.is_current_stream_capturing`` without its Python)."""
    return torch._C._cuda_isCurrentStreamCapturing()


def weight_state(w) -> tuple:
    """What a recorded sequence holds of a weight: its tensors' addresses; mxfp4 also its scales' version (an
    in-place update is checked again: ``check_mx_scales``)."""
    if w.scale.dtype == torch.uint8:
        return w.q.data_ptr(), w.scale.data_ptr(), w.scale._version
    return w.q.data_ptr(), w.scale.data_ptr(), w.zero.data_ptr()


def clear_words_plans() -> None:
    """Drop every words plan, kept call and padded weight copy (``triton_wo.clear_launch_caches``)."""
    from moekit.experts.triton_wo_words_pad import clear_padded

    _PLANS.clear()
    _KEPT.clear()
    clear_padded()

