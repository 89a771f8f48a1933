"""The gate GEMM on tensor cores for MAX_ROWS >= M > ``gate.MAX_TOKENS`` rows, alone or with the fused router in the
same launch: x [M, K] -> router logits [M, E] (-> ``Routing`` [M, k(+S)]), written into a caller's buffers.

    [Gate (-> Route + shared slots), one launch] -> Capacity (opt-in) -> Group -> Experts -> Combine

Why: above 8 rows the gate was ``torch.mm`` (cuBLAS: 13-20 µs of host per call on the H200) and the router its own
launch; here both are one raw Triton launch (``_kernels/gate_mma_kernel.py``). Torch twin: ``F.linear`` then
``moekit.routing.route`` (the tests check both). The logits' bits are this kernel's (its K order), not cuBLAS's:
every path that gates 9..MAX_ROWS rows on the kernel takes this one (``moekit.routing.gate``), so eager, captured
and stats calls agree.

Each kind of call (M, K, E, dtypes, strides, alignment, the router's plan) is bound once (``BoundGateMma``). The
scratch it needs (the split-K partials and the counters, ``scratch_sizes``) lives in the caller's buffers
(``moekit.routing.workspace``), never shared by two launches in flight.

Shapes: M tokens, K hidden, E experts, k + S slots.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from moekit.routing import fused
from moekit.triton_bind import BoundLaunch, interpreting, next_pow2

MAX_ROWS = 256  # rows up to which the gate runs on this kernel (issue 13: the layer's memory-bound batches)
NUM_WARPS = 4
# Float32 logits run an FMA dot (no float32 MMA at ieee): a serial FFMA chain over a program's K slice for each of a
# thread's block_m x block_e / 128 outputs (Qwen3's gate at 64 rows: 2048 FFMAs a thread, V3's at 256: 28672).
# FP32_BLOCK_E = B: expert blocks of at most B over the same split of K, so more programs of shorter chains and the same
# bits (an output's chain and the split sum unchanged; bf16 tiles untouched; ``benchmarks/gate52_compile_cpu.py``).
# None (session 51's tiles) until a device measures it (``benchmarks/gate52_device_check.py``: not run in session 52).
# Read where a launch is bound (a kind of call's first call); the scratch has room for any value.
FP32_BLOCK_E: int | None = None


@dataclass(frozen=True)
class MmaTiles:
    """A launch's tiles: programs (row blocks, expert blocks, K splits), each an fp32 tile [block_m, block_e] over
    k_per_split columns of K stepped by block_k; the router then takes route_m rows at a time."""

    block_m: int
    block_e: int
    block_k: int
    split_k: int
    num_stages: int = 3

    def grid(self, m: int, e: int) -> tuple[int, int, int]:
        return (-(-m // self.block_m), -(-e // self.block_e), self.split_k)

    def k_per_split(self, k: int) -> int:
        """K columns per split, a multiple of block_k (the last split may hold fewer)."""
        steps = -(-k // self.block_k)
        return -(-steps // self.split_k) * self.block_k


def mma_tiles(m: int, e: int, k: int, dtype: torch.dtype, fp32_block_e: int | None = None) -> MmaTiles:
    """The tiles for [M, K] x [K, E]: 16-row blocks (the router's parallelism: one routing program per row block),
    all experts of a row in one or two tiles, K split until the grid has about 128 programs. Float32 logits:
    expert blocks of ``fp32_block_e`` at most (None: the one or two tiles), over the same split of K."""
    if fp32_block_e is not None and (fp32_block_e < 16 or fp32_block_e & (fp32_block_e - 1)):
        raise ValueError(f"fp32_block_e (gate_mma.FP32_BLOCK_E): a power of 2 of 16 or more (tl.dot's least "
                         f"block, the scratch's room), or None; got {fp32_block_e}")
    block_m = 16 if m <= 64 else 32
    block_e = max(16, min(128, next_pow2(e)))
    block_k = 64 if dtype == torch.float32 else 128
    tiles = -(-m // block_m) * -(-e // block_e)
    split = 1
    while tiles * split * 2 <= 128 and k // (block_k * split * 2) >= 2:
        split *= 2
    if dtype == torch.float32 and fp32_block_e is not None:  # K's order (the bits) is the split's: kept above
        block_e = min(block_e, fp32_block_e)
    return MmaTiles(block_m, block_e, block_k, split)


def scratch_sizes(m: int, e: int, k: int, dtype: torch.dtype, tiles: MmaTiles | None = None) -> tuple[int, int]:
    """(counter elements int32, partial elements fp32) a launch of M rows needs (float32: counters for any
    ``FP32_BLOCK_E``); (0, 0) outside the kernel's rows."""
    tiles = mma_tiles(m, e, k, dtype, FP32_BLOCK_E) if tiles is None else tiles
    rb, eb, split = tiles.grid(m, e)
    if dtype == torch.float32:  # room for 16-expert blocks: buffers kept before FP32_BLOCK_E changed stay large enough
        eb = max(eb, -(-e // 16))
    return rb * (eb + 1), (split * m * e if split > 1 else 0)


def kernels():
    """The kernel module, imported on first use (Triton decides at decoration whether it is interpreted)."""
    return importlib.import_module("moekit.routing._kernels.gate_mma_kernel")


def _route_rows(plan, block_m: int) -> int:
    """Rows the router takes at a time: about 2048 tile elements on 4 warps, a divisor of block_m."""
    return max(1, min(block_m, 2048 // plan.cols))


class BoundGateMma:
    """One kind of call, decided once: the bound launch (gate only with ``plan`` None, else gate and router) and,
    with nonfinite="raise" where the kernel cannot assert itself, the router's flag."""

    __slots__ = ("launch", "ok", "check_finite", "tiles", "scratch")

    def __init__(self, plan, x: torch.Tensor, weight: torch.Tensor, linear_bias: torch.Tensor | None,
                 bias: torch.Tensor | None = None, gate_logits: torch.Tensor | None = None,
                 assert_in_kernel: bool = False, tiles: MmaTiles | None = None,
                 dtype: torch.dtype | None = None) -> None:
        m, e, k = x.shape[0], weight.shape[0], weight.shape[1]
        dtype = x.dtype if dtype is None else dtype  # the logits' (the router dtype): x and W read as stored
        options = fused._launch_options(x.device)
        precise = options["PRECISE"]
        self.tiles = tiles = mma_tiles(m, e, k, dtype, FP32_BLOCK_E) if tiles is None else tiles  # float32's
        self.scratch = scratch_sizes(m, e, k, dtype, tiles)
        # bf16 / fp16 x or W for float32 logits (``gate.reads_as``): upcast in registers, then the float32 inputs'
        # ieee dot, on the GPU an FMA chain over K in K's order whatever the operands' load layout
        upcast = interpreting() or x.dtype != dtype or weight.dtype != dtype
        scalars = (m, k, x.stride(0), weight.stride(0), 0 if bias is None else bias.stride(0),
                   0 if gate_logits is None else gate_logits.stride(0), 1.0 if plan is None else plan.scaling,
                   tiles.k_per_split(k))
        constexprs = dict(NUM_EXPERTS=e, BLOCK_M=tiles.block_m, BLOCK_E=tiles.block_e, BLOCK_K=tiles.block_k,
                          SPLIT_K=tiles.split_k, IEEE=dtype == torch.float32, UPCAST=upcast,
                          HAS_LINEAR_BIAS=linear_bias is not None,
                          ROUTE=plan is not None, PDL=options["PDL"], num_warps=NUM_WARPS,
                          num_stages=tiles.num_stages)  # not launched with PDL
        in_kernel = False
        if plan is not None:
            in_kernel = assert_in_kernel and precise  # the interpreter: the flag
            constexprs.update(**plan.constexprs, ROUTE_M=_route_rows(plan, tiles.block_m),
                              TOP2=plan.top2[bias is not None], HAS_BIAS=bias is not None,
                              HAS_GATE=gate_logits is not None, PRECISE=precise, enable_reflect_ftz=False)
            if in_kernel and plan.check_finite:
                constexprs.update(CHECK_FINITE=False, ASSERT_FINITE=True, debug=True, sanitize_overflow=False)
        self.launch = BoundLaunch(kernels().gate_mma_kernel, tiles.grid(m, e), 11, scalars, True, **constexprs)
        self.check_finite = plan is not None and plan.check_finite
        flag = self.check_finite and not in_kernel
        self.ok = torch.ones(1, dtype=torch.int32, device=x.device) if flag else None  # [1], as _BoundRoute's

    def __call__(self, x, weight, linear_bias, bias, gate_logits, buffers) -> None:
        """Launch into ``buffers`` (``RouteBuffers`` of this kind of call: logits [M, E], with the router ids and
        weights [M, k+S]; its count holds ``scratch[0]`` int32 zeros, its part ``scratch[1]`` fp32 elements)."""
        self.launch(*self.pointers(x, weight, linear_bias, bias, gate_logits, buffers))

    def pointers(self, x, weight, linear_bias, bias, gate_logits, buffers) -> tuple:
        """The launch's pointer arguments (``moekit.layer_fast`` records them once for a joined launch)."""
        ok, count = self.ok, buffers.count
        return (x, weight, weight if linear_bias is None else linear_bias, buffers.logits, buffers.part, count,
                x if bias is None else bias, x if gate_logits is None else gate_logits, buffers.ids, buffers.weights,
                count if ok is None else ok)
