"""The plan of an fp8 block-scaled Triton experts call (``triton_fp8``): its config and launches, decided
on the first call of its kind and cached, like the bf16 path's ``triton_plan``.

    fp8_config(M, E, N, K, k, block_k, device): a tuned file's nearest-M entry, else the heuristic
    Fp8Plan: config, alignment (or the tiny-batch shortcut), workspace regions, the weights' TMA
    descriptor key (or pointer loads), the bound launches of quantize x, gate-up (+ SiLU-and-mul +
    re-quantize h), down (x routed weight), k-sum

Choices that leave the result unchanged, for A/Bs (``benchmarks/fp8_device_check.py``; session 9's sweep,
``benchmarks/fp8_speed_device_check.py`` at 7e36ab4), are arguments of ``plan_for``: x quantized inside gate-up,
weights through TMA or pointers.

Tuned configs are JSON files in the bf16 path's format and directories (``moekit.experts.configs``, overlaid per M
the same way, a sibling device's files taken the same way), named ``E{E}_N{N}_K{K}_fp8_block_{device}.json``;
BLOCK_K of both GEMMs must equal the scale blocks' reduction width G and the gate-up BLOCK_N be a multiple of G (h
re-quantized in its epilogue) or a power of two below it (h written in float32, quantized by the down GEMM); a file
that says otherwise is refused. An fp8 entry may also name the weight loads it was measured with, "weight_tma" (true or
false; absent: the plan's rule, ``TMA_MAX_BLOCK_M``), and "x_in_gate_up" (true: in eager calls x is quantized
inside the gate-up GEMM, no launch of its own: a launch of host time fewer, for cells whose eager calls are
host-bound; a CUDA graph capture keeps the kernel of its own, faster on the GPU; absent or false: its own kernel),
and "persistent" (``triton_fp8_persistent.Persistent``: the GEMMs on a few programs per SM that loop over the tiles,
taken where the plan can, else one program a tile; absent: one program a tile), and "pair_dot" (true: the gate-up
GEMM loads each K-step's gate and up tiles as one TMA tile and multiplies them in one dot, ``gemm_fp8``'s PAIR_DOT,
where the plan has TMA weights and a gate-up tile within one weight scale block; absent or false: two dots).
H200 Qwen3-30B-A3B, the backend's eager wall µs with the switch / without: M = 1 31.0 / 37.7 (run 2), 39.8 / 46.8
(run 3), M = 2 37.1 / 38.6; at M = 8 94.7 / 84.0 (GPU-bound), so only its entry 1 (M = 1, 2) has it
(benchmarks/results/raw/*-fp8_small.*).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, (GN, G) the block
shape; KB = ceil(K / G), NB = ceil(N / G).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit._bounded import put_bounded
from moekit.experts.configs import (
    GemmTile, KernelConfig, device_key, lookup_env, nearest, on_config_cache_clear, overlay, read_configs, tuned_files,
)
from moekit.experts.triton_align import AlignPlan, one_pass_programs, plan_block_rows, shortcut_allowed
from moekit.experts.triton_cache import WorkspaceSpec, pair_chunk
from moekit.experts.triton_fp8_persistent import Persistent, choose_persistent, persistent_gemms
from moekit.experts.triton_fp8_variant import PLAIN, Fp8Variant
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels, resolve_launch_options
from moekit.experts.triton_plan import (
    ZERO_TOKENS, SumTail, _fold_constexprs, ksum_constexprs, ksum_counter_count, sum_launch,
)
from moekit.triton_bind import BoundLaunch

SCHEME = "fp8_block"
QUANT_ROWS = 16  # rows per program of the activation quantization kernel (one column group each)
# The weights go through TMA descriptors in GEMMs of at most this many rows per tile (the tiny-batch
# tiles), through pointer loads in taller ones. H200, the configs of before (fp8_device_check): TMA
# against pointers at M=1 22.2 / 116.8 / 124.9 µs against 23.8 / 121.9 / 115.2 (Qwen3 / DeepSeek-V3 /
# Mixtral), at M=4096 908 / 8049 / 5213 against 667 / 5964 / 3909 (those configs spilled registers).
TMA_MAX_BLOCK_M = 16
# Interleaved gate/up rows (gpt-oss's w13) through TMA from this many tokens on (``gemm_fp8``'s W_DESC with INTERLEAVED:
# the plain calls' descriptor, each tile's rows in place as two row tiles), where neither the caller nor a tuned entry
# names the weight loads; None: pointer loads at every M (session 40's route). The one switch of issue #15's gpt-oss
# prefill cells (session 41), set from ``f6f35e93:benchmarks/gof41_device_check.py``'s table by the defaults rule: an
# H100 (Triton 3.6, gpt-oss-20b's experts, graph µs pointer / TMA, every check PASS, TMA >= 3% faster in 5/5 rounds at
# each M): 1 53.7 / 49.8, 8 217.7 / 202.9, 64 318.1 / 303.5, 512 474.1 / 392.4, 1024 693.4 / 544.5, 2048 1172.2 / 896.7,
# 4096 2288.6 / 1751.1 (x1.05-1.31; raw/NVIDIA_H100_80GB_HBM3-2026-12-06-ae5250b-gof41.*). So from the first token.
INTERLEAVED_TMA_FROM_M: int | None = 1


@dataclass(frozen=True, eq=False)
class Fp8Plan:
    """What every call of one kind launches with. Holds no tensor."""

    config: KernelConfig  # the GEMM tiles; up.BLOCK_K == down.BLOCK_K == G, up.BLOCK_N a multiple or divisor of G
    align: AlignPlan | None  # None in the tiny-batch shortcut (block a = assignment a); folded: gate-up writes it
    # x_q [M, K] and x_s [M, KB] (none where gate-up quantizes x), h_q [A, N], h_s [A, NB] (where up.BLOCK_N < G:
    # h float32 and h_s [1], unused), y [A, K], + the alignment's
    workspace: WorkspaceSpec
    # (False, E, 2N, K, up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K) with TMA weights (``triton_cache``'s
    # descriptor key; interleaved gate/up rows take the plain one, w13 as [E*2N, K]); None: pointer loads
    descriptor_key: tuple | None
    quantize: BoundLaunch | None  # pointers: x, x_q, x_s; None where gate-up quantizes x as it loads it
    # pointers: x_q, x_s, w13_q (or its descriptor), w13_scale, h_q, h_s, ids, sorted_ids, expert_ids, num_padded,
    # expert_map (read by a folded alignment only)
    gate_up: BoundLaunch
    # pointers: h_q, h_s, w2_q (or its descriptor), w2_scale, y, weights, ids, sorted_ids, expert_ids, num_padded,
    # then None, None, None (down_sum's out, counters, expert_map)
    down: BoundLaunch
    sum_slots: BoundLaunch  # pointers: y, ids, expert_map (ids without one), out; ordered (the fold's order)
    # down with the k-sum folded in (M <= options.sum_fold_max) or in sum programs after the GEMM's (M <=
    # sum_tail_max), the bf16 plan's rule; else None; pointers: down's ten, then out, counters (int32, all 0: the
    # pool's "counters"), expert_map (ids without one)
    down_sum: BoundLaunch | None
    poison: bool  # fill h_q, h_s, y with NaN first (tests: a read of an unwritten row shows up)
    reuse_workspace: bool  # eager calls take their buffers from the reused pool (``options.reuse_workspace``)


MAX_PLANS = 4096  # kinds of call kept; the oldest goes first
_PLANS: dict[tuple, Fp8Plan] = {}
_TABLES: dict[tuple, dict[int, Fp8Entry] | None] = {}  # (E, N, K, device, the user directories) -> ``_table``
on_config_cache_clear(_PLANS.clear)
on_config_cache_clear(_TABLES.clear)


def clear_plans() -> None:
    """Drop the cached plans (they hold the kernels they were built with)."""
    _PLANS.clear()


def heuristic_fp8_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int,
                         group: int = 128) -> KernelConfig:
    """The default with no tuned file, from the H200 config A/B of ``benchmarks/fp8_device_check.py``
    (Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B; TMA weights). Below 16 rows per expert (M*k/E) the
    tiny-batch tiles are 16 rows by one scale group (h re-quantized in the gate-up epilogue): at M = 1,
    128-wide gate-up and down tiles took DeepSeek-V3 from 140.5 to 100.8 µs and Mixtral from 124.7 to
    119.4, Qwen3 within noise (26.7 -> 26.0). From 16 rows per expert, 64-row tiles on 8 warps (two
    warpgroups splitting the columns): the gate-up GEMM holds gate and up accumulators and each K-step's
    product before its scale fold, and at 64 accumulator registers per thread (128 rows on 8 warps, or
    64 on 4) it used 255 registers with 24 spilled; here 173, none. The fastest of six in every prefill
    cell: M=4096 Qwen3 910 -> 702 µs, DeepSeek-V3 8103 -> 6018, Mixtral 5261 -> 4369; M=512 Mixtral
    1017 -> 718. The down GEMM of those on 4 warps (session 9, ``fp8_speed_device_check`` at 7e36ab4, pointer
    weights): Qwen3 M=1024 / 4096 / 16384 253 -> 251, 683 -> 671, 2569 -> 2391 µs; Mixtral M=1024 / 4096
    1392 -> 1237, 4715 -> 4471."""
    width = max(128, group)  # a multiple of the group: h is re-quantized in the gate-up epilogue
    if num_tokens * top_k / num_experts < 16:
        return KernelConfig(16, GemmTile(width, group, 1, 4, 4), GemmTile(128, group, 1, 4, 4))
    return KernelConfig(64, GemmTile(width, group, 8, 8, 4), GemmTile(128, group, 8, 4, 4))


def config_file_name(num_experts: int, n: int, k: int, device: str) -> str:
    return f"E{num_experts}_N{n}_K{k}_{SCHEME}_{device}.json"


@dataclass(frozen=True)
class Fp8Entry:
    """One entry of a tuned file: the config, and the weight loads it was measured with where the file
    names them (the entry's optional "weight_tma" key; None: ``TMA_MAX_BLOCK_M`` decides), and where x is
    quantized ("x_in_gate_up": True inside the gate-up GEMM in eager calls; None: in its own kernel)."""

    config: KernelConfig
    weight_tma: bool | None = None
    x_in_gate_up: bool | None = None
    persistent: Persistent | None = None  # "persistent": the GEMMs persistent (``triton_fp8_persistent``)
    pair_dot: bool | None = None  # "pair_dot": gate and up in one dot a K-step (``gemm_fp8``'s PAIR_DOT)


def fp8_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, group: int, device: str) -> KernelConfig:
    """The tuned entry's config of the nearest M for (E, N, K, device), else ``heuristic_fp8_config``."""
    return fp8_entry(num_tokens, num_experts, n, k, top_k, group, device).config


def fp8_entry(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, group: int, device: str) -> Fp8Entry:
    """The tuned entry of the nearest M (``configs.nearest``), else the heuristic config, no switch."""
    table = _table(num_experts, n, k, device)
    if not table:
        return Fp8Entry(heuristic_fp8_config(num_tokens, num_experts, n, k, top_k, group))
    entry = table[nearest({m: m for m in table}, num_tokens)]
    check_config(entry.config, group, f"the tuned file {config_file_name(num_experts, n, k, device)}")
    return entry


def _table(num_experts: int, n: int, k: int, device: str) -> dict[int, Fp8Entry] | None:
    """{M: Fp8Entry} of the files of this shape (``configs.tuned_files``: the device's own, then a sibling device's
    where it has no packaged file), overlaid per M (``configs.overlay``: a user file's M, switches and all, over the
    packaged file's same M; its other M stay); None where there is none. Cached."""
    key = (num_experts, n, k, device, lookup_env())
    if key not in _TABLES:
        files = tuned_files(lambda dev: config_file_name(num_experts, n, k, dev), device)
        _TABLES[key] = overlay(files.paths, read_entries)
    return _TABLES[key]


def read_entries(path: Path) -> dict[int, Fp8Entry]:
    """{M: Fp8Entry} of one fp8 config file (``configs.read_configs``' entries, with their switches)."""
    raw = json.loads(Path(path).read_text())["configs"]
    entries = {}
    for m, config in read_configs(path).items():
        switches = {name: raw[str(m)].get(name) for name in ("weight_tma", "x_in_gate_up", "pair_dot")}
        for name, value in switches.items():
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{path}: entry {m}'s {name!r} must be true or false, got {value!r}")
        persistent = raw[str(m)].get("persistent")
        entries[m] = Fp8Entry(config, **switches, persistent=None if persistent is None else Persistent.from_dict(
            persistent, f"{path}: entry {m}"))
    return entries


def check_config(config: KernelConfig, group: int, where: str = "config") -> None:
    """BLOCK_K is the scale group (one scale per K-step); the gate-up tile holds whole groups, or
    divides one (then the down GEMM quantizes h)."""
    if config.up.BLOCK_K != group or config.down.BLOCK_K != group:
        raise ValueError(f"{where}: BLOCK_K of both GEMMs must be the block shape's {group}, got "
                         f"{config.up.BLOCK_K} and {config.down.BLOCK_K}")
    up_n = config.up.BLOCK_N
    if up_n % group and (up_n < 16 or group % up_n):
        raise ValueError(f"{where}: the gate-up BLOCK_N must be a multiple of {group} or a power of two from 16 "
                         f"below it, got {up_n}")


def plan_for(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, expert_map, block_shape: tuple[int, int],
             config: KernelConfig | None, options: LaunchOptions, x_in_gate_up: bool | None = None,
             weight_tma: bool | None = None, ahead: bool = True, persistent: Persistent | None = None,
             pair_dot: bool | None = None, variant: Fp8Variant = PLAIN) -> Fp8Plan:
    """The cached plan of this call's kind. ``ids``, ``weights``, ``expert_map``: contiguous. ``variant``: the
    call's biases and activation (``Fp8Variant``); interleaved gate/up rows take pointer weights with per-column
    scales, or TMA weights (``weight_tma``, else ``INTERLEAVED_TMA_FROM_M``) with a scale per row tile where the tile
    allows (``fp8_descriptors_allowed``); never PAIR_DOT; a variant call persistent GEMMs only where asked (and
    interleaved rows only through TMA: ``choose_persistent``).
    ``x_in_gate_up``: quantize x inside the gate-up GEMM instead of in a kernel of its own; None: the tuned
    entry's switch outside a CUDA graph capture, else never: on the GPU it is slower everywhere (H200, graph
    µs, its own kernel against inside gate-up: M = 1 Qwen3 20.6 / 24.4, DeepSeek-V3 98.6 / 101.0, Mixtral
    110.9 / 122.4; M = 8 Qwen3 84.1 / 91.1, DeepSeek-V3 677.6 / 724.6; Qwen3 M = 64 164.5 / 167.0, M = 1024
    247.9 / 318.0: every program quantizes each x tile it reads, in its K loop; raw/*-fp8_small.*).
    ``weight_tma``: the weights through TMA descriptors (True) or pointer loads (False) where
    ``options.weight_descriptors`` and the strides allow descriptors; None: the tuned entry's switch, else
    ``default_weight_tma`` decides. ``ahead``: the GEMMs that quantize their activation tiles in the loop
    load each one a K-step ahead (``gemm_fp8``'s AHEAD; False: the plain in-loop load, for A/Bs). ``persistent``:
    the GEMMs on a grid of a few programs per SM looping over the tiles (``triton_fp8_persistent``; refused where
    the plan cannot take them); None: the tuned entry's "persistent" where the plan takes it, else one program a
    tile (``triton_fp8_persistent.OFF``). ``pair_dot``: the gate-up GEMM's gate and up tiles in one dot a K-step
    (``choose_pair_dot``; True refused where the plan cannot take it); None: the tuned entry's "pair_dot"."""
    # Triton specialises each pointer on its 16-byte alignment, and a plan keeps the compiled launcher.
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    aligned = tuple(t.data_ptr() & 15 for t in (x, w13_q, w13_scale, w2_q, w2_scale, ids, weights))
    key = (x.shape, x.dtype, x.device, x.stride(), w13_q.shape, w13_q.stride(), w13_scale.stride(), w2_q.stride(),
           w2_scale.stride(), ids.shape[1], ids.dtype, weights.dtype, aligned,
           None if expert_map is None else (expert_map.numel(), expert_map.dtype, expert_map.data_ptr() & 15),
           block_shape, config, options, x_in_gate_up, weight_tma, ahead, persistent, pair_dot, capturing, variant)
    plan = _PLANS.get(key)
    if plan is None:
        plan = put_bounded(_PLANS, key, build_plan(x, w13_q, w13_scale, w2_q, w2_scale, ids, expert_map, block_shape,
                                                   config, options, x_in_gate_up, weight_tma, ahead, capturing,
                                                   persistent, pair_dot, variant), MAX_PLANS)
    return plan


def build_plan(x, w13_q, w13_scale, w2_q, w2_scale, ids, expert_map, block_shape: tuple[int, int], config,
               options: LaunchOptions, x_in_gate_up: bool | None = None, weight_tma: bool | None = None,
               ahead: bool = True, capturing: bool = False, persistent: Persistent | None = None,
               pair_dot: bool | None = None, variant: Fp8Variant = PLAIN) -> Fp8Plan:
    """Decide everything for this call's kind: config, shortcut or alignment, workspace, launches.
    ``capturing``: for a CUDA graph capture (a tuned entry's "x_in_gate_up" applies to eager calls only)."""
    block_n, group = block_shape
    options = resolve_launch_options(options, x.device)
    (num_experts, two_n, hidden), (num_tokens, top_k) = w13_q.shape, ids.shape
    n, num_assignments = two_n // 2, num_tokens * top_k
    entry = Fp8Entry(config) if config is not None else fp8_entry(num_tokens, num_experts, n, hidden, top_k, group,
                                                                   device_key(x.device))
    config, weight_tma = entry.config, entry.weight_tma if weight_tma is None else weight_tma
    x_in_gate_up = (entry.x_in_gate_up and not capturing) if x_in_gate_up is None else x_in_gate_up
    check_config(config, group)
    # the folded k-sum's counters (M <= sum_fold_max; 2 for the sum programs after the GEMM's, M <= sum_tail_max),
    # then the fused hist + scan's arrival slot (the bf16 plan's)
    down, ksum_counters = config.down, ksum_counter_count(num_tokens, hidden, config.down.BLOCK_N, options)
    rows = plan_block_rows(num_assignments, num_experts, config.BLOCK_M, expert_map, options,
                           shortcut=shortcut_allowed(num_tokens, options), fold=True, arrival_slot=ksum_counters,
                           one_pass=one_pass_programs(options, x.device))
    align, naive, block_m, num_pid_m = rows.align, rows.align is None, rows.block_m, rows.num_pid_m
    fold = _fold_constexprs(align, num_assignments, num_experts, block_m, expert_map)
    emulate, h_fp32 = interpreting(), config.up.BLOCK_N < group
    weight_tma = default_weight_tma(num_tokens, block_m, variant) if weight_tma is None else weight_tma
    x_raw, descriptors = bool(x_in_gate_up), weight_tma and fp8_descriptors_allowed(w13_q, w2_q, options, variant,
                                                                                  config, block_n)
    regions = _workspace_regions(x, num_assignments, n, group, x_raw, h_fp32)
    shared = dict(GROUP_N=block_n, BLOCK_M=block_m, NAIVE=naive, UPCAST=emulate, EMULATE=emulate, H_FP32=h_fp32,
                  W_DESC=descriptors, AHEAD=ahead, SWAP_AB=config.swap_ab, cached=options.cached_launcher,
                  **options.pdl_kwargs())
    up = config.up
    # else a scale a column; interleaved rows through TMA: a scale a row tile (``gemm_fp8``'s INTERLEAVED)
    up_one = descriptors if variant.interleaved else block_n % up.BLOCK_N == 0 and n % up.BLOCK_N == 0
    down_one = block_n % down.BLOCK_N == 0
    pair = choose_pair_dot(pair_dot, entry.pair_dot, descriptors, up_one, variant.interleaved)
    up_shared = dict(shared, ONE_BLOCK=up_one, PAIR_DOT=pair, PAIR_CHUNK=pair_chunk(up.BLOCK_N))
    gate_up = _gate_up_launch(w13_q, w13_scale, x.stride() if x_raw else None, num_assignments, top_k, config,
                              num_pid_m, dict(up_shared, X_RAW=x_raw, **variant.constexprs()), fold)
    down_shared = dict(shared, ONE_BLOCK=down_one)
    down_launch = _down_launch(w2_q, w2_scale, num_assignments, config, num_pid_m, down_shared)
    down_sum = ksum_counters and _down_launch(w2_q, w2_scale, num_assignments, config, num_pid_m, down_shared, ksum=(
        num_tokens, top_k, expert_map, num_tokens <= options.sum_fold_max)) or None
    persistent = choose_persistent(persistent, entry.persistent, naive or align.folded, h_fp32, x_raw, config.swap_ab,
                                   variant.plain, variant.interleaved and not descriptors)
    if persistent is not None:
        gate_up, down_launch, down_sum = persistent_gemms(
            persistent, (gate_up, down_launch, down_sum), w13_q, w13_scale, w2_q, w2_scale, num_assignments, top_k,
            config, num_pid_m, dict(up_shared, **variant.constexprs()), down_shared, x.device)
    return Fp8Plan(
        config=config, align=align,
        workspace=WorkspaceSpec.of(regions + list(align.regions if align is not None else ()),
                                   counters=ksum_counters + (align.kept_counters if align is not None else 0)),
        descriptor_key=("pair" if pair else False, num_experts, two_n, hidden, up.BLOCK_N, up.BLOCK_K, down.BLOCK_N,
                        down.BLOCK_K) if descriptors else None,
        quantize=None if x_raw else _quantize_launch(x, group, options),
        gate_up=gate_up, down=down_launch, down_sum=down_sum,
        sum_slots=sum_launch(num_tokens, hidden, top_k, num_experts, expert_map, options, ordered=True),
        poison=options.poison_workspace, reuse_workspace=options.reuse_workspace,
    )


def default_weight_tma(num_tokens: int, block_m: int, variant: Fp8Variant) -> bool:
    """The weight loads where neither the caller nor a tuned entry names them: TMA for tiles of at most
    ``TMA_MAX_BLOCK_M`` rows; interleaved gate/up rows from ``INTERLEAVED_TMA_FROM_M`` tokens on (None: never)."""
    if variant.interleaved:
        return INTERLEAVED_TMA_FROM_M is not None and num_tokens >= INTERLEAVED_TMA_FROM_M
    return block_m <= TMA_MAX_BLOCK_M


def _workspace_regions(x: torch.Tensor, num_assignments: int, n: int, group: int, x_raw: bool, h_fp32: bool) -> list:
    """(name, dtype, shape) of x_q [M, K] and x_s [M, KB] (none where gate-up quantizes x), h_q [A, N], h_s [A, NB]
    (h_fp32: h float32 and h_s [1], unused), y [A, K]; under the interpreter e4m3 values and y in float32."""
    (num_tokens, hidden), emulate = x.shape, interpreting()
    q_dtype, y_dtype = (torch.float32, torch.float32) if emulate else (torch.float8_e4m3fn, x.dtype)
    regions = [] if x_raw else [("x_q", q_dtype, (num_tokens, hidden)),
                                ("x_s", torch.float32, (num_tokens, cdiv(hidden, group)))]
    return regions + [("h_q", torch.float32 if h_fp32 else q_dtype, (num_assignments, n)),
                      ("h_s", torch.float32, (1,) if h_fp32 else (num_assignments, cdiv(n, group))),
                      ("y", y_dtype, (num_assignments, hidden))]


def choose_pair_dot(asked: bool | None, from_entry: bool | None, descriptors: bool, up_one_block: bool,
                    interleaved: bool = False) -> bool:
    """Whether the gate-up GEMM runs PAIR_DOT: the caller's ``asked`` (True refused by name where the plan cannot
    take it), else the tuned entry's where it can. It needs TMA weight descriptors, every gate-up tile in one
    weight scale block (one scalar scale a step for each of gate and up) and gate rows apart from up rows (not
    ``interleaved``: those tiles hold gate and up already, ``gemm_fp8``'s INTERLEAVED)."""
    refused = ("pointer weights (no TMA descriptors)" if not descriptors
               else "interleaved gate/up rows" if interleaved
               else "a gate-up tile across weight scale blocks" if not up_one_block else None)
    if asked and refused:
        raise ValueError(f"pair_dot does not take {refused}")
    return bool(from_entry if asked is None else asked) and refused is None


def fp8_descriptors_allowed(w13_q: torch.Tensor, w2_q: torch.Tensor, options: LaunchOptions,
                            variant: Fp8Variant = PLAIN, config: KernelConfig | None = None,
                            block_n: int = 128) -> bool:
    """Asked for (``options.weight_descriptors``), and both weights contiguous, 16-byte aligned, with
    rows of a multiple of 16 bytes (K and N multiples of 16: what a TMA copy of e4m3 tiles needs).
    Anything else (transposed storage, a slice) keeps the pointer loads through its strides, no copy. Interleaved
    gate/up rows (``variant``; ``gemm_fp8``'s INTERLEAVED with W_DESC) also need the gate-up tile (``config``) one h
    group wide (BLOCK_N == BLOCK_K) and within one weight scale block (``block_n``, the blocks' height, a multiple of
    it), else they keep pointer loads."""
    tiles_fit = not variant.interleaved or (
        config is not None and config.up.BLOCK_N == config.up.BLOCK_K and block_n % config.up.BLOCK_N == 0)
    return options.weight_descriptors and tiles_fit and all(
        w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[2] % 16 == 0 for w in (w13_q, w2_q))


def _quantize_launch(x: torch.Tensor, group: int, options: LaunchOptions) -> BoundLaunch:
    """x [M, K] -> x_q [M, K], x_s [M, KB] (contiguous workspace regions)."""
    (num_tokens, hidden), groups = x.shape, cdiv(x.shape[1], group)
    return BoundLaunch(kernels("quant_fp8").quantize_rows_kernel, (cdiv(num_tokens, QUANT_ROWS), groups), 3,
                       (num_tokens, hidden, *x.stride(), hidden, groups), BLOCK_R=QUANT_ROWS, GROUP=group,
                       EMULATE=interpreting(), cached=options.cached_launcher, **options.pdl_kwargs())


def _gate_up_launch(w13_q, w13_scale, x_stride: tuple | None, num_assignments: int, top_k: int,
                    config: KernelConfig, num_pid_m: int, shared: dict, fold: dict) -> BoundLaunch:
    """x_q [M, K] and h_q [A, N] are contiguous workspace regions, and so are their scales; ``x_stride``:
    x's strides where the kernel reads x itself (X_RAW), else None. ``fold``: the bf16 plan's FOLD
    constexprs and ``num_global`` (``triton_plan._fold_constexprs``)."""
    (num_experts, _, hidden), n, up = w13_q.shape, w13_q.shape[1] // 2, config.up
    fold = dict(fold)
    num_global = fold.pop("num_global")
    return BoundLaunch(
        kernels("gemm_fp8").gate_up_fp8_kernel, (num_pid_m * cdiv(n, up.BLOCK_N),), 12,
        (n, hidden, num_assignments, top_k, num_experts, num_pid_m, *(x_stride or (hidden, 1)),
         cdiv(hidden, up.BLOCK_K), *w13_q.stride(), *w13_scale.stride(), n, cdiv(n, up.BLOCK_K), num_global),
        BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, GROUP_M=up.GROUP_M,
        num_warps=up.num_warps, num_stages=up.num_stages, **shared, **fold,
    )


def _down_launch(w2_q, w2_scale, num_assignments: int, config: KernelConfig, num_pid_m: int, shared: dict,
                 ksum: tuple | None = None) -> BoundLaunch:
    """h_q [A, N], h_s [A, NB] and y [A, K] are contiguous workspace regions. ``ksum``: (M, k, expert_map, folded)
    for the down GEMM with the k-sum in it: folded (its zero-fill programs after the GEMM's, ``gemm_fp8``'s KSUM),
    else its sum programs after the GEMM's (SUM_AFTER)."""
    (num_experts, hidden, n), down = w2_q.shape, config.down
    programs = num_pid_m * cdiv(hidden, down.BLOCK_N)
    if ksum is not None:
        num_tokens, top_k, expert_map, folded = ksum
        if folded:
            shared = dict(shared, **ksum_constexprs(top_k, down.BLOCK_N, expert_map))
            programs += cdiv(num_tokens, ZERO_TOKENS)
        else:
            tail = SumTail.of(num_tokens, hidden, top_k, expert_map)
            shared = dict(shared, **tail.constexprs)
            programs += tail.programs
    return BoundLaunch(
        kernels("gemm_fp8").down_fp8_kernel, (programs,), 14,
        (hidden, n, num_assignments, num_experts, num_pid_m, n, cdiv(n, down.BLOCK_K), *w2_q.stride(),
         *w2_scale.stride(), hidden),
        BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, GROUP_M=down.GROUP_M,
        num_warps=down.num_warps, num_stages=down.num_stages, **shared,
    )
