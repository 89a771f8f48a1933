"""The plan of a Triton experts call: everything its launches share that does not depend on the
call's data, decided on the first call of its kind and cached.

    plan_key(call) --_PLANS, a dict--> Plan: resolved options, config (tuned, nearest M, fitted to shared
    memory), the naive shortcut or the alignment's launches, the workspace's regions, and the bound
    launches (grid, scalars, constexprs) of gate-up, down and the k-sum
    plan_launches(plan, call's tensors) -> [(BoundLaunch, its arguments)] in launch order: run by
    ``triton._run``, recorded once with stand-ins by ``triton_lean``

A call's kind is what the launches depend on apart from the tensors' contents and addresses: M, the
shapes, strides and dtypes, each pointer's 16-byte alignment (Triton specialises on it), the expert
map's length, whether each bias is there (its dtype, strides, alignment), the activation (a name, or an
``ActivationSpec`` whose fields become the gate-up kernel's constexprs: a silu plan is never reused for
a clamped SwiGLU), an explicit config and the options. A plain ``"silu"`` call's key is what it was
with two more Nones: the variant costs it nothing per call. The config lookup reads files and
environment variables once per kind: ``configs.clear_config_cache()`` (which ``moekit tune`` calls on
saving) clears the plans too.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, B = BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.activations import ActivationSpec, as_spec, glu_constexprs
from moekit.experts.configs import KernelConfig, device_key, fit_shared_memory, get_config, on_config_cache_clear
from moekit.experts.triton_align import (
    AlignPlan, align_launches, one_pass_programs, plan_block_rows, shortcut_allowed,
)
from moekit.experts.triton_cache import WorkspaceSpec
from moekit.experts.triton_launch import (
    LaunchOptions, cdiv, interpreting, is_available, kernels, max_shared_memory, next_pow2, resolve_launch_options,
)
from moekit.triton_bind import BoundLaunch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_PLANS = 4096  # kinds of call kept (a few hundred bytes each); the oldest goes first


@dataclass(frozen=True, eq=False)
class Plan:
    """What every call of one kind launches with. Holds no tensor: nothing here outlives its data."""

    options: LaunchOptions  # resolved for the device
    config: KernelConfig  # the GEMM tiles; on the GPU shrunk to its shared memory
    align: AlignPlan | None  # the alignment's launches; None in the naive shortcut (block a = assignment a)
    workspace: WorkspaceSpec  # h [A, N], y [A, K] (work dtype), and the alignment's buffers
    # (interleaved, E, 2N or N, K, up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K) with TMA weights; else None
    descriptor_key: tuple | None
    # pointers: x, w13 (or its gate descriptor), the up rows' descriptor (interleaved TMA only, else None),
    # b13 (or None), h, ids, sorted_ids, expert_ids, num_padded, expert_map (or None)
    gate_up: BoundLaunch
    # pointers: h, w2 (or its descriptor), b2 (or None), y, weights, ids, sorted_ids, expert_ids, num_padded,
    # then None, None, None (down_sum's out, counters, expert_map)
    down: BoundLaunch
    sum_slots: BoundLaunch  # pointers: y, ids, expert_map (ids without one), out
    # down with the k-sum folded in (M <= options.sum_fold_max) or after the GEMM in its grid (M <= sum_tail_max;
    # else None); pointers: down's nine, then out, counters (int32, all 0: the workspace's "counters"), expert_map
    down_sum: BoundLaunch | None


_PLANS: dict[tuple, Plan] = {}
on_config_cache_clear(_PLANS.clear)


def clear_plans() -> None:
    _PLANS.clear()


def plan_key(x, w13, w2, ids, weights, expert_map, activation, config, options: LaunchOptions,
             b13=None, b2=None) -> tuple:
    """The kind of a call (see the module docstring). ``ids``, ``weights``, ``expert_map``: contiguous."""
    return (
        x.shape[0], x.dtype, x.device, x.stride(), w13.shape, w13.stride(), w2.stride(), ids.shape[1], ids.dtype,
        weights.dtype, x.data_ptr() & 15, w13.data_ptr() & 15, w2.data_ptr() & 15, ids.data_ptr() & 15,
        weights.data_ptr() & 15,
        None if expert_map is None else (expert_map.numel(), expert_map.dtype, expert_map.data_ptr() & 15),
        activation, config, options,
        None if b13 is None else (b13.dtype, b13.stride(), b13.data_ptr() & 15),
        None if b2 is None else (b2.dtype, b2.stride(), b2.data_ptr() & 15),
    )


def plan_for(x, w13, w2, ids, weights, expert_map, activation, config, options: LaunchOptions,
             b13=None, b2=None) -> Plan:
    """The cached plan of this call's kind (``options.cache_plans``), else a new one."""
    if not options.cache_plans:
        return build_plan(x, w13, w2, ids, expert_map, activation, config, options, b13, b2)
    key = plan_key(x, w13, w2, ids, weights, expert_map, activation, config, options, b13, b2)
    plan = _PLANS.get(key)
    if plan is None:
        plan = build_plan(x, w13, w2, ids, expert_map, activation, config, options, b13, b2)
        put_bounded(_PLANS, key, plan, MAX_PLANS)
    return plan


def plan_launches(plan: Plan, b: dict, x, w13_arg, up_arg, w2_arg, b13, b2, ids, weights, expert_map, out,
                  counters) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment (unless folded or the
    naive shortcut), gate-up, then down with the k-sum folded in (where the plan has it and ``counters``
    is given) or down and the k-sum. ``b``: the workspace's regions; the weight arguments are tensors or
    the plan's descriptors. Any argument may be a stand-in (``triton_lean`` records where each goes)."""
    map_or_ids = expert_map if expert_map is not None else ids  # read only with a map
    if plan.align is None:
        rows, launches = (None, None, None), []  # the kernels read each block's expert from topk_ids instead
    else:  # folded: the gate-up GEMM's programs write the layout
        rows = (b["sorted_ids"], b["expert_ids"], b["num_padded"])
        launches = align_launches(plan.align, ids, map_or_ids, b, counters)
    h, y = b["h"], b["y"]  # [A, N], [A, K]; rows of unrouted assignments unwritten
    # h = glu(x w13^T + b13), in assignment order; the map is read only by a folded alignment
    launches.append((plan.gate_up, (x, w13_arg, up_arg, b13, h, ids, *rows, expert_map)))
    # y = routed weight * (h w2^T + b2) per assignment, then out = the sum over each token's slots: folded
    # into the down GEMM (its epilogue, one launch fewer) where the plan has it and counters are kept, else
    # a launch of its own; either way the same sums in the same order, bit for bit.
    if counters is not None and plan.down_sum is not None:
        launches.append((plan.down_sum, (h, w2_arg, b2, y, weights, ids, *rows, out, counters, expert_map)))
    else:
        launches.append((plan.down, (h, w2_arg, b2, y, weights, ids, *rows, None, None, None)))
        launches.append((plan.sum_slots, (y, ids, map_or_ids, out)))
    return launches


def check_triton_args(x: torch.Tensor, activation: str | ActivationSpec, b13=None, b2=None) -> None:
    """What only this backend asks of a call (``check_experts_args`` has run): a clear error for each."""
    as_spec(activation)  # raises for an unknown name or a wrong type, naming the argument
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be one of {DTYPES} for the triton backend, got {x.dtype}")
    for arg, bias in (("b13", b13), ("b2", b2)):
        if bias is not None and bias.dtype not in DTYPES:
            raise TypeError(f"{arg} must be one of {DTYPES} for the triton backend, got {bias.dtype}")


def variant_constexprs(activation: str | ActivationSpec) -> dict:
    """The gate-up kernel's variant constexprs (``_kernels/gemm.py``) of ``activation``, a name (a plain
    gated activation) or an ``ActivationSpec`` (which has checked its fields: an ungated one has no
    interleaving, limit or up_shift)."""
    spec = as_spec(activation)
    return dict(ACT=spec.kernel_id, GATED=spec.gated, INTERLEAVED=spec.interleaved, **glu_constexprs(spec))


def build_plan(x, w13, w2, ids, expert_map, activation: str | ActivationSpec, config, options: LaunchOptions,
               b13=None, b2=None) -> Plan:
    """Decide everything for this call's kind: config, shortcut or alignment, workspace, launches."""
    check_triton_args(x, activation, b13, b2)
    if not is_available(x.device):
        raise RuntimeError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {x.device}")
    options = resolve_launch_options(options, x.device)
    variant = variant_constexprs(activation)
    (num_experts, w13_rows, hidden), (num_tokens, top_k) = w13.shape, ids.shape
    n, num_assignments = w2.shape[2], num_tokens * top_k  # w13_rows: 2N gated, N ungated
    descriptors = descriptors_allowed(w13, w2, options)
    config = launch_config(config, x, num_experts, n, top_k, descriptors)
    work_dtype = torch.float32 if interpreting() else x.dtype
    # the folded k-sum's counters (M <= sum_fold_max; 2 for the k-sum after the GEMM), then the fused hist + scan's
    # arrival slot
    ksum_counters = ksum_counter_count(num_tokens, hidden, config.down.BLOCK_N, options)
    rows = plan_block_rows(num_assignments, num_experts, config.BLOCK_M, expert_map, options,
                           shortcut=shortcut_allowed(num_tokens, options), fold=True, arrival_slot=ksum_counters,
                           one_pass=one_pass_programs(options, x.device))
    align = rows.align
    regions = [("h", work_dtype, (num_assignments, n)), ("y", work_dtype, (num_assignments, hidden))]
    up, down = config.up, config.down
    gate_up, down_launch, down_sum = _gemm_launches(x, w13, w2, b13, b2, top_k, config, rows.block_m, rows.num_pid_m,
                                                    align is None, descriptors, variant, options,
                                                    _fold_constexprs(align, num_assignments, num_experts, rows.block_m,
                                                                     expert_map), expert_map)
    return Plan(
        options=options, config=config, align=align,
        workspace=WorkspaceSpec.of(regions + list(align.regions if align is not None else ()),
                                   counters=ksum_counters + (align.kept_counters if align is not None else 0)),
        descriptor_key=(variant["INTERLEAVED"], num_experts, w13_rows, hidden, up.BLOCK_N, up.BLOCK_K, down.BLOCK_N,
                        down.BLOCK_K) if descriptors else None,
        gate_up=gate_up, down=down_launch,
        sum_slots=sum_launch(num_tokens, hidden, top_k, num_experts, expert_map, options, ordered=True),
        down_sum=down_sum,
    )


def _fold_constexprs(align: AlignPlan | None, num_assignments: int, num_experts: int, block_m: int,
                     expert_map: torch.Tensor | None) -> dict:
    """The gate-up kernel's FOLD constexprs (``_kernels/gemm.py``), on only for a folded alignment, and
    its ``num_global`` scalar (the expert map's length; 0 without one or unfolded)."""
    if align is None or not align.folded:
        return dict(num_global=0, FOLD=False)
    a_pad = next_pow2(num_assignments)
    return dict(num_global=0 if expert_map is None else expert_map.numel(), FOLD=True, A_PAD=a_pad,
                E_PAD=next_pow2(num_experts + 1), FOLD_CHUNK=min(a_pad, 4096 // block_m),
                HAS_MAP=expert_map is not None)


def _gemm_launches(x, w13, w2, b13, b2, top_k: int, config: KernelConfig, block_m: int, num_pid_m: int, naive: bool,
                   descriptors: bool, variant: dict, options: LaunchOptions,
                   fold: dict, expert_map=None) -> tuple[BoundLaunch, BoundLaunch, BoundLaunch | None]:
    """The gate-up and down GEMM launches, and the down GEMM with the k-sum folded in where
    ``options.sum_fold_max`` allows (else None). h [A, N] and y [A, K] are contiguous workspace regions; the
    weights and biases are read through their own strides (a bias that is None gets strides 0). ``fold``:
    the gate-up kernel's FOLD constexprs (``_fold_constexprs``)."""
    if config.swap_ab:
        raise ValueError("config.swap_ab is for the fp8 GEMMs (bf16 measured no faster with it, session 20)")
    num_experts, hidden, n = w2.shape
    num_assignments = x.shape[0] * top_k
    up, down, gemm = config.up, config.down, kernels("gemm")
    shared = dict(BLOCK_M=block_m, NAIVE=naive, UPCAST=interpreting(), W_DESC=descriptors,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # ieee: the fp32 1e-5 contract
                  cached=options.cached_launcher, raw=options.raw_launcher, **options.pdl_kwargs())
    fold = dict(fold)
    num_global = fold.pop("num_global")
    gate_up = BoundLaunch(
        gemm.gate_up_kernel, (num_pid_m * cdiv(n, up.BLOCK_N),), 10,
        (n, hidden, num_assignments, top_k, num_experts, num_pid_m, num_global, *x.stride(), *w13.stride(),
         *(b13.stride() if b13 is not None else (0, 0)), n),
        BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, GROUP_M=up.GROUP_M, **variant, **fold,
        # Interleaved rows contiguous (transposed storage): one [BK, 2BN] load split in two, not two
        # stride-2 loads (measured on the H200: gpt-oss-20b at M = 64, 2693 µs strided against 385 µs TMA).
        PAIRS=variant["INTERLEAVED"] and not descriptors and w13.stride(1) == 1,
        num_warps=up.num_warps, num_stages=up.num_stages, **shared,
    )
    down_scalars = (hidden, n, num_assignments, num_experts, num_pid_m, n, *w2.stride(),
                    *(b2.stride() if b2 is not None else (0, 0)), hidden)
    down_tiles = dict(BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, GROUP_M=down.GROUP_M,
                      num_warps=down.num_warps, num_stages=down.num_stages, **shared)
    gemm_programs = num_pid_m * cdiv(hidden, down.BLOCK_N)
    down_launch = BoundLaunch(gemm.down_kernel, (gemm_programs,), 12, down_scalars, **down_tiles)
    down_sum = None
    if 0 < x.shape[0] <= options.sum_fold_max:
        down_sum = BoundLaunch(gemm.down_kernel, (gemm_programs + cdiv(x.shape[0], ZERO_TOKENS),), 12, down_scalars,
                               **down_tiles, **ksum_constexprs(top_k, down.BLOCK_N, expert_map))
    elif 0 < x.shape[0] <= options.sum_tail_max:
        tail = SumTail.of(x.shape[0], hidden, top_k, expert_map)
        down_sum = BoundLaunch(gemm.down_kernel, (gemm_programs + tail.programs,), 12, down_scalars, **down_tiles,
                               **tail.constexprs)
    return gate_up, down_launch, down_sum


ZERO_TOKENS = 16  # tokens per program of the folded k-sum's zero-fill programs (after the GEMM's; ``_kernels/gemm.py``)


def ksum_constexprs(top_k: int, block_n: int, expert_map) -> dict:
    """The down kernel's KSUM arguments (``_kernels/gemm.py``, ``ksum_epilogue``): SUM_ROWS last rows
    summed at a time, their k [S, BN] slot tiles in flight together (<= 4096 elements)."""
    topk_pad = next_pow2(top_k)
    return dict(KSUM=True, top_k=top_k, num_global=0 if expert_map is None else expert_map.numel(), TOPK_PAD=topk_pad,
                HAS_MAP=expert_map is not None, SUM_ROWS=max(1, min(16, 4096 // (block_n * topk_pad))),
                ZERO_T=ZERO_TOKENS)


def ksum_counter_count(num_tokens: int, hidden: int, block_n: int, options: LaunchOptions) -> int:
    """The kept counters a down GEMM with the k-sum in it needs: [M, K tiles] folded (M <= sum_fold_max), 2 with
    the sum programs after the GEMM's (M <= sum_tail_max: the GEMM's arrivals, the sum programs' exits), else 0."""
    if 0 < num_tokens <= options.sum_fold_max:
        return num_tokens * cdiv(hidden, block_n)
    return 2 if 0 < num_tokens <= options.sum_tail_max else 0


SUM_TAIL_TOKENS = 4  # tokens per sum program after the down GEMM's (its SUM_T; ``SumTail``)


@dataclass(frozen=True)
class SumTail:
    """The sum programs a down GEMM's grid gets after its own (``_kernels/gemm.py``, SUM_AFTER): each a
    [SUM_T = SUM_TAIL_TOKENS tokens, SUM_K columns] tile of out (SUM_K: the separate ordered k-sum's,
    ``sum_launch``)."""

    programs: int
    constexprs: dict

    @classmethod
    def of(cls, num_tokens: int, hidden: int, top_k: int, expert_map) -> "SumTail":
        block_t, block_k = SUM_TAIL_TOKENS, sum_tile(hidden, top_k)[1]
        return cls(cdiv(num_tokens, block_t) * cdiv(hidden, block_k),
                   dict(SUM_AFTER=True, SUM_T=block_t, SUM_K=block_k, top_k=top_k, TOPK_PAD=next_pow2(top_k),
                        num_global=0 if expert_map is None else expert_map.numel(), HAS_MAP=expert_map is not None))


def sum_tile(hidden: int, top_k: int) -> tuple[int, int]:
    """(tokens, columns) of one k-sum program: [BT, k, BK] <= 8k elements."""
    return 4, min(next_pow2(hidden), max(32, 2048 // next_pow2(top_k)))


def down_launches(kernel, programs: int, split_k: int, scalars: tuple, num_tokens: int, ksum: dict | None,
                  pointers: int = 13, **constexprs) -> tuple[BoundLaunch, BoundLaunch | None]:
    """A weight-only down GEMM's launch (grid: ``programs`` x ``split_k``; pointers: its ten, then out, counters,
    expert_map, and b2 where ``pointers`` is 14: the tile and register decodes), and with ``ksum``
    (``ksum_constexprs``; one split) the same GEMM with the k-sum folded in, its zero-fill programs after the GEMM's
    (``gemm.down_kernel``'s KSUM); else None."""
    down = BoundLaunch(kernel, (programs, split_k), pointers, scalars, **constexprs)
    if ksum is None:
        return down, None
    return down, BoundLaunch(kernel, (programs + cdiv(num_tokens, ZERO_TOKENS), 1), pointers, scalars, **constexprs,
                             **ksum)


def sum_launch(num_tokens: int, hidden: int, top_k: int, num_experts: int, expert_map, options,
               split: int = 1, ordered: bool = False) -> BoundLaunch:
    """out[t] = sum of y over token t's routed slots (and over ``split`` split-K partials, the weight-only
    down GEMM's); skipped slots are never read; out [M, K] contiguous. Every Triton experts path uses it.
    ``ordered`` (split 1 only): slot by slot in slot order, bit for bit the down GEMM's folded k-sum."""
    if ordered and split != 1:
        raise ValueError(f"an ordered k-sum sums one split, got split={split}")
    has_map = expert_map is not None
    topk_pad = next_pow2(top_k)
    block_t, block_k = sum_tile(hidden, top_k)
    return BoundLaunch(
        kernels("combine").sum_slots_kernel, (cdiv(num_tokens, block_t), cdiv(hidden, block_k)), 4,
        (num_tokens, hidden, top_k, num_experts, expert_map.numel() if has_map else 0, hidden, hidden, 1),
        BLOCK_T=block_t, BLOCK_K=block_k, TOPK_PAD=topk_pad, HAS_MAP=has_map, SPLIT=split, ORDERED=ordered,
        cached=options.cached_launcher, raw=options.raw_launcher, **options.pdl_kwargs(),
    )


def descriptors_allowed(w13: torch.Tensor, w2: torch.Tensor, options: LaunchOptions) -> bool:
    """Asked for, and 16-bit weights, both contiguous with 16-byte aligned rows (what a TMA copy needs;
    the interleaved up rows' descriptor starts one row in, so it is aligned too). Anything else keeps
    the pointer loads with the weights' real strides, no copy: transposed storage (a view whose last dim
    is not K), a sliced or misaligned weight. float32 keeps the pointer loads: it is the precise path,
    not the fast one, and only those were run on the H200."""
    return options.weight_descriptors and all(
        w.element_size() == 2 and w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[2] * 2 % 16 == 0
        for w in (w13, w2)
    )


def launch_config(config: KernelConfig | None, x: torch.Tensor, num_experts: int, n: int, top_k: int,
                  descriptors: bool) -> KernelConfig:
    """``config``, or the tuned / heuristic one for this shape; on the GPU shrunk to its shared memory."""
    if config is None:
        config = get_config(x.shape[0], num_experts, n, x.shape[1], top_k, x.dtype, device_key(x.device))
    if interpreting():
        return config
    return fit_shared_memory(config, x.element_size(), max_shared_memory(x.device), descriptors=descriptors)
