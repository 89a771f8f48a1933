"""Fused Triton experts: the default backend on CUDA.

    [Route] -> [Align (GPU, no sync)] -> [gate-up GEMM + act-and-mul] -> [down GEMM x routed weight] -> [sum over k]

Activations are never permuted: each M-block of the block-aligned layout belongs to one expert and
gathers its rows through ``sorted_ids // k``. The [A, 2N] gate-up product is never written (the
activation is fused into that GEMM's epilogue); the routed weight is applied in the down GEMM's
epilogue; the k-sum reads the [A, K] per-slot rows once. At A*4 <= E with no expert map (vLLM's
tiny-batch shortcut) no alignment runs: block a is assignment a.

No host synchronisation anywhere: every size is derived from shapes, so the path is CUDA-graph
capturable and replays correctly with new routing. How it launches is chosen by a ``LaunchOptions``
passed down to every launch (``triton_launch``; e.g. programmatic dependent launch on compute
capability 9.0 and later, the waits in ``_kernels._common``, so each grid launches while the one
before it drains). ``torch.ops.moekit.triton_experts`` and ``torch.ops.moekit.align_block_triton``
(``triton_align``) are ``torch.library`` custom ops with fakes, so ``torch.compile(fullgraph=True)``
traces through them.

Torch twins: ``moekit.layouts.block_aligned.align_block`` (alignment, equal element for element) and
``moekit.experts.reference`` (the GEMMs). The kernels are in ``moekit.experts._kernels``.

On the CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, read when a kernel is
decorated, so the kernel modules are imported lazily). The interpreter's bf16 ``tl.dot`` is wrong, so
there the operands are upcast to float32 first; and its float -> bf16 conversion truncates instead of
rounding (measured: 2x the rounding error), so there the [A, N] and [A, K] workspaces are float32.
Everything else runs as on the GPU.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, B = BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from moekit.experts import check_experts_args
from moekit.activations import get_activation
from moekit.experts.configs import KernelConfig, device_key, fit_shared_memory, get_config
from moekit.experts.triton_align import align_into
from moekit.experts.triton_launch import (
    LaunchOptions, cdiv, interpreting, kernels, max_shared_memory, next_pow2, resolve_launch_options,
)
from moekit.layouts.block_aligned import BlockAlignedLayout, use_naive
from moekit.layouts.grouping import max_padded_rows

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_available(device: torch.device | str) -> bool:
    """True on CUDA with Triton importable; on the CPU only under ``TRITON_INTERPRET=1`` (so ``auto``
    never picks the interpreter on its own)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


# ---------------------------------------------------------------------------------------------------
# The plan: everything the launches of one call share, decided before the first launch
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    options: LaunchOptions  # resolved for the device
    config: KernelConfig  # the GEMM tiles; on the GPU shrunk to its shared memory
    block_m: int  # rows per M-block: config.BLOCK_M; 16 in the naive shortcut (its one assignment in row 0)
    num_pid_m: int  # M-blocks the GEMM grids cover: A in the naive shortcut, else whole blocks of R
    layout: BlockAlignedLayout | None  # the aligned rows; None in the naive shortcut (block a = assignment a)
    w13: Any  # [E, 2N, K], or a TMA descriptor over it as [E*2N, K] when weight_descriptors
    w2: Any  # [E, K, N], or a TMA descriptor over it as [E*K, N] when weight_descriptors
    weight_descriptors: bool  # options.weight_descriptors and the weights fit TMA (``_descriptors_allowed``)
    precision: str  # tl.dot input precision: "ieee" for float32 inputs (the 1e-5 contract), else "tf32"
    work_dtype: torch.dtype  # of the h and y workspaces: x.dtype; float32 under the interpreter

    def row_args(self) -> list:
        """The kernels' sorted_ids, expert_ids, num_padded: None in the naive shortcut, where the
        kernels read each block's expert from topk_ids instead."""
        if self.layout is None:
            return [None, None, None]
        return [self.layout.sorted_ids, self.layout.expert_ids, self.layout.num_padded]

    def gemm_kwargs(self) -> dict:
        """The constexprs and launch options both GEMMs share."""
        return dict(NAIVE=self.layout is None, UPCAST=interpreting(), PRECISION=self.precision,
                    W_DESC=self.weight_descriptors, **self.options.pdl_kwargs())


def _descriptors_allowed(w13: torch.Tensor, w2: torch.Tensor, options: LaunchOptions) -> bool:
    """Asked for, and 16-bit weights, both contiguous with 16-byte aligned rows (what a TMA copy needs).
    float32 keeps the pointer loads: it is the precise path, not the fast one, and only those were run
    on the H200."""
    return options.weight_descriptors and all(
        w.element_size() == 2 and w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[2] * 2 % 16 == 0
        for w in (w13, w2)
    )


def _descriptor(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA tensor descriptor over w [E, rows, cols] as [E*rows, cols], blocks of [block_n, block_k]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [block_n, block_k])


def _launch_config(config: KernelConfig | None, x: torch.Tensor, num_experts: int, n: int, top_k: int,
                   descriptors: bool) -> KernelConfig:
    """``config``, or the tuned / heuristic one for this shape; on the GPU shrunk to its shared memory."""
    if config is None:
        config = get_config(x.shape[0], num_experts, n, x.shape[1], top_k, x.dtype, device_key(x.device))
    if interpreting():
        return config
    return fit_shared_memory(config, x.element_size(), max_shared_memory(x.device), descriptors=descriptors)


def _plan(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
          expert_map: torch.Tensor | None, config: KernelConfig | None, options: LaunchOptions) -> _Plan:
    """Resolve the options and the config, and launch the alignment (unless the naive shortcut skips it)."""
    options = resolve_launch_options(options, x.device)
    num_experts, two_n, _ = w13.shape
    num_assignments = topk_ids.numel()
    descriptors = _descriptors_allowed(w13, w2, options)
    config = _launch_config(config, x, num_experts, two_n // 2, topk_ids.shape[1], descriptors)
    if use_naive(num_assignments, num_experts, expert_map):
        block_m, num_pid_m, layout = 16, num_assignments, None
    else:
        block_m = config.BLOCK_M
        num_pid_m = cdiv(max_padded_rows(num_assignments, num_experts, block_m), block_m)
        layout = align_into(topk_ids.contiguous(), num_experts, block_m, expert_map, num_pid_m * block_m, options)
    up, down = config.up, config.down
    return _Plan(
        options=options, config=config, block_m=block_m, num_pid_m=num_pid_m, layout=layout,
        w13=_descriptor(w13, up.BLOCK_N, up.BLOCK_K) if descriptors else w13,
        w2=_descriptor(w2, down.BLOCK_N, down.BLOCK_K) if descriptors else w2,
        weight_descriptors=descriptors, precision="ieee" if x.dtype == torch.float32 else "tf32",
        work_dtype=torch.float32 if interpreting() else x.dtype,
    )


def _workspace(shape: tuple[int, int], plan: _Plan, device: torch.device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=plan.work_dtype, device=device)
    return buf.fill_(float("nan")) if plan.options.poison_workspace else buf


# ---------------------------------------------------------------------------------------------------
# The fused experts path
# ---------------------------------------------------------------------------------------------------


def fused_experts(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    config: KernelConfig | None = None,
    options: LaunchOptions = LaunchOptions(),
) -> torch.Tensor:
    """The kernels, launched (arguments already checked). ``config`` overrides the tuned lookup;
    ``options`` are resolved for x's device here. Not a custom op: for tools that pick configs or
    options per call (tuning, A/B benchmarks); models go through ``experts_triton``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [M, K]
    if topk_ids.numel() == 0:
        return out
    ids = topk_ids.contiguous().view(-1)  # [A]
    plan = _plan(x, w13, w2, topk_ids, expert_map, config, options)
    h = _gate_up(x, w13, ids, topk_ids.shape[1], plan, get_activation(activation).kernel_id)  # [A, N]
    # The k-sum stays a pass of its own even for tiny batches. Three ways to fuse it into the down GEMM
    # measured slower on the H200 (Qwen3-30B-A3B M=1: 8.7 + 2.6 µs for down then sum): one program
    # per token looping over its slots (27.9 µs), one flat (slot, step) loop with CUDA-core sums (39.6
    # µs), and the GEMM's own grid with the last of a token's k programs summing (+1 to +3 µs).
    y = _down(h, w2, topk_weights.contiguous().view(-1), ids, plan)  # [A, K]
    _sum_slots(y, ids, expert_map, out, topk_ids.shape[1], w13.shape[0], plan.options)
    return out


def _gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, top_k: int, plan: _Plan, act: int) -> torch.Tensor:
    """h [A, N] = act(x w_gate^T) * (x w_up^T), in assignment order; rows of unrouted assignments unwritten."""
    num_assignments, (num_experts, two_n, hidden) = ids.numel(), w13.shape
    n, up = two_n // 2, plan.config.up
    h = _workspace((num_assignments, n), plan, x.device)  # [A, N]
    kernels("gemm").gate_up_kernel[(plan.num_pid_m * cdiv(n, up.BLOCK_N),)](
        x, plan.w13, h, ids, *plan.row_args(),
        n, hidden, num_assignments, top_k, num_experts, plan.num_pid_m,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, GROUP_M=up.GROUP_M, ACT=act,
        num_warps=up.num_warps, num_stages=up.num_stages, **plan.gemm_kwargs(),
    )
    return h


def _down(h: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """y [A, K] = routed weight * (h w2^T) per assignment; rows of unrouted assignments unwritten."""
    num_assignments, (num_experts, hidden, n) = ids.numel(), w2.shape
    down = plan.config.down
    y = _workspace((num_assignments, hidden), plan, h.device)  # [A, K] weighted per-slot outputs
    kernels("gemm").down_kernel[(plan.num_pid_m * cdiv(hidden, down.BLOCK_N),)](
        h, plan.w2, y, weights, ids, *plan.row_args(),
        hidden, n, num_assignments, num_experts, plan.num_pid_m,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, GROUP_M=down.GROUP_M,
        num_warps=down.num_warps, num_stages=down.num_stages, **plan.gemm_kwargs(),
    )
    return y


def _sum_slots(
    y: torch.Tensor,  # [A, K] weighted per-slot outputs
    ids: torch.Tensor,  # [A] expert id of each assignment
    expert_map: torch.Tensor | None,
    out: torch.Tensor,  # [M, K], written
    top_k: int,
    num_experts: int,
    options: LaunchOptions,  # resolved for the device
) -> None:
    """out[t] = sum of y over token t's routed slots (skipped slots are never read)."""
    num_tokens, hidden = out.shape
    has_map = expert_map is not None
    topk_pad = next_pow2(top_k)
    block_t, block_k = 4, min(next_pow2(hidden), max(32, 2048 // topk_pad))  # [BT, k, BK] <= 8k elements
    kernels("combine").sum_slots_kernel[(cdiv(num_tokens, block_t), cdiv(hidden, block_k))](
        y, ids, expert_map if has_map else ids, out,
        num_tokens, hidden, top_k, num_experts, expert_map.numel() if has_map else 0,
        y.stride(0), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_K=block_k, TOPK_PAD=topk_pad, HAS_MAP=has_map, **options.pdl_kwargs(),
    )


# The launch options cross the op boundary as five primitive arguments: a custom op's schema has no
# dataclasses, and plain bools and ints are constants to torch.compile (baked into the graph, no guard
# on any global) and to a CUDA graph (fixed at capture). They are resolved for the device inside the
# op, where tracing never looks (resolving asks the CUDA driver for the device's capability).
@torch.library.custom_op("moekit::triton_experts", mutates_args=())
def _experts_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], activation: str, weight_descriptors: bool, dependent_launch: bool,
    poison_workspace: bool, align_small_max: int, align_small_max_bins: int,
) -> torch.Tensor:
    options = LaunchOptions(weight_descriptors, dependent_launch, poison_workspace, align_small_max,
                            align_small_max_bins)
    return fused_experts(x, w13, w2, topk_ids, topk_weights, expert_map, activation, options=options)


@_experts_op.register_fake
def _experts_fake(x, w13, w2, topk_ids, topk_weights, expert_map, activation, weight_descriptors, dependent_launch,
                  poison_workspace, align_small_max, align_small_max_bins):
    return x.new_empty(x.shape)


def experts_triton(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
    options: LaunchOptions = LaunchOptions(),
) -> torch.Tensor:
    """The experts contract (see ``moekit.experts``) on fused Triton kernels; returns [M, K] in x.dtype.
    ``options``: how to launch (``LaunchOptions``; the defaults are what the H200 measurements picked)."""
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map)
    get_activation(activation)  # raises, naming the argument, for an unknown one
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be one of {_DTYPES} for the triton backend, got {x.dtype}")
    if not is_available(x.device):
        raise RuntimeError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {x.device}")
    return torch.ops.moekit.triton_experts(
        x, w13, w2, topk_ids, topk_weights, expert_map, activation, options.weight_descriptors,
        options.dependent_launch, options.poison_workspace, options.align_small_max, options.align_small_max_bins,
    )
