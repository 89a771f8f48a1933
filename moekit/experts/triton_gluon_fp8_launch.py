"""Tiles and launches of the fp8 Gluon path (``triton_gluon_fp8``): the gather that quantizes x into the
contiguous layout (a plain Triton kernel: it also runs in the interpreter) and the block-scaled Gluon GEMM
(``_kernels/gluon_gemm_fp8.py``: Hopper only). The combine is the bf16 path's (``triton_gluon_launch``).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from moekit.experts.triton_gluon_launch import BLOCK_M, gluon_descriptor, num_sms
from moekit.experts.triton_launch import cdiv, interpreting
from moekit.triton_bind import COMPILE_OPTIONS

GROUP = 128  # the scale blocks (weights 128 x 128, activations 1 x 128) = the GEMM's BLOCK_N and BLOCK_K
HALF_M = BLOCK_M // 2  # rows per consumer warpgroup
CONSUMER_WARPS = 4  # the default partition (consumer 0); consumer 1 (4 warps) and the loader (1 warp) added
GATHER_ROWS = 16  # rows per program of the gather-quantize kernel
GATHER_GROUPS = 1  # 128-column groups per program of the gather-quantize kernel (the plan's without the wide tile)
WIDE_GATHER_GROUPS = 4  # with the wide down tile (a power of 2: the kernel's tl.arange)
WIDE_MIN_ROWS = 4096  # assignments per local expert from which the plan takes the wide down tile
# Where the plan takes the pipelined down tile (``wants_pipelined_down``): the shape and the bucket of assignments per
# local expert the H200 measured it faster at (Mixtral-8x7B, M = 1024 at top-2: 256), with an even count of down K-steps
PIPE_DOWN_SHAPES = ((8, 4096, 14336),)  # (local experts E, hidden K, inter N)
PIPE_DOWN_ROWS = (256, 512)  # M * k / E in [256, 512): Mixtral-8x7B M = 1024-2047
_KERNELS = "moekit.experts._kernels"


@dataclass(frozen=True)
class Fp8GluonTile:
    """One fp8 GEMM's pipeline (the tile is [128, 128] outputs by 128-wide K-steps, fixed by the scale
    blocks): ``stages`` SMEM slots, ``group_m`` row blocks sharing each column block in the persistent
    walk; registers: ``max_registers`` per thread at launch (12 warps: the loader's one is padded to a
    warpgroup; 12 x 32 x 160 of the SM's 64K), then ``consumer_regs`` for consumer 1, 24 for the loader and
    the rest (3 x max_registers - 24 - consumer_regs, at most 256) for consumer 0. 160 / 224 (consumer 0:
    232) is a split ptxas compiles without spills; 168 / 232 (consumer 0: 248) spilled ~11 registers in the
    gate-up K loop (ptxas -v on the sm_90a PTX: ``benchmarks/gluon_fp8_compile_cpu.py``)."""

    stages: int = 4
    group_m: int = 8
    consumer_regs: int = 224
    max_registers: int = 160
    wide: bool = False  # down GEMM: [128, 256] tiles, two weight column blocks per A stage (the kernel's WIDE)
    pipelined: bool = False  # two wgmmas in flight, one's part folded in under the other (the kernel's PIPE)

    @property
    def block_n(self) -> int:
        """Output columns per tile."""
        return 2 * GROUP if self.wide else GROUP


# SMEM per program: stages x (two A halves 2 x 8 KB + weight tiles 16 KB each) + two output halves, of 227 KB.
# Stages from the H200's variants at M=4096 (benchmarks/results/raw/NVIDIA_H200-2026-12-02-e30386d-fp8_gluon.*):
# gate-up 3 against 4: Mixtral 1725 / 1918 us, DeepSeek-V3 2741 / 2713, Qwen3 250 / 250; down 5 against 6:
# DeepSeek-V3 1480 / 1644, Mixtral 968 / 973, Qwen3 150 / 149.
UP_TILE = Fp8GluonTile(stages=3)  # 3 x 48 KB + 2 x 8 KB e4m3 h = 160 KB
DOWN_TILE = Fp8GluonTile(stages=5)  # 5 x 32 KB + 2 x 16 KB bf16 y = 192 KB
WIDE_DOWN_TILE = Fp8GluonTile(stages=3, wide=True)  # 3 x 48 KB + 4 x 16 KB bf16 y = 208 KB
# The pipelined promotion (issue 15, sessions 31-32): the down GEMM's K-steps in pairs (sm_90a, ptxas -v, Triton 3.6 /
# 3.9: no spills, not serialized), the plan's at PIPE_DOWN_SHAPES / ROWS. The gate-up's (64-column halves chained, 224 /
# 264 B of spill stores) lost 0.67-0.70x alone on the H200 (session 32) and was removed (history: c7e4995).
PIPELINED_DOWN_TILE = Fp8GluonTile(stages=5, pipelined=True)


@dataclass(frozen=True)
class Fp8GluonVariant:
    """What a call with expert biases or a gated activation variant adds to the two GEMMs (issue #15; the defaults:
    a plain call, the kernels of before): the gate-up GEMM's INTERLEAVED / ACT / ALPHA / LIMIT / UP_SHIFT /
    LIMIT_AFTER constexprs (``moekit.activations.ActivationSpec``'s fields, ``gemm._glu``'s) and whether b13 / b2
    are given (each a pointer of its GEMM; None passed where absent). Hashable: in the lean plans' keys."""

    interleaved: bool = False  # w13's gate j at row 2j, up j at 2j + 1 (gpt-oss)
    act: int = 0  # ACTIVATIONS[name].kernel_id (0: silu)
    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0
    b13: bool = False
    b2: bool = False
    limit_after: bool = False  # min(act(gate), limit), not act(min(gate, limit)) (Step-3.7, Bailing-Hybrid)

    def gate_up_constexprs(self) -> dict:
        """The gate-up GEMM's variant constexprs (the down GEMM takes none: its b2 is a pointer)."""
        return dict(INTERLEAVED=self.interleaved, ACT=self.act, ALPHA=self.alpha, LIMIT=self.limit,
                    UP_SHIFT=self.up_shift, LIMIT_AFTER=self.limit_after)

    def gate_offset(self, inter: int) -> int:
        """The gate-up GEMM's second weight tile, rows past its first: the up rows N + c.., or (interleaved) the
        next 128 rows in place."""
        return GROUP if self.interleaved else inter


PLAIN_VARIANT = Fp8GluonVariant()


@functools.lru_cache(maxsize=256)
def _variant(activation, b13: bool, b2: bool) -> Fp8GluonVariant:
    from moekit.activations import as_spec

    spec = as_spec(activation)
    return Fp8GluonVariant(spec.interleaved, spec.kernel_id, float(spec.alpha),
                           None if spec.limit is None else float(spec.limit), float(spec.up_shift), b13, b2,
                           spec.limit_after_act)


def variant_of(activation, b13: torch.Tensor | None, b2: torch.Tensor | None) -> Fp8GluonVariant:
    """The variant of a call (a gated ``activation``, str or spec; the biases, or None): built once per kind."""
    if activation == "silu" and b13 is None and b2 is None:  # the plain call: no lookup
        return PLAIN_VARIANT
    return _variant(activation, b13 is not None, b2 is not None)


@dataclass(frozen=True)
class Fp8GluonPlan:
    """Rows T of the permuted buffer (any routing fits: no host sync), the two GEMMs' pipelines and the gather's
    128-column groups per program."""

    rows: int
    up: Fp8GluonTile
    down: Fp8GluonTile
    gather_groups: int


def wants_wide_down(num_tokens: int, top_k: int, num_experts: int, hidden: int) -> bool:
    """Whether the plan takes the wide down tile with the 4-group gather: M * k / E >= 4096 assignments per local
    expert and K a multiple of 256 (``check_wide``). H200, graph replay, 9 interleaved rounds (3fffd14): Mixtral
    M = 16384 (4096 rows per expert) 11595 against 12059 µs (1.040x, >= 3% faster in 9/9; 74.5% of the fp8 mm
    rate against 71.6%); Qwen3 M = 16384 (1024) 1.032x in 7/9, DeepSeek-V3 M = 4096 (128) 1.018x in 0/5: not taken
    there."""
    return num_tokens * top_k >= WIDE_MIN_ROWS * num_experts and hidden % WIDE_DOWN_TILE.block_n == 0


def wants_pipelined_down(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int | None) -> bool:
    """Whether the plan takes the pipelined down tile: (E, K, N) in PIPE_DOWN_SHAPES, M * k / E in PIPE_DOWN_ROWS,
    and an even count of down K-steps (N / 128: the pipelined loop's odd last step is not measured on the device).
    H200, Triton 3.6, CUDA-graph replay, 5 rounds, every call PASS and bit-equal to the plan's tiles: Mixtral M = 1024
    (256 rows an expert; 112 down K-steps) 930.8 against the route's 967.2 µs (x1.039, >= 3% faster in 5/5; raw
    ...-1d841ab-f8pp) and 923.1 against 970.0 with the plan's tiles (x1.051, 5/5; settled rounds, ...-76a8820-
    f8r32-ck1), eager wall 1022 against 1053 µs a call; the down GEMM alone x1.136 / x1.147. Not taken at 128 rows
    an expert: Mixtral M = 512 x1.018-1.028 (1-2/5), DeepSeek-V3 M = 4096 x1.003 (0/5); other shapes and M not
    measured."""
    rows = num_tokens * top_k
    return (inter is not None and (num_experts, hidden, inter) in PIPE_DOWN_SHAPES and inter // GROUP % 2 == 0
            and PIPE_DOWN_ROWS[0] * num_experts <= rows < PIPE_DOWN_ROWS[1] * num_experts)


def plan_gluon_fp8(num_tokens: int, top_k: int, num_experts: int, hidden: int, up: Fp8GluonTile | None = None,
                   down: Fp8GluonTile | None = None, gather_groups: int | None = None,
                   inter: int | None = None, b2: bool = False) -> Fp8GluonPlan:
    """The plan of a call; ``up``, ``down``, ``gather_groups`` given replace the choice's each alone; ``inter`` (N,
    the down GEMM's reduce width; None: not known, no pipelined down) for ``wants_pipelined_down``; ``b2``: the call
    has a down bias (the wide tile's epilogue adds none: never chosen then)."""
    from moekit.layouts.grouping import max_padded_rows

    if gather_groups is not None and (gather_groups < 1 or gather_groups & (gather_groups - 1)):
        raise ValueError(f"gather_groups={gather_groups}: expected a power of 2 (the gather kernel's tl.arange)")
    wide = not b2 and wants_wide_down(num_tokens, top_k, num_experts, hidden)
    pipelined = wants_pipelined_down(num_tokens, top_k, num_experts, hidden, inter)
    return Fp8GluonPlan(max_padded_rows(num_tokens * top_k, num_experts, BLOCK_M), up or UP_TILE,
                        down or (WIDE_DOWN_TILE if wide else PIPELINED_DOWN_TILE if pipelined else DOWN_TILE),
                        gather_groups or (WIDE_GATHER_GROUPS if wide else GATHER_GROUPS))


def launch_gather_quant(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int, x_q: torch.Tensor, x_s: torch.Tensor,
                        dst: torch.Tensor, gather_groups: int) -> None:
    """x_q[r], x_s[r] = the e4m3 groups of x[sorted_ids[r] // k] and dst[sorted_ids[r]] = r for the real rows.
    x [M, K] unit-stride rows; x_q [R, K] (float32 under the interpreter), x_s [R, ceil(K/128)] float32,
    dst [A] int32 filled with -1 by the caller; ``gather_groups`` 128-column groups per program."""
    kernel = importlib.import_module(f"{_KERNELS}.gather_fp8").gather_quant_rows_kernel
    rows, hidden = x_q.shape
    groups = cdiv(hidden, GROUP)
    kernel[(cdiv(rows, GATHER_ROWS), cdiv(groups, gather_groups))](
        x, sorted_ids, x_q, x_s, dst, rows, dst.numel(), hidden, x.stride(0), x_q.stride(0), x_s.stride(0), groups,
        TOP_K=top_k, BLOCK_R=GATHER_ROWS, GROUP=GROUP, EMULATE=interpreting(), GROUPS=gather_groups, num_warps=4,
        **COMPILE_OPTIONS)


def launch_gemm_fp8(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor,
                    out_s: torch.Tensor | None, block_experts: torch.Tensor, rows_used: torch.Tensor,
                    tile: Fp8GluonTile, gated: bool, gate_offset: int = 0, bias: torch.Tensor | None = None,
                    variant: Fp8GluonVariant = PLAIN_VARIANT):
    """out [T, C] = act(block-scaled a [T, R] @ w[e]^T (+ bias)) per row block. a e4m3, a_s [T, ceil(R/128)]
    float32 (unit column stride); w e4m3 [E, W_ROWS, R] contiguous, w_s [E, ceil(W_ROWS/128), ceil(R/128)] float32
    contiguous; gated: out e4m3 h [T, N] and out_s [T, ceil(N/128)] its scales, gate rows c.. and up rows
    gate_offset + c.. (W_ROWS = 2N; ``variant.interleaved``: gate_offset 128, the rows in place), ``variant``'s
    activation; else out bf16/fp16 [T, K]. bias: b13 [E, 2N] / b2 [E, K] contiguous, or None. block_experts
    [T/128] int32; rows_used: 1-element integer tensor (a multiple of 128, <= T). R and C need not be multiples of
    128 (rows of 16-byte multiples: TMA). Returns what the launch returns (Triton's compiled kernel: its registers,
    spills and PTX for the device check)."""
    check_wide(tile, gated, out.shape[1], bias is not None)
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_fp8").grouped_gemm_fp8_kernel
    num_experts, w_rows, reduce_dim = w.shape
    a_desc = gluon_descriptor(a, [HALF_M, GROUP])
    w_desc = gluon_descriptor(w.view(num_experts * w_rows, reduce_dim), [GROUP, GROUP])
    c_desc = gluon_descriptor(out, [HALF_M, GROUP])
    num_col_blocks = cdiv(out.shape[1], tile.block_n)
    gate_offset = GROUP if tile.wide else gate_offset  # WIDE: the second weight tile is the next column block
    max_tiles = cdiv(a.shape[0], BLOCK_M) * num_col_blocks
    grid = (max(1, min(num_sms(a.device), max_tiles)),)
    out_s = a_s if out_s is None else out_s  # never written by the down GEMM
    return kernel[grid](a_desc, w_desc, c_desc, a_s, w_s, out_s, block_experts, rows_used, bias, reduce_dim,
                        num_col_blocks, w_rows, gate_offset, a_s.stride(0), w_s.stride(0), w_s.stride(1),
                        out_s.stride(0), GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                        CONSUMER_REGS=tile.consumer_regs, WIDE=tile.wide, PIPE=tile.pipelined,
                        **(variant.gate_up_constexprs() if gated else {}),  # the down GEMM: the defaults
                        num_warps=CONSUMER_WARPS, maxnreg=tile.max_registers, **COMPILE_OPTIONS)


def check_wide(tile: Fp8GluonTile, gated: bool, cols: int, bias: bool = False) -> None:
    """A wide tile is for the down GEMM without a bias (its epilogue adds none), whose output width ``cols`` (K) must
    be a multiple of 256; a pipelined one is the narrow down GEMM's (the wide tile's two accumulators and two parts
    would not fit the registers)."""
    if tile.pipelined and (tile.wide or gated):
        raise ValueError(f"tile={tile}: the pipelined promotion is for the narrow down GEMM alone (gated={gated})")
    if not tile.wide:
        return
    if gated or cols % tile.block_n or bias:
        raise ValueError(f"tile={tile}: wide tiles are for the down GEMM alone (gated={gated}), without a bias "
                         f"(bias={bias}), with an output width that is a multiple of {tile.block_n} (got {cols})")
