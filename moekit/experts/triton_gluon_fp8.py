"""fp8 block-scaled experts on the contiguous layout with warp-specialized Gluon GEMMs (Hopper), for prefill.

    [align (Triton, no sync), gather x into 128-aligned expert segments, quantized: e4m3 per row per 128
    columns] -> [gate-up GEMM, block-scaled, silu(gate)*up, h quantized per 128 columns in the epilogue]
      -> [down GEMM, block-scaled, y bf16] -> [weighted sum over the k slots, back in token order]

The weights are ``fp8_block``'s (``triton_fp8``'s convention: e4m3 w13_q [E, 2N, K], w2_q [E, K, N], float32
scales per 128 x 128 block, dequantized = q * scale). ``experts_gluon_fp8`` runs the path (and raises where it
cannot: ``gluon_fp8_supported``, ``gluon_fp8_unfit``); ``experts_gluon_fp8_twin`` is its arithmetic in torch
(the oracle of the tests and of ``benchmarks/fp8_gluon_device_check.py``): ``fused_experts_fp8_torch``'s
quantization steps, with y rounded to x's dtype before the weighted sum as the kernels do.
The ``triton`` backend (and ``triton_gluon``, which sends quantized weights the same way) hands fp8_block
weights here where ``Fp8GluonChoice`` wants the call (and it fits, and nothing traces or needs a backward),
and to the fused Triton fp8 kernels everywhere else (``triton_quant.run_quantized_triton``).
The experts variant (issue #15, session 42): b13 after the block scales, before the activation; any gated spec in the
gate-up epilogue (gpt-oss's interleaved rows read in place, two row tiles a column block); b2 before the routed
weight; N and K past a multiple of 128 read as TMA's zeros. The backends send such calls here only with
``Fp8GluonChoice.variants`` (on by default: 1.4-1.66x the fused Triton fp8 kernels at gpt-oss-20b's prefill).
A repeated eager backend call launches from its fast-path entry (``run_fast_fp8``); a biased one keeps one only with
``BIASED_FAST`` (session 43), holding its biases as the fused kernels' entries do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec, apply_glu, as_spec
from moekit.experts.triton_fp8 import dequantize_blocks, dequantize_groups, quantize_groups
from moekit.experts.triton_gluon_fp8_launch import (
    GATHER_GROUPS, GROUP, Fp8GluonTile, launch_gather_quant, launch_gemm_fp8, plan_gluon_fp8, variant_of,
)
from moekit.experts.triton_gluon_launch import BLOCK_M, gluon_supported, launch_contiguous_sum
from moekit.experts.triton_gluon_lean import run_fast_gluon  # a module import, not one per repeated call
from moekit.experts.triton_launch import cdiv, interpreting
from moekit.layouts.grouping import to_local_ids

_DTYPES = (torch.bfloat16, torch.float16)
_SILU = ActivationSpec("silu")


@dataclass(frozen=True)
class Fp8GluonChoice:
    """Where the ``triton`` backend runs fp8_block weights on the Gluon path: calls of at least ``min_flops``
    (6 * M * k * N * K; None: never) with at least ``min_rows_per_expert`` assignments per local expert on average
    (M * k / E: below one 128-row segment each, the segments are mostly padding). Measured on the H200 against the
    Triton fp8 kernels (Triton 3.6, layout and combine counted), CUDA-graph replay / eager with the lean launch
    (``triton_gluon_lean``: ~0.1 ms of host time per call instead of 0.9-1.1 ms;
    benchmarks/results/raw/NVIDIA_H200-2026-12-02-f9b7b0d-gluon_lean.*): M=4096 Qwen3 1.27x / 1.28x, DeepSeek-V3
    1.22x / 1.20x; M=16384 Qwen3 1.18x / 1.26x, DeepSeek-V3 1.32x / 1.30x. Graph replay in an earlier run
    (raw/NVIDIA_H200-2026-12-02-e30386d-fp8_gluon.*): Mixtral 1.36x (4096), 1.18x (16384), 1.29x (1024: 256 rows
    per expert); M=1024 Qwen3 0.96x (64 rows per expert), DeepSeek-V3 0.83x (32). So: from 3e11 FLOPs (Qwen3
    M=4096: 3.1e11) and 128 rows per expert; before the lean launch the eager host cost kept it at 1e12. Checked
    on the rule's new cells (raw/NVIDIA_H200-2026-12-02-72367f7-gluon_lean*, eager / graph): Mixtral M=512 1.26x /
    1.14x, M=1024 1.25x / 1.22x; the cells it leaves to Triton lose on Gluon (Qwen3 M=512, 1024; DeepSeek-V3 512)."""

    min_flops: float | None = 3e11
    min_rows_per_expert: float = 128.0
    # Calls with expert biases, another gated activation or N / K not multiples of 128 (gpt-oss's: b13 / b2, interleaved
    # rows, silu alpha 1.702, limit 7, up + 1, N = K = 2880; issue 15, session 42) on this path too, where they fit
    # (``gluon_fp8_unfit``: N, K multiples of 16; without interleaved rows N a multiple of 128). On since
    # benchmarks/gfp42_device_check.py on one H100 (session 42, raw results/raw/NVIDIA_H100-2026-12-06-b35bf8b-gfp42.*):
    # gpt-oss-20b's experts, graph µs fused Triton fp8 / Gluon / bf16 at M 2048 901.8 / 642.5 / 934.4, 4096 1778.6 /
    # 1134.7 / 1646.0, 8192 3423.9 / 2064.5 / 2988.9 (x1.40-1.66, 5/5 rounds each; fp8 / bf16 1.08 -> 0.69 at 4096),
    # eager wall at 4096 1649.7 -> 1151.4 (5/5). False sends them back to the fused Triton kernels.
    variants: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.min_flops, self.min_rows_per_expert, self.variants)))

    def __hash__(self) -> int:
        # In every fp8 Gluon fast-path key (``fp8_fast_key``): computed once, not by the generated __hash__ per call
        return self._hash

    def wants(self, num_tokens: int, top_k: int, inter: int, hidden: int, num_experts: int) -> bool:
        assignments = num_tokens * top_k
        return (self.min_flops is not None and 6.0 * assignments * inter * hidden >= self.min_flops
                and assignments >= self.min_rows_per_expert * num_experts)


DEFAULT_FP8_CHOICE = Fp8GluonChoice()
_FAST = "gluon_fp8"  # the first field of the fp8 Gluon path's fast-path keys (``triton_fast``'s activation slot)
# Whether a call with expert biases (gpt-oss's b13 / b2) keeps a fast-path entry as an unbiased one does (issue 15,
# session 43; the entry holds the biases, ``kept_biases``). Without one it pays the lean launch's host time on every
# call. benchmarks/gfl43_device_check.py on one H100 (session 43, gpt-oss-20b fp8, eager µs a call, off -> on): host
# 91.9 -> 48.2 at M = 1024 and 103.2 -> 46.5 at 4096 (>= 3% lower in 5/5 rounds each), wall 491.9 -> 486.1 and
# 1167.7 -> 1167.7 (GPU-bound; one round of 4096's five read >= 3% higher, at the same median); every check PASS.
BIASED_FAST = True


def fp8_fast_key(w13, w2, activation, choice: Fp8GluonChoice) -> tuple:
    """The fast-path key of a backend call on fp8_block weights (``triton_gluon_lean.run_fast_gluon``, keyed there by
    the ``q`` tensors too): what decided the path besides shapes (the activation, str or spec: a gpt-oss spec never
    meets a silu entry; choice, block shape) and the scales' addresses, which the kept launches hold (an in-place
    update keeps them; a new scale tensor misses). The biases are not in it: the entry holds them (``kept_biases``;
    its launches hold their addresses), and a call with others, or none where it had some, misses."""
    return (_FAST, activation, choice, w13.block_shape, w13.scale.data_ptr(), w2.scale.data_ptr())


def run_fast_fp8(x, w13, w2, topk_ids, topk_weights, activation, choice: Fp8GluonChoice | None = None, b13=None,
                 b2=None):
    """A repeated fp8_block call the fp8 Gluon path took (with its biases ``b13`` / ``b2``, or None), launched from
    what it kept, or None (a miss)."""
    key = fp8_fast_key(w13, w2, activation, DEFAULT_FP8_CHOICE if choice is None else choice)
    return run_fast_gluon(x, w13.q, w2.q, topk_ids, topk_weights, key, b13, b2)


def gluon_fp8_unfit(x: torch.Tensor, w13_q, w13_scale, w2_q, w2_scale, activation="silu",
                    block_shape: tuple[int, int] = (128, 128), b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> str | None:
    """Why the fp8 Gluon path cannot take this call (None when it can): bf16/fp16 x with unit-stride rows,
    a gated activation, 128 x 128 weight blocks, contiguous e4m3 weights, float32 scales and biases (b13 [E, 2N],
    b2 [E, K]), N and K multiples of 16 (TMA's 16-byte rows; the tails past a multiple of 128 read zeros), and
    without interleaved rows N a multiple of 128 (the up rows N + c.. of a tile then lie in one scale block)."""
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} (bf16/fp16 only)"
    spec = _SILU if activation == "silu" else as_spec(activation)
    if not spec.gated:
        return f"activation={activation!r} (gated activations only: w13 [E, 2N, K])"
    if tuple(block_shape) != (GROUP, GROUP):
        return f"block_shape={tuple(block_shape)} ((128, 128) only)"
    if w13_q.dtype != torch.float8_e4m3fn or w2_q.dtype != torch.float8_e4m3fn:
        return f"weights {w13_q.dtype}/{w2_q.dtype} (float8_e4m3fn only)"
    biases = tuple(b for b in (b13, b2) if b is not None)
    if not all(t.is_contiguous() for t in (w13_q, w13_scale, w2_q, w2_scale, *biases)) or x.stride(-1) != 1:
        return "strided weights, scales, biases or x (weights, scales and biases contiguous, x rows unit-stride)"
    num_experts, hidden, inter = w2_q.shape
    if inter % 16 or hidden % 16:
        return f"w2_q [E, K={hidden}, N={inter}]: N and K must be multiples of 16 (TMA rows of 16 bytes)"
    if inter % GROUP and not spec.interleaved:
        return f"w2_q [E, K={hidden}, N={inter}]: N must be a multiple of 128 unless gate/up rows are interleaved"
    for name, b, shape in (("b13", b13, (num_experts, 2 * inter)), ("b2", b2, (num_experts, hidden))):
        if b is not None and (tuple(b.shape) != shape or not b.is_floating_point()):
            return f"{name} {tuple(b.shape)} {b.dtype}: expected a float tensor of shape {shape}"
    return None


def gluon_fp8_supported(device: torch.device | str) -> bool:
    """The device runs the Gluon GEMMs (``triton_gluon_launch.gluon_supported``: Hopper, a Gluon Triton)."""
    return gluon_supported(device)


def gluon_fp8_takes(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, activation, b13, b2,
                    choice: Fp8GluonChoice) -> bool:
    """Whether the ``triton`` and ``triton_gluon`` backends run this call on the fp8 Gluon path: fp8_block weights, a
    call ``choice`` wants (biases, an activation other than the plain silu, or N / K not multiples of 128 only with
    ``choice.variants``), a device that runs it, a call that fits (``gluon_fp8_unfit``), and nothing that needs the
    Triton path's custom op (tracing, autograd). The rest stays on the fused Triton kernels at every M (they take
    biases and variants since session 40)."""
    from moekit.experts.triton import _runs_directly
    from moekit.quant import QuantizedWeight

    if not choice.wants(x.shape[0], topk_weights.shape[1], w2.shape[2], x.shape[1], w2.shape[0]):  # decode stops here
        return False
    if not (isinstance(w13, QuantizedWeight) and isinstance(w2, QuantizedWeight)
            and w13.scheme == w2.scheme == "fp8_block"):
        return False
    plain = b13 is None and b2 is None and (activation == "silu" or as_spec(activation) == _SILU)  # no spec per call
    if not ((plain and w2.shape[1] % GROUP == 0 and w2.shape[2] % GROUP == 0) or choice.variants):  # main's calls
        return False
    if not gluon_fp8_supported(x.device) or tuple(w13.block_shape) != tuple(w2.block_shape):
        return False
    return (gluon_fp8_unfit(x, w13.q, w13.scale, w2.q, w2.scale, "silu" if plain else activation,
                            tuple(w13.block_shape), b13, b2) is None
            and _runs_directly(x, w13.q, w2.q, topk_weights, b13, b2))


@dataclass(frozen=True)
class Fp8GluonLayout:
    """The contiguous layout of x, quantized: ``GluonLayout``'s rows with x_q and x_s for x_perm."""

    x_q: torch.Tensor  # [R, K] e4m3 (float32 holding e4m3 values under the interpreter); padding rows unwritten
    x_s: torch.Tensor  # [R, ceil(K/128)] float32
    block_experts: torch.Tensor  # [R // 128] int32; -1 past rows_used
    rows_used: torch.Tensor  # [1] int32; a multiple of 128
    src_to_dst: torch.Tensor  # [M, k] int32; row of assignment (t, j), -1 when not routed here


def gluon_fp8_layout(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                     expert_map: torch.Tensor | None = None, align=None,
                     gather_groups: int = GATHER_GROUPS) -> Fp8GluonLayout:
    """``triton_gluon.gluon_layout`` with x quantized in the same pass (one Triton kernel, no host sync).
    ``align``: ``align_block_triton`` by default (its torch twin ``align_block`` in the CPU tests);
    ``gather_groups``: 128-column groups per program of the gather (the plan's)."""
    if align is None:
        from moekit.experts.triton_align import align_block_triton as align
    blocks = align(topk_ids, num_experts, BLOCK_M, expert_map, allow_naive=False)
    num_tokens, top_k = topk_ids.shape
    rows, hidden = blocks.sorted_ids.numel(), x.shape[1]
    x_q = torch.empty(rows, hidden, device=x.device, dtype=torch.float32 if interpreting() else torch.float8_e4m3fn)
    x_s = torch.empty(rows, cdiv(hidden, GROUP), device=x.device, dtype=torch.float32)
    dst = torch.full((num_tokens * top_k,), -1, dtype=torch.int32, device=x.device)  # [A]
    launch_gather_quant(x, blocks.sorted_ids, top_k, x_q, x_s, dst, gather_groups)
    return Fp8GluonLayout(x_q, x_s, blocks.expert_ids, blocks.num_padded, dst.view(num_tokens, top_k))


def experts_gluon_fp8(
    x: torch.Tensor,  # [M, K] bf16/fp16
    w13_q: torch.Tensor,  # [E, 2N, K] e4m3
    w13_scale: torch.Tensor,  # [E, ceil(2N/128), ceil(K/128)] float32
    w2_q: torch.Tensor,  # [E, K, N] e4m3
    w2_scale: torch.Tensor,  # [E, ceil(K/128), ceil(N/128)] float32
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    expert_map: torch.Tensor | None = None,
    activation: str | ActivationSpec = "silu",
    b13: torch.Tensor | None = None,  # [E, 2N] in w13's row order
    b2: torch.Tensor | None = None,  # [E, K]
    up: Fp8GluonTile | None = None,
    down: Fp8GluonTile | None = None,
    gather_groups: int | None = None,
    lean: bool = True,
) -> torch.Tensor:
    """The fp8 experts contract on the Gluon path (arguments checked by the caller: ``check_fp8_args``).
    ``activation`` (any gated spec: gpt-oss's interleaved rows, alpha, limit, up shift), ``b13`` / ``b2``: the
    experts variant (issue #15). ``up`` / ``down``: the GEMMs' pipelines, ``gather_groups``: the gather's 128-column
    groups per program (each the plan's by default: ``plan_gluon_fp8``). Raises where the device or the call does not
    fit. No host sync. ``lean`` off: the plain launches, built per call."""
    if not gluon_fp8_supported(x.device):
        raise RuntimeError(f"the fp8 Gluon path needs a Hopper GPU and a Triton with Gluon; x is on {x.device}")
    reason = gluon_fp8_unfit(x, w13_q, w13_scale, w2_q, w2_scale, activation, b13=b13, b2=b2)
    if reason is not None:
        raise ValueError(f"the fp8 Gluon path cannot take this call: {reason}")
    return launch_gluon_fp8(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map, up, down, lean,
                            gather_groups=gather_groups, activation=activation, b13=b13, b2=b2)


def launch_gluon_fp8(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map=None,
                     up: Fp8GluonTile | None = None, down: Fp8GluonTile | None = None, lean: bool = True,
                     fast_key: tuple | None = None, gather_groups: int | None = None, activation="silu",
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """``experts_gluon_fp8`` for a caller that has run its checks (the backend, through ``gluon_fp8_takes``);
    ``fast_key``: the backend's key for its fast path (``fp8_fast_key``; a biased call's entry holds its biases)."""
    num_experts, hidden, inter = w2_q.shape
    variant = variant_of(activation, b13, b2)
    plan = plan_gluon_fp8(x.shape[0], topk_ids.shape[1], num_experts, hidden, up, down, gather_groups, inter,
                          b2=b2 is not None)
    if lean:  # triton_gluon_lean: plans, weight descriptors, workspaces and launches kept (equal outputs)
        from moekit.experts.triton_gluon_lean import run_lean

        return run_lean(x, w13_q, w2_q, topk_ids, topk_weights, expert_map, plan.up, plan.down, w13_scale, w2_scale,
                        fast_key=fast_key if BIASED_FAST or not (variant.b13 or variant.b2) else None,
                        gather_groups=plan.gather_groups, variant=variant, b13=b13, b2=b2)
    layout = gluon_fp8_layout(x, topk_ids, num_experts, expert_map, gather_groups=plan.gather_groups)
    rows = layout.x_q.shape[0]
    h_q = torch.empty(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]; rows past rows_used unwritten
    h_s = torch.empty(rows, cdiv(inter, GROUP), device=x.device, dtype=torch.float32)
    launch_gemm_fp8(layout.x_q, layout.x_s, w13_q, w13_scale, h_q, h_s, layout.block_experts, layout.rows_used,
                    plan.up, gated=True, gate_offset=variant.gate_offset(inter), bias=b13, variant=variant)
    y = x.new_empty(rows, hidden)  # [R, K]
    launch_gemm_fp8(h_q, h_s, w2_q, w2_scale, y, None, layout.block_experts, layout.rows_used, plan.down,
                    gated=False, bias=b2)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, layout.src_to_dst, topk_weights.contiguous(), out)
    return out


def experts_gluon_fp8_twin(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, *,
                           expert_map: torch.Tensor | None = None, activation: str | ActivationSpec = "silu",
                           b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """The fp8 Gluon path's arithmetic in torch (any device; syncs): x quantized per row per 128 columns,
    float32 products of the dequantized operands per expert (+ b13 in float32), the gated activation
    (``apply_glu``: the spec's, interleaved rows read in place), h quantized per 128 columns (a last partial group
    over its real columns), + b2 in float32, y rounded to x's dtype (the down GEMM's bf16 output), then the float32
    weighted sum over the k slots."""
    reason = gluon_fp8_unfit(x, w13_q, w13_scale, w2_q, w2_scale, activation, b13=b13, b2=b2)
    if reason is not None:
        raise ValueError(f"the fp8 Gluon path cannot take this call: {reason}")
    num_experts, top_k = w13_q.shape[0], topk_ids.shape[1]
    x_deq = dequantize_groups(*quantize_groups(x, GROUP), GROUP)  # [M, K] float32
    local = to_local_ids(topk_ids, num_experts, expert_map)  # [A]; E = not routed here
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local.unique().tolist():
        if e >= num_experts:
            continue
        assignments = (local == e).nonzero().squeeze(1)  # [n_e]
        tokens, slots = assignments // top_k, assignments % top_k
        gate_up = x_deq[tokens] @ dequantize_blocks(w13_q[e], w13_scale[e], (GROUP, GROUP)).T  # [n_e, 2N]
        if b13 is not None:
            gate_up = gate_up + b13[e].float()
        h = apply_glu(gate_up, activation)  # [n_e, N]
        h_deq = dequantize_groups(*quantize_groups(h, GROUP), GROUP)
        y = h_deq @ dequantize_blocks(w2_q[e], w2_scale[e], (GROUP, GROUP)).T  # [n_e, K]
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tokens, y.to(x.dtype).float() * topk_weights[tokens, slots].float()[:, None])
    return out.to(x.dtype)
