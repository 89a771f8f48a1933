"""The word decode of weight-only experts (``_kernels/gemm_wo_gemv.py``: packed weights read as 32-bit
words into registers and multiplied on the CUDA cores, no tensor cores): where it applies, its default
config and its two bound launches. The plan (``triton_wo_plan``) calls these for decode "gemv"; a GemmTile's
num_stages is the steps of words loaded ahead of the one a program decodes, in registers (the kernels' AHEAD),
its launches' own num_stages 1. (A packed-half fp16x2 twin, "gemv_half", was removed in session 21: its last
pick, Qwen3 mxfp4 M=1, measured 28.8 µs against this decode's 25.9.)

Config: a ``KernelConfig`` as the other decodes', read so: BLOCK_M the M-block's rows (the tiny-batch
shortcut always runs 1 row a block), each GemmTile's BLOCK_N the weight rows of a program and BLOCK_K
the reduction elements of a step (a multiple of the values a word holds: 8 for the 4-bit schemes, 4
for int8; BLOCK_K / PER words a step, a power of two).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels
from moekit.experts.triton_plan import down_launches
from moekit.triton_bind import BoundLaunch

PER = {"int8_w8a16": 4, "int4_w4a16": 8, "mxfp4": 8}  # values a 32-bit word holds
WORD_DECODES = {"gemv": "gemm_wo_gemv"}  # the word decodes: decode name -> kernel module
ROUND = {torch.bfloat16: 1, torch.float16: 2}  # h's dtype -> ``wo_split.load_h``'s ROUND (the folded gate-up)
MAX_ROWS = 2  # the tallest M-block the word decode takes (one FMA per weight and row: CUDA cores)


@dataclass(frozen=True)
class WordConfig(KernelConfig):
    """A word-decode config with its reduction splits: ``up_split`` the gate-up's (each split's float32
    partials reduced in the activation launch, ``split_glu_launch``; 1: none) and ``down_split`` the down
    GEMM's (0: ``triton_wo_plan.decode_split_k``'s); ``glu_fold``: the split gate-up's partials summed and
    activated in the down GEMM's prologue instead (``_kernels/wo_split.load_h``: bit-equal, one launch fewer).
    A plain ``KernelConfig`` splits the gate-up never. ``x_tile`` ("gemv", the 4-bit schemes): each step's activations
    (and the down GEMM's h) read as one [words, 8] tile (bf16: 16 bytes a word), not 8 strided 2-byte loads.
    ``halves`` (decode "mma" only, ``triton_wo_mma.mma_gate_up``): the gate rows and the up rows in separate
    gate-up programs, which write float32 partials (activated as ``up_split``'s are, by the split_glu launch)."""

    up_split: int = 1
    down_split: int = 0
    glu_fold: bool = False
    x_tile: bool = False
    halves: bool = False

    def to_dict(self) -> dict:
        return {**super().to_dict(), "up_split": self.up_split, "down_split": self.down_split,
                "glu_fold": self.glu_fold, "x_tile": self.x_tile, "halves": self.halves}


def up_splits(config: KernelConfig, kw: int, scheme: str) -> tuple[int, int]:
    """(splits, words a split) of the gate-up's rows of ``kw`` words: the config's up_split (``WordConfig``,
    else 1), each split a whole number of steps and none empty."""
    bkw = config.up.BLOCK_K // PER[scheme]
    asked = config.up_split if isinstance(config, WordConfig) else 1
    if asked < 1:
        raise ValueError(f"config.up_split must be >= 1, got {asked}")
    split_words = cdiv(cdiv(kw, bkw), asked) * bkw
    return cdiv(kw, split_words), split_words


def folded_splits(config: KernelConfig, kw: int, scheme: str) -> int:
    """The gate-up splits whose sum and activation the down GEMM does as it reads h (``WordConfig.glu_fold``
    and a split gate-up, ``up_splits``), else 1 (none folded)."""
    split = up_splits(config, kw, scheme)[0]
    return split if split > 1 and getattr(config, "glu_fold", False) else 1


def words_ok(q: torch.Tensor) -> bool:
    """Whether a packed weight ``q`` [E, R, bytes] reads as int32 words: a row's bytes contiguous and a
    multiple of 4, every stride and the address a multiple of 4 bytes."""
    return (q.element_size() == 1 and q.stride(2) == 1 and q.shape[2] % 4 == 0 and q.stride(0) % 4 == 0
            and q.stride(1) % 4 == 0 and q.data_ptr() % 4 == 0)


def gemv_rows(num_tokens: int, num_experts: int, top_k: int) -> int:
    """The word decode's BLOCK_M: 1 up to one row per expert on average (M*k/E), else MAX_ROWS."""
    return 1 if num_tokens * top_k <= num_experts else MAX_ROWS


def gemv_group_m(num_tokens: int, num_experts: int, top_k: int) -> int:
    """GROUP_M: the M-blocks of about one expert (M*k/E / BLOCK_M, 1 to 8) sweep the weight tiles
    together, so the other blocks of an expert read its tiles from L2."""
    rows = num_tokens * top_k / max(num_experts, 1)
    return max(1, min(8, round(rows / gemv_rows(num_tokens, num_experts, top_k))))


def gemv_heuristic_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str) -> KernelConfig:
    """The default: BLOCK_M ``gemv_rows``; 16 words a step (int4 at g = 128: one group a step, scales
    per row). 1-row blocks: 64 weight rows a program in 2 warps, both GEMMs (each thread then holds
    several weight rows of the same words, so each activation value it loads serves them all): the
    H200's fastest at int4 M = 1 (DeepSeek-V3 114 µs, Mixtral 130 µs; 1-warp 16/32-row tiles 121-279,
    4-warp 249-297). 2-row blocks (never the chooser's pick: they lost every measured cell): 16 rows
    (gate-up; 32 spill, ptxas sm_90) and 32 (down) in 1 warp. The down GEMM splits its reduction
    where programs are few (``triton_wo_plan.decode_split_k``)."""
    step, group_m = 16 * PER[scheme], gemv_group_m(num_tokens, num_experts, top_k)
    block_m = gemv_rows(num_tokens, num_experts, top_k)
    if block_m == 1:
        return KernelConfig(1, GemmTile(64, step, group_m, 2, 1), GemmTile(64, step, group_m, 2, 1))
    return KernelConfig(block_m, GemmTile(16, step, group_m, 1, 1), GemmTile(32, step, group_m, 1, 1))


def check_gemv_config(config: KernelConfig, scheme: str) -> None:
    """A clear error unless BLOCK_M <= MAX_ROWS, both GEMMs' BLOCK_K are a power-of-two number of words and
    their num_stages (AHEAD) 1 or 2; x_tile only for the 4-bit schemes."""
    if not (1 <= config.up.num_stages <= 2 and 1 <= config.down.num_stages <= 2):
        raise ValueError(f"the gemv decode's num_stages (words loaded ahead, steps) must be 1 or 2, got "
                         f"{config.up.num_stages} and {config.down.num_stages}")
    if getattr(config, "x_tile", False) and scheme == "int8_w8a16":
        raise ValueError("config.x_tile takes the 4-bit schemes (int4_w4a16, mxfp4), got int8_w8a16")
    if getattr(config, "halves", False):
        raise ValueError("config.halves (gate and up rows in separate programs) is for decode 'mma', not the gemv")
    if not 1 <= config.BLOCK_M <= MAX_ROWS:
        raise ValueError(f"config.BLOCK_M must be 1 to {MAX_ROWS} for the gemv decode, got {config.BLOCK_M}")
    for name, tile in (("up", config.up), ("down", config.down)):
        words = tile.BLOCK_K // PER[scheme]
        if tile.BLOCK_K % PER[scheme] or words & (words - 1):
            raise ValueError(f"config.{name}.BLOCK_K must be {PER[scheme]} x a power of two for the gemv decode "
                             f"of {scheme}, got {tile.BLOCK_K}")


def gemv_launches(x, w13, w2, top_k: int, config: KernelConfig, num_pid_m: int, naive: bool, scheme: str,
                  scheme_id: int, act: int, options: LaunchOptions, split_k: int, split_len: int,
                  asm: bool = False, ksum: dict | None = None, variant: dict | None = None,
                  ) -> tuple[BoundLaunch, BoundLaunch, BoundLaunch | None]:
    """The gate-up and down launches (``w13``/``w2``: ``triton_wo_plan.WeightArgs``, q strides in bytes,
    passed to the kernels in words; gate-up takes b13 after its nine pointers, down b2 after its thirteen: None
    without), and down with the k-sum folded in where ``ksum`` (else None; ``triton_plan.down_launches``);
    ``split_len`` the down GEMM's reduction elements per split (a multiple of its BLOCK_K); ``asm``: the kernels'
    inline PTX decode (``triton_wo_plan.inline_asm_ok``); ``variant``: the gate-up's INTERLEAVED / ALPHA / LIMIT /
    UP_SHIFT / LIMIT_AFTER (None: the kernel's defaults, the plain activation). A folded split gate-up
    (``folded_splits``): down reads the partials p [SPLIT * A, 2N] in h's place (UP_SPLIT, ACT, ROUND: h's
    dtype, x's or float32 under the interpreter, as the plan's workspace)."""
    check_gemv_config(config, scheme)
    num_experts, two_n = w13.q.shape[:2]
    n, hidden, num_assignments, per = two_n // 2, x.shape[1], x.shape[0] * top_k, PER[scheme]
    module, up, down = kernels("gemm_wo_gemv"), config.up, config.down
    shared = dict(BLOCK_M=config.BLOCK_M, PER=per, SCHEME=scheme_id, NAIVE=naive, ASM=asm,
                  cached=options.cached_launcher, **options.pdl_kwargs())

    def strides(w) -> tuple:  # q (e, r) in words, scale (e, r, g), zero (e, r, g)
        qe, qr, _, *rest = w.strides
        return (qe // 4, qr // 4, *rest)

    def staging(tile: GemmTile) -> dict:  # the tile's num_stages: its words loaded ahead (AHEAD)
        return {"num_stages": 1, "AHEAD": tile.num_stages, "XTILE": getattr(config, "x_tile", False)}

    up_split, up_words = up_splits(config, w13.q.shape[2] // 4, scheme)
    gate_up = BoundLaunch(  # SPLIT > 1: h_ptr the float32 partials [SPLIT * A, 2N] (``_kernels/wo_split``)
        module.gate_up_wo_gemv_kernel, (num_pid_m * cdiv(n, up.BLOCK_N), up_split), 10,
        (n, hidden, w13.q.shape[2] // 4, num_assignments, top_k, num_experts, num_pid_m, *x.stride(), *strides(w13),
         n if up_split == 1 else 2 * n, up_words),
        BLOCK_N=up.BLOCK_N, BKW=up.BLOCK_K // per, GROUP=w13.group_size, GROUP_M=up.GROUP_M, ACT=act,
        SPLIT=up_split, num_warps=up.num_warps, **staging(up), **shared, **(variant or {}),
    )
    fold = folded_splits(config, w13.q.shape[2] // 4, scheme)
    folding = {} if fold == 1 else dict(UP_SPLIT=fold, ACT=act, ROUND=0 if interpreting() else ROUND[x.dtype])
    down_launch, down_sum = down_launches(
        module.down_wo_gemv_kernel, num_pid_m * cdiv(hidden, down.BLOCK_N), split_k,
        (hidden, n, w2.q.shape[2] // 4, num_assignments, num_experts, num_pid_m, split_len // per,
         n if fold == 1 else 2 * n, *strides(w2), hidden), x.shape[0], ksum, 14,
        BLOCK_N=down.BLOCK_N, BKW=down.BLOCK_K // per, GROUP=w2.group_size, GROUP_M=down.GROUP_M, SPLIT=split_k,
        num_warps=down.num_warps, **staging(down), **shared, **folding,
    )
    return gate_up, down_launch, down_sum


def split_glu_launch(config: KernelConfig, num_assignments: int, n: int, w13_words: int, scheme: str, act: int,
                     options: LaunchOptions, variant: dict | None = None) -> BoundLaunch | None:
    """The launch that sums the split gate-up's partials and applies the activation (pointers: p [SPLIT * A,
    2N] float32, h [A, N]; ``variant``: ``glu_launch``'s); None where the gate-up does not split (``up_splits``) or
    the down GEMM folds it in (``folded_splits``)."""
    split = up_splits(config, w13_words, scheme)[0]
    if split == 1 or folded_splits(config, w13_words, scheme) > 1:
        return None
    return glu_launch(split, num_assignments, n, act, options, variant)


def glu_launch(split: int, num_assignments: int, n: int, act: int, options: LaunchOptions,
               variant: dict | None = None) -> BoundLaunch:
    """h = act(gate) * up from ``split`` >= 1 sets of float32 partials (``wo_split.split_glu_kernel``; pointers: p
    [split * A, 2N], h [A, N]); ``variant``: the clamped SwiGLU's ALPHA / LIMIT / UP_SHIFT / LIMIT_AFTER (the mma's,
    ``triton_wo_gemm.variant_constexprs``), None the kernel's defaults (the plain activation)."""
    block = min(1024, max(16, 1 << (n - 1).bit_length()))
    return BoundLaunch(kernels("wo_split").split_glu_kernel, (num_assignments, cdiv(n, block)), 2,
                       (n, num_assignments, 2 * n, n), SPLIT=split, BLOCK_N=block, ACT=act, num_warps=4,
                       cached=options.cached_launcher, **options.pdl_kwargs(), **(variant or {}))
