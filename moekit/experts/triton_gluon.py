"""Experts on the contiguous layout with warp-specialized Gluon GEMMs (Hopper), for prefill.

    [align (Triton, no sync), gather x into 128-aligned expert segments] -> [gate-up GEMM, silu(gate)*up]
      -> [down GEMM] -> [weighted sum over the k slots, back in token order]

``experts_gluon`` runs that path (and raises where it cannot: see ``gluon_unfit``);
``experts_gluon_twin`` computes the same layout and products in torch (the oracle of the tests and of
``benchmarks/gluon_device_check.py``). The ``triton`` backend hands a call to the Gluon path where that measured faster
on the H200 (``DEFAULT_CHOICE``, ``run_default_gluon``) and the call fits it, and to the fused Triton kernels everywhere
else: other GPUs, a Triton without Gluon, the interpreter, decode sizes, biases, other activations, strided
weights, ``torch.compile``, and calls that need a backward (the Gluon launches have none). The backend
``triton_gluon`` (``experts_triton_gluon``) is the same with the caller's ``GluonChoice``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec, as_spec
from moekit.experts.triton_gluon_launch import (
    BLOCK_M, down_tile, gluon_supported, launch_contiguous_sum, launch_gather_gemm, launch_gather_rows, launch_gemm,
    plan_gluon, up_tile, wants_loader_gather, wants_tail,
)
from moekit.experts.triton_gluon_lean import run_fast_gluon  # a module import, not one per repeated call
from moekit.layouts.contiguous import combine_contiguous, permute_contiguous

_DTYPES = (torch.bfloat16, torch.float16)
_SILU = ActivationSpec("silu")
_FAST = "triton_gluon"  # the first field of this backend's fast-path keys (``triton_fast``'s activation slot)


@dataclass(frozen=True)
class GluonChoice:
    """Where the Gluon path measured faster than the fused Triton kernels for the whole call (H200,
    Triton 3.6, layout and combine counted; benchmarks/results/raw/NVIDIA_H200-2026-12-01-gluon-run3.json):
    from ``min_tokens`` tokens for every shape (M=16384: Qwen3 1.03x, Mixtral 1.00x, DeepSeek-V3 1.15x; M=8192,
    session 21, the lean launch against the fused kernels' route, 9 interleaved graph rounds: Qwen3 1.12x,
    DeepSeek-V3 1.08x, each >= 3% in 8 of 9, raw/NVIDIA_H200-2026-12-03-0efdb0f-prefill_ab.log),
    from ``min_tokens_wide`` for experts at least ``wide_inter`` wide (Mixtral N=14336 at M=4096: 1.12x; at
    1024 / 2048: 1.24x / 1.19x, raw/NVIDIA_H200-2026-12-02-a6660ca-gluon_mid.log; at 512, graph replay, 3
    interleaved rounds: the plan's tiles 946 µs against the fused kernels' 1032-1052, every Gluon tile tried
    934-997, raw/NVIDIA_H200-2026-12-02-bc6d24d-ridge.log), and from ``min_tokens_narrow`` for experts at most
    ``narrow_inter`` wide (Qwen3 N=768 at M=4096, the lean launch against the fused kernels, interleaved graph
    rounds: 1.115x, >= 3% in 8 of 9, session 21's prefill_ab run; 1.108x, 6 of 7, session 22's
    raw/NVIDIA_H200-2026-12-03-db430ac-prefill2-ck1.log; 1.16x, 4 of 5, raw/...-9c15285-prefill.log; the route so
    chosen on merged main: 1.124x at 4096, 1.133x at 6144, 0 of 9 rounds the other way, ...-c1c5838-prefill2-ck2.log;
    from 2048 since session 23, with the gate-up GEMM gathering x's rows in its loader (``LOADER_GATHER_MAX_INTER``):
    Qwen3 M=2048 1.108x (>= 3% in 6 of 7) and 1.119x (8 of 9), M=3072 1.130x (8 of 9) against the fused kernels,
    raw/...-0f5a314-gather-ck1.log, ...-3867e94-gather-ck2early.log; on merged main 1.110x / 1.123x at 2048 / 3072,
    0 of 9 rounds the other way, ...-b89fbea-gather-merged.log; M=1024 1.030x, 3 of 9: not taken).
    Not below: M=4096 DeepSeek-V3 (N=2048) 1.04x (4 of 9), 1.036x (4 of 7), 1.047x (6 of 9), 1.00x and 0.97x
    in earlier runs; Qwen3 M=2048 1.044x (7 of 9, one run); before the lean launch M = 1024 / 2048 Qwen3
    0.91x / 0.97x, DeepSeek-V3 0.80x / 0.98x; M = 512 Qwen3 0.84x (0.93x at 64-row tiles, removed); the gather in
    the loader for wide experts: Mixtral 4096 0.951x / 0.958x, DeepSeek-V3 8192 0.986x / 0.974x (its GEMM's work
    6-13% slower than the TMA-fed one's, more than the gather it saves)."""

    min_tokens: int = 8192
    min_tokens_narrow: int = 2048
    narrow_inter: int = 1024
    min_tokens_wide: int = 512
    wide_inter: int = 8192

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.min_tokens, self.min_tokens_narrow, self.narrow_inter,
                                                self.min_tokens_wide, self.wide_inter)))

    def __hash__(self) -> int:
        # In every Gluon fast-path key (``run_fast_default_gluon``): computed once, not by the generated __hash__
        # on each call (CPU here: 0.29 -> 0.14 µs the key's hash)
        return self._hash

    def wants(self, num_tokens: int, inter: int, top_k: int = 0, num_experts: int = 0) -> bool:
        """``top_k``, ``num_experts`` (0: unknown): also where the down GEMM's tail pays (``wants_tail``: DeepSeek-V3
        M = 4096, the lean launch with it 1.083x the fused kernels, >= 3% in 6 of 7 rounds,
        raw/...-1008e29-prefill5-ck1.log)."""
        return (num_tokens >= self.min_tokens or (num_tokens >= self.min_tokens_narrow and inter <= self.narrow_inter)
                or (num_tokens >= self.min_tokens_wide and inter >= self.wide_inter)
                or (top_k > 0 and wants_tail(num_tokens, top_k, num_experts, inter)))


DEFAULT_CHOICE = GluonChoice()


def gluon_unfit(x: torch.Tensor, w13, w2, activation: str | ActivationSpec = "silu", b13=None, b2=None) -> str | None:
    """Why the Gluon path cannot take this call (None when it can): bf16/fp16 tensors, plain gated silu
    (gate rows then up rows), no biases, contiguous weights (TMA reads them as 2-D), N and K multiples of
    the 128-wide output tiles."""
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return f"w13/w2 quantized ({type(w13).__name__}, {type(w2).__name__}; plain tensors only)"
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (bf16/fp16 only)"
    if activation != "silu" and as_spec(activation) != _SILU:  # the string first: no spec built per call
        return f"activation={activation!r} (plain gated silu only)"
    if b13 is not None or b2 is not None:
        return "biases b13/b2 given (none allowed)"
    if not (w13.is_contiguous() and w2.is_contiguous() and x.stride(-1) == 1):
        return "strided weights or x (w13 and w2 contiguous, x rows unit-stride)"
    hidden, inter = w2.shape[1], w2.shape[2]
    if inter % 128 or hidden % 128:
        return f"w2 [E, K={hidden}, N={inter}]: N and K must be multiples of 128"
    return None


@dataclass(frozen=True)
class GluonLayout:
    """The contiguous layout as the kernels read it, built from the block-aligned one (its Triton
    alignment kernels: no sort in torch, no host sync). R rows. Padding rows of x_perm are never
    written: the GEMMs compute their rows from whatever they hold (each output row depends on its own
    input row only) and the combine never reads them."""

    x_perm: torch.Tensor | None  # [R, K]; row r = x[sorted_ids[r] // k]; padding rows uninitialised; None: in_loader
    block_experts: torch.Tensor  # [R // BLOCK_M] int32; local expert of each row block, -1 past rows_used
    rows_used: torch.Tensor  # [1] int32; rows in use, a multiple of BLOCK_M
    src_to_dst: torch.Tensor  # [M, k] int32; row holding assignment (t, j), -1 when not routed here
    sorted_ids: torch.Tensor  # [R] int32; assignment of each row, >= M*k for padding


def gluon_layout(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                 expert_map: torch.Tensor | None = None, align=None, in_loader: bool = False) -> GluonLayout:
    """Group x's rows by expert into BLOCK_M-aligned segments. ``align``: the alignment function
    (``align_block_triton`` by default; its torch twin ``align_block`` in the CPU tests). One Triton
    kernel then copies the real rows and writes their inverse (the torch indexing it replaced cost 0.4-1.6
    ms at prefill on the H200: a copy of x, all R rows gathered, a scatter). ``in_loader``: neither: no x_perm,
    dst filled with -1 only (the gate-up GEMM gathering in its loader copies the rows and writes dst)."""
    if align is None:
        from moekit.experts.triton_align import align_block_triton as align
    blocks = align(topk_ids, num_experts, BLOCK_M, expert_map, allow_naive=False)
    num_tokens, top_k = topk_ids.shape
    dst = torch.full((num_tokens * top_k,), -1, dtype=torch.int32, device=x.device)  # [A]
    if in_loader:
        return GluonLayout(None, blocks.expert_ids, blocks.num_padded, dst.view(num_tokens, top_k), blocks.sorted_ids)
    x_perm = x.new_empty(blocks.sorted_ids.numel(), x.shape[1])  # [R, K]
    launch_gather_rows(x, blocks.sorted_ids, top_k, x_perm, dst)
    return GluonLayout(x_perm, blocks.expert_ids, blocks.num_padded, dst.view(num_tokens, top_k), blocks.sorted_ids)


def experts_gluon(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K] contiguous
    w2: torch.Tensor,  # [E, K, N] contiguous
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    lean: bool = True,
) -> torch.Tensor:
    """The experts contract on the Gluon path; the caller has run ``check_experts_args``. Raises where
    the device or the call does not fit (``gluon_supported``, ``gluon_unfit``). No host sync. ``lean``:
    launched through ``triton_gluon_lean`` (plans, weight descriptors, workspaces and launches kept);
    off: the plain launches, built per call (the same kernels and arguments: equal outputs)."""
    if not gluon_supported(x.device):
        raise RuntimeError(f"the Gluon path needs a Hopper GPU and a Triton with Gluon; x is on {x.device}")
    reason = gluon_unfit(x, w13, w2, activation, b13, b2)
    if reason is not None:
        raise ValueError(f"the Gluon path cannot take this call: {reason}")
    return launch_gluon(x, w13, w2, topk_ids, topk_weights, expert_map, lean)


def launch_gluon(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None, lean: bool = True,
                 fast_key: tuple | None = None) -> torch.Tensor:
    """``experts_gluon`` for a caller that has run its checks (the backend: they ran once, not twice per call);
    ``fast_key``: the backend's key for its fast path (``triton_gluon_lean.run_fast_gluon``)."""
    num_experts, hidden, inter = w2.shape
    if lean:
        from moekit.experts.triton_gluon_lean import run_lean

        m, top_k = topk_ids.shape
        tail = wants_tail(m, top_k, num_experts, inter)  # the down GEMM folds tails
        return run_lean(x, w13, w2, topk_ids, topk_weights, expert_map, up_tile(m, top_k, num_experts, inter),
                        down_tile(inter, tail), fast_key=fast_key)
    plan = plan_gluon(x.shape[0], topk_ids.shape[1], num_experts, inter)
    w13_2d = w13.view(num_experts * 2 * inter, hidden)
    # the gate-up GEMM reads x's rows itself and writes dst (not on 256-row tiles: they read x_perm by TMA)
    in_loader = not plan.up.blk256 and wants_loader_gather(x, inter)
    layout = gluon_layout(x, topk_ids, num_experts, expert_map, in_loader=in_loader)
    rows = layout.sorted_ids.numel()
    h = x.new_empty(rows, inter)  # [R, N]; rows past rows_used are never written nor read
    assignments = topk_ids.numel()  # a tile's tail reads the layout's sorted_ids (>= A: padding)
    if in_loader:
        launch_gather_gemm(x, layout.sorted_ids, layout.src_to_dst.view(-1), w13_2d, h, layout.block_experts,
                           layout.rows_used, topk_ids.shape[1], plan.up)
    else:
        launch_gemm(layout.x_perm, w13_2d, h, layout.block_experts, layout.rows_used, plan.up, gated=True,
                    w_rows=2 * inter, gate_offset=inter, sorted_ids=layout.sorted_ids, num_assignments=assignments)
    y = x.new_empty(rows, hidden)  # [R, K]
    launch_gemm(h, w2.view(num_experts * hidden, inter), y, layout.block_experts, layout.rows_used, plan.down,
                gated=False, w_rows=hidden, sorted_ids=layout.sorted_ids, num_assignments=assignments)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, layout.src_to_dst, topk_weights.contiguous(), out)
    return out


def experts_gluon_twin(x, w13, w2, topk_ids, topk_weights, *, activation="silu", expert_map=None,
                       b13=None, b2=None) -> torch.Tensor:
    """The Gluon path's arithmetic in torch, on the same layout: float32 products per expert segment,
    h rounded to x's dtype between the GEMMs like the kernels, y rounded too, float32 combine. Syncs."""
    reason = gluon_unfit(x, w13, w2, activation, b13, b2)
    if reason is not None:
        raise ValueError(f"the Gluon path cannot take this call: {reason}")
    num_experts, hidden, inter = w2.shape
    return segment_twin(x, topk_ids, topk_weights, expert_map, num_experts, inter,
                        lambda e: w13[e].float().t(), lambda e: w2[e].float().t())


def segment_twin(x, topk_ids, topk_weights, expert_map, num_experts: int, inter: int, up_t, down_t) -> torch.Tensor:
    """The Gluon paths' arithmetic in torch on their layout (128-row expert segments): per segment float32
    products with ``up_t(e)`` [K, 2N] and ``down_t(e)`` [N, K] float32, h and y rounded to x's dtype like the
    kernels, float32 combine. Syncs."""
    plan = plan_gluon(x.shape[0], topk_ids.shape[1], num_experts, inter)
    layout = permute_contiguous(x, topk_ids, num_experts, BLOCK_M, expert_map, static_rows=plan.rows)
    y = x.new_zeros(plan.rows, x.shape[1])  # [T, K]
    starts = layout.offsets.tolist()
    for e in range(num_experts):
        lo, hi = starts[e], starts[e + 1]
        if hi == lo:
            continue
        gate_up = layout.x_perm[lo:hi].float() @ up_t(e)  # [rows, 2N]
        h = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
        y[lo:hi] = (h.float() @ down_t(e)).to(x.dtype)
    return combine_contiguous(y, layout, topk_weights).to(x.dtype)


def experts_triton_gluon(
    x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    *, activation: str | ActivationSpec = "silu", expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, choice: GluonChoice = DEFAULT_CHOICE,
    fp8_choice=None,
) -> torch.Tensor:
    """The ``triton_gluon`` backend: the Gluon path where ``choice`` wants it, the call fits it and the
    device runs it; the fused Triton kernels (``experts_triton_unchecked``) otherwise, and always where
    the Triton path would go through its custom op: while ``torch.compile`` or a dispatch mode traces,
    and when autograd needs a backward (the Gluon launches are neither a custom op nor differentiable).
    Quantized weights go where the ``triton`` backend sends them (``triton_quant.run_quantized_triton``):
    ``fp8_block`` to the fp8 Gluon path where ``fp8_choice`` (``triton_gluon_fp8.Fp8GluonChoice``; None: its
    default, the ``triton`` backend's too) wants the call and it fits, else to the Triton fp8 kernels."""
    from moekit.experts.triton import _DEFAULT_OPTIONS, FUSED_OPTIONS, experts_triton_unchecked

    fast_key = (_FAST, activation, choice)  # a repeated call the Gluon path took: its kept launches, no checks
    if expert_map is None:  # fp8 with or without biases (the entry holds them); bf16 without (its path takes none)
        from moekit.experts.triton_gluon_fp8 import run_fast_fp8
        from moekit.experts.triton_gluon_lean import run_fast_gluon
        from moekit.quant.fp8_block import Fp8BlockWeight

        out = None
        if w13.__class__ is Fp8BlockWeight:
            out = run_fast_fp8(x, w13, w2, topk_ids, topk_weights, activation, fp8_choice, b13, b2)
        elif b13 is None and b2 is None:
            out = run_fast_gluon(x, w13, w2, topk_ids, topk_weights, fast_key)
        if out is not None:
            return out
    if not isinstance(w13, torch.Tensor):  # quantized weights: fp8_block may take the fp8 Gluon path
        from moekit.experts.triton_quant import is_quantized, run_quantized_triton

        if is_quantized(w13, w2):
            return run_quantized_triton(x, w13, w2, topk_ids, topk_weights, activation=activation,
                                        expert_map=expert_map, b13=b13, b2=b2, options=_DEFAULT_OPTIONS,
                                        fp8_choice=fp8_choice)
    if gluon_takes(x, w13, w2, topk_weights, activation, b13, b2, choice):
        return launch_gluon(x, w13, w2, topk_ids, topk_weights, expert_map, fast_key=fast_key)
    return experts_triton_unchecked(x, w13, w2, topk_ids, topk_weights, activation=activation,
                                    expert_map=expert_map, b13=b13, b2=b2, options=FUSED_OPTIONS)


def gluon_takes(x, w13, w2, topk_weights, activation, b13, b2, choice: GluonChoice) -> bool:
    """Whether the Gluon path takes this call: plain weights, a size ``choice`` wants, a device that runs Gluon,
    a call that fits it (``gluon_unfit``) and runs directly (no trace, no autograd: ``triton._runs_directly``)."""
    from moekit.experts.triton import _runs_directly

    return (isinstance(w2, torch.Tensor) and choice.wants(x.shape[0], w2.shape[-1], topk_weights.shape[1], w2.shape[0])
            and gluon_supported(x.device)
            and gluon_unfit(x, w13, w2, activation, b13, b2) is None
            and _runs_directly(x, w13, w2, topk_weights, b13, b2))


def run_default_gluon(x, w13, w2, topk_ids, topk_weights, activation, expert_map, b13, b2) -> torch.Tensor | None:
    """The ``triton`` backend's Gluon route (bf16/fp16 weights): out where ``DEFAULT_CHOICE`` takes the call
    (``gluon_takes``), through the lean launch under the ``triton_gluon`` backend's fast-path key (its default
    choice: the two backends share kept calls), else None (the fused Triton kernels run it)."""
    if not gluon_takes(x, w13, w2, topk_weights, activation, b13, b2, DEFAULT_CHOICE):
        return None
    return launch_gluon(x, w13, w2, topk_ids, topk_weights, expert_map, fast_key=(_FAST, activation, DEFAULT_CHOICE))


def run_fast_default_gluon(x, w13, w2, topk_ids, topk_weights, activation) -> torch.Tensor | None:
    """A repeated call ``run_default_gluon`` took, from what it kept (``triton_gluon_lean.run_fast_gluon``), or None."""
    if x.shape[0] < min(DEFAULT_CHOICE.min_tokens, DEFAULT_CHOICE.min_tokens_wide):
        return None
    return run_fast_gluon(x, w13, w2, topk_ids, topk_weights, (_FAST, activation, DEFAULT_CHOICE))


def is_available(device: torch.device) -> bool:
    """The backend hook: available wherever the ``triton`` backend is (it falls back to it)."""
    from moekit.experts.triton import is_available as triton_available

    return triton_available(device)
