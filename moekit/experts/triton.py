"""Fused Triton experts: the default backend on CUDA.

    [Route] -> [Align (GPU, no sync)] -> [gate-up GEMM + act-and-mul] -> [down GEMM x routed weight] -> [sum over k]

Activations are never permuted: each M-block of the block-aligned layout belongs to one expert and
gathers its rows through ``sorted_ids // k``. The [A, 2N] gate-up product is never written (the
activation is fused into that GEMM's epilogue); the routed weight is applied in the down GEMM's
epilogue; the k-sum reads the [A, K] per-slot rows once. At A*4 <= E with no expert map (vLLM's
tiny-batch shortcut) no alignment runs: block a is assignment a.

No host synchronisation anywhere: every size is derived from shapes, so the path is CUDA-graph
capturable and replays correctly with new routing. On compute capability 9.0 and later every kernel
is launched with programmatic dependent launch (``_launch_options``; the waits are in
``_kernels._common``), so each grid launches while the one before it drains.
``torch.ops.moekit.triton_experts`` and ``torch.ops.moekit.align_block_triton`` are ``torch.library``
custom ops with fakes, so ``torch.compile(fullgraph=True)`` traces through them.

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

import functools
import importlib
import os
from typing import Optional

import torch

from moekit.experts import check_experts_args
from moekit.experts.configs import KernelConfig, device_key, fit_shared_memory, get_config
from moekit.layouts.block_aligned import BlockAlignedLayout, check_align_args, use_naive
from moekit.layouts.grouping import max_padded_rows

_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ALIGN_CHUNK = 128  # assignments per chunk program; the in-chunk rank is a [C, C] compare (16k lanes)
# Up to ALIGN_SMALL_MAX assignments and ALIGN_SMALL_MAX_BINS histogram bins the alignment is one
# single-program launch instead of three. Measured on the H200 at M=8: Mixtral (E=8, 16 bins) 4.1 µs
# against 6.6 µs for the three launches; Qwen3 (E=128, 256 bins) 11.5 µs against 6.8 µs, because one
# program then walks [blocks, bins] tiles that three launches spread over the chip.
ALIGN_SMALL_MAX = _ALIGN_CHUNK
ALIGN_SMALL_MAX_BINS = 64

# Weights through TMA tensor descriptors where the strides allow (``_descriptors_allowed``). A switch so
# that benchmarks can measure both ways in one run.
WEIGHT_DESCRIPTORS = True

# Programmatic dependent launch between the path's kernels where the GPU has it (compute capability
# 9.0 and later): each grid launches while the one before it drains. A switch so that benchmarks can
# measure both ways in one run.
DEPENDENT_LAUNCH = True

# Tests set this to fill the intermediate buffers with NaN, proving that unwritten rows are never read.
POISON_WORKSPACE = False


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_available(device: torch.device | str) -> bool:
    """True on CUDA with Triton importable; on the CPU only under ``TRITON_INTERPRET=1`` (so ``auto``
    never picks the interpreter on its own)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


@functools.lru_cache(maxsize=None)
def _max_shared_memory_of(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def _max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: the limit Triton's launcher checks."""
    return _max_shared_memory_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _major_capability_of(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _launch_options(device: torch.device) -> dict:
    """Keyword arguments of every kernel launch: programmatic dependent launch (``PDL``, and Triton's
    ``launch_pdl``) on NVIDIA devices of compute capability 9.0 and later; never under the interpreter,
    never on ROCm (whose "cuda" devices report capabilities like 9.4 but have no griddepcontrol)."""
    pdl = (DEPENDENT_LAUNCH and device.type == "cuda" and torch.version.hip is None and not interpreting()
           and _major_capability_of(device.index if device.index is not None else torch.cuda.current_device()) >= 9)
    return dict(PDL=pdl, launch_pdl=pdl)


def _kernels(name: str):
    return importlib.import_module(f"moekit.experts._kernels.{name}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------------------
# Alignment
# ---------------------------------------------------------------------------------------------------


def _align_into(topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: torch.Tensor | None,
                num_rows: int, launch: dict):
    """Launch the sorted alignment; sorted_ids gets ``num_rows`` rows (>= R; the rest are padding).
    ``launch``: ``_launch_options`` of the device, decided once by the caller."""
    device = topk_ids.device
    ids = topk_ids.reshape(-1)  # [A]
    num_assignments = ids.numel()
    e_pad = _next_pow2(num_experts + 1)
    num_chunks = triton_cdiv(num_assignments, _ALIGN_CHUNK)
    num_blocks = triton_cdiv(num_rows, block_size)
    i32 = dict(dtype=torch.int32, device=device)
    hist = torch.empty(max(num_chunks, 1), e_pad, **i32)  # [chunks, EP]
    chunk_base = torch.empty_like(hist)  # [chunks, EP]
    counts = torch.empty(num_experts, **i32)  # [E]
    offsets = torch.empty(e_pad, **i32)  # [EP]; offsets[E] = rows used
    num_padded = torch.empty(1, **i32)
    sorted_ids = torch.empty(num_rows, **i32)  # [rows]
    expert_ids = torch.empty(num_blocks, **i32)  # [rows / B]
    has_map = expert_map is not None
    map_arg = expert_map if has_map else ids
    num_global = expert_map.numel() if has_map else 0
    k = _kernels("align")
    if 0 < num_assignments <= ALIGN_SMALL_MAX and e_pad <= ALIGN_SMALL_MAX_BINS:
        k.align_small_kernel[(1,)](
            ids, map_arg, sorted_ids, expert_ids, counts, num_padded,
            num_assignments, num_experts, num_global, block_size, num_rows, num_blocks,
            CHUNK=_ALIGN_CHUNK, E_PAD=e_pad, BLOCKS_PER_ITER=max(1, min(_next_pow2(num_blocks), 4096 // e_pad)),
            BLOCK_PAD=_next_pow2(block_size), HAS_MAP=has_map, **launch,
        )
        return sorted_ids, expert_ids, num_padded, counts
    if num_chunks:
        k.align_hist_kernel[(num_chunks,)](
            ids, map_arg, hist, num_assignments, num_experts, num_global,
            CHUNK=_ALIGN_CHUNK, E_PAD=e_pad, HAS_MAP=has_map, **launch,
        )
    chunk_rows = max(1, min(_next_pow2(max(num_chunks, 1)), 8192 // e_pad))
    k.align_scan_kernel[(1,)](
        hist, chunk_base, counts, offsets, num_padded, num_chunks, num_experts, block_size,
        CHUNK_ROWS=chunk_rows, E_PAD=e_pad, **launch,
    )
    blocks_per_program = max(1, min(_next_pow2(max(num_blocks, 1)), 4096 // e_pad))
    grid = num_chunks + triton_cdiv(num_blocks, blocks_per_program)
    if grid:
        k.align_scatter_kernel[(grid,)](
            ids, map_arg, chunk_base, offsets, counts, num_padded, sorted_ids, expert_ids,
            num_assignments, num_experts, num_global, block_size, num_rows, num_blocks, num_chunks,
            CHUNK=_ALIGN_CHUNK, E_PAD=e_pad, BLOCKS_PER_PROGRAM=blocks_per_program,
            BLOCK_PAD=_next_pow2(block_size), HAS_MAP=has_map, **launch,
        )
    return sorted_ids, expert_ids, num_padded, counts


def _align_naive(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    num_assignments = ids.numel()
    i32 = dict(dtype=torch.int32, device=device)
    sorted_ids = torch.empty(num_assignments * block_size, **i32)
    expert_ids = torch.empty(num_assignments, **i32)
    counts = torch.empty(num_experts, **i32)
    num_padded = torch.empty(1, **i32)
    _kernels("align").align_naive_kernel[(1,)](
        ids, sorted_ids, expert_ids, counts, num_padded, num_assignments, num_experts, block_size,
        A_PAD=_next_pow2(max(num_assignments, 1)), E_PAD=_next_pow2(num_experts + 1),
        BLOCK_PAD=_next_pow2(block_size), **_launch_options(device),
    )
    return sorted_ids, expert_ids, num_padded, counts


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("moekit::align_block_triton", mutates_args=())
def _align_op(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: Optional[torch.Tensor], allow_naive: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_assignments = topk_ids.numel()
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        return _align_naive(topk_ids.contiguous(), num_experts, block_size)
    num_rows = max_padded_rows(num_assignments, num_experts, block_size)
    return _align_into(topk_ids.contiguous(), num_experts, block_size, expert_map, num_rows,
                       _launch_options(topk_ids.device))


@_align_op.register_fake
def _align_fake(topk_ids, num_experts, block_size, expert_map, allow_naive):
    num_assignments = topk_ids.numel()
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        rows, blocks = num_assignments * block_size, num_assignments
    else:
        rows = max_padded_rows(num_assignments, num_experts, block_size)
        blocks = triton_cdiv(rows, block_size)
    new = dict(dtype=torch.int32, device=topk_ids.device)
    return (torch.empty(rows, **new), torch.empty(blocks, **new), torch.empty(1, **new),
            torch.empty(num_experts, **new))


def align_block_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: torch.Tensor | None = None,
    allow_naive: bool = True,
) -> BlockAlignedLayout:
    """``align_block`` on the device (Triton kernels, no host sync); equal to it element for element."""
    check_align_args(topk_ids, num_experts, block_size, expert_map)
    sorted_ids, expert_ids, num_padded, counts = torch.ops.moekit.align_block_triton(
        topk_ids, num_experts, block_size, expert_map, allow_naive
    )
    num_assignments = topk_ids.numel()
    return BlockAlignedLayout(
        sorted_ids=sorted_ids, expert_ids=expert_ids, num_padded=num_padded, counts=counts,
        block_size=block_size, top_k=topk_ids.shape[1], num_assignments=num_assignments,
        naive=allow_naive and use_naive(num_assignments, num_experts, expert_map),
    )


# ---------------------------------------------------------------------------------------------------
# The fused experts path
# ---------------------------------------------------------------------------------------------------


def _descriptors_allowed(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """16-bit weights, both contiguous with 16-byte aligned rows (what a TMA copy needs). float32 keeps
    the pointer loads: it is the precise path, not the fast one, and only those were run on the H200."""
    return WEIGHT_DESCRIPTORS and all(
        w.element_size() == 2 and w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[2] * 2 % 16 == 0
        for w in (w13, w2)
    )


def _weight_descriptors(w13: torch.Tensor, w2: torch.Tensor, config: KernelConfig):
    """TMA tensor descriptors over w13 as [E*2N, K] and w2 as [E*K, N], blocks of the config's tiles
    (only where ``_descriptors_allowed``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    up, down = config.up, config.down
    return (TensorDescriptor.from_tensor(w13.view(-1, w13.shape[2]), [up.BLOCK_N, up.BLOCK_K]),
            TensorDescriptor.from_tensor(w2.view(-1, w2.shape[2]), [down.BLOCK_N, down.BLOCK_K]))


def _launch_config(config: KernelConfig | None, x: torch.Tensor, num_experts: int, n: int, top_k: int,
                   descriptors: bool) -> KernelConfig:
    """``config``, or the tuned / heuristic one for this shape; on the GPU shrunk to its shared memory."""
    if config is None:
        config = get_config(x.shape[0], num_experts, n, x.shape[1], top_k, x.dtype, device_key(x.device))
    if interpreting():
        return config
    return fit_shared_memory(config, x.element_size(), _max_shared_memory(x.device), descriptors=descriptors)


def _workspace(shape, dtype, device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    return buf.fill_(float("nan")) if POISON_WORKSPACE else buf


def fused_experts(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """The kernels, launched (arguments already checked). ``config`` overrides the tuned lookup."""
    num_tokens, hidden = x.shape
    num_experts, two_n, _ = w13.shape
    n = two_n // 2
    top_k = topk_ids.shape[1]
    num_assignments = num_tokens * top_k
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [M, K]
    if num_assignments == 0:
        return out
    w_desc = _descriptors_allowed(w13, w2)
    config = _launch_config(config, x, num_experts, n, top_k, w_desc)
    ids = topk_ids.contiguous().view(-1)  # [A]
    weights = topk_weights.contiguous().view(-1)  # [A]
    naive = use_naive(num_assignments, num_experts, expert_map)
    launch = _launch_options(x.device)  # decided once for the path's five or so launches
    block_m = 16 if naive else config.BLOCK_M
    if naive:
        sorted_ids = expert_ids = num_padded = ids  # unused: block a is assignment a, expert ids[a]
        num_pid_m = num_assignments
    else:
        num_rows = max_padded_rows(num_assignments, num_experts, block_m)
        num_pid_m = triton_cdiv(num_rows, block_m)
        sorted_ids, expert_ids, num_padded, _ = _align_into(ids, num_experts, block_m, expert_map,
                                                            num_pid_m * block_m, launch)
    common = dict(
        NAIVE=naive, UPCAST=interpreting(), PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **launch,
    )
    gemm = _kernels("gemm")
    w13_op, w2_op = _weight_descriptors(w13, w2, config) if w_desc else (w13, w2)
    work_dtype = torch.float32 if interpreting() else x.dtype
    h = _workspace((num_assignments, n), work_dtype, x.device)  # [A, N] act(gate) * up, assignment order
    up, down = config.up, config.down
    gemm.gate_up_kernel[(num_pid_m * triton_cdiv(n, up.BLOCK_N),)](
        x, w13_op, h, ids, sorted_ids, expert_ids, num_padded,
        n, hidden, num_assignments, top_k, num_experts, num_pid_m,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, GROUP_M=up.GROUP_M,
        ACT=_ACTIVATIONS[activation], W_DESC=w_desc, num_warps=up.num_warps, num_stages=up.num_stages, **common,
    )
    # The k-sum stays a pass of its own even for tiny batches. Three ways to fuse it into the down GEMM
    # measured slower on the H200 (Qwen3-30B-A3B M=1: 8.7 + 2.6 µs for down then sum): one program
    # per token looping over its slots (27.9 µs), one flat (slot, step) loop with CUDA-core sums (39.6
    # µs), and the GEMM's own grid with the last of a token's k programs summing (+1 to +3 µs).
    y = _workspace((num_assignments, hidden), work_dtype, x.device)  # [A, K] weighted per-slot outputs
    gemm.down_kernel[(num_pid_m * triton_cdiv(hidden, down.BLOCK_N),)](
        h, w2_op, y, weights, ids, sorted_ids, expert_ids, num_padded,
        hidden, n, num_assignments, num_experts, num_pid_m,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, GROUP_M=down.GROUP_M,
        W_DESC=w_desc, num_warps=down.num_warps, num_stages=down.num_stages, **common,
    )
    _sum_slots(y, ids, expert_map, out, top_k, num_experts, launch)
    return out


def _sum_slots(
    y: torch.Tensor,  # [A, K] weighted per-slot outputs
    ids: torch.Tensor,  # [A] expert id of each assignment
    expert_map: torch.Tensor | None,
    out: torch.Tensor,  # [M, K], written
    top_k: int,
    num_experts: int,
    launch: dict,  # _launch_options of the device
) -> None:
    """out[t] = sum of y over token t's routed slots (skipped slots are never read)."""
    num_tokens, hidden = out.shape
    has_map = expert_map is not None
    topk_pad = _next_pow2(top_k)
    block_t, block_k = 4, min(_next_pow2(hidden), max(32, 2048 // topk_pad))  # [BT, k, BK] <= 8k elements
    _kernels("combine").sum_slots_kernel[(triton_cdiv(num_tokens, block_t), triton_cdiv(hidden, block_k))](
        y, ids, expert_map if has_map else ids, out,
        num_tokens, hidden, top_k, num_experts, expert_map.numel() if has_map else 0,
        y.stride(0), out.stride(0), out.stride(1),
        BLOCK_T=block_t, BLOCK_K=block_k, TOPK_PAD=topk_pad, HAS_MAP=has_map, **launch,
    )


@torch.library.custom_op("moekit::triton_experts", mutates_args=())
def _experts_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], activation: str,
) -> torch.Tensor:
    return fused_experts(x, w13, w2, topk_ids, topk_weights, expert_map, activation)


@_experts_op.register_fake
def _experts_fake(x, w13, w2, topk_ids, topk_weights, expert_map, activation):
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
) -> torch.Tensor:
    """The experts contract (see ``moekit.experts``) on fused Triton kernels; returns [M, K] in x.dtype."""
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be one of {_DTYPES} for the triton backend, got {x.dtype}")
    if not is_available(x.device):
        raise RuntimeError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {x.device}")
    return torch.ops.moekit.triton_experts(x, w13, w2, topk_ids, topk_weights, expert_map, activation)
