"""Weight-only quantized experts on fused Triton kernels: int8_w8a16, int4_w4a16 and mxfp4 weights,
dequantized in registers inside the grouped GEMMs; activations stay in x's dtype (bf16 or fp16).

    [Align (as bf16)] -> [gate-up GEMM, w13 dequantized per tile, act-and-mul] -> [down GEMM, w2
    dequantized per tile, x routed weight; split-K at decode where its tiles are few] -> [sum over
    splits and k]

The same alignment, tiny-batch shortcut, workspace regions, k-sum (folded into the down GEMM in lean eager
calls up to ``LaunchOptions.sum_fold_max`` tokens with one split) and launch options as the 16-bit
path (``moekit.experts.triton``); the plan is ``triton_wo_plan``. Five decodes of the packed weights,
chosen per call kind from H200 measurements (``triton_wo_plan.choose_decode``; before it, the words decode in the
cells ``triton_wo_words_default`` measured, on an H100) or by ``decode=``:
"tile" (``_kernels/gemm_wo.py``: a whole dequantized tile per step, fast at prefill sizes),
"register" (``_kernels/gemm_wo_reg.py``: decoded in the MMA operand's registers), "mma"
(``_kernels/gemm_wo_mma.py``, all three schemes: 32-bit words decoded where they land into one tensor-core
operand in a permuted K order, one dot each 128 columns of a step of 128 or 256), "gemv"
(``_kernels/gemm_wo_gemv.py``: 32-bit words bit-placed into float32 on the CUDA cores, blocks of 1-2
rows; weights whose rows are whole words only, ``triton_wo_gemv.words_ok``), and at large batches
"scratch" (``triton_wo_scratch``: dequantized once into a scratch buffer, then the bf16 GEMMs).
No host synchronisation: CUDA-graph capturable; ``torch.ops.moekit.triton_experts_wo`` is an op with a fake and
no autograd layer (``op_library``; ``triton_experts_wo_autograd``, a custom op without a backward, takes calls whose
inputs need a gradient), so ``torch.compile(fullgraph=True)`` traces through it.

Weights (``WoWeight``; the session's quantized layouts, a logical weight [E, R, C] quantized along C,
the reduction dim; w13: R = 2N gate rows then up rows, C = K; w2: R = K, C = N):
    int8_w8a16  q int8 [E, R, C], scale fp32 [E, R] (symmetric, per output row); w = q * scale
    int4_w4a16  q uint8 [E, R, ceil(C/2)], element 2i in the low nibble, 2i+1 in the high (0..15);
                scale fp32 and zero uint8 (0..15; symmetric: 8) [E, R, ceil(C/g)], g in {32, 64, 128};
                w = (q - zero) * scale
    mxfp4       q uint8 as int4, e2m1 codes (sign bit 3, magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]);
                scale uint8 e8m0 [E, R, ceil(C/32)]; w = value * 2^(scale - 127)
Every tensor is read through its strides (no copies).

Expert biases and the activation variant (gpt-oss as it ships): b13 [E, 2N] (w13's row order) and b2 [E, K], each
None or any float dtype, read contiguous (a strided one is copied per call); ``activation`` a name or a gated
``ActivationSpec`` (interleaved gate/up rows, alpha, limit, up_shift). The tile, register, mma and gemv decodes take
them (``triton_wo_plan.VARIANT_DECODES``; a shape's measured entry first, ``triton_wo_variant``, else the chooser's
decode as for a plain call), and so does the scratch decode (its bf16 GEMMs add each chunk's bias rows and run the
variant on the scratch's rows as stored): a call with them takes "scratch" where a plain call of its shape and M would
(``_runs_scratch``: the winners table's rows, SCRATCH_MIN_TOKENS, ``scratch_fits``) and from a measured M of its shape
(``triton_wo_scratch.VARIANT_SCRATCH_FROM``: gpt-oss-20b's mxfp4 / int4 from 1024), a fused variant decode elsewhere.
The Gluon decode does not take them (such a call never takes it, not even where a plain call would; asked for by
name, an error).

Torch twin: ``fused_experts_wo_torch`` (``dequantize_wo`` per expert, then a float32 per-expert loop).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, g the group size.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from moekit.activations import ActivationSpec, apply_glu, as_spec, plan_activation, spec_fields
from moekit.experts.configs import KernelConfig
from moekit.experts.op_library import define_inference_op, needs_grad
from moekit.experts.triton_align import align_launches, clear_op_plans, shortcut_allowed
from moekit.experts.triton_cache import WorkspacePool
from moekit.experts.triton_launch import LaunchOptions, is_available
from moekit.experts.triton_wo_args import WoWeight, check_wo_args
from moekit.experts.triton_wo_plan import (
    SCHEME_IDS, WeightArgs, check_decode, chosen_decode, clear_wo_plans, weight_args, wo_plan_for,
)
from moekit.experts.triton_wo_scratch import (
    SCRATCH_MIN_TOKENS, run_experts_wo_scratch, scratch_chunking, variant_takes_scratch,
)
from moekit.experts.triton_wo_scratch_plan import clear_scratch_plans, scratch_lean_inputs
from moekit.experts.triton_wo_winners import MIN_M
from moekit.experts.triton_wo_words_default import words_default_covers
from moekit.experts.triton_wo_words_route import run_experts_words, words_call_variant, words_fit
from moekit.func_ops import transform_function, transforming
from moekit.layouts.grouping import to_local_ids
from moekit.quant import e2m1_decode
from moekit.quant.base import unpack_nibbles

GLUON_MIN_TOKENS = 128  # no ``triton_gluon_wo.GLUON_WO_CELLS`` range starts below it (a test holds them to it)


# ---------------------------------------------------------------------------------------------------
# The torch twin
# ---------------------------------------------------------------------------------------------------


def dequantize_wo(w: WoWeight, cols: int, expert: int | None = None) -> torch.Tensor:
    """The float32 weight [E, R, C] (or expert ``expert``'s [R, C]) that ``w`` stores; ``cols`` = C. The
    codes decode as ``moekit.quant`` defines them (``unpack_nibbles``, ``e2m1_decode``)."""
    q, scale, zero = w.q, w.scale, w.zero
    if expert is not None:
        q, scale, zero = q[expert], scale[expert], None if zero is None else zero[expert]
    if w.scheme == "int8_w8a16":
        return q.float() * scale.float()[..., None]
    codes = unpack_nibbles(q, cols)  # [.., R, C]: element 2i the low nibble, 2i+1 the high

    def per_column(t: torch.Tensor) -> torch.Tensor:  # [.., R, groups] -> [.., R, C]
        return t.repeat_interleave(w.group_size, dim=-1)[..., :cols].float()

    if w.scheme == "int4_w4a16":
        return (codes.float() - per_column(zero)) * per_column(scale)
    return e2m1_decode(codes) * torch.exp2(per_column(scale) - 127.0)


def fused_experts_wo_torch(
    x: torch.Tensor,  # [M, K]
    w13: WoWeight,  # [E, 2N, K]
    w2: WoWeight,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, 2N]
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """The twin of ``fused_experts_wo``: each routed expert's weights dequantized (one expert at a time,
    so real shapes fit), then + b13, the activation (``apply_glu``), + b2 and the weighted sum in float32; returns
    x.dtype [M, K]."""
    check_wo_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation, b13, b2)
    (num_experts, two_n), hidden = w13.q.shape[:2], x.shape[1]
    num_tokens, top_k = topk_ids.shape
    local = to_local_ids(topk_ids, num_experts, expert_map).view(num_tokens, top_k)  # [M, k]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)  # [M, K]
    for expert in range(num_experts):
        tokens, slots = (local == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].float() @ dequantize_wo(w13, hidden, expert).t()  # [m, 2N]
        if b13 is not None:
            h = h + b13[expert].float()
        y = apply_glu(h, activation) @ dequantize_wo(w2, two_n // 2, expert).t()  # [m, K]
        if b2 is not None:
            y = y + b2[expert].float()
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------------


def run_experts_wo(
    x: torch.Tensor, w13: WeightArgs, w2: WeightArgs, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None, scheme: str, activation: str | ActivationSpec = "silu",
    config: KernelConfig | None = None, options: LaunchOptions = LaunchOptions(), split_k: int | None = None,
    decode: str | None = None, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels, launched (arguments already checked); ``config`` overrides the lookup (of ``decode``'s
    configs), ``split_k`` the down GEMM's splits (None: ``decode_split_k``), ``decode`` the decode ("tile",
    "register", "mma", "gemv", "scratch" (``triton_wo_scratch``), "gluon" (``triton_gluon_wo``) or "gluon_words"
    (``triton_wo_words``: int4 or mxfp4; a repeated eager call lean); None: the words decode in its measured cells
    (``triton_wo_words_default``) where it fits, else ``choose_decode``, the fused ones when ``config`` or
    ``split_k`` is given). b13 [E, 2N] / b2 [E, K] or None
    and a non-plain ``activation`` spec: ``triton_wo_plan.VARIANT_DECODES`` and "scratch" (module docstring). Not an
    op: for tools that pick configs per call; models go through ``fused_experts_wo``."""
    shortcut = shortcut_allowed(x.shape[0], options)  # the words kernels' tiny-batch shortcut past one token
    if decode == "gluon_words":  # issue 16, sessions 45-46: ``triton_wo_words``, its own checks
        return run_experts_words(x, w13, w2, topk_ids, topk_weights, expert_map, scheme, activation, b13, b2,
                                 shortcut=shortcut)
    if (decode is None and config is None and split_k is None
            and words_default_covers(x, w13, scheme, activation, expert_map)):  # session 48: its measured cells
        out = run_experts_words(x, w13, w2, topk_ids, topk_weights, None, scheme, activation, b13, b2, default=True,
                                shortcut=shortcut)
        if out is not None:
            return out
    if not is_available(x.device):
        raise RuntimeError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {x.device}")
    ids, weights = topk_ids.contiguous(), topk_weights.contiguous()  # the kernels read them flat: [A]
    if ids.numel() == 0 or x.shape[1] == 0:
        return x.new_zeros(x.shape)
    if expert_map is not None:
        expert_map = expert_map.contiguous()
    variant = b13 is not None or b2 is not None or not as_spec(activation).plain
    if variant and decode == "gluon":
        raise ValueError("decode='gluon' takes no expert biases or activation variant: those run on "
                         "triton_wo_plan.VARIANT_DECODES or decode='scratch'")
    if not variant and _runs_gluon(x, w13, w2, ids, scheme, activation, config, split_k, decode):  # triton_gluon_wo
        from moekit.experts.triton_gluon_wo import run_experts_wo_gluon

        return run_experts_wo_gluon(x, w13, w2, ids, weights, expert_map, scheme, activation)
    # a variant call where a plain one of its shape and M would run scratch (the Gluon path's cells included: the
    # chooser below knows no Gluon) or from its measured M (VARIANT_SCRATCH_FROM), else a fused variant decode
    if _runs_scratch(x, w13, ids, scheme, config, split_k, decode, variant):
        return run_experts_wo_scratch(x, w13, w2, ids, weights, expert_map, SCHEME_IDS[scheme], activation, options,
                                      b13=b13, b2=b2)
    b13 = None if b13 is None else b13.contiguous()  # the kernels read them contiguous: no copy unless strided
    b2 = None if b2 is None else b2.contiguous()
    plan = wo_plan_for(x, w13, w2, ids, weights, expert_map, scheme, activation, config, options, split_k, decode,
                       b13, b2)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [M, K]
    b = plan.workspace.allocate(x.device)  # fresh: graph-safe, never aliased by what is returned
    if options.poison_workspace:
        b["h"].fill_(float("nan"))
        b["y"].fill_(float("nan"))
    for launch, pointers in wo_launches(plan, b, x, w13, w2, ids, weights, expert_map, out, b13, b2):
        launch(*pointers)
    return out


LEAN_WORKSPACES = WorkspacePool()  # the reused buffers of lean eager calls (``triton_quant_fast``)


def wo_lean_inputs(x, w13: WoWeight, w2: WoWeight, ids, weights, activation: str | ActivationSpec,
                   options: LaunchOptions, b13=None, b2=None):
    """What ``triton_quant_fast`` records a plain eager call (no map) from: its plan (the one the op's
    call used: the same options), a workspace pool, and its launches as a function of (b, x, ids, weights,
    out), weights bound. For a call the scratch decode runs, its kept form (``triton_wo_scratch_plan.
    scratch_lean_inputs``: the op's options; None where there is none); for one the Gluon path runs, its
    lean launch's (``triton_gluon_wo_lean.wo_gluon_lean_inputs``; None above its pool's size); for one the words
    default runs, its ``WordsVariant`` (no fused sequence: its own kept one, ``words_lean_call``). ``b13`` / ``b2``
    (contiguous, or None): bound into the launches as the weights are (the caller checks they are the same on a
    replay); a biased call the scratch decode runs: None (its lean form takes none)."""
    a13 = weight_args(w13.q, w13.scale, w13.zero, w13.group_size)
    a2 = weight_args(w2.q, w2.scale, w2.zero, w2.group_size)
    if words_default_covers(x, a13, w13.scheme, activation, None) and words_fit(x, a13, a2, ids.shape[1]):
        return words_call_variant(activation, b13, b2)
    biased = b13 is not None or b2 is not None
    plain = as_spec(activation).plain and not biased  # a variant never takes the Gluon decode (run_experts_wo)
    if plain and _runs_gluon(x, a13, a2, ids, w13.scheme, activation, None, None, None):  # its lean plan and pool
        from moekit.experts.triton_gluon_wo_lean import wo_gluon_lean_inputs

        return wo_gluon_lean_inputs(x, a13, a2, ids, weights, w13.scheme)
    if _runs_scratch(x, a13, ids, w13.scheme, None, None, None, not plain):
        if biased:
            return None
        op_options = _wo_options(options.dependent_launch)
        num_experts, two_n = a13.q.shape[:2]
        per, overlap = scratch_chunking(x, num_experts, two_n // 2, x.shape[1])
        return scratch_lean_inputs(x, a13, a2, ids, weights, SCHEME_IDS[w13.scheme], activation, op_options, per,
                                   overlap)
    # the op's options (its plan is the one the plain call compiled), with the caller's k-sum fold limit
    op_options = LaunchOptions(dependent_launch=options.dependent_launch, reuse_workspace=False,
                               sum_fold_max=options.sum_fold_max)
    plan = wo_plan_for(x, a13, a2, ids, weights, None, w13.scheme, activation, None, op_options, None, None, b13, b2)
    b = LEAN_WORKSPACES.buffers(plan.workspace, x.device)
    warm = wo_launches(plan, b, x, a13, a2, ids, weights, None, torch.empty_like(x), b13, b2)
    if any(launch._launcher is None and launch._raw is None for launch, _ in warm):
        # the plain call (the op: a fresh workspace, no counters) ran the separate k-sum; the folded down GEMM
        # the lean calls launch (and a plan of another fold limit) compiles on one call of them now (output dropped)
        for launch, pointers in warm:
            launch(*pointers)

    def launches(b: dict, x_arg, ids_arg, weights_arg, out_arg) -> list:
        return wo_launches(plan, b, x_arg, a13, a2, ids_arg, weights_arg, None, out_arg, b13, b2)

    return plan, LEAN_WORKSPACES, launches


def wo_launches(plan, b: dict, x, w13: WeightArgs, w2: WeightArgs, ids, weights, expert_map, out, b13=None,
                b2=None) -> list:
    """A call's launches in order, each (BoundLaunch, its pointers): the alignment (unless the naive
    shortcut; hist and scan as one with the pool's counters where the plan has it), gate-up, down with the
    k-sum folded in (where the plan has it and ``b`` the pool's counters) or down and the sum over splits
    and slots. ``b``: the workspace's regions (h [A, N],
    y [SPLIT*A, K]); b13 / b2 (contiguous, or None) go to a ``WoPlan.biased`` plan's GEMMs. Any tensor argument
    may be a stand-in (``triton_quant_fast`` records where each goes)."""
    map_or_ids = expert_map if expert_map is not None else ids  # read only with a map
    counters = b.get("counters")  # only a pool's workspace keeps them (the lean calls')
    if plan.align is None:
        rows, launches = (None, None, None), []  # naive: the kernels read each block's expert from topk_ids
    else:
        rows = (b["sorted_ids"], b["expert_ids"], b["num_padded"])
        launches = align_launches(plan.align, ids, map_or_ids, b, counters)
    h, y = b["h"], b["y"]  # [A, N], [SPLIT*A, K]
    bias13, bias2 = ((b13,), (b2,)) if plan.biased else ((), ())
    if plan.glu is None and not plan.glu_fold:
        launches.append((plan.gate_up, (x, w13.q, w13.scale, w13.zero, h, ids, *rows, *bias13)))
    else:  # the split gate-up's partials, then their sum and the activation (folded: down's, as it reads them)
        launches.append((plan.gate_up, (x, w13.q, w13.scale, w13.zero, b["p"], ids, *rows, *bias13)))
        if plan.glu_fold:
            h = b["p"]
        else:
            launches.append((plan.glu, (b["p"], h)))
    down = (h, w2.q, w2.scale, w2.zero, y, weights, ids, *rows)
    if counters is not None and plan.down_sum is not None:  # the k-sum in the down GEMM's epilogue: one launch fewer
        launches.append((plan.down_sum, (*down, out, counters, map_or_ids, *bias2)))
    else:  # the same sums in the same order, bit for bit
        launches.append((plan.down, (*down, None, None, None, *bias2)))
        launches.append((plan.sum_slots, (y, ids, map_or_ids, out)))
    return launches


def _runs_gluon(x, w13: WeightArgs, w2: WeightArgs, ids, scheme: str, activation: str | ActivationSpec, config,
                split_k, decode: str | None) -> bool:
    """The caller's "gluon", or for a call that fixes no decode, config or split the measured cells'
    (``triton_gluon_wo.gluon_wo_takes``; cheap first test: below GLUON_MIN_TOKENS never)."""
    if decode is not None or config is not None or split_k is not None or x.shape[0] < GLUON_MIN_TOKENS:
        return decode == "gluon"
    from moekit.experts.triton_gluon_wo import gluon_wo_takes

    return gluon_wo_takes(x, w13, w2, ids, scheme, activation)


def _runs_scratch(x, w13: WeightArgs, ids, scheme: str, config, split_k, decode: str | None,
                  variant: bool = False) -> bool:
    """The caller's "scratch", or for a call that fixes no fused config or split the chooser's, and for a ``variant``
    call (biases or an activation variant) also from its shape's measured M (``variant_takes_scratch``). Cheap
    first test: batches below SCRATCH_MIN_TOKENS and below the winners table's scope never run it."""
    small = x.shape[0] < min(SCRATCH_MIN_TOKENS, MIN_M // 2)
    if decode is not None or config is not None or split_k is not None or small:
        return decode == "scratch"
    num_experts, two_n = w13.q.shape[:2]  # the shortcut matters to the fused decodes only
    shape = (x.shape[0], num_experts, two_n // 2, x.shape[1])
    if variant and variant_takes_scratch(scheme, *shape, x.element_size()):
        return True
    return chosen_decode(scheme, *shape, ids.shape[1], x.element_size()) == "scratch"


def _wo_kernel(
    x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, z13: Optional[torch.Tensor], g13: int,
    q2: torch.Tensor, s2: torch.Tensor, z2: Optional[torch.Tensor], g2: int,
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor],
    scheme: str, activation: str, dependent_launch: bool, decode: str = "", b13: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None, gated: bool = True, interleaved: bool = False, alpha: float = 1.0,
    limit: Optional[float] = None, up_shift: float = 0.0, limit_after_act: bool = False,
) -> torch.Tensor:
    """The ops' body: x [M, K], each weight's (q, scale, zero or None, group size), topk_ids / topk_weights [M, k],
    expert_map [E_global] or None, the scheme, the activation's name, one ``LaunchOptions`` field, the decode ("" for
    the chooser's), b13 [E, 2N] / b2 [E, K] or None, the rest of the activation's fields
    (``activations.spec_fields``) -> out [M, K] (x.dtype)."""
    spec = plan_activation(activation, gated, interleaved, alpha, limit, up_shift, limit_after_act)
    return run_experts_wo(x, weight_args(q13, s13, z13, g13), weight_args(q2, s2, z2, g2), topk_ids, topk_weights,
                          expert_map, scheme, spec, options=_wo_options(dependent_launch), decode=decode or None,
                          b13=b13, b2=b2)


@functools.lru_cache(maxsize=2)
def _wo_options(dependent_launch: bool) -> LaunchOptions:
    """The op's ``LaunchOptions`` (workspaces never reused), built and validated once per value (as
    ``triton_op._options_of``)."""
    return LaunchOptions(dependent_launch=dependent_launch, reuse_workspace=False)


def _wo_fake(x, q13, s13, z13, g13, q2, s2, z2, g2, topk_ids, topk_weights, expert_map, scheme, activation,
             dependent_launch, decode="", b13=None, b2=None, gated=True, interleaved=False, alpha=1.0, limit=None,
             up_shift=0.0, limit_after_act=False):
    return x.new_empty(x.shape)  # [M, K], x.dtype: what run_experts_wo returns


# Two registrations of one body (as ``triton_fp8``'s): no autograd layer for calls without a gradient, and a custom
# op without a backward (main's form for every call) for a call with an input that needs one.
define_inference_op("triton_experts_wo", _wo_kernel, _wo_fake)
torch.library.custom_op("moekit::triton_experts_wo_autograd", _wo_kernel, mutates_args=()).register_fake(_wo_fake)


def fused_experts_wo(
    x: torch.Tensor,  # [M, K]
    w13: WoWeight,  # [E, 2N, K]
    w2: WoWeight,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    options: LaunchOptions = LaunchOptions(),
    decode: str | None = None,
    b13: torch.Tensor | None = None,  # [E, 2N], w13's row order
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """The experts contract on quantized weights: out [M, K] (x.dtype) = sum over the routed slots of
    weight * (w2 @ glu(w13 @ x + b13) + b2), the weights dequantized in the kernels, glu the activation (a name: its
    plain gated spec). Through the op ``triton_experts_wo``, or ``triton_experts_wo_autograd`` where an input needs a
    gradient. ``options``: its ``dependent_launch`` applies. ``decode``: one of ``triton_wo_plan.DECODES``, or
    None for the decode the H200 measured faster at this scheme, shape and batch size (with biases or a variant:
    module docstring)."""
    check_wo_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation, b13, b2)
    check_decode(decode)
    grad = needs_grad(x, w13.q, w13.scale, w2.q, w2.scale, topk_weights, b13, b2)
    op = (_TRANSFORM_FUNCTION.apply if transforming()  # torch.func: ``moekit.func_ops``
          else torch.ops.moekit.triton_experts_wo_autograd if grad else torch.ops.moekit.triton_experts_wo)
    name, *fields = spec_fields(activation)
    return op(x, w13.q, w13.scale, w13.zero, w13.group_size, w2.q, w2.scale, w2.zero, w2.group_size,
              topk_ids, topk_weights, expert_map, w13.scheme, name, options.dependent_launch, decode or "", b13, b2,
              *fields)


# the op as a torch.func transform reaches it (``moekit.func_ops``): vmap runs, a derivative refuses
_TRANSFORM_FUNCTION = transform_function(
    "TritonExpertsWo", torch.ops.moekit.triton_experts_wo, None, None,
    "the triton backend's weight-only kernels have no derivative (torch.func grad, vjp, jvp): take it on "
    "backend='grouped_mm', which runs the scheme in differentiable torch ops")


def clear_launch_caches() -> None:
    """Drop every weight-only plan and the lean calls' reused workspaces, the scratch decode's plans and kept
    scratch too (the next call builds them again)."""
    clear_wo_plans()
    clear_scratch_plans()
    clear_op_plans()  # the alignment op's (``triton_align``)
    LEAN_WORKSPACES.clear()
    from moekit.experts.triton_wo_words_lean import clear_words_plans  # decode "gluon_words"'s

    clear_words_plans()
