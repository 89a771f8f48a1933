"""The plan of a weight-only quantized Triton experts call (``triton_wo``): the config, the alignment,
the workspace and the bound launches, decided once per kind of call and cached, as ``triton_plan``
does for 16-bit weights (and reusing its alignment, workspace and k-sum machinery).

    wo_plan_for(call) --_WO_PLANS--> WoPlan: options, the decode (``choose_decode`` or the caller's),
    config (tuned file or heuristic, per decode), alignment or the naive shortcut, workspace regions
    h [A, N] and y [A, K], gate-up / down / k-sum launches

Seven decodes of the packed weights (DECODES), each its own kernels and its own configs:
    tile      ``_kernels/gemm_wo``: one whole dequantized [BN, BK] tile per step, one ``tl.dot``.
    register  ``_kernels/gemm_wo_reg``: decoded in the MMA operand's registers (inline PTX on NVIDIA
              sm_80+ with bf16, ``inline_asm_ok``), group scales on each chunk's fp32 partial product.
    mma       ``_kernels/gemm_wo_mma`` (int8, int4, mxfp4; steps of BLOCK_K = 128 or 256 columns, rows read as
              words): each 128 columns' words decoded where they land into one MMA operand in a permuted K order,
              their x tile read once in that order, one tensor-core dot each (session 26; int8, wide steps: 28).
    gemv      ``_kernels/gemm_wo_gemv`` (launches: ``triton_wo_gemv``): no tensor cores; 32-bit words
              bit-placed into float32, one FMA a weight and row, blocks of 1-2 rows; only where the
              packed rows read as words (``words_ok``: the chooser falls back to register elsewhere).
    scratch   ``triton_wo_scratch``: dequantized once into a scratch buffer, then the bf16 GEMMs (no fused
              plan: ``run_experts_wo`` diverts to it); chosen from SCRATCH_MIN_TOKENS where it fits.
    gluon     ``triton_gluon_wo`` (int8 / int4 / mxfp4, Hopper with Gluon): warp-specialized Gluon GEMMs decoding
              each stored tile to bf16 in shared memory one step ahead of the wgmma (no fused plan:
              ``run_experts_wo`` diverts to it); taken where ``GLUON_WO_CELLS`` measured it faster, else selectable.
    gluon_words ``triton_wo_words`` (int4 session 45, mxfp4 46; Gluon): the packed words by 16-byte loads into
              mma.sync's register operand, K permuted so no operand moves (no fused plan: ``run_experts_wo``
              diverts to it); taken where ``triton_wo_words_default.WORDS_DEFAULT_CELLS`` measured it faster (before
              the chooser below), else selectable.
``choose_decode`` picks what the H200 measured faster: the winners table's decode where a row covers the
call (``triton_wo_winners``, mid and large batches), else per (scheme, shape, nearest measured M of the same
tile-height bucket) for the measured shapes (``DECODE_MEASURED``; gemv only on the tiny-batch shortcut, or on
the aligned layout at or below a measured M whose calls run aligned), else per (scheme, tile-height bucket)
(``DECODE_RULE``); ``decode=`` on the call (``run_experts_wo``, ``fused_experts_wo``) overrides it.

Expert biases and the activation variant (gpt-oss: b13 [E, 2N], b2 [E, K], interleaved gate/up rows, a clamped
SwiGLU): the tile, register, mma and gemv decodes' kernels take them (VARIANT_DECODES; without them those kernels are
the ones before, constexpr-guarded; the gemv's split gate-up is never folded into the down GEMM for a variant,
``_config_for``); a call with either gets its shape's measured entry (``triton_wo_variant``), else the chooser's
decode (as a plain call; "register" where a "gemv" or "mma" pick lacks words or a fitting group). The scratch
decode takes them too (``triton_wo.run_experts_wo`` routes such a call there as a plain one).

Configs (``triton_wo_configs.wo_config``): ``E{E}_N{N}_K{K}_{name}_{device}.json`` in the config directories
(``moekit.experts.configs``'s format and search order, ``config_name(scheme, decode)`` in the dtype's place:
the scheme for the tile decode, ``{scheme}_register`` for the register decode), nearest M; without a file,
for the tile decode the winners table's tile where a row covers the call, else ``wo_heuristic_config``.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, g the group size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from moekit._bounded import put_bounded
from moekit.activations import ActivationSpec, as_spec
from moekit.experts.configs import KernelConfig, device_key, nearest, on_config_cache_clear
from moekit.experts.triton_align import AlignPlan, one_pass_programs, plan_block_rows, shortcut_allowed
from moekit.experts.triton_cache import WorkspaceSpec
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, max_shared_memory, resolve_launch_options
from moekit.experts.triton_plan import ksum_constexprs, sum_launch
from moekit.experts.triton_wo_configs import MIN_PROGRAMS, fit_wo_shared_memory, height_bucket, wo_config
from moekit.experts.triton_wo_gemm import SCHEME_IDS, VARIANT_DECODES, gemm_launches, variant_constexprs
from moekit.experts.triton_wo_gemv import (
    WORD_DECODES, WordConfig, folded_splits, gemv_launches, glu_launch, split_glu_launch, up_splits, words_ok,
)
from moekit.experts.triton_wo_mma import check_mma, mma_fits, mma_gate_up
from moekit.experts.triton_wo_scratch import SCRATCH_MIN_TOKENS, scratch_fits
from moekit.experts.triton_wo_variant import measured_variant_decode
from moekit.experts.triton_wo_winners import winner
from moekit.layouts.block_aligned import use_naive
from moekit.triton_bind import BoundLaunch

MAX_PLANS = 1024
MAX_SPLIT = 8  # the down GEMM's reduction splits at most (each adds an [A, K] fp32 partial to write and read)
DECODES = ("tile", "register", "mma", "gemv", "scratch", "gluon", "gluon_words")
# The decode per (scheme, tile-height bucket) where no shape row below says otherwise. H200, Triton 3.6,
# bf16 activations, two runs each (benchmarks/results/raw: ``b6a5c5f-wo_device_check`` tile and
# ``87bfd3a-...-wo-fast-2-reverted`` register, then both in one run, ``a13647b-wo_device_check-wo-choice``;
# the second run's µs here). int4 at decode heights (16 rows) register everywhere: DeepSeek M=1/8/64 146 /
# 958 / 3391 against 256 / 1523 / 5120, Qwen3 32 / 120 / 249 against 39 / 155 / 346, Mixtral M=1/8 151 /
# 484 against 248 / 724. Taller tiles tile: Mixtral M=64 (32 rows) 1023 against 1695; M=1024 4-5x.
# mxfp4: per shape (below). int8: both decodes run the same whole-tile dot (the two within noise): tile.
DECODE_RULE = {("int4_w4a16", 16): "register"}
# (scheme, E, N, K) -> {M: the decode measured faster at M} for measured shapes; a call takes the entry
# of the nearest M in log2 distance (as tuned configs do) among those of its tile-height bucket (the
# decodes' configs change with it); none there: DECODE_RULE. Entries: the decode faster in both H200
# runs (each cell's winner agreed between the runs; the margins are small, 1-6%). mxfp4 µs (tile /
# register, second run): Qwen3 M=1 37.3 / 36.9, M=8 134.5 / 141.0, M=64 290.4 / 280.9; DeepSeek M=1
# 210.2 / 214.5, M=8 1202 / 1188, M=64 4024 / 3925; Mixtral M=1 200.3 / 193.9, M=8 586.5 / 621.9.
# int4 (session 9 checkpoint, benchmarks/wo_speed_device_check.py at 19af4d7, µs tile / register / gemv, the
# gemv at its 2-warp 64-row 16-word tiles, the heuristic since): DeepSeek M=1 254 / 143 / 114, M=8 1504 /
# 949 / 658, M=64 5126 / 3413 / 5032 (2-row blocks); Mixtral M=1 244 / 149 / 130, M=8 720 / 480 / 802
# (2-row blocks). mxfp4 and int8: the gemv lost every cell (1.1-7x), so no entry picks it there.
# Qwen3 int4 (session 9 final run at 226019a, wo_speed / wo_device_check): M=1 39.2 / 32.9 / 31.6, M=8
# (aligned: 4A > E) 153.1 / 118.3 / 88.1, M=64 339.2 / 245.5 / 521.9. gemv_half (its 32-row prefetching tiles
# at M*k <= 16; benchmarks/wo_decode_device_check.py, branch wo-decode at b067aca): int4 M=1 Qwen3 27.8 against
# gemv 31.5 (taken); DeepSeek-V3 120.4 against 127.2 in that run, but gemv measured 113.7 in session 9's: within
# the machines' noise, not taken; at Qwen3 M=8 and M=64 it lost (89 / 487 against 88 / 247). Second run
# (e68bcde): DeepSeek-V3 mxfp4 M=1 184.2 against tile 211.4 (taken); int4 M=1 121.6 against gemv 127.9 (its
# gate-up 32 / down 64 variant 113.2); lost every M=8 / M=64 cell and Mixtral's. The word decodes with split
# reductions (``triton_wo_word_winners``, benchmarks/wo_decode2_device_check.py, run 2 at 34d17b2, µs against the
# pick before): Qwen3 int4 M=1 gemv 22.7 (gemv_half 29.2), mxfp4 M=1 gemv_half 30.5 (register 36.5); DeepSeek-V3
# mxfp4 M=1 gemv 160.5 (gemv_half 183.2), M=8 gemv unsplit 1100.0 (register 1192.7; 1101.5 at e68bcde). Session
# 21 (branch wo4, wo_ahead_device_check run 2): Qwen3 mxfp4 M=1 the gemv with the x tile 25.9 against gemv_half 28.8.
# Session 26 (branch w6, wo_mma_device_check at 8bac90b, graph µs, 5 rounds): the word MMA decode won Mixtral int4
# M=8 343.0 against the swapped register decode 422.3 (5/5; M=3..31 take it); it lost DeepSeek-V3 M=1 / 8, Qwen3
# M=1 / 8 and both mxfp4 cells (127-1124 against 99-1013). Merged main b32c0fb (--merged): Mixtral int4 M=8 / 16 / 4
# 340.5 / 405.2 / 289.7 against the register decode's 422.6 / 459.9 / 352.8 (5/5 each); and, taken then (M=64
# entries: DeepSeek-V3 M=23..511, Qwen3 M=23..255; Mixtral mxfp4 M=3..63), int4 M=64 DeepSeek-V3 2309.5 against
# register 2742.0, Qwen3 162.5 against 196.7, mxfp4 Mixtral M=8 562.0 against tile 589.6 (5/5 each).
# Session 38 (wo38_device_check, one H100, 5/5, triton-notes.md): Qwen3 M=256, mxfp4 M=8..128 mma, 1.35-2.09x faster
DECODE_MEASURED: dict[tuple, dict[int, str]] = {
    ("int4_w4a16", 128, 768, 2048): {1: "gemv", 8: "gemv", 64: "mma", 256: "mma"},  # Qwen3-30B-A3B
    ("int4_w4a16", 256, 2048, 7168): {1: "gemv", 8: "gemv", 64: "mma"},  # DeepSeek-V3
    ("int4_w4a16", 8, 14336, 4096): {1: "gemv", 8: "mma"},  # Mixtral-8x7B
    ("mxfp4", 128, 768, 2048): {1: "gemv", 8: "mma", 64: "mma", 256: "mma"},  # Qwen3-30B-A3B (session 38)
    ("mxfp4", 256, 2048, 7168): {1: "mma", 8: "mma", 64: "mma"},  # DeepSeek-V3 (session 29, mx9: the mma's
    ("mxfp4", 8, 14336, 4096): {1: "mma", 8: "mma", 64: "mma"},  # Mixtral-8x7B  multiply placement; tuned files: µs)
    ("int8_w8a16", 256, 2048, 7168): {1: "mma", 8: "tile", 64: "tile"},  # DeepSeek-V3 (session 28, dec8: the mma's
    ("int8_w8a16", 8, 14336, 4096): {1: "mma", 8: "tile"},  # Mixtral-8x7B  256-byte steps; its tuned files: µs)
}


@dataclass(frozen=True)
class WeightArgs:
    """What the kernels read of one quantized weight: its scheme's layout (see ``triton_wo``) as
    tensors and strides. ``zero`` is ``scale`` where the scheme has none (never read then)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int  # >= 1; int8 (per channel): the whole row, the kernels never divide by it
    strides: tuple  # q (e, r, c), scale (e, r, g), zero (e, r, g): 9 ints


def weight_args(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> WeightArgs:
    s_strides = scale.stride() if scale.dim() == 3 else (*scale.stride(), 0)  # int8: [E, R], no group dim
    z = scale if zero is None else zero
    z_strides = (0, 0, 0) if zero is None else zero.stride()
    return WeightArgs(q, scale, z, max(group_size, 1), (*q.stride(), *s_strides, *z_strides))


@dataclass(frozen=True, eq=False)
class WoPlan:
    """What every call of one kind launches with. Holds no tensor."""

    options: LaunchOptions  # resolved for the device
    decode: str  # one of DECODES
    config: KernelConfig
    align: AlignPlan | None  # None in the naive shortcut (block a = assignment a)
    split_k: int  # the down GEMM's reduction splits (1: none); y then holds SPLIT partial rows per assignment
    workspace: WorkspaceSpec  # h [A, N], y [SPLIT*A, K] (work dtype; fp32 partials), the alignment's buffers
    gate_up: BoundLaunch  # pointers: x, q13, s13, z13, h, ids, sorted_ids, expert_ids, num_padded
    # pointers: h, q2, s2, z2, y, weights, ids, sorted_ids, expert_ids, num_padded, then None, None, None
    down: BoundLaunch
    # pointers: y, ids, expert_map (ids without one), out: the sum over splits and slots (one split: ordered)
    sum_slots: BoundLaunch
    # down with the k-sum folded in (M <= options.sum_fold_max, the bf16 plan's rule, and one split; else None);
    # pointers: down's ten, then out, counters (int32 [M * K tiles], all 0: the pool's), expert_map (ids without one)
    down_sum: BoundLaunch | None = None
    # the word decodes' split gate-up (``triton_wo_gemv.split_glu_launch``; else None): gate-up writes the float32
    # partials p [SPLIT * A, 2N], then this launch h = act(sum over splits); pointers: p, h
    glu: BoundLaunch | None = None
    # the split gate-up folded into the down GEMM (``WordConfig.glu_fold``): no glu launch, down reads p for h
    glu_fold: bool = False

    @property
    def biased(self) -> bool:
        """Whether gate-up takes b13 after its nine pointers and down b2 after its thirteen (None without one)."""
        return self.decode in VARIANT_DECODES


_WO_PLANS: dict[tuple, WoPlan] = {}
on_config_cache_clear(_WO_PLANS.clear)
clear_wo_plans = _WO_PLANS.clear


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.data_ptr() & 15


def wo_plan_key(x, w13: WeightArgs, w2: WeightArgs, ids, weights, expert_map, scheme: str,
                activation: str | ActivationSpec, config, options: LaunchOptions, split_k: int | None = None,
                decode: str | None = None, b13=None, b2=None) -> tuple:
    """The kind of a call: everything the launches depend on but the tensors' contents and addresses."""
    return (
        _tensor_key(x), x.device, *(_tensor_key(t) for w in (w13, w2) for t in (w.q, w.scale, w.zero)),
        w13.group_size, w2.group_size, _tensor_key(ids), _tensor_key(weights),
        None if expert_map is None else _tensor_key(expert_map), scheme, activation, config, options, split_k, decode,
        None if b13 is None else _tensor_key(b13), None if b2 is None else _tensor_key(b2),
    )


def wo_plan_for(x, w13: WeightArgs, w2: WeightArgs, ids, weights, expert_map, scheme: str,
                activation: str | ActivationSpec, config: KernelConfig | None, options: LaunchOptions,
                split_k: int | None = None, decode: str | None = None, b13=None, b2=None) -> WoPlan:
    """The cached plan of this call's kind (``options.cache_plans``), else a new one. ``split_k``: the
    down GEMM's splits, None for ``decode_split_k``'s choice; ``decode``: one of DECODES, None for
    ``choose_decode``'s; ``activation``: a name or a spec that is not plain; b13 [E, 2N] / b2 [E, K]
    contiguous, or None."""
    build = (x, w13, w2, ids, expert_map, scheme, activation, config, options, split_k, decode, b13 is not None,
             b2 is not None)
    if not options.cache_plans:
        return build_wo_plan(*build)
    key = wo_plan_key(x, w13, w2, ids, weights, expert_map, scheme, activation, config, options, split_k, decode,
                      b13, b2)
    plan = _WO_PLANS.get(key)
    if plan is None:
        plan = build_wo_plan(*build)
        put_bounded(_WO_PLANS, key, plan, MAX_PLANS)
    return plan


def choose_decode(scheme: str, num_tokens: int, num_experts: int, n: int, k: int, top_k: int,
                  shortcut: bool | None = None, fused: bool = False, itemsize: int = 2) -> str:
    """The decode (one of DECODES) the H200 measured faster: the winners table's where it covers the call
    (``triton_wo_winners``; its "scratch" only where that fits and not ``fused``); "scratch" from
    SCRATCH_MIN_TOKENS where an expert's bf16 w13 fits (``scratch_fits``; never if ``fused``); else for a shape in
    DECODE_MEASURED the entry of the nearest measured M in the call's tile-height bucket, else DECODE_RULE's, else
    "tile". ``itemsize``: x's (the scratch's dtype). "gemv" only on the tiny-batch shortcut (``shortcut``; None:
    ``use_naive`` without an expert map), or at or below the measured M when that M's own calls run aligned (the gemv
    measured faster there)."""
    won = winner(scheme, num_experts, n, k, num_tokens)
    if won is not None and (won.decode != "scratch" or (not fused and scratch_fits(n, k, itemsize))):
        return won.decode
    if num_tokens >= SCRATCH_MIN_TOKENS and not fused and scratch_fits(n, k, itemsize):
        return "scratch"
    bucket = height_bucket(num_tokens, num_experts, top_k)
    rule = DECODE_RULE.get((scheme, bucket), "tile")
    measured = {m: decode for m, decode in DECODE_MEASURED.get((scheme, num_experts, n, k), {}).items()
                if height_bucket(m, num_experts, top_k) == bucket}
    at = nearest({m: m for m in measured}, num_tokens) if measured else None  # the measured M taken
    pick = rule if at is None else measured[at]
    if shortcut is None:
        shortcut = use_naive(num_tokens * top_k, num_experts, None)
    aligned_ok = at is not None and num_tokens <= at and not use_naive(at * top_k, num_experts, None)
    return rule if pick in WORD_DECODES and not (shortcut or aligned_ok) else pick


@functools.lru_cache(maxsize=4096)
def chosen_decode(scheme: str, num_tokens: int, num_experts: int, n: int, k: int, top_k: int, itemsize: int) -> str:
    """``choose_decode`` of an unfused call without a map (``run_experts_wo``'s scratch test), kept per
    call kind: it walks the winners and measured tables, every call from SCRATCH_MIN_TOKENS up."""
    return choose_decode(scheme, num_tokens, num_experts, n, k, top_k, False, itemsize=itemsize)


on_config_cache_clear(chosen_decode.cache_clear)


def check_decode(decode: str | None) -> None:
    if decode is not None and decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES} or None (the measured choice), got {decode!r}")


def inline_asm_ok(device: torch.device) -> bool:
    """Whether the register decode may use its inline PTX: an NVIDIA GPU of compute capability 8.0+
    (prmt, lop3, fma.rn.bf16x2), compiled (never under the interpreter, never on ROCm)."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _check_config(config: KernelConfig, decode: str, scheme: str, w13: WeightArgs, w2: WeightArgs) -> None:
    """Refuse a config the chosen decode cannot run."""
    if config.swap_ab and decode != "register":
        raise ValueError(f"config.swap_ab is for the register decode (``gemm_wo_reg``), not decode {decode!r}")
    if decode == "mma":
        check_mma(config, scheme, w13, w2)


def _config_for(config: KernelConfig | None, decode: str, scheme: str, w13: WeightArgs, w2: WeightArgs,
                spec: ActivationSpec, call: tuple, device: torch.device) -> KernelConfig:
    """The caller's ``config`` or ``wo_config``'s for ``decode`` and ``call`` (M, E, N, K, k), checked
    (``_check_config``). A spec that is not plain never folds the split gate-up into the down GEMM (``glu_fold``:
    ``wo_split.load_h`` runs the plain activation): a looked-up config's fold is dropped (its split_glu launch
    instead), a caller's refused by name."""
    if config is None:
        config = wo_config(*call, scheme, device_key(device), decode)
        if not spec.plain and getattr(config, "glu_fold", False):
            config = replace(config, glu_fold=False)
    elif not spec.plain and getattr(config, "glu_fold", False):
        raise ValueError("config.glu_fold runs the plain activation: a call with an activation variant takes "
                         "glu_fold=False (the split_glu launch runs the variant)")
    _check_config(config, decode, scheme, w13, w2)
    return config


def build_wo_plan(x, w13: WeightArgs, w2: WeightArgs, ids, expert_map, scheme: str, activation: str | ActivationSpec,
                  config: KernelConfig | None, options: LaunchOptions, split_k: int | None = None,
                  decode: str | None = None, has_b13: bool = False, has_b2: bool = False) -> WoPlan:
    """Decide everything for this call's kind (arguments already checked)."""
    check_decode(decode)
    options = resolve_launch_options(options, x.device)
    (num_experts, two_n), (num_tokens, top_k) = w13.q.shape[:2], ids.shape
    n, hidden, num_assignments = two_n // 2, x.shape[1], num_tokens * top_k
    shortcut = use_naive(num_assignments, num_experts, expert_map)
    spec = as_spec(activation)  # biases or a spec that is not plain: a variant decode (``_usable_decode``)
    decode = _usable_decode(decode, w13, w2, scheme, num_tokens, num_experts, n, hidden, top_k, shortcut,
                            has_b13 or has_b2 or not spec.plain)
    shortcut = shortcut and shortcut_allowed(num_tokens, options)  # the decode's as measured; the layout's here
    config = _config_for(config, decode, scheme, w13, w2, spec, (num_tokens, num_experts, n, hidden, top_k), x.device)
    if not interpreting() and decode not in WORD_DECODES and decode != "mma":  # mma: BLOCK_K fixed, small
        config = fit_wo_shared_memory(config, scheme, x.element_size(), max_shared_memory(x.device))
    if split_k is None and isinstance(config, WordConfig) and config.down_split > 0:
        split_k = config.down_split
    if split_k is None:  # the split decides the fold: BLOCK_M is the shortcut's 16 or the config's here
        split_k = decode_split_k(replace(config, BLOCK_M=16 if shortcut else config.BLOCK_M), num_tokens, top_k,
                                 num_experts, n, hidden, decode in WORD_DECODES)
    split_len = cdiv(cdiv(n, config.down.BLOCK_K), split_k) * config.down.BLOCK_K  # N per split
    split_k = cdiv(n, split_len)  # no empty split
    # the folded k-sum's counters (M <= sum_fold_max, one split), then the fused hist + scan's arrival slot
    fold = split_k == 1 and 0 < num_tokens <= options.sum_fold_max
    ksum_counters = num_tokens * cdiv(hidden, config.down.BLOCK_N) if fold else 0
    rows = plan_block_rows(num_assignments, num_experts, config.BLOCK_M, expert_map, options, shortcut=shortcut,
                           arrival_slot=ksum_counters, one_pass=one_pass_programs(options, x.device))
    block_m = 1 if decode in WORD_DECODES and rows.align is None else rows.block_m  # the shortcut: one row a block
    align, num_pid_m, config = rows.align, rows.num_pid_m, replace(config, BLOCK_M=block_m)
    work_dtype = torch.float32 if interpreting() else x.dtype
    regions = [("h", work_dtype, (num_assignments, n)),
               ("y", work_dtype if split_k == 1 else torch.float32, (split_k * num_assignments, hidden))]
    ksum, glu, glu_fold = ksum_constexprs(top_k, config.down.BLOCK_N, expert_map) if fold else None, None, False
    if decode in WORD_DECODES:
        gate_up, down, down_sum = gemv_launches(x, w13, w2, top_k, config, num_pid_m, align is None, scheme,
                                                SCHEME_IDS[scheme], spec.kernel_id, options, split_k, split_len,
                                                inline_asm_ok(x.device), ksum, variant_constexprs(spec, rows=True))
        glu = split_glu_launch(config, num_assignments, n, w13.q.shape[2] // 4, scheme, spec.kernel_id, options,
                               variant_constexprs(spec))
        glu_fold = folded_splits(config, w13.q.shape[2] // 4, scheme) > 1
        splits = up_splits(config, w13.q.shape[2] // 4, scheme)[0]
        if splits > 1:
            regions.append(("p", torch.float32, (splits * num_assignments, 2 * n)))
    else:
        gate_up, down, down_sum = gemm_launches(x, w13, w2, top_k, config, num_pid_m, align is None, scheme, decode,
                                                spec, inline_asm_ok(x.device), options, split_k, split_len, ksum)
        mma = mma_gate_up(config, w13.q.shape[2] // 4, scheme, n, num_pid_m) if decode == "mma" else None
        if mma is not None and mma.partials:  # float32 partials (split along K, or the halves apart), then h
            glu = glu_launch(mma.partials, num_assignments, n, spec.kernel_id, options, variant_constexprs(spec))
            regions.append(("p", torch.float32, (mma.partials * num_assignments, 2 * n)))
    return WoPlan(
        options=options, decode=decode, config=config, align=align, split_k=split_k,
        workspace=WorkspaceSpec.of(regions + list(align.regions if align is not None else ()),
                                   counters=ksum_counters + (align.kept_counters if align is not None else 0)),
        gate_up=gate_up, down=down,
        sum_slots=sum_launch(num_tokens, hidden, top_k, num_experts, expert_map, options, split=split_k,
                             ordered=split_k == 1),
        down_sum=down_sum, glu=glu, glu_fold=glu_fold,
    )


def _usable_decode(decode: str | None, w13: WeightArgs, w2: WeightArgs, scheme: str, num_tokens: int,
                   num_experts: int, n: int, hidden: int, top_k: int, shortcut: bool = True,
                   variant: bool = False) -> str:
    """``decode``, or ``choose_decode``'s for None; the chooser's "gemv" becomes "register" where the
    weights do not read as words (``words_ok``), and its "mma" where the weights do not meet ``check_mma`` (int4
    groups not a multiple of 128); a caller's "gemv" or "mma" there is an error naming it. With ``variant`` (expert
    biases or an activation spec that is not plain) the measured entry of its shape first
    (``triton_wo_variant.measured_variant_decode``), and a decode outside VARIANT_DECODES: the chooser's becomes
    "register", a caller's is an error naming it."""
    if decode in ("scratch", "gluon", "gluon_words"):
        raise ValueError(f"decode={decode!r} has no fused plan: run_experts_wo runs it "
                         "(triton_wo_scratch / triton_gluon_wo / triton_wo_words)")
    chosen = decode
    if chosen is None and variant:
        chosen = measured_variant_decode(scheme, num_tokens, num_experts, n, hidden, top_k)
    chosen = chosen or choose_decode(scheme, num_tokens, num_experts, n, hidden, top_k, shortcut, fused=True)
    if variant and chosen not in VARIANT_DECODES:
        if decode is not None:
            raise ValueError(f"decode={decode!r} takes no expert biases or activation variant: those run on "
                             f"{VARIANT_DECODES}")
        return "register"
    if chosen in WORD_DECODES and not (words_ok(w13.q) and words_ok(w2.q)):
        if decode is not None:
            raise ValueError(f"decode={decode!r} needs w13.q and w2.q rows of a multiple of 4 contiguous bytes "
                             "with strides and addresses of multiples of 4 bytes")
        return "register"
    if chosen == "mma" and decode is None and not mma_fits(w13, w2, scheme):
        return "register"
    return chosen


def decode_split_k(config: KernelConfig, num_tokens: int, top_k: int, num_experts: int, n: int, hidden: int,
                   any_height: bool = False) -> int:
    """Splits of the down GEMM's reduction at decode sizes (16-row tiles, or any height with
    ``any_height``: the gemv decode): enough that the touched experts' output tiles x splits reach
    MIN_PROGRAMS, at most MAX_SPLIT and one per BLOCK_K step. The decode heuristic's narrow tiles
    already give the three presets >= 256 programs (no split); few local experts (expert parallelism,
    small hidden sizes) do not."""
    if config.BLOCK_M != 16 and not any_height:
        return 1
    blocks = max(1, min(num_experts, num_tokens * top_k))  # ~ one block per touched expert
    programs = blocks * cdiv(hidden, config.down.BLOCK_N)
    return max(1, min(cdiv(MIN_PROGRAMS, programs), MAX_SPLIT, cdiv(n, config.down.BLOCK_K)))
