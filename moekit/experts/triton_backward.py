"""Autograd for the Triton experts path: gradients for x, w13, w2 and topk_weights (so the router trains).

    forward: torch.ops.moekit.triton_experts (triton_op.py)  or  torch.ops.moekit.triton_experts_train
    backward: torch.ops.moekit.triton_experts_backward  ->  triton_backward_launch.experts_backward

Per assignment a = (t, j) routed to e with weight w_a: h_a = w13[e] x_t [2N], g_a = act(gate_a) up_a
[N], y_a = w2[e] g_a [K], out_t = sum_j w_a y_a. With dout_t = dL/dout_t:

    dg_a = w_a w2[e]^T dout_t      dh_a = act-and-mul backward of dg_a   d w_a = <dout_t, y_a> = <w2[e]^T dout_t, g_a>
    dx_t = sum_j w13[e]^T dh_a     dW2[e] = sum_a dout_t (w_a g_a)^T     dW13[e] = sum_a dh_a x_t^T

d w_a comes out of the dY @ W2 GEMM's epilogue as a dot with g, so y is neither saved nor recomputed.

Options (``BackwardOptions``, for ``experts_triton_train``; the ``triton_experts`` op of ``MoE`` and
``experts_triton`` takes the defaults):
- ``recompute=True`` (default): the backward recomputes gate and up in the same K loop as dY @ W2 (x
  and dout rows share the token gather). Memory: nothing saved beyond the inputs. Time: one more
  gate-up GEMM: per assignment the backward does 16NK FLOPs instead of 12NK (dY @ W2 2NK, dX 4NK,
  dW13 4NK, dW2 2NK), the whole step 22NK instead of 18NK (+22%).
- ``recompute=False``: the forward runs on x permuted into the layout's rows (``triton_train_forward``,
  fused: the gate-up GEMM also stores its product) and keeps x_p [P, K] and the gate-up pre-activation
  h_p [P, 2N] in x's dtype (P = layout rows ~ A = M*k plus each expert's padding to the block); the
  backward reads h_p instead of recomputing it: 12NK FLOPs an assignment instead of 16NK, the step 18NK.
  Memory: 4N bytes a layout row in bf16 held from the forward to the backward, beside x_p's 2K (Mixtral-
  8x7B at M=4096: h_p 504 MiB and x_p 72 MiB a layer; Qwen3-30B-A3B at M=16384: 432 MiB + 576 MiB).
  The tiles are the shape's with the grad tile and the weight grads on the layout's rows
  (``triton_backward_sorted.kept_tiles``).
- ``split_m``: each expert's M-blocks split this many ways in the weight grads (fp32 partials summed
  in a fixed order); 0 = chosen from the shapes (``triton_backward_launch.choose_split``).
``experts_triton_train``'s forward (recompute) runs on x permuted into the layout's rows when the tiles
of the shape carry forward tiles (``BackwardTiles.fwd13``/``fwd2``, ``triton_train_forward``) and keeps
x_p for the backward, which then does not permute x again; else it is the inference forward.
Every fused path is deterministic: no atomics, the d-weight and split sums in a fixed order.

The variants (expert biases, an ``ActivationSpec`` other than the plain gated one of ``BACKWARD_ACTIVATIONS``:
interleaved rows, alpha, a clamp before or after the activation, up_shift, ungated, relu2) train too, through a
recomputing backward (``triton_backward_recompute``): the forward runs on the Triton kernels, the backward
re-runs the call on ``grouped_mm``'s differentiable path and takes its gradients (x, w13, w2, topk_weights,
b13, b2), one grouped_mm forward + backward in the backward pass. ``unsupported_variant`` names why a call
takes it; a plain call's backward is the fused one above, unchanged. ``experts_triton_train`` sends a variant
through the ``triton_experts`` op (its ``BackwardOptions`` are the fused backward's and do not apply).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moekit.activations import ActivationSpec, spec_fields
from moekit.experts import check_experts_args
from moekit.experts.triton_backward_recompute import GRAD_NAMES, recompute_grads
from moekit.func_ops import transform_function, transforming
from moekit.experts.triton_backward_launch import (BACKWARD_ACTIVATIONS, BackwardTiles, _work_dtype, backward_tiles,
                                                   experts_backward)
from moekit.experts.triton_backward_sorted import kept_tiles
from moekit.experts.triton_kept_forward import with_kept_forward
from moekit.experts.triton_train_forward import layout_rows, sorted_forward
from moekit.experts.triton_plan import check_triton_args

# Arguments of a variant the fused backward does not take, with the value of the base variant (the
# forward's schema may carry any of them; one that differs sends the backward to recomputation).
_BASE_VARIANT = {"b13": None, "b2": None, "gated": True, "interleaved": False, "alpha": 1.0,
                 "limit_after_act": False, "limit": None, "up_shift": 0.0}


@dataclass(frozen=True)
class BackwardOptions:
    """How ``experts_triton_train`` trades memory for time (module docstring)."""

    recompute: bool = True  # recompute the gate-up product in the backward; False: the forward keeps it (h_p)
    split_m: int = 0  # ways each expert's M-blocks split in the weight grads; 0 = from the shapes

    def __post_init__(self) -> None:
        if not isinstance(self.split_m, int) or self.split_m < 0:
            raise ValueError(f"split_m must be an int >= 0 (0 = chosen from the shapes), got {self.split_m!r}")


def unsupported_variant(args: dict) -> str | None:
    """Why the fused backward cannot take a forward called with ``args`` (by schema name), or None; such a
    call's gradients come by recomputation (``triton_backward_recompute``)."""
    activation = args.get("activation", "silu")
    if activation not in BACKWARD_ACTIVATIONS:
        return f"the fused backward has no derivative for activation={activation!r} (it has {BACKWARD_ACTIVATIONS})"
    for name, base in _BASE_VARIANT.items():
        value = args.get(name, base)
        if (value is not None) if base is None else (value != base):
            shown = f"a {type(value).__name__}" if isinstance(value, torch.Tensor) else repr(value)
            return f"the fused backward takes {name}={base!r} only, not {name}={shown}"
    return None


# ---------------------------------------------------------------------------------------------------
# The backward op: one opaque call, so torch.compile traces the backward through its fake
# ---------------------------------------------------------------------------------------------------


@torch.library.custom_op("moekit::triton_experts_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor], h_pre: Optional[torch.Tensor], activation: str,
    need_x: bool, need_w13: bool, need_w2: bool, need_weights: bool, split_m: int, x_p: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, K], dw13 [E, 2N, K], dw2 [E, K, N], dweights [M, k]); an empty [0] tensor where not needed."""
    needs = (need_x, need_w13, need_w2, need_weights)
    if topk_ids.numel() == 0:
        grads = (torch.zeros_like(x), torch.zeros_like(w13), torch.zeros_like(w2), torch.zeros_like(topk_weights))
        return tuple(g if need else g.new_empty(0) for g, need in zip(grads, needs))
    grads = experts_backward(dout, x, w13, w2, topk_ids, topk_weights, expert_map, h_pre, activation, needs, split_m,
                             x_p=x_p)
    return tuple(g if g is not None else x.new_empty(0) for g in (grads.x, grads.w13, grads.w2, grads.topk_weights))


@_backward_op.register_fake
def _backward_fake(dout, x, w13, w2, topk_ids, topk_weights, expert_map, h_pre, activation, need_x, need_w13,
                   need_w2, need_weights, split_m, x_p):
    return tuple(t.new_empty(t.shape) if need else x.new_empty(0)
                 for t, need in ((x, need_x), (w13, need_w13), (w2, need_w2), (topk_weights, need_weights)))


# the backward op as a torch.func transform reaches it (func_ops): it has no derivative of its own
_BACKWARD_FUNCTION = transform_function(
    "TritonExpertsBackward", torch.ops.moekit.triton_experts_backward, None, None,
    "the triton experts backward has no derivative of its own (grad of grad, hessian, a jvp of a vjp): "
    "take second derivatives on backend='reference' or 'grouped_mm'")


def _grads(ctx, dout: torch.Tensor, h_pre: torch.Tensor | None, split_m: int, x_p: torch.Tensor | None = None) -> tuple:
    """The backward op on the saved inputs; the grads by the forward's input position (None elsewhere)."""
    if ctx.unsupported is not None:
        return _recomputed(ctx, dout)
    x, w13, w2, ids, weights, expert_map = ctx.saved_tensors[:6]
    positions = ctx.positions  # input positions of x, w13, w2, topk_weights
    needs = tuple(ctx.needs_input_grad[i] for i in positions)
    backward = _BACKWARD_FUNCTION.apply if transforming() else torch.ops.moekit.triton_experts_backward
    grads = backward(dout, x, w13, w2, ids, weights, expert_map, h_pre, ctx.activation, *needs, split_m, x_p)
    result = [None] * ctx.num_inputs
    for position, need, grad in zip(positions, needs, grads):
        result[position] = grad if need else None
    return tuple(result)


def _recomputed(ctx, dout: torch.Tensor) -> tuple:
    """A variant's grads by recomputation (``triton_backward_recompute``), by the forward's input position."""
    needs = tuple(ctx.needs_input_grad[i] for i in ctx.grad_positions)
    grads = recompute_grads(dout, ctx.saved_tensors[:8], ctx.spec_fields, needs)
    result = [None] * ctx.num_inputs
    for position, grad in zip(ctx.grad_positions, grads):
        result[position] = grad
    return tuple(result)


def _setup(ctx, names: list[str], inputs: tuple) -> dict:
    args = dict(zip(names, inputs))
    ctx.unsupported = unsupported_variant(args)
    ctx.activation = args["activation"]
    ctx.positions = tuple(names.index(n) for n in ("x", "w13", "w2", "topk_weights"))
    ctx.num_inputs = len(inputs)
    return args


# ---------------------------------------------------------------------------------------------------
# Autograd of torch.ops.moekit.triton_experts (triton_op.py registers these two)
# ---------------------------------------------------------------------------------------------------


# the op schema's names of an ActivationSpec's fields, in ``spec_fields``' order
_SPEC_NAMES = ("activation", "gated", "interleaved", "alpha", "limit", "up_shift", "limit_after_act")


def fused_backward_takes(activation: str | ActivationSpec, b13, b2) -> bool:
    """Whether the fused backward differentiates a call of ``activation`` with biases ``b13`` / ``b2`` (each a tensor
    or None); else its gradients come by recomputation (``unsupported_variant``'s rule, on the spec's fields)."""
    return unsupported_variant({**dict(zip(_SPEC_NAMES, spec_fields(activation))), "b13": b13, "b2": b2}) is None


def setup_experts_op(ctx, inputs: tuple, output) -> None:
    """``setup_context`` of ``moekit::triton_experts``: its inputs read by schema name, so arguments
    that the forward gains later (biases, activation fields) reach ``unsupported_variant``."""
    names = [a.name for a in torch.ops.moekit.triton_experts.default._schema.arguments]
    args = _setup(ctx, names, inputs)
    # a variant's recompute (``_recomputed``) also reads the biases, the spec's fields and the bias positions
    ctx.grad_positions = tuple(names.index(n) for n in GRAD_NAMES)
    ctx.spec_fields = tuple(args[n] for n in _SPEC_NAMES)
    ctx.save_for_backward(args["x"], args["w13"], args["w2"], args["topk_ids"], args["topk_weights"],
                          args["expert_map"], args["b13"], args["b2"])


def backward_experts_op(ctx, dout: torch.Tensor) -> tuple:
    """The backward of ``moekit::triton_experts``: the default ``BackwardOptions`` (recompute)."""
    return _grads(ctx, dout, None, 0)


# ---------------------------------------------------------------------------------------------------
# The training entry point with its options: torch.ops.moekit.triton_experts_train
# ---------------------------------------------------------------------------------------------------


def sorted_forward_tiles(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         save_h: bool, pick_forward: bool = True) -> BackwardTiles | None:
    """The tiles when ``experts_triton_train``'s forward runs on x permuted (``triton_train_forward``):
    always with ``save_h`` (``kept_tiles``; ``pick_forward``: the forward tiles ``triton_kept_forward``'s pick, which
    the fake, needing only the layout's block, leaves out: its shapes may be symbolic); else where the tiles carry
    forward tiles and the backward takes the permuted path that reads x_p; else None."""
    if topk_ids.numel() == 0:
        return None
    t = backward_tiles(topk_ids.numel(), w13.shape[0], w2.shape[2], x.dtype, x.device)
    if save_h:
        return with_kept_forward(t, kept_tiles(t), x, w13, topk_ids) if pick_forward else kept_tiles(t)
    permuted = t.grad.contiguous and t.dw13.contiguous and t.dw2.contiguous
    return t if permuted and t.fwd13 is not None and t.fwd2 is not None else None


@torch.library.custom_op("moekit::triton_experts_train", mutates_args=())
def _train_op(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], activation: str, save_h: bool, split_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [M, K], x_p, h_p): x_p = x permuted [P, K] when the forward runs on it (``sorted_forward_tiles``),
    h_p = the gate-up product [P, 2N] when ``save_h``; each else an empty [0]."""
    if topk_ids.numel() == 0:
        return x.new_zeros(x.shape), x.new_empty(0), x.new_empty(0)
    tiles = sorted_forward_tiles(x, w13, w2, topk_ids, save_h)
    if tiles is not None:
        kept = sorted_forward(x, w13, w2, topk_ids, topk_weights, expert_map, activation, tiles, keep_h=save_h)
        return kept.out, kept.x_p, kept.h_p if save_h else x.new_empty(0)
    from moekit.experts.triton import fused_experts  # triton.py imports this module: lazily, no cycle

    out = fused_experts(x, w13, w2, topk_ids, topk_weights, expert_map=expert_map, activation=activation)
    return out, x.new_empty(0), x.new_empty(0)


@_train_op.register_fake
def _train_fake(x, w13, w2, topk_ids, topk_weights, expert_map, activation, save_h, split_m):
    tiles = sorted_forward_tiles(x, w13, w2, topk_ids, save_h, pick_forward=False)
    if tiles is None:
        return x.new_empty(x.shape), x.new_empty(0), x.new_empty(0)
    rows = layout_rows(topk_ids.numel(), w13.shape[0], tiles.block_m)
    h_p = x.new_empty((rows, w13.shape[1]), dtype=_work_dtype(x)) if save_h else x.new_empty(0)
    return x.new_empty(x.shape), x.new_empty((rows, x.shape[1])), h_p


_TRAIN_NAMES = ["x", "w13", "w2", "topk_ids", "topk_weights", "expert_map", "activation", "save_h", "split_m"]


def _setup_train(ctx, inputs: tuple, output: tuple) -> None:
    args = _setup(ctx, _TRAIN_NAMES, inputs)
    ctx.split_m = args["split_m"]
    ctx.mark_non_differentiable(output[1], output[2])
    # no zeros for x_p's and h_p's grads (autograd would fill [P, K] and [P, 2N] for the backward, never read)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(args["x"], args["w13"], args["w2"], args["topk_ids"], args["topk_weights"],
                          args["expert_map"], *(t if t.numel() else None for t in output[1:]))


def _backward_train(ctx, dout: torch.Tensor, _x_p, _h_p) -> tuple:
    x_p, h_p = ctx.saved_tensors[6:8]
    return _grads(ctx, dout, h_p, ctx.split_m, x_p)


_train_op.register_autograd(_backward_train, setup_context=_setup_train)
# the train op as a torch.func transform reaches it (func_ops)
_TRAIN_FUNCTION = transform_function(
    "TritonExpertsTrain", torch.ops.moekit.triton_experts_train, _setup_train, _backward_train,
    "experts_triton_train has no forward-mode derivative (torch.func.jvp, jacfwd, hessian): take those on "
    "backend='reference' or 'grouped_mm'; grad, vjp and jacrev work here")


def experts_triton_train(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, R]
    b2: torch.Tensor | None = None,  # [E, K]
    backward: BackwardOptions = BackwardOptions(),
) -> torch.Tensor:
    """The experts contract (``moekit.experts``) on the Triton kernels, differentiable with the fused
    backward's options chosen (``BackwardOptions``); ``experts_triton`` differentiates
    with the defaults. A variant (``unsupported_variant``: biases, a spec the fused backward lacks) runs
    through ``experts_triton``, whose backward recomputes (``triton_backward_recompute``); options other
    than the defaults are refused for it, as they would not apply."""
    check_experts_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation=activation, b13=b13, b2=b2)
    if not isinstance(backward, BackwardOptions):
        raise TypeError(f"backward must be a BackwardOptions, got {type(backward).__name__}")
    fields = spec_fields(activation)
    variant = unsupported_variant({**dict(zip(_SPEC_NAMES, fields)), "b13": b13, "b2": b2})
    if variant is not None:
        if backward != BackwardOptions():
            raise ValueError(f"backward={backward} applies to the fused backward only, and this call's backward "
                             f"recomputes ({variant}): leave backward at its default")
        from moekit.experts.triton import experts_triton  # triton.py imports this module: lazily, no cycle

        return experts_triton(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                              b13=b13, b2=b2)
    activation = fields[0]  # a plain spec: its name
    check_triton_args(x, activation)
    train = _TRAIN_FUNCTION.apply if transforming() else torch.ops.moekit.triton_experts_train
    out, _, _ = train(x, w13, w2, topk_ids, topk_weights, expert_map, activation, not backward.recompute,
                      backward.split_m)
    return out


_KEPT = BackwardOptions(recompute=False)


def experts_triton_kept(x, w13, w2, topk_ids, topk_weights, *, activation="silu", expert_map=None, b13=None, b2=None):
    """``experts_triton_train`` with the gate-up product kept (``BackwardOptions(recompute=False)``): what a
    ``backend="auto"`` training rule with ``keep`` runs (``auto_train.TrainingRule``; plain calls only)."""
    return experts_triton_train(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                                b13=b13, b2=b2, backward=_KEPT)
