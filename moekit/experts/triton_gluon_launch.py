"""Plan and launches of the Gluon path (``triton_gluon``): tiles, whether this Triton and device can run
it at all, and the three launches (gate-up GEMM, down GEMM, k-slot combine).

The GEMMs (``_kernels/gluon_gemm.py``) need Hopper (compute capability 9.x), CUDA, and a Triton whose
``triton.experimental.gluon`` has the Hopper pieces (3.6 and 3.9 do; their spelling differences are
handled in the kernel module). The combine is a plain Triton kernel, so it also runs in the interpreter.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, replace

import torch

from moekit.triton_bind import COMPILE_OPTIONS

BLOCK_M = 128  # rows per tile = the contiguous layout's segment alignment (one expert per row block)
NUM_WARPS = 8  # the MMA partition: two warpgroups per [BLOCK_M, BLOCK_N] tile; the loader adds one warp
MAX_REGISTERS = 168  # per thread at launch: 12 warps x 32 x 168 fit the SM's 64K; the loader gives its share back
SHARED_BYTES = 227 * 1024  # sm_90's shared memory per program
# The gate-up GEMM gathering its A rows from x in its loader (``_kernels/gluon_gemm_gather.py``, issue 19): the
# loader partition's warps (cp.async row copies + the weights' TMA) and their registers; 12 warps x 32 x 168 at launch
LOADER_WARPS, LOADER_REGS = 4, 64
# experts at most this wide (N) take the in-loader gather on the bf16 route; wider ones the gather kernel + TMA reads
# of x_perm. Qwen3 (N = 768) against the gather kernel, whole call, graph rounds: M = 1024 / 2048 / 3072 / 4096 / 8192
# / 16384 1.106x (>= 3% in 9 of 9) / 1.065x (7/7), 1.052x (9/9) / 1.013x (5/9) / 1.016x (3/7), 1.023x (2/9) /
# 1.018x (2/7), 1.020x (0/9) / 1.017x (3/7), 1.029x (6/9); the kernels' profiled sum 5.5-7% less. Wide experts lose
# (Mixtral 4096 0.95x, DeepSeek-V3 8192 0.97-0.99x): raw/NVIDIA_H200-2026-12-03-0f5a314-gather-ck1.log, -3867e94-...;
# on merged main (-b89fbea-gather-merged.log) the route so chosen: 1.011-1.035x at Qwen3 2048-16384, 3-5 of 9 >= 3%
LOADER_GATHER_MAX_INTER = 1024
_KERNELS = "moekit.experts._kernels"


@dataclass(frozen=True)
class GluonTile:
    """One GEMM's tile and pipeline: [BLOCK_M, block_n] outputs, block_k reduction steps, ``stages``
    SMEM slots, ``group_m`` row blocks sharing each column block in the persistent walk. ``tail`` (64; 0: off, the
    down GEMM only): a row block whose next block is the same expert's last one, holding at most 64 real rows, also
    computes that block's first 64 rows from the same weight stages, and the last block's own tiles are skipped
    (``triton_gluon_tail``, the padding tax). ``blk256``: a tile covers up to 256 rows of one expert (two row
    blocks), its 64-row sub-tiles past the expert's real rows skipped; the weight stage's ``block_n`` = 128 rows are
    64 gate + 64 up rows (``triton_gluon_blk256``; the gate-up GEMM only: the down GEMM on such tiles and a
    ``spread`` form lost in session 28, removed, history 5d589df). (64-row tiles and one consumer warpgroup: measured
    at the ridge in sessions 18 and 20, no win; removed.)"""

    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    group_m: int = 8
    tail: int = 0
    blk256: bool = False

    def __post_init__(self):
        if self.block_n not in (64, 128, 256) or self.block_k not in (32, 64, 128):
            raise ValueError(f"block_n={self.block_n}, block_k={self.block_k}: 64/128/256 and 32/64/128")
        if self.stages < 2 or self.group_m < 1:
            raise ValueError(f"stages={self.stages} (>= 2), group_m={self.group_m} (>= 1)")
        if self.tail not in (0, 64):
            raise ValueError(f"tail={self.tail}: 0 (off) or 64")
        if self.blk256 and (self.block_n != 128 or self.tail):
            raise ValueError(f"blk256={self.blk256} with block_n={self.block_n} (128), tail={self.tail} (none)")

    def shared_bytes(self, gated: bool, element_size: int = 2) -> int:
        """SMEM of one program: stages x (activation tile + the tail's + one or two weight tiles) + the output
        tiles (the tail's too); blk256 (gate-up): stages x (256 + 128 rows) + two [128, 64] output buffers."""
        if self.blk256:
            return element_size * (self.stages * (2 * BLOCK_M + self.block_n) * self.block_k + BLOCK_M * self.block_n)
        stage = (BLOCK_M + self.tail + (2 if gated else 1) * self.block_n) * self.block_k
        return element_size * (self.stages * stage + (BLOCK_M + self.tail) * self.block_n)

    def accumulator_registers(self, gated: bool) -> int:
        """float32 accumulator registers per MMA thread (one or two [BLOCK_M + tail, block_n] tiles; blk256: one
        [128, 128] a 4-warp consumer)."""
        if self.blk256:
            return BLOCK_M * self.block_n // (32 * 4)
        return (2 if gated else 1) * (BLOCK_M + self.tail) * self.block_n // (32 * NUM_WARPS)


def check_tile(tile: GluonTile, gated: bool, element_size: int = 2) -> None:
    """Raise (naming the tile) where it cannot run: SMEM over sm_90's, accumulators over 128 registers a
    thread (the rest of the partition's registers hold addresses, the epilogue and the wgmma operands), a tail on
    the gate-up GEMM (measured slower everywhere: its 3 stages; removed), 256-row tiles on the down GEMM (slower:
    removed)."""
    if gated and tile.tail:
        raise ValueError(f"tile={tile}: a tail is for the down GEMM only")
    if not gated and tile.blk256:
        raise ValueError(f"tile={tile}: 256-row tiles are for the gate-up GEMM only")
    smem = tile.shared_bytes(gated, element_size)
    if smem > SHARED_BYTES:
        raise ValueError(f"tile={tile} ({'gate-up' if gated else 'down'}): {smem} B of SMEM > {SHARED_BYTES}")
    if tile.accumulator_registers(gated) > 128:
        raise ValueError(f"tile={tile} ({'gate-up' if gated else 'down'}): "
                         f"{tile.accumulator_registers(gated)} accumulator registers a thread > 128")


@dataclass(frozen=True)
class GluonPlan:
    """Rows and tiles of one call: rows T of the permuted buffer (static, no host sync), the gate-up
    GEMM's tile and the down GEMM's."""

    rows: int
    up: GluonTile
    down: GluonTile


# Shared memory per program (bf16): stages x (A tile + weight tiles) + the output tile, within sm_90's 227 KB
UP_TILE = GluonTile(block_n=128, block_k=64, stages=4)  # 4 x 48 KB ring + 32 KB out = 224 KB
DOWN_TILE = GluonTile(block_n=128, block_k=64, stages=6)  # 6 x 32 KB ring + 32 KB out = 224 KB
# Narrow experts (Qwen3-30B-A3B, N = 768: a 12-step reduction): the down GEMM's row blocks in plain order,
# not GROUP_M-swizzled: 317 / 763 us against 379 / 919 at M = 4096 / 16384; the wider shapes lose 5-20%
# with it (H200, benchmarks/results/raw/NVIDIA_H200-2026-12-01-gluon-run2.json's tile variants).
NARROW_INTER = 1024
NARROW_DOWN_TILE = GluonTile(block_n=128, block_k=64, stages=6, group_m=1)
# 256-row tiles (``GluonTile.blk256``): one row block's column blocks in turn (its A sub-tiles shared in L2 by the
# programs running them, each expert's weight rows read in order). The gate-up GEMM only (a down one, 3 stages, was
# 1.5-2x slower alone than DOWN_TILE at every cell of session 28's CK1: removed, history 5d589df)
BLK256_UP_TILE = GluonTile(block_n=128, block_k=64, stages=4, group_m=1, blk256=True)  # 4 x 48 KB + 2 x 16 KB out


# The padding tax (issue 19): the route's down GEMM folds an expert's mostly empty last 128-row block into the tiles
# of the block before it (``GluonTile.tail``) where the call's assignments per expert M*k/E lie in TAIL_PER_EXPERT
# for experts wider than NARROW_INTER: about half the experts then end 1-40 rows past a block. Its 4 stages (not 6)
# make every other tile slower, so it pays only there. H200 run 1 (raw/NVIDIA_H200-2026-12-03-1008e29-prefill5-ck1.log,
# 7 interleaved graph rounds): DeepSeek-V3 M = 4096 (M*k/E = 128, 123 of 379 blocks folded) the lean launch with it
# 7421 us against the route's fused kernels 8036 (1.083x, >= 3% in 6 of 7), its down GEMM alone 2668 against 2912;
# slower where few blocks fold: Qwen3 4096 (256 a expert, narrow) 0.99x, Mixtral 4096 0.94x, DeepSeek-V3 16384 0.88x
TAIL_PER_EXPERT = (112, 160)


def wants_tail(num_tokens: int, top_k: int, num_experts: int, inter: int) -> bool:
    """Whether the route's down GEMM takes the tail (``TAIL_PER_EXPERT``, experts wider than ``NARROW_INTER``)."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    return inter > NARROW_INTER and TAIL_PER_EXPERT[0] <= per_expert <= TAIL_PER_EXPERT[1]


# The gate-up GEMM on 256-row tiles where M*k/E lies in BLK256_UP_PER_EXPERT for experts at least BLK256_UP_MIN_INTER
# wide: an expert ending 1-40 rows past a 128-row block no longer streams its weight tiles twice. H200 CK1 of session
# 28 (raw/NVIDIA_H200-2026-12-04-c12ba1e-blk256-ck1.log, graph replay, 5 interleaved rounds): Mixtral M = 512 (128
# an expert) the lean launch with it 894.8 us against the route's 940.5 (1.051x, >= 3% in 5 of 5), its gate-up alone
# 579 against 631 us; slower where experts hold ~256 rows or are narrow: Mixtral 1024 0.926x, Qwen3 4096 0.82x
# (against the route's in-loader gather); DeepSeek-V3 4096 (N = 2048, 128 an expert) 0.956x, gate-up alone 5339
# against 4670 us under uniform routing (4139 against 4442 balanced)
BLK256_UP_PER_EXPERT = (112, 160)
BLK256_UP_MIN_INTER = 8192


def up_tile(num_tokens: int, top_k: int, num_experts: int, inter: int) -> GluonTile:
    """The route's gate-up tile: ``BLK256_UP_TILE`` where M*k/E lies in ``BLK256_UP_PER_EXPERT`` and the experts
    are at least ``BLK256_UP_MIN_INTER`` wide, else ``UP_TILE``."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    wide = inter >= BLK256_UP_MIN_INTER and BLK256_UP_PER_EXPERT[0] <= per_expert <= BLK256_UP_PER_EXPERT[1]
    return BLK256_UP_TILE if wide else UP_TILE


def plan_gluon(num_tokens: int, top_k: int, num_experts: int, inter: int) -> GluonPlan:
    """The plan of a call (``inter``: N); its rows hold any routing of the M*k assignments
    (``max_padded_rows``); the gate-up tile ``up_tile``'s, the down tile with the tail where ``wants_tail``."""
    from moekit.layouts.grouping import max_padded_rows

    rows = max_padded_rows(num_tokens * top_k, num_experts, BLOCK_M)
    return GluonPlan(rows=rows, up=up_tile(num_tokens, top_k, num_experts, inter),
                     down=down_tile(inter, wants_tail(num_tokens, top_k, num_experts, inter)))


def down_tile(inter: int, tail: bool = False) -> GluonTile:
    """The down GEMM's tile for experts ``inter`` (N) wide; ``tail``: with the 64-row tail (``with_tail``)."""
    tile = NARROW_DOWN_TILE if inter <= NARROW_INTER else DOWN_TILE
    return with_tail(tile) if tail else tile


def with_tail(tile: GluonTile) -> GluonTile:
    """The down ``tile`` with the 64-row tail and the most stages (at most its own) that fit sm_90: 4 (4 x 40 KB ring
    + 48 KB out)."""
    for stages in range(tile.stages, 1, -1):
        candidate = replace(tile, tail=64, stages=stages)
        if candidate.shared_bytes(gated=False) <= SHARED_BYTES:
            return candidate
    raise ValueError(f"tile={tile}: no stage count fits with a tail")


@functools.cache
def gluon_importable() -> bool:
    """Whether this Triton ships the Gluon Hopper pieces the kernels use (warp specialization, wgmma,
    mbarriers, TMA under either of its names, host tensor descriptors)."""
    try:
        gl = importlib.import_module("triton.experimental.gluon.language")
        hopper = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper")
        importlib.import_module("triton.experimental.gluon.nvidia.hopper").TensorDescriptor  # noqa: B018
    except (ImportError, AttributeError):
        return False
    tma = hopper.tma
    has_load = hasattr(tma, "async_load") or hasattr(tma, "async_copy_global_to_shared")
    has_store = hasattr(tma, "async_store") or hasattr(tma, "async_copy_shared_to_global")
    return has_load and has_store and all(
        hasattr(m, n) for m, n in ((gl, "warp_specialize"), (hopper, "warpgroup_mma"), (hopper, "mbarrier")))


def gluon_supported(device: torch.device | str) -> bool:
    """Whether the Gluon GEMMs can run on ``device``: CUDA, compute capability 9.x (Hopper: wgmma + TMA;
    Blackwell has neither wgmma nor this schedule), a Gluon-capable Triton, and not the interpreter."""
    if device.__class__ is not torch.device:
        device = torch.device(device)
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _hopper_with_gluon(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_with_gluon(index: int) -> bool:
    """Device ``index`` is a Hopper (9.x) and this Triton has Gluon: asked once per device (a call asks per call)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index)[0] == 9 and gluon_importable()


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The persistent GEMMs' program count bound: the device's SMs (1 off CUDA: the CPU tests' stand-in kernels)."""
    return _num_sms(device.index or 0) if device.type == "cuda" else 1


@functools.lru_cache(maxsize=64)
def _shared_layout(block: tuple, dtype: torch.dtype):
    from triton.experimental.gluon import language as gl

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv,
                torch.float32: gl.float32, torch.int8: gl.int8, torch.uint8: gl.uint8,
                torch.int32: gl.int32}[dtype]  # float32: fp8 x_q under the interpreter
    # (the CPU tests); int8 / uint8 / int32: the weight-only GEMM's stored weights (``triton_gluon_wo``)
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def gluon_descriptor(t: torch.Tensor, block) -> object:
    """A Gluon TMA descriptor over the 2-D ``t`` in ``block`` tiles (its shared layout built once per block, dtype)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _shared_layout(tuple(block), t.dtype))


def launch_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                rows_used: torch.Tensor, tile: GluonTile, gated: bool, w_rows: int, gate_offset: int = 0,
                sorted_ids: torch.Tensor | None = None, num_assignments: int = 0) -> None:
    """out [T, C] = act(a [T, R] @ w[e]^T) per row block; w [E*w_rows, R] (contiguous 2-D view);
    block_experts [T // BLOCK_M] int32; rows_used: a 1-element integer tensor (rows in use, a multiple
    of BLOCK_M, <= T). A tile with a ``tail`` or ``blk256`` reads the layout's sorted_ids [T] (>= num_assignments:
    padding)."""
    if tile.blk256:
        from moekit.experts.triton_gluon_blk256 import launch_blk256_gemm

        if sorted_ids is None or not gated:
            raise ValueError(f"tile={tile}: blk256 needs the layout's sorted_ids and the gate-up GEMM (gated={gated})")
        launch_blk256_gemm(a, w, out, block_experts, sorted_ids, rows_used, num_assignments, tile, w_rows,
                           gate_offset)
        return
    if tile.tail:
        from moekit.experts.triton_gluon_tail import launch_tail_down

        if sorted_ids is None or gated:
            raise ValueError(f"tile={tile}: a tail needs the layout's sorted_ids and the down GEMM (gated={gated})")
        launch_tail_down(a, w, out, block_experts, sorted_ids, rows_used, num_assignments, tile, w_rows)
        return
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm").grouped_gemm_kernel
    a_desc = gluon_descriptor(a, [BLOCK_M, tile.block_k])
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    num_col_blocks = out.shape[1] // tile.block_n
    max_tiles = -(-a.shape[0] // BLOCK_M) * num_col_blocks
    grid = (max(1, min(num_sms(a.device), max_tiles)),)
    kernel[grid](a_desc, w_desc, c_desc, block_experts, rows_used, a.shape[1], num_col_blocks,
                 W_ROWS=w_rows, GATE_OFFSET=gate_offset, GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                 num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS)


def loader_gather_fits(x: torch.Tensor) -> bool:
    """Whether the in-loader gather can read x: 2-byte elements, rows 16-byte aligned (its 16-byte cp.async pieces)."""
    return x.element_size() == 2 and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def wants_loader_gather(x: torch.Tensor, inter: int) -> bool:
    """Whether a bf16/fp16 call on x with experts ``inter`` (N) wide takes the in-loader gather: N at most
    ``LOADER_GATHER_MAX_INTER`` (read per call) and x fits it."""
    return inter <= LOADER_GATHER_MAX_INTER and loader_gather_fits(x)


def launch_gather_gemm(x: torch.Tensor, sorted_ids: torch.Tensor, dst: torch.Tensor, w: torch.Tensor,
                       out: torch.Tensor, block_experts: torch.Tensor, rows_used: torch.Tensor, top_k: int,
                       tile: GluonTile) -> None:
    """out [T, N] = silu(x[tok] @ w[e, :N]^T) * (x[tok] @ w[e, N:]^T) per row r (tok = sorted_ids[r] // top_k),
    the rows gathered in the GEMM's loader; writes dst [A] (the row of each real assignment). w [E*2N, K]
    (contiguous 2-D view of w13); x fits ``loader_gather_fits``."""
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_gather").gather_gate_up_kernel
    inter = out.shape[1]
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    num_col_blocks = inter // tile.block_n
    grid = (max(1, min(num_sms(x.device), -(-out.shape[0] // BLOCK_M) * num_col_blocks)),)
    kernel[grid](x, sorted_ids, dst, w_desc, c_desc, block_experts, rows_used, dst.numel(), x.stride(0), x.shape[1],
                 num_col_blocks, TOP_K=top_k, W_ROWS=2 * inter, GATE_OFFSET=inter, STAGES=tile.stages,
                 GROUP_M=tile.group_m, LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=NUM_WARPS,
                 maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS)


def launch_gather_rows(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int, x_perm: torch.Tensor,
                       dst: torch.Tensor, block_r: int = 16, block_k: int = 512) -> None:
    """x_perm[r] = x[sorted_ids[r] // k] and dst[sorted_ids[r]] = r for the real rows (sorted_ids[r] <
    dst.numel() = A); padding rows of x_perm are left as they are. dst [A] int32, filled with -1 by the caller."""
    kernel = importlib.import_module(f"{_KERNELS}.contiguous").gather_rows_kernel
    rows, hidden = x_perm.shape
    grid = (-(-rows // block_r), -(-hidden // block_k))
    kernel[grid](x, sorted_ids, x_perm, dst, rows, dst.numel(), hidden, x.stride(0), x_perm.stride(0),
                 TOP_K=top_k, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4, **COMPILE_OPTIONS)


@dataclass(frozen=True)
class SumTile:
    """The k-slot combine's program (``_kernels/contiguous.contiguous_sum_kernel``): ``block_t`` tokens x ``block_k``
    columns, ``num_warps`` warps. Every tile sums the same slots in the same order: equal outputs bit for bit."""

    block_t: int = 16
    block_k: int = 256
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_t", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name}={v}: a power of two")


# The combine reads M*k rows of y [R, K] bf16 once (537 MB at Qwen3-30B-A3B M = 16384: near the copy rate), so its
# tile only sets how many rows a program has in flight. 32 x 128 (4 warps) was faster alone in session 26's first run
# (1.01-1.09x at five prefill cells) but not on merged main (raw/NVIDIA_H200-2026-12-04-b32c0fb-pre6-merged.log: alone
# 1.02x / 1.03x / 1.11x / 1.00x at Qwen3 16384 / 4096, DeepSeek-V3 4096 / 16384, 0.97x / 0.96x at Mixtral 4096 /
# 16384; whole calls >= 3% in at most 4 of 7 rounds): this tile stays. 8-warp tiles lost in both runs.
SUM_TILE = SumTile()


def launch_contiguous_sum(y: torch.Tensor, dst: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                          tile: SumTile = SUM_TILE) -> None:
    """out [M, K] = sum_j weights[t, j] * y[dst[t, j]] (dst [M, k] int32, -1 = not routed here)."""
    kernel = importlib.import_module(f"{_KERNELS}.contiguous").contiguous_sum_kernel
    num_tokens, top_k = dst.shape
    hidden = out.shape[1]
    grid = (-(-num_tokens // tile.block_t), -(-hidden // tile.block_k))
    kernel[grid](y, dst, weights, out, dst, dst, num_tokens, hidden, y.stride(0), out.stride(0), 0, 0,
                 TOP_K=top_k, BLOCK_T=tile.block_t, BLOCK_K=tile.block_k,
                 num_warps=tile.num_warps, **COMPILE_OPTIONS)  # ids and map unread (FROM_IDS off)
