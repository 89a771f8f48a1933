"""One launch for a whole tiny-batch experts call (``_kernels/decode_one.py``): the host side.

    decode_one_refusal(call) -> None, or why the call does not fit (the caller falls back to the fused path)
    run_decode_one(x, w13, w2, ids, weights, config, options) -> out [M, K]: one launch, no host sync
    decode_one_torch(...) -> out: the torch twin (same slot loop, same roundings, float32 sums in slot order)

Wiring: ``LaunchOptions.decode_one`` (off by default until the H200 A/B picks cells): ``triton._fused`` sends
a call here when ``decode_one_refusal`` finds nothing (M*k <= SLOT_LIMIT among it).

The workspace (h [S, N], y [S, K] float32, int32 counters) is kept per (device, stream, kind of call): the
kernel leaves its counters at 0, so they need no reset between calls, eager or replayed in a CUDA graph. The
counters are regions of one zeroed arena per device, so a capture takes its region with no allocation and no
zeroing in the graph (h and y: the capture's own buffers). Two streams never share a region (their launches
would race on the counters); two graphs captured on one stream do, so replay them on one stream.

Shapes: M tokens, k slots, S = M*k, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec
from moekit.experts.triton_launch import LaunchOptions, cdiv, kernels, next_pow2, resolve_launch_options
from moekit.experts.triton_lean import IDS, OUT, W2, W13, WEIGHTS, X, _Slot, record_launches
from moekit.triton_bind import BoundLaunch, interpreting

SLOT_LIMIT = 16  # M*k at most: the ids of all slots are one [16] vector in every program
SPIN_LIMIT = 1 << 22  # acquire reads before a down tile gives up waiting (a bug: wrong output, not a hang)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DecodeOneConfig:
    """Tiles of the one-launch kernel (powers of two)."""

    block_n_up: int = 16  # gate-up: intermediate columns per program
    block_k_up: int = 512  # gate-up: hidden elements per step
    block_k_out: int = 16  # down: hidden rows (output columns) per program
    block_n_red: int = 256  # down: intermediate elements per step (the first step's w2 goes out before the wait)
    gemv: bool = True  # gate-up as a CUDA-core GEMV per slot; False: one tl.dot per expert over its slots
    num_warps: int = 4
    num_stages: int = 2
    ticket: bool = True  # False: the program id as logical id (an A/B of the ticket's cost; relies on dispatch order)
    down_tiles: int = 1  # consecutive down tiles per program, each step's loads issued before the step before it

    def __post_init__(self) -> None:
        if self.down_tiles < 1:
            raise ValueError(f"DecodeOneConfig.down_tiles must be >= 1, got {self.down_tiles}")
        for name in ("block_n_up", "block_k_up", "block_k_out", "block_n_red", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"DecodeOneConfig.{name} must be a power of two, got {value}")
        if not self.gemv and (self.block_n_up < 16 or self.block_k_up < 16):
            raise ValueError("DecodeOneConfig: the tl.dot gate-up (gemv=False) needs block_n_up and block_k_up >= 16, "
                             f"got {self.block_n_up}, {self.block_k_up}")


@functools.lru_cache(maxsize=256)
def default_config(n: int, k: int) -> DecodeOneConfig:
    """The heuristic tiles: gate-up [16, 512] steps; down programs of 4 tiles of 8 rows, N up to 1024 a step
    (168 registers at 4 warps on sm_90, the gate-up branch's: 3 programs per SM)."""
    return DecodeOneConfig(block_k_up=min(512, next_pow2(k)), block_k_out=8, block_n_red=min(1024, next_pow2(n)),
                           down_tiles=4)


@dataclass(frozen=True)
class DecodeOneChoice:
    """Where the ``triton`` backend runs a call as one launch by default (``LaunchOptions.decode_one_choice``): at
    most ``max_slots`` slots (M*k) and experts of at most ``max_expert_elems`` weight elements (3·N·K: short
    streams, where the two-launch path's ramp and drain cost most). Measured on the H200 (graph replay, bf16 and
    fp8_block alike): see benchmarks/triton-notes.md, issue 19 "one launch"."""

    max_slots: int = 0  # 0: never (until the H200 A/B)
    max_expert_elems: float = 0.0

    def wants(self, slots: int, inter: int, hidden: int) -> bool:
        return slots <= self.max_slots and 3.0 * inter * hidden <= self.max_expert_elems


DEFAULT_DECODE_ONE_CHOICE = DecodeOneChoice()


def decode_one_wanted(x, w2, ids, options: LaunchOptions) -> bool:
    """Whether this call should try the one launch: asked for (``options.decode_one``) or in the default choice's cells."""
    return options.decode_one or (options.decode_one_choice
                                  and DEFAULT_DECODE_ONE_CHOICE.wants(ids.numel(), w2.shape[2], x.shape[1]))


@dataclass
class DecodeOneWorkspace:
    h: torch.Tensor  # [S, N] the work dtype
    y: torch.Tensor  # [S, K] float32: each slot's weighted output, summed by the token's last slot
    counters: torch.Tensor  # int32 [2 + S_PAD + M*KT], all 0 between launches


# the per-device counter arena (4 MiB): a kind of call on a stream takes 2 + 16 + M*K/block_k_out ints of it, kept
# (a benchmark's short-lived timing streams each take their own); past it, calls get fresh zeroed counters
ARENA_INTS = 1 << 20
_WORKSPACES: dict[tuple, DecodeOneWorkspace] = {}
_LAUNCHES: dict[tuple, BoundLaunch] = {}
_ARENAS: dict[torch.device, torch.Tensor] = {}
_REGIONS: dict[tuple, int] = {}  # (device, stream, kind) -> offset of its counters in the arena
_ARENA_USED: dict[torch.device, int] = {}


def clear_decode_one() -> None:
    """Drop the kept workspaces and launches."""
    _WORKSPACES.clear()
    _LAUNCHES.clear()
    _ARENAS.clear()
    _REGIONS.clear()
    _ARENA_USED.clear()


def decode_one_refusal(x, w13, w2, topk_ids, expert_map=None, activation="silu", b13=None, b2=None,
                       max_slots: int = SLOT_LIMIT) -> str | None:
    """None when the one-launch kernel takes this call, else why not (arguments already checked)."""
    slots = topk_ids.numel()
    if not 0 < slots <= min(max_slots, SLOT_LIMIT):
        return f"M*k = {slots} slots, the one-launch kernel takes 1..{min(max_slots, SLOT_LIMIT)}"
    if expert_map is not None or b13 is not None or b2 is not None:
        return "an expert map or biases (not built into the one-launch kernel)"
    plain = activation == "silu" if isinstance(activation, str) else (
        isinstance(activation, ActivationSpec) and activation.plain and activation.name == "silu")
    if not plain:
        return f"activation {activation!r}: only plain gated silu"
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return f"dtypes x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: one of {DTYPES}, all equal"
    if type(w13) not in (torch.Tensor, torch.nn.Parameter) or type(w2) not in (torch.Tensor, torch.nn.Parameter):
        return "weights of a tensor subclass (quantized weights take their own path)"
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        return "x, w13 and w2 must be contiguous (the kernel reads them row-major)"
    if w13.shape[1] != 2 * w2.shape[2]:
        return f"w13 rows {w13.shape[1]} != 2N = {2 * w2.shape[2]} (gated only)"
    return None


def _slot_pad(slots: int) -> int:
    return max(16, next_pow2(slots))  # the tl.dot gate-up's row count, and the ids vector


def _counters(device: torch.device, key: tuple, size: int, capturing: bool) -> torch.Tensor:
    """int32 [size], all 0: a region of the device's counter arena kept for ``key`` (the kernel leaves it at 0).
    The arena is allocated (zeroed) on the first call outside a capture; a capture before that, or a full arena,
    gets fresh zeros (the zeroing then part of the graph)."""
    arena = _ARENAS.get(device)
    if arena is None and not capturing:
        arena = _ARENAS[device] = torch.zeros(ARENA_INTS, device=device, dtype=torch.int32)
    if arena is not None:
        offset = _REGIONS.get(key)
        if offset is None and _ARENA_USED.get(device, 0) + size <= ARENA_INTS:
            offset = _REGIONS[key] = _ARENA_USED.get(device, 0)
            _ARENA_USED[device] = offset + -(-size // 4) * 4  # regions start 16-byte aligned (Triton specialises)
        if offset is not None:
            return arena[offset:offset + size]
    return torch.zeros(size, device=device, dtype=torch.int32)


def workspace(x, slots: int, n: int, k: int, config: DecodeOneConfig, h_dtype=None) -> DecodeOneWorkspace:
    """The kept workspace of this kind of call on the current stream (h in ``h_dtype``, default the work dtype)."""
    work = h_dtype or (torch.float32 if interpreting() else x.dtype)
    size = 2 + _slot_pad(slots) + x.shape[0] * cdiv(k, config.block_k_out)
    capturing = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0
    key = (x.device, stream, slots, n, k, work, size)
    ws = None if capturing else _WORKSPACES.get(key)
    if ws is None:
        ws = DecodeOneWorkspace(torch.empty(slots, n, device=x.device, dtype=work),
                                torch.empty(slots, k, device=x.device, dtype=torch.float32),
                                _counters(x.device, key, size, capturing))
        if not capturing:
            _WORKSPACES[key] = ws
    return ws


def launch_key(x, weight_tensors: tuple, ids, weights) -> tuple:
    """What a bound launch was compiled for beyond shapes and tiles: dtypes and 16-byte alignment of the call's
    own tensors (the workspace's are always aligned)."""
    tensors = (x, *weight_tensors, ids, weights)
    return x.device, tuple(t.dtype for t in tensors), tuple(t.data_ptr() & 15 for t in tensors)


def _launch(x, w13, w2, ids, weights, config: DecodeOneConfig, options: LaunchOptions) -> BoundLaunch:
    num_experts, _, k = w13.shape
    n, slots, top_k = w13.shape[1] // 2, ids.numel(), ids.shape[1]
    key = (slots, top_k, num_experts, n, k, launch_key(x, (w13, w2), ids, weights), config, options)
    launch = _LAUNCHES.get(key)
    if launch is None:
        grid = slots * cdiv(n, config.block_n_up) + slots * cdiv(cdiv(k, config.block_k_out), config.down_tiles)
        launch = BoundLaunch(
            kernels("decode_one").decode_one_kernel, (grid,), 9, (n, k, num_experts, slots, top_k),
            S_PAD=_slot_pad(slots), BN_UP=config.block_n_up, BK_UP=config.block_k_up, BK_OUT=config.block_k_out,
            BN_RED=config.block_n_red, GEMV=config.gemv, UPCAST=interpreting(), SPIN_LIMIT=SPIN_LIMIT,
            TICKET=config.ticket, DOWN_TILES=config.down_tiles,
            num_warps=config.num_warps, num_stages=config.num_stages, cached=options.cached_launcher,
            raw=options.raw_launcher, **options.pdl_kwargs())
        _LAUNCHES[key] = launch
    return launch


def run_decode_one(x, w13, w2, topk_ids, topk_weights, config: DecodeOneConfig | None = None,
                   options: LaunchOptions = LaunchOptions()) -> torch.Tensor:
    """out [M, K] in one launch. The call must fit (``decode_one_refusal`` is None); ids and weights
    contiguous [M, k]."""
    return run_and_record(x, w13, w2, topk_ids, topk_weights, config, options, record=False)[0]


def run_and_record(x, w13, w2, topk_ids, topk_weights, config: DecodeOneConfig | None, options: LaunchOptions,
                   record: bool) -> tuple:
    """(out, the launch as a ``triton_lean.LaunchSequence`` or None): with ``record`` (an eager call outside a
    capture, its launch compiled) the sequence that repeats it, for the backend's fast path (``triton_fast``:
    it holds the workspace's addresses, which live until ``triton.clear_launch_caches``, which drops it too)."""
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()
    slots, n, k = ids.numel(), w2.shape[2], x.shape[1]
    config = config or default_config(n, k)
    options = resolve_launch_options(options, x.device)
    ws = workspace(x, slots, n, k, config)
    out = torch.empty_like(x)
    launch = _launch(x, w13, w2, ids, weights, config, options)
    launch(x, w13, w2, ids, weights, ws.h, ws.y, out, ws.counters)
    if not record or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return out, None
    stand_ins = (_Slot(X), _Slot(W13), _Slot(W2), _Slot(IDS), _Slot(WEIGHTS), ws.h, ws.y, _Slot(OUT), ws.counters)
    return out, record_launches([(launch, stand_ins)], {"h": ws.h}, None)


def decode_one_torch(x, w13, w2, topk_ids, topk_weights, h_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The kernel's twin: per slot h = silu(x w_g^T) * (x w_u^T) (float32, rounded to ``h_dtype``, default
    x's), y = weight * (h w2^T) in float32; out[t] = y[t*k] + ... + y[t*k + k - 1] in slot order, in x's dtype.
    Slots whose id is outside [0, E) add nothing."""
    num_experts, n = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    ids, weights = topk_ids.reshape(-1).tolist(), topk_weights.reshape(-1).float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for s, e in enumerate(ids):
        if not 0 <= e < num_experts:
            continue
        xt = x[s // top_k].float()
        gate, up = w13[e, :n].float() @ xt, w13[e, n:].float() @ xt
        h = (torch.nn.functional.silu(gate) * up).to(h_dtype or x.dtype).float()
        out[s // top_k] += weights[s] * (w2[e].float() @ h)
    return out.to(x.dtype)
