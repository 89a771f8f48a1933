"""The GEMM launches of the weight-only tile, register and mma decodes (``triton_wo_plan`` builds a plan from them):
each decode's gate-up and down kernels bound to a call kind's grid, scalars and constexprs.

Expert biases and the activation variant (gpt-oss as it ships: b13 [E, 2N], b2 [E, K], interleaved gate/up rows,
its clamped SwiGLU) reach the tile, register and mma decodes' kernels (VARIANT_DECODES: ``_kernels/gemm_wo.py``'s
and ``_kernels/gemm_wo_mma.py``'s module docstrings): their gate-up takes b13 after its nine pointers and the spec's
INTERLEAVED / ALPHA / LIMIT / UP_SHIFT (``variant_constexprs``; the mma decode's split or halves gate-up: b13 in its
partials, the spec's clamp in the split_glu launch), their down GEMM b2 after its thirteen; with neither (None
pointers, the plain spec's values) they are the kernels before (sm_90 SASS identical,
``benchmarks/wo_sass_diff_cpu.py``). The gemv decode (``triton_wo_gemv.gemv_launches``) takes them the same way.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, g the group size.
"""

from __future__ import annotations

from moekit.activations import ActivationSpec, glu_constexprs
from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels
from moekit.experts.triton_plan import down_launches
from moekit.experts.triton_wo_configs import MIN_PACKED_K, ahead_of
from moekit.experts.triton_wo_mma import mma_gate_up, mma_launch_args
from moekit.triton_bind import BoundLaunch

SCHEME_IDS = {"int8_w8a16": 0, "int4_w4a16": 1, "mxfp4": 2}  # the kernels' SCHEME constexpr
VARIANT_DECODES = ("tile", "register", "mma", "gemv")  # the decodes whose kernels take b13 / b2 and the variant
_KERNELS = {"tile": ("gemm_wo", "gate_up_wo_kernel", "down_wo_kernel"),
            "register": ("gemm_wo_reg", "gate_up_wo_reg_kernel", "down_wo_reg_kernel"),
            "mma": ("gemm_wo_mma", "gate_up_wo_mma_kernel", "down_wo_mma_kernel")}


def span(tile: GemmTile, scheme: str, group_size: int) -> int:
    """SPAN, the reduction width one scale covers inside a step: min(BLOCK_K, g) (int8: BLOCK_K; its
    scale is per row). A packed config whose BLOCK_K is below MIN_PACKED_K is refused, naming it."""
    if scheme == "int8_w8a16":
        return tile.BLOCK_K
    if tile.BLOCK_K < MIN_PACKED_K:
        raise ValueError(f"config BLOCK_K must be >= {MIN_PACKED_K} for {scheme}, got {tile.BLOCK_K}")
    return min(tile.BLOCK_K, group_size)


def variant_constexprs(spec: ActivationSpec, rows: bool = False) -> dict:
    """The clamped SwiGLU's constexprs of ``spec`` (``activations.glu_constexprs``: ``gemm._glu``'s ALPHA, LIMIT,
    UP_SHIFT, LIMIT_AFTER), with ``rows`` also its INTERLEAVED (a gate-up's); a plain spec's are the kernels'
    defaults."""
    glu = glu_constexprs(spec)
    return dict(INTERLEAVED=spec.interleaved, **glu) if rows else glu


def gemm_launches(x, w13, w2, top_k: int, config: KernelConfig, num_pid_m: int, naive: bool, scheme: str,
                  decode: str, spec: ActivationSpec, asm: bool, options: LaunchOptions, split_k: int, split_len: int,
                  ksum: dict | None = None) -> tuple[BoundLaunch, BoundLaunch, BoundLaunch | None]:
    """The gate-up and down launches of ``decode``'s kernels, and down with the k-sum folded in where
    ``ksum`` (``triton_plan.down_launches``); h [A, N] and y [A, K] are contiguous workspace regions; w13 / w2 are
    ``triton_wo_plan.WeightArgs``. The VARIANT_DECODES' launches take b13 / b2 as pointers (``WoPlan.biased``) and
    ``spec``'s variant constexprs (its defaults: the plain kernels); ``asm``: the kernels' inline PTX decode."""
    num_experts, two_n = w13.q.shape[:2]
    n, hidden, num_assignments = two_n // 2, x.shape[1], x.shape[0] * top_k
    module, gate_up_name, down_name = _KERNELS[decode]
    up, down, gemm = config.up, config.down, kernels(module)
    shared = dict(BLOCK_M=config.BLOCK_M, SCHEME=SCHEME_IDS[scheme], NAIVE=naive, UPCAST=interpreting(),
                  cached=options.cached_launcher, **options.pdl_kwargs())
    if decode == "register":
        shared["ASM"], shared["SWAP_AB"] = asm, config.swap_ab
    elif decode == "mma":
        shared["ASM"] = asm
    else:
        shared["AHEAD"] = ahead_of(config)
    q13, q2 = (w13.q.shape[2], w13.strides), (w2.q.shape[2], w2.strides)
    extra13, extra2, up_grid, h_tail = {}, {}, (num_pid_m * cdiv(n, up.BLOCK_N),), (n,)
    pointers13, pointers2 = 9, 13
    if decode in VARIANT_DECODES:
        pointers13, pointers2 = 10, 14
        extra13.update(variant_constexprs(spec, rows=True))
    if decode == "mma":  # the rows read as int32 words: their lengths and q strides in words; a split gate-up
        (q13, words13), (q2, extra2) = mma_launch_args(w13, scheme), mma_launch_args(w2, scheme)
        extra13.update(words13)
        mma = mma_gate_up(config, q13[0], scheme, n, num_pid_m)  # its kernel, grid and output (h or partials)
        gate_up_name, up_grid, h_tail, extra13["SPLIT"] = mma.kernel, mma.grid, mma.h_tail, mma.grid[1]
    gate_up = BoundLaunch(
        getattr(gemm, gate_up_name), up_grid, pointers13,
        (n, hidden, q13[0], num_assignments, top_k, num_experts, num_pid_m, *x.stride(), *q13[1], *h_tail),
        BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, SPAN=span(up, scheme, w13.group_size), GROUP=w13.group_size,
        GROUP_M=up.GROUP_M, ACT=spec.kernel_id, num_warps=up.num_warps, num_stages=up.num_stages, **shared, **extra13,
    )
    down_launch, down_sum = down_launches(
        getattr(gemm, down_name), num_pid_m * cdiv(hidden, down.BLOCK_N), split_k,
        (hidden, n, q2[0], num_assignments, num_experts, num_pid_m, split_len, n, *q2[1], hidden),
        x.shape[0], ksum, pointers2,
        BLOCK_N=down.BLOCK_N, BLOCK_K=down.BLOCK_K, SPAN=span(down, scheme, w2.group_size), GROUP=w2.group_size,
        GROUP_M=down.GROUP_M, SPLIT=split_k, num_warps=down.num_warps, num_stages=down.num_stages, **shared,
        **extra2,
    )
    return gate_up, down_launch, down_sum
