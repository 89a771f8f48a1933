"""A decode call (M*k <= 16 slots) as ONE persistent Gluon kernel (Hopper; ``_kernels/gluon_decode.py``).

``experts_gluon_decode`` launches it: the gate-up GEMM with SiLU-and-mul, the down GEMM with the routed weight and
the ordered sum over each token's k slots, one launch, no memset (its counters reset themselves), no host sync.
``decode_twin`` computes the same function along the same tile schedule (``DecodePlan``) in torch: the oracle of
the CPU tests (Gluon does not run in the interpreter) and of the device check. ``decode_unfit`` says why a call
cannot take the kernel. Not a default: a variant of ``benchmarks/m1_device_check.py`` until the H200 says so.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

import torch

from moekit.experts.triton_cache import WeightDescriptors
from moekit.quant.fp8_block import Fp8BlockWeight
from moekit.triton_bind import BoundLaunch

MAX_SLOTS = 16  # M*k at most (the h / y scratch rows, the up_done counters)
MAX_TOKENS = 8  # M at most: x's rows are the wgmma's N = XR = 8 columns
XR = 8  # x / h rows as the narrow B operand ([BK, XR]), zero-padded
BM = 64  # weight rows per tile (the wgmma's M: one warpgroup)
SHARED_BYTES = 227 * 1024
_KERNEL = "moekit.experts._kernels.gluon_decode"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class DecodePlan:
    """The tile schedule of one call: S slots, experts N wide, hidden K; BK the reduction step, ``stages`` ring
    stages of two [BM, BK] weight tiles; ``grid`` programs (at most the SMs). Tiles 0 .. S*NB*KS-1 are gate-up tiles
    (slot, BM rows of N, one of ``split`` = KS pieces along K), then S*KB down tiles (slot, BM rows of K); program
    p takes p, p + grid, ..."""

    slots: int
    top_k: int
    inter: int  # N
    hidden: int  # K
    block_k: int
    stages: int
    grid: int
    split: int = 1  # KS
    fp8: bool = False  # e4m3 weights, x and h (``_kernels/gluon_decode_fp8.py``): 1-byte tiles, float32 scales

    @property
    def up_blocks(self) -> int:  # NB
        return self.inter // BM

    @property
    def down_blocks(self) -> int:  # KB
        return self.hidden // BM

    @property
    def num_tiles(self) -> int:
        return self.slots * (self.up_blocks * self.split + self.down_blocks)

    def tile(self, t: int) -> tuple[bool, int, int, int]:
        """Tile id -> (gate-up?, slot, row block, K piece): the kernel's ``_slot_tile``."""
        per = self.up_blocks * self.split
        if t < self.slots * per:
            return True, t // per, t % per // self.split, t % per % self.split
        d = t - self.slots * per
        return False, d // self.down_blocks, d % self.down_blocks, 0

    def program_tiles(self, p: int) -> list[tuple[bool, int, int, int]]:
        return [self.tile(t) for t in range(p, self.num_tiles, self.grid)]

    def ring_steps(self, p: int) -> int:
        """Ring stages program p's loader fills (and its MMA partition drains): K/(BK KS) per gate-up tile, N/(2 BK)
        per down tile."""
        return sum(self.hidden // self.block_k // self.split if up else self.inter // (2 * self.block_k)
                   for up, _, _, _ in self.program_tiles(p))

    @property
    def h_rows(self) -> int:
        """HR: the staged h rows (all S slots, zero-padded), the down MMAs' B operand width."""
        return 8 if self.slots <= 8 else 16

    def shared_bytes(self) -> int:
        """x (XR rows of K) + h (HR rows of N) + the ring (fp8: 1-byte elements; the scales live in registers), its
        barriers, and 512 B for the compiler's scratch (the reductions' and atomics' broadcasts: 92 B in the sm_90
        builds of Triton 3.6 and 3.9)."""
        rows = XR * self.hidden + self.h_rows * self.inter
        return (1 if self.fp8 else 2) * (rows + self.stages * 2 * BM * self.block_k) + 8 * 2 * self.stages + 512


def plan_decode(num_tokens: int, top_k: int, inter: int, hidden: int, num_programs: int, block_k: int = 128,
                stages: int = 0, split: int = 1, fp8: bool = False) -> DecodePlan:
    """The plan for M tokens of k slots on ``num_programs`` SMs; ``stages`` 0: as many as shared memory holds;
    ``split``: gate-up tiles in that many pieces along K (1, 2, 4)."""
    slots = num_tokens * top_k
    if slots > MAX_SLOTS or num_tokens > MAX_TOKENS:
        raise ValueError(f"M={num_tokens}, k={top_k}: M*k <= {MAX_SLOTS} and M <= {MAX_TOKENS} for the decode kernel")
    if split not in (1, 2, 4):
        raise ValueError(f"split={split} (1, 2 or 4)")
    if fp8 and block_k != 128:
        raise ValueError(f"block_k={block_k}: fp8_block steps are one 128-column scale block")
    if inter % (2 * block_k) or hidden % (block_k * split) or inter % BM or hidden % BM:
        raise ValueError(f"N={inter}, K={hidden}: N a multiple of {2 * block_k} and K of {max(block_k * split, BM)}")
    probe = DecodePlan(slots, top_k, inter, hidden, block_k, 1, 1, split, fp8)
    fit = (SHARED_BYTES - probe.shared_bytes()) // ((1 if fp8 else 2) * 2 * BM * block_k + 16) + 1
    stages = stages or fit
    if stages < 2 or stages > fit:
        raise ValueError(f"stages={stages}: 2 .. {fit} fit {SHARED_BYTES} B of shared memory at N={inter}, K={hidden}")
    plan = DecodePlan(slots, top_k, inter, hidden, block_k, stages, 1, split, fp8)
    grid = max(1, min(num_programs, plan.num_tiles))
    return DecodePlan(slots, top_k, inter, hidden, block_k, stages, grid, split, fp8)


def decode_unfit(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, expert_map=None, b13=None, b2=None,
                 activation="silu") -> str | None:
    """Why the decode kernel cannot take this call (None when it can)."""
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return "quantized weights (bf16 / fp16 tensors only)"
    if x.dtype not in (torch.bfloat16, torch.float16) or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return f"dtypes x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype} (one of bf16 / fp16)"
    if expert_map is not None or b13 is not None or b2 is not None or activation != "silu":
        return "expert map, biases or an activation other than plain gated silu"
    if not (x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()):
        return "strided x or weights"
    if x.data_ptr() % 16 or w13.data_ptr() % 16 or w2.data_ptr() % 16:
        return "x or weights not 16-byte aligned (TMA)"
    m, k = topk_ids.shape
    if m * k > MAX_SLOTS or m > MAX_TOKENS:
        return f"M={m}, k={k}: more than {MAX_SLOTS} slots or {MAX_TOKENS} tokens"
    hidden, inter = w2.shape[1], w2.shape[2]
    if inter % 256 or hidden % 128:
        return f"N={inter} (a multiple of 256), K={hidden} (of 128)"
    return None


_scratch: dict[tuple, tuple] = {}
_lock = threading.Lock()


def decode_scratch(device: torch.device, dtype: torch.dtype, inter: int, hidden: int) -> tuple:
    """(h [16, N], y [16, K] float32, part [16, N/BM, 4, 2, BM] float32, up_done [16], piece [16, N/BM],
    arrive [8, K/BM], exit [1]) kept per (device, dtype, N, K): the counters zeroed once (the kernel leaves them
    at 0). One call in flight per device at a time (a stream's order)."""
    key = (device, dtype, inter, hidden)
    with _lock:
        if key not in _scratch:
            nb, kb = inter // BM, hidden // BM
            counters = torch.zeros(MAX_SLOTS * (1 + nb) + MAX_TOKENS * kb + 1, dtype=torch.int32, device=device)
            _scratch[key] = (torch.empty(MAX_SLOTS, inter, dtype=dtype, device=device),
                             torch.empty(MAX_SLOTS, hidden, dtype=torch.float32, device=device),
                             torch.empty(MAX_SLOTS * inter * 4 * 2, dtype=torch.float32, device=device),
                             counters[:MAX_SLOTS], counters[MAX_SLOTS:MAX_SLOTS * (1 + nb)],
                             counters[MAX_SLOTS * (1 + nb):-1], counters[-1:])
        return _scratch[key]


@dataclass
class _Kept:
    """What a kind of call (device, dtype, M, k, E, N, K, tile) keeps: its bound launch and scratch."""

    launch: BoundLaunch
    scratch: tuple  # decode_scratch's (h, y, part, up_done, piece, arrive, exit)


_KEPT: dict[tuple, _Kept] = {}
_DESCRIPTORS = WeightDescriptors()


def _weight_descriptors(w13: torch.Tensor, w2: torch.Tensor, key: tuple) -> tuple:
    from moekit.experts.triton_gluon_launch import gluon_descriptor

    return gluon_descriptor(w13.view(-1, w13.shape[2]), [BM, key[-1]]), gluon_descriptor(w2.view(-1, w2.shape[2]),
                                                                                         [BM, key[-1]])


def _keep(x, w13, w2, topk_ids, key: tuple, block_k: int, stages: int, split: int) -> _Kept:
    from moekit.experts.triton_gluon_launch import num_sms

    why = decode_unfit(x, w13, w2, topk_ids)
    if why:
        raise ValueError(f"gluon decode kernel: {why}")
    m, k = topk_ids.shape
    e, hidden, inter = w2.shape
    plan = plan_decode(m, k, inter, hidden, num_sms(x.device), block_k, stages, split)
    kernel = importlib.import_module(_KERNEL).decode_kernel
    launch = BoundLaunch(kernel, (plan.grid,), 13, (e,), True, S=plan.slots, TOP_K=k, N=inter, K=hidden, KS=split,
                         STAGES=plan.stages, num_warps=4)
    kept = _KEPT[key] = _Kept(launch, decode_scratch(x.device, x.dtype, inter, hidden))
    return kept


def experts_gluon_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, block_k: int = 128, stages: int = 0, split: int = 1) -> torch.Tensor:
    """out [M, K] = the experts contract for a decode call, one launch (raises where ``decode_unfit`` says why).
    topk_ids int32 and topk_weights float32 are read as they are (others converted: one more launch each). The
    first call of a kind (``_KEPT``) checks the call and binds the launch; later ones check what can change
    between calls of one kind (x's and the weights' layout and alignment) and launch."""
    if x.shape[0] == 0:
        return torch.empty(0, w2.shape[1], dtype=x.dtype, device=x.device)
    key = (x.device, x.dtype, topk_ids.shape, w2.shape, w13.shape, w13.dtype, block_k, stages, split)
    kept = _KEPT.get(key)
    if kept is None:
        kept = _keep(x, w13, w2, topk_ids, key, block_k, stages, split)
    elif (w13.__class__ not in _PLAIN or w2.__class__ not in _PLAIN or not x.is_contiguous() or x.data_ptr() % 16
          or not w13.is_contiguous() or not w2.is_contiguous() or w13.data_ptr() % 16 or w2.data_ptr() % 16):
        raise ValueError(f"gluon decode kernel: {decode_unfit(x, w13, w2, topk_ids)}")
    w13_desc, w2_desc = _DESCRIPTORS.get(w13, w2, ("gluon_decode", x.device, BM, block_k), _weight_descriptors)
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    h, y, part, up_done, piece, arrive, exit_ = kept.scratch
    kept.launch(w13_desc, w2_desc, x, ids, wts, h, y, out, part, up_done, piece, arrive, exit_)
    return out


@dataclass(frozen=True)
class DecodeChoice:
    """Where the ``triton`` backend (default options) hands a call to the decode kernels: on a Hopper with Gluon,
    at most ``max_slots`` slots (M*k; 0: never) on bf16 / fp16 plain weights, ``fp8_max_slots`` on fp8_block
    weights (``triton_gluon_decode_fp8``), experts at most ``max_inter`` (N) wide, with the tiles named here; no
    backward wanted, not while torch.compile traces."""

    max_slots: int = 0
    fp8_max_slots: int = 0
    max_inter: int = 1024
    block_k: int = 128
    split: int = 1
    fp8_split: int = 1


DEFAULT_DECODE = DecodeChoice()


def route(default_options: bool, x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
          activation, check: bool) -> torch.Tensor | None:
    """The ``triton`` backend's decode route (its entry points call this first, no map or biases): the decode
    kernel's output where the call has the default options and ``DEFAULT_DECODE`` wants and fits it (``check``:
    ``check_experts_args`` first, for an entry point that has not run it), else None (the caller's path runs it).
    Off (both limits 0) it costs two attribute reads."""
    choice = DEFAULT_DECODE
    if not (choice.max_slots or choice.fp8_max_slots) or not default_options or topk_ids.dim() != 2:
        return None
    plain = w13.__class__ in _PLAIN and w2.__class__ in _PLAIN
    fp8 = not plain and w13.__class__ is Fp8BlockWeight and w2.__class__ is Fp8BlockWeight
    if topk_ids.numel() > (choice.max_slots if plain else choice.fp8_max_slots if fp8 else 0):
        return None
    if w2.shape[-1] > choice.max_inter or activation != "silu" or not x.is_cuda or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or topk_weights.requires_grad or (plain and (  # no backward
            w13.requires_grad or w2.requires_grad))):
        return None
    from moekit.experts.triton_gluon_launch import gluon_supported

    if not gluon_supported(x.device):
        return None
    if fp8:
        from moekit.experts.triton_gluon_decode_fp8 import decode_fp8_unfit, experts_gluon_decode_fp8

        if decode_fp8_unfit(x, w13, w2, topk_ids) is not None:
            return None
    elif decode_unfit(x, w13, w2, topk_ids) is not None:
        return None
    if check:
        from moekit.experts import check_experts_args

        check_experts_args(x, w13, w2, topk_ids, topk_weights, activation=activation)
    if fp8:
        return experts_gluon_decode_fp8(x, w13, w2, topk_ids, topk_weights, split=choice.fp8_split)
    return experts_gluon_decode(x, w13, w2, topk_ids, topk_weights, block_k=choice.block_k, split=choice.split)


def decode_twin(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """The kernel's function along its schedule, in torch: the tiles in id order (round i of every program before
    round i + 1), gate-up pieces' float32 partials summed in piece order, h = silu(gate) * up rounded to x's dtype,
    down tiles y (float32, times the routed weight; weight 0 for an id >= E), each token's slots summed in slot
    order, rounded to x's dtype. float32 products (the wgmma accumulates in float32)."""
    m, k = topk_ids.shape
    e_count, hidden, inter = w2.shape
    ids, wts = topk_ids.reshape(-1).long(), topk_weights.reshape(-1).float()
    h = torch.zeros(plan.slots, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(plan.slots, hidden, dtype=torch.float32, device=x.device)
    part = torch.zeros(plan.slots, plan.up_blocks, plan.split, 2, BM, dtype=torch.float32, device=x.device)
    pieces, up_done, kp = [[0] * plan.up_blocks for _ in range(plan.slots)], [0] * plan.slots, hidden // plan.split
    for up, s, blk, piece in map(plan.tile, range(plan.num_tiles)):
        e, rows = min(int(ids[s]), e_count - 1), slice(blk * BM, (blk + 1) * BM)
        if up:
            ks = slice(piece * kp, (piece + 1) * kp)
            xs = x[s // k, ks].float()
            part[s, blk, piece, 0] = w13[e, rows, ks].float() @ xs
            part[s, blk, piece, 1] = w13[e, inter + blk * BM: inter + (blk + 1) * BM, ks].float() @ xs
            pieces[s][blk] += 1
            if pieces[s][blk] == plan.split:
                g, u = part[s, blk, 0, 0].clone(), part[s, blk, 0, 1].clone()
                for p in range(1, plan.split):
                    g, u = g + part[s, blk, p, 0], u + part[s, blk, p, 1]
                h[s, rows] = (g * torch.sigmoid(g) * u).to(x.dtype)
                up_done[s] += 1
        else:
            if up_done[s] != plan.up_blocks:
                raise AssertionError(f"down tile of slot {s} before its {plan.up_blocks} gate-up tiles")
            wt = float(wts[s]) if int(ids[s]) < e_count else 0.0
            y[s, rows] = (w2[e, rows].float() @ h[s].float()) * wt
    out = y.view(m, k, hidden)[:, 0].clone()
    for j in range(1, k):
        out += y.view(m, k, hidden)[:, j]
    return out.to(x.dtype)
