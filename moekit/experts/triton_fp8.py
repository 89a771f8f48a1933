"""Fused Triton experts on fp8 block-quantized weights (DeepSeek-V3's recipe), and its torch twin.

    [Align (GPU, no sync)] -> [quantize x: e4m3 per token per G columns] -> [gate-up GEMM, block-scaled, + b13,
    the gated activation (SiLU-and-mul, or the spec's), h re-quantized per G columns] -> [down GEMM, block-scaled,
    + b2, x routed weight] -> [sum over k]

Expert biases (b13 [E, 2N], b2 [E, K]) and any gated ``ActivationSpec`` (gpt-oss's interleaved rows, alpha, clamp,
up_shift; GELU) since session 40 (issue #15; ``_kernels/gemm_fp8``'s module docstring): each call passes its own
biases to a plan keyed by their presence and the spec (``triton_fp8_variant.Fp8Variant``).

Weights (``fp8_block``, COMMON layout): w13_q [E, 2N, K] and w2_q [E, K, N] float8_e4m3fn, scales
[E, ceil(2N/GN), ceil(K/G)] and [E, ceil(K/GN), ceil(N/G)] float32, dequantized = q * scale (DeepSeek-V3's
``weight_scale_inv``), block_shape = (GN, G) = (128, 128) by default. Activations are quantized at run
time per row per G columns: s = amax / 448 (1 for a zero group), q = round_to_e4m3(v / s).

The alignment (folded into the gate-up GEMM up to ``LaunchOptions.align_fold_max`` assignments), the
tiny-batch shortcut (A*4 <= E, no expert map), the k-sum (folded into the down GEMM up to
``LaunchOptions.sum_fold_max`` tokens where the pool keeps its counters) and the launch machinery are the bf16 path's
(``triton_align``, ``triton_launch``, ``_kernels/combine``); the GEMMs and the
quantization are ``_kernels/gemm_fp8`` and ``_kernels/quant_fp8``; the plans ``triton_fp8_plan``. The
e4m3 weights go to the tiny-batch GEMMs as TMA descriptors where they are contiguous with 16-byte rows
(built once per weight tensor and plan blocks, ``triton_cache.WeightDescriptors``, as the bf16 path's),
else as pointers read through their strides (``triton_fp8_plan.TMA_MAX_BLOCK_M`` has the measurements);
``LaunchOptions.weight_descriptors=False`` forces the pointers.
``torch.ops.moekit.triton_experts_fp8`` is an op with a fake and no autograd layer (``op_library``; its twin
``triton_experts_fp8_autograd``, a custom op without a backward, takes calls whose inputs need a gradient): no host
sync, every size from shapes, so ``torch.compile(fullgraph=True)`` traces it and CUDA graphs capture it. Direct
eager calls take their buffers from a reused pool (``triton_cache.WorkspacePool``); a call through the op takes fresh
ones (from the graph's pool under CUDA graphs: nothing it allocates outlives it but its output).

Torch twin: ``fused_experts_fp8_torch`` (the same quantization steps, float32 GEMMs on dequantized
operands: equal to the block-scaled sum up to float32 rounding, except that now and then a value within
float32 rounding of an e4m3 midpoint rounds the other way in one of the two). Under the CPU interpreter the e4m3
values are kept in float32 buffers (see ``_kernels/quant_fp8``), as is y.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, (GN, G) block shape.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from moekit.activations import ActivationSpec, apply_glu, as_spec, plan_activation, spec_fields
from moekit.experts import _check_bias
from moekit.experts.configs import KernelConfig
from moekit.experts.op_library import define_inference_op, needs_grad
from moekit.experts.triton import _runs_directly
from moekit.experts.triton_align import align_launches, clear_op_plans
from moekit.experts.triton_cache import WeightDescriptors, WorkspacePool
from moekit.experts.triton_fp8_persistent import Persistent
from moekit.experts.triton_fp8_plan import QUANT_ROWS, Fp8Plan, clear_plans, plan_for
from moekit.experts.triton_fp8_variant import Fp8Variant
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, is_available, kernels
from moekit.func_ops import transform_function, transforming
from moekit.layouts.grouping import to_local_ids
from moekit.quant.fp8_block import check_block_shape
from moekit.triton_bind import COMPILE_OPTIONS

E4M3_MAX = 448.0
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize_groups(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v [R, C] -> (q [R, C] float8_e4m3fn, s [R, ceil(C/G)] float32), v ~= q * s per group of G columns.
    The twin of ``_kernels.quant_fp8``: s = amax / 448 (1 for a group of zeros), q = e4m3(v / s)."""
    rows, cols = v.shape
    padded = torch.nn.functional.pad(v.float(), (0, cdiv(cols, group) * group - cols))
    groups = padded.view(rows, -1, group)  # [R, CB, G]
    amax = groups.abs().amax(dim=2)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))  # [R, CB]
    q = (groups / s[:, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, -1)[:, :cols], s


def dequantize_groups(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """q [R, C] * s [R, ceil(C/G)] expanded over its groups -> float32 [R, C]."""
    return q.float() * s.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """One expert's q [R, C] * scale [ceil(R/GN), ceil(C/G)] expanded over its blocks -> float32 [R, C]."""
    rows, cols = q.shape
    expanded = scale.repeat_interleave(block_shape[0], dim=0).repeat_interleave(block_shape[1], dim=1)
    return q.float() * expanded[:rows, :cols]


def fused_experts_fp8_torch(
    x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, *,
    activation: str | ActivationSpec = "silu", expert_map: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128), b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of ``fused_experts_fp8`` (any device; syncs): x quantized per token per G columns,
    block-scaled gate-up in float32 (+ b13), the gated activation (``apply_glu``: SiLU-and-mul, or the spec's), h
    re-quantized per G columns, block-scaled down (+ b2), routed weight, sum over the k slots. Returns [M, K] in
    x.dtype."""
    check_fp8_args(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, activation, expert_map, block_shape,
                   b13, b2)
    group = block_shape[1]
    x_deq = dequantize_groups(*quantize_groups(x, group), group)  # [M, K] fp32
    top_k = topk_ids.shape[1]
    local = to_local_ids(topk_ids, w13_q.shape[0], expert_map)  # [A]; E = not routed here
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in local.unique().tolist():
        if e >= w13_q.shape[0]:
            continue
        assignments = (local == e).nonzero().squeeze(1)  # [n_e]
        tokens, slots = assignments // top_k, assignments % top_k
        gate_up = x_deq[tokens] @ dequantize_blocks(w13_q[e], w13_scale[e], block_shape).T  # [n_e, 2N]
        if b13 is not None:
            gate_up = gate_up + b13[e].float()
        h = apply_glu(gate_up, activation)  # [n_e, N]
        y = (dequantize_groups(*quantize_groups(h, group), group)
             @ dequantize_blocks(w2_q[e], w2_scale[e], block_shape).T)  # [n_e, K]
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])  # [n_e, K]
    return out.to(x.dtype)


def check_fp8_args(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, activation, expert_map,
                   block_shape, b13=None, b2=None) -> None:
    """A clear error, naming the argument, for anything the fp8 path cannot take."""
    if activation != "silu" and not as_spec(activation).gated:  # as_spec: a clear error for a wrong name or type
        raise ValueError(f"activation must be gated for the fp8 path (w13 [E, 2N, K]), got {activation!r}")
    check_block_shape(tuple(block_shape))  # the quantizer's and the checkpoints' rule
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be [M, K] in one of {X_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    (m, hidden), (bn, bk) = x.shape, block_shape
    for name, w in (("w13_q", w13_q), ("w2_q", w2_q)):
        if w.dtype != torch.float8_e4m3fn or w.dim() != 3:
            raise TypeError(f"{name} must be a 3-D float8_e4m3fn tensor, got {tuple(w.shape)} {w.dtype}")
    num_experts, two_n = w13_q.shape[0], w13_q.shape[1]
    if w13_q.shape[2] != hidden or two_n % 2:
        raise ValueError(f"w13_q must have shape [E, 2N, K={hidden}], got {tuple(w13_q.shape)}")
    n = two_n // 2
    _check_shape("w2_q", w2_q, (num_experts, hidden, n))
    _check_shape("w13_scale", w13_scale, (num_experts, cdiv(two_n, bn), cdiv(hidden, bk)), torch.float32)
    _check_shape("w2_scale", w2_scale, (num_experts, cdiv(hidden, bn), cdiv(n, bk)), torch.float32)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != m or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [M={m}, k] int32 or int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating [M, k] like topk_ids {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"expert_map must be 1-D int32 or int64, got {tuple(expert_map.shape)} {expert_map.dtype}")
    if b13 is not None:
        _check_bias("b13", b13, (num_experts, two_n), f"2N={two_n}", x)
    if b2 is not None:
        _check_bias("b2", b2, (num_experts, hidden), f"K={hidden}", x)
    for name, t in (("w13_q", w13_q), ("w13_scale", w13_scale), ("w2_q", w2_q), ("w2_scale", w2_scale),
                    ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("expert_map", expert_map)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {t.device}")


def _check_shape(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype | None = None) -> None:
    if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
        want = f"{list(shape)}" + (f" {dtype}" if dtype is not None else "")
        raise ValueError(f"{name} must be {want}, got {list(t.shape)} {t.dtype}")


# ---------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------


_DESCRIPTORS = WeightDescriptors()  # the e4m3 weights' TMA descriptors, per weight tensor (weakly)
_WORKSPACES = WorkspacePool()  # reused x_q, h, y and alignment buffers of eager calls (``triton_cache``)


def clear_launch_caches() -> None:
    """Drop every cached plan, weight descriptor and reused workspace (the next call builds them again)."""
    clear_plans()
    _DESCRIPTORS.clear()
    clear_op_plans()  # the alignment op's (``triton_align``)
    _WORKSPACES.clear()


def quantize_groups_triton(v: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_groups`` by the path's own kernel (v [R, C] -> q [R, C] e4m3, s [R, ceil(C/G)]): for
    checks of the rounding; the path launches it from its plan."""
    rows, cols = v.shape
    q = torch.empty(v.shape, dtype=torch.float32 if interpreting() else torch.float8_e4m3fn, device=v.device)
    s = torch.empty(rows, cdiv(cols, group), dtype=torch.float32, device=v.device)
    if v.numel():
        kernels("quant_fp8").quantize_rows_kernel[(cdiv(rows, QUANT_ROWS), cdiv(cols, group))](
            v, q, s, rows, cols, *v.stride(), cols, s.shape[1], BLOCK_R=QUANT_ROWS, GROUP=group,
            EMULATE=interpreting(), PDL=False, **COMPILE_OPTIONS)
    return q.to(torch.float8_e4m3fn), s  # under the interpreter q holds e4m3 values in float32: exact


def fused_experts_fp8_launch(
    x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map=None,
    block_shape: tuple[int, int] = (128, 128), config: KernelConfig | None = None,
    options: LaunchOptions = LaunchOptions(), x_in_gate_up: bool | None = None, weight_tma: bool | None = None,
    ahead: bool = True, persistent: Persistent | None = None, pair_dot: bool | None = None,
    activation: str | ActivationSpec = "silu", b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels, launched (arguments already checked; ``activation`` gated, b13 [E, 2N] / b2 [E, K] or None).
    ``config`` overrides the tuned lookup (for tuning and tests); models go through ``fused_experts_fp8``. Of
    ``options``, weight_descriptors, dependent_launch, cached_launcher and poison_workspace apply. ``x_in_gate_up``:
    quantize x inside the gate-up GEMM (True) or in a kernel of its own (False, and None: measured faster).
    ``weight_tma``: the weights through TMA descriptors (True) or pointers (False); None: the tuned entry's, else
    the plan's rule (``triton_fp8_plan.TMA_MAX_BLOCK_M``). ``ahead``, ``persistent``, ``pair_dot``: ``plan_for``'s.
    Whatever the choices, the result is the same."""
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # the kernels read them flat: [A]
    if ids.numel() == 0:
        return x.new_zeros(x.shape)
    if not is_available(x.device):
        raise RuntimeError(f"the fp8 triton path needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got "
                           f"{x.device}")
    if expert_map is not None:
        expert_map = expert_map.contiguous()
    b13, b2 = None if b13 is None else b13.contiguous(), None if b2 is None else b2.contiguous()  # read flat
    plan = plan_for(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, expert_map, tuple(block_shape), config, options,
                    x_in_gate_up, weight_tma, ahead, persistent, pair_dot, Fp8Variant.of(activation, b13, b2))
    return _run(plan, x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, expert_map, b13, b2)


def _run(plan: Fp8Plan, x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, expert_map, b13, b2) -> torch.Tensor:
    out = torch.empty_like(x) if x.is_contiguous() else x.new_empty(x.shape)  # [M, K]
    b = _WORKSPACES.buffers(plan.workspace, x.device) if plan.reuse_workspace else plan.workspace.allocate(x.device)
    if plan.poison:  # a read of a row no kernel wrote shows up as NaN in the output
        for name in ("h_q", "h_s", "y"):
            b[name].fill_(float("nan"))
    w13_arg, w2_arg = w13_q, w2_q
    if plan.descriptor_key is not None:
        pair = _DESCRIPTORS.get(w13_q, w2_q, plan.descriptor_key)
        w13_arg, w2_arg = pair.w13, pair.w2
    for launch, pointers in fp8_launches(plan, b, x, w13_arg, w13_scale, w2_arg, w2_scale, ids, weights, expert_map,
                                         out, b13, b2):
        launch(*pointers)
    return out


def fp8_lean_inputs(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, block_shape: tuple[int, int],
                    options: LaunchOptions, activation: str | ActivationSpec = "silu", b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> tuple:
    """What ``triton_quant_fast`` records an eager call without a map from: its plan (the one the call used:
    ``activation``'s, ``plan_activation``'s value, and its biases' kind), the workspace pool, and its launches as a
    function of (b, x, ids, weights, out), weights and b13 [E, 2N] / b2 [E, K] (contiguous, or None) bound (the caller
    checks they are the same on a replay, ``kept_biases``)."""
    plan = plan_for(x, w13_q, w13_scale, w2_q, w2_scale, ids, weights, None, block_shape, None, options,
                    variant=Fp8Variant.of(activation, b13, b2))
    w13_arg, w2_arg = w13_q, w2_q
    if plan.descriptor_key is not None:
        pair = _DESCRIPTORS.get(w13_q, w2_q, plan.descriptor_key)
        w13_arg, w2_arg = pair.w13, pair.w2

    def launches(b: dict, x_arg, ids_arg, weights_arg, out_arg) -> list:
        return fp8_launches(plan, b, x_arg, w13_arg, w13_scale, w2_arg, w2_scale, ids_arg, weights_arg, None, out_arg,
                            b13, b2)

    return plan, _WORKSPACES, launches


def fp8_launches(plan: Fp8Plan, b: dict, x, w13_arg, w13_scale, w2_arg, w2_scale, ids, weights, expert_map,
                 out, b13=None, b2=None) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment (unless folded or the
    shortcut; hist and scan as one with the pool's counters where the plan has it), x quantized (unless gate-up
    does it), gate-up, down with the k-sum folded in (where the plan has it and ``b`` the pool's counters) or
    down and the k-sum. ``b``: the workspace's
    regions; the weight arguments are tensors or the plan's descriptors; b13 [E, 2N] / b2 [E, K] contiguous, or None
    as the plan was built (``Fp8Variant``). Any argument may be a stand-in
    (``triton_quant_fast`` records where each goes)."""
    map_or_ids = expert_map if expert_map is not None else ids  # read only with a map
    counters = b.get("counters")  # only a pool's workspace keeps them (never while a graph captures)
    if plan.align is None:
        rows, launches = (None, None, None), []  # the kernels read each block's expert from topk_ids instead
    else:  # folded: the gate-up GEMM's programs write the layout
        rows = (b["sorted_ids"], b["expert_ids"], b["num_padded"])
        launches = align_launches(plan.align, ids, map_or_ids, b, counters)
    if plan.quantize is None:  # the gate-up GEMM quantizes x as it loads it
        x_q, x_s = x, x  # x_s is never read then
    else:
        x_q, x_s = b["x_q"], b["x_s"]
        launches.append((plan.quantize, (x, x_q, x_s)))
    launches.append((plan.gate_up, (x_q, x_s, w13_arg, w13_scale, b["h_q"], b["h_s"], ids, *rows, expert_map, b13)))
    down = (b["h_q"], b["h_s"], w2_arg, w2_scale, b["y"], weights, ids, *rows)
    if counters is not None and plan.down_sum is not None:  # the k-sum in the down GEMM's epilogue: one launch fewer
        launches.append((plan.down_sum, (*down, out, counters, map_or_ids, b2)))
    else:  # the same sums in the same order, bit for bit
        launches.append((plan.down, (*down, None, None, None, b2)))
        launches.append((plan.sum_slots, (b["y"], ids, map_or_ids, out)))
    return launches


def _fp8_kernel(
    x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor], block_n: int,
    block_k: int, weight_descriptors: bool, dependent_launch: bool, poison_workspace: bool,
    b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None, activation: str = "silu", gated: bool = True,
    interleaved: bool = False, alpha: float = 1.0, limit: Optional[float] = None, up_shift: float = 0.0,
    limit_after_act: bool = False,
) -> torch.Tensor:
    """The ops' body: x [M, K], the fp8 weights and scales, topk_ids / topk_weights [M, k], expert_map [E_global]
    or None, the block shape (block_n, block_k), three ``LaunchOptions`` fields, b13 [E, 2N] / b2 [E, K] or None, the
    activation's fields (``activations.spec_fields``) -> out [M, K] (x.dtype)."""
    # The op never reuses workspaces (``triton_op``'s rule): compiled callers run it inside CUDA-graph trees, whose
    # warm-up runs allocate from the graph's private pool, and the pool's buffer and kept counters made there outlive
    # the call (H200: generate with "reduce-overhead" on fp8 experts failed, "Detected 2 tensor(s) in the cudagraph
    # pool not tracked as outputs"). Eager calls reach the pool through the direct path, not the op.
    options = _fp8_options(weight_descriptors, dependent_launch, poison_workspace)
    return fused_experts_fp8_launch(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map,
                                    (block_n, block_k), options=options, b13=b13, b2=b2,
                                    activation=plan_activation(activation, gated, interleaved, alpha, limit, up_shift,
                                                               limit_after_act))


@functools.lru_cache(maxsize=8)
def _fp8_options(weight_descriptors: bool, dependent_launch: bool, poison_workspace: bool) -> LaunchOptions:
    """The op's option fields as ``LaunchOptions`` (``reuse_workspace`` off), built and validated once per set of
    values (as ``triton_op._options_of``: a compiled graph passes the same constants on every call)."""
    return LaunchOptions(weight_descriptors=weight_descriptors, dependent_launch=dependent_launch,
                         poison_workspace=poison_workspace, reuse_workspace=False)


def _fp8_fake(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map, block_n, block_k,
              weight_descriptors, dependent_launch, poison_workspace, b13=None, b2=None, activation="silu", gated=True,
              interleaved=False, alpha=1.0, limit=None, up_shift=0.0, limit_after_act=False):
    return x.new_empty(x.shape)  # [M, K], x.dtype: what fused_experts_fp8_launch returns


# Two registrations of one body: the op (no Python autograd layer) for calls without a gradient, and for a call with
# an input that needs one a custom op without a backward (main's form, which every call went through: the forward
# runs, a backward through it raises torch's "no autograd formula" error).
define_inference_op("triton_experts_fp8", _fp8_kernel, _fp8_fake)
torch.library.custom_op("moekit::triton_experts_fp8_autograd", _fp8_kernel, mutates_args=()).register_fake(_fp8_fake)


def fused_experts_fp8(
    x: torch.Tensor,  # [M, K]
    w13_q: torch.Tensor,  # [E, 2N, K] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, ceil(2N/GN), ceil(K/G)] float32
    w2_q: torch.Tensor,  # [E, K, N] float8_e4m3fn
    w2_scale: torch.Tensor,  # [E, ceil(K/GN), ceil(N/G)] float32
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    block_shape: tuple[int, int] = (128, 128),
    options: LaunchOptions = LaunchOptions(),
    b13: torch.Tensor | None = None,  # [E, 2N], w13's row order
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """The experts contract on fp8 block-quantized weights, fused Triton kernels: sum over the routed slots of
    weight * (w2 @ q(glu(w13 @ q(x) + b13)) + b2), q the 1 x G activation quantization, glu any gated activation
    (a name: its plain spec; gpt-oss's interleaved clamped SwiGLU too); returns [M, K] in x.dtype. In eager mode
    where nothing traces or needs the op (``triton``'s direct-eager rule, ``options.direct_eager``), the kernels are
    launched directly; else through
    ``torch.ops.moekit.triton_experts_fp8`` (of ``options``, weight_descriptors, dependent_launch and
    poison_workspace cross the op), or ``triton_experts_fp8_autograd`` where an input needs a gradient."""
    check_fp8_args(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, activation, expert_map, block_shape,
                   b13, b2)
    if options.direct_eager and _runs_directly(x, w13_q, w2_q, topk_weights, b13, b2):
        return fused_experts_fp8_launch(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map,
                                        tuple(block_shape), options=options, activation=activation, b13=b13, b2=b2)
    grad = needs_grad(x, w13_q, w13_scale, w2_q, w2_scale, topk_weights, b13, b2)
    op = (_TRANSFORM_FUNCTION.apply if transforming()  # torch.func: ``moekit.func_ops``
          else torch.ops.moekit.triton_experts_fp8_autograd if grad else torch.ops.moekit.triton_experts_fp8)
    return op(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map, block_shape[0], block_shape[1],
              options.weight_descriptors, options.dependent_launch, options.poison_workspace, b13, b2,
              *spec_fields(activation))


# the op as a torch.func transform reaches it (``moekit.func_ops``): vmap runs, a derivative refuses
_TRANSFORM_FUNCTION = transform_function(
    "TritonExpertsFp8", torch.ops.moekit.triton_experts_fp8, None, None,
    "the triton backend's fp8_block kernels have no derivative (torch.func grad, vjp, jvp): take it on "
    "backend='grouped_mm', which runs the scheme in differentiable torch ops")
