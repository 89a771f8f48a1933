"""Gradients of one fuzz case against float64 autograd through the loop of ``_fuzz_reference``: what
``test_fuzz_grad`` asserts and ``benchmarks/fuzz_layer.py --grad`` counts.

    loss = sum(out * R) (+ the configured aux loss)  ->  d loss / d {x, gate, gate bias, w13, w2, b13, b2, shared}

The layer's side: ``torch.autograd.grad`` of the loss through its forward (eval mode, autograd on). The reference's:
the float64 loop with every parameter a float64 leaf (``LayerWeights.of(layer, leaves)``); the routing's choices
(ids, capacity drops, sparsemixer rounds) are piecewise constant, taken from the float reference routed from the
layer's own logits, and the gradient flows through the routing weights, recomputed here from the float64 gate's
logits with torch ops (soft-cap, softmax / sigmoid, renormalisation, scaling, sparsemixer's softmax over a round's
members, Inkling's k + S sigmoids). The aux losses are written here from their closed forms (``moekit.losses``'
docstrings), not called. A case with any near tie is left out whole: the choice a tie decides moves every gradient.

Shapes: M tokens, K hidden, E routed experts, k = top_k, W = the router's width, S shared slots.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from _fuzz_cases import FuzzCase
from _fuzz_cases import token_ids
from _fuzz_check import Outcome, hash_rows, prepared
from _fuzz_experts import rounded_gate_up
from _fuzz_reference import HASH_EPS, LayerWeights, TokenRoute, combine, reference_moe

# relative L2 of each gradient tensor against float64, its norm floored at FLOOR x the case's largest gradient norm:
# a gradient much smaller than the others is a difference of larger rounded terms (the softmax's
# d(logit_i) = p_i (g_i - <p, g>); seed 162: a float32 gate gradient 1.4e-5 off on its own norm, one token on a
# peaked sparsemixer round), so its error is measured against the terms' scale, not its own.
# float32 as the forward's 1e-5 (the backward is GEMMs and elementwise ops of the forward's depth, in float32);
# float64 1e-10 as the forward, routed in float32 (the fused router, router_dtype) 1e-6 as the forward, its gate's
# gradients (and x's, which sums them) at float32's: float32's softmax backward, p_i (g_i - <p, g>), loses
# 1 / (1 - p_max) in the difference on a peaked row (hash seed 70405, logits 0.3 / 4.0 / 0.3 with 5 tokens kept: the
# gate's gradient 2.99e-6 off, a float32 torch twin of that backward the same bits; 1.99e-6 with ATen's AVX2 kernels,
# ATEN_CPU_CAPABILITY=avx2, so over 1e-6 on an AVX2 CPU too: not the Xeon's alone); bf16 / fp16
# 2e-2, twice the forward's (the backward rounds dY, each expert's dH and dX and the weight gradients' sums to the
# dtype), three times that under SMALL_M tokens (a gradient sums M rank-1 terms: one token's roundings don't average).
# Measured, seeds 0..700, the floor applied: bf16 up to 8.0e-3 from 8 tokens on (seed 463's gate, grouped_mm and
# triton), 1.1e-2 under (seed 494), fp16 up to 2e-3. A bfloat16 router's gate backward runs in bfloat16: its gradients
# (and x's, which sums the gate's) at bf16's.
GRAD_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-2}
ROUTED_IN_FLOAT32 = 1e-6
FLOOR = 0.1
SMALL_M = 8
AUX_COEFS = (0.0, 0.0, 0.01, 0.5)  # drawn per coefficient: 0.5 makes the aux loss's gradient a visible share


GATE_GRADS = ("x", "gate.weight", "gate.bias")  # what the gate's backward (in the router dtype) computes


@dataclass
class Grads:
    """One side's loss and its gradients, float64, by name: "x" and the layer's parameter names."""

    aux_loss: float | None
    grads: dict[str, torch.Tensor]


def trainable(case: FuzzCase, quantized: bool = False) -> bool:
    """Float experts (quantized ones have no gradient; ``quantized``: trained all the same, the gradients of x, the
    gate and the float parameters: ``backend="auto"`` trains them on grouped_mm) and a token at least."""
    return (case.scheme is None or quantized) and case.m > 0


@dataclass
class GradCase:
    """A forward case made a training one: the aux losses' coefficients drawn from the seed's own stream (the forward
    fuzzer's seeds unchanged), and its NaN gate rows (``nonfinite="mask"``) moved to a router bias of -inf: experts
    masked by a finite gate, the way a trained model disables one (a NaN weight row's own gradient is NaN, and so is
    x's: d logits @ W_gate reads it)."""

    case: FuzzCase
    masked_rows: list[int]  # gate-bias entries set to -inf


def grad_case(case: FuzzCase) -> GradCase:
    rng = random.Random(f"grad{case.seed}")
    fields = {**case.fields, **{name: rng.choice(AUX_COEFS)
                                for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef")}}
    if case.nan_gate_rows:
        fields["router_bias"] = True
    return GradCase(dataclasses.replace(case, fields=fields, nan_gate_rows=[]), list(case.nan_gate_rows))


def grad_tolerance(case: FuzzCase, name: str) -> float:
    """The tolerance of gradient ``name`` (``GRAD_TOLERANCE``'s notes)."""
    low = case.dtype in (torch.bfloat16, torch.float16) or (case.fields.get("router_dtype") == "bfloat16"
                                                             and name in GATE_GRADS)
    if low:
        small = case.m < SMALL_M or (case.dtype != torch.float32 and _tight_clamp(case))
        return GRAD_TOLERANCE[torch.bfloat16] * (3 if small else 1)
    routed_in = case.fields.get("router_dtype")
    if case.dtype == torch.float64 and (case.router == "fused" or routed_in in ("float32", "bfloat16")):
        return GRAD_TOLERANCE[torch.float32] if name in GATE_GRADS else ROUTED_IN_FLOAT32
    return GRAD_TOLERANCE[case.dtype]


def _tight_clamp(case: FuzzCase) -> bool:
    """Whether a clamp of ``_fuzz_newest``'s (after the experts' activation, or the shared MLP's own) is at <= 1: where
    bf16 / fp16 round a gate-up value across the clamp's kink its gradient is 0 on one side and not on the other, so the
    float64 loop's (the same weights, unrounded products) differs on those elements, whatever the backend (seed 261,
    bf16, a gelu shared MLP clamped at 0.8: shared_w13 4.75e-2 in all three; hash seed 145, silu clamped after at 0.5:
    x 2.3e-2; vbw48's device check, Step-3.7's clamp at 1.0 in bf16: 5.9e-2 on triton and grouped_mm alike)."""
    after, shared = case.config.activation, case.config.shared_activation
    specs = [spec for spec in (after, shared) if getattr(spec, "limit", None) is not None]
    return any(spec.limit <= 1.0 and (spec is shared or spec.limit_after_act) for spec in specs)


def projection(case: FuzzCase) -> torch.Tensor:
    """R [M, K] float64: the loss's random projection, from the seed."""
    g = torch.Generator().manual_seed(case.seed + 1)
    return torch.randn(case.m, case.config.hidden_size, generator=g, dtype=torch.float64)


def layer_grads(layer, x: torch.Tensor, r: torch.Tensor, ids: dict | None = None):
    """The layer's loss gradients and its forward (``MoEOutput``: out, router_logits, aux_loss); ``ids``: a hash
    layer's token_ids argument."""
    leaf = x.detach().clone().requires_grad_(True)
    params = dict(layer.named_parameters())
    result = layer(leaf, return_aux_loss=True, **(ids or {}))
    loss = (result.out.double() * r).sum()
    if result.aux_loss is not None:
        loss = loss + result.aux_loss.double()
    grads = _grads(loss, {"x": leaf, **params})
    aux = None if result.aux_loss is None else result.aux_loss.item()
    return Grads(aux, grads), result


def reference_grads(layer, case: FuzzCase, x: torch.Tensor, logits: torch.Tensor, r: torch.Tensor) -> Grads | None:
    """Float64 autograd through the loop, routed as the layer's ``logits`` [M, W] route; None where a near tie
    decided anything."""
    cfg = case.config
    decided = reference_moe(LayerWeights.of(layer), cfg, x, logits.detach().double(),
                            capacity_factor=case.capacity_factor, drop_policy=case.drop_policy,
                            hash_rows=hash_rows(case))
    if decided.ambiguous_tokens or decided.capacity_ambiguous:
        return None
    leaves: dict[str, torch.Tensor] = {}
    w = LayerWeights.of(layer, leaves)
    x64 = x.detach().double().requires_grad_(True)
    raw = x64 @ w.gate.t() + (w.gate_bias if w.gate_bias is not None else 0.0)  # [M, W]
    # the layer's own logits' values (a bf16 router rounds them: the contract is the MoE of those logits, as the
    # forward check's), the float64 gate's gradient
    raw = torch.where(torch.isfinite(raw), raw + (logits.detach().double() - raw).detach(), raw)
    row = _capped(raw, cfg)  # [M, W]
    pairs = [route_weights(row[t], route, cfg) for t, route in enumerate(decided.routes)]
    out = combine(x64, w, cfg, decided.routes, decided.kept, [p[0] for p in pairs], [p[1] for p in pairs],
                  round_to=case.dtype)
    loss = (out * r).sum()
    aux = aux_loss(row, decided, cfg)
    if aux is not None:
        loss = loss + aux
    return Grads(None if aux is None else aux.item(), _grads(loss, {"x": x64, **leaves}))


def _grads(loss: torch.Tensor, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """d loss / d each input, float64, zeros where the loss does not reach it (all of them where it is a constant:
    every slot masked on input-weighted experts, seed 628)."""
    got = torch.autograd.grad(loss, list(inputs.values()), allow_unused=True) if loss.requires_grad else \
        [None] * len(inputs)
    return {name: torch.zeros(t.shape, dtype=torch.float64) if g is None else g.detach().double()
            for (name, t), g in zip(inputs.items(), got)}


def _capped(raw: torch.Tensor, cfg) -> torch.Tensor:
    """The logits as the router scores them: soft-capped (non-finite values kept as they are, and kept out of the
    tanh: its backward would read 0 x NaN into their gradient)."""
    cap = cfg.router_logit_softcap
    if not cap:
        return raw
    finite = torch.isfinite(raw)
    return torch.where(finite, cap * torch.tanh(torch.where(finite, raw, 0.0) / cap), raw)


def route_weights(row: torch.Tensor, route: TokenRoute, cfg) -> tuple[list, list | None]:
    """One token's slot weights [k] (and Inkling's shared weights [S]) as float64 tensors of its capped logits
    ``row`` [W], for the choice ``route`` made: the formulas of ``route_token`` in torch ops (0.0 for a masked slot)."""
    finite = [math.isfinite(v) for v in row.detach().tolist()]
    scale = cfg.routed_scaling_factor * (0.5 if cfg.shared_expert_combine == "average" else 1.0)
    if route.members is not None:  # sparsemixer: each round a softmax over its members, read at the best
        weights = [1 / torch.exp(row[members] - row[best]).sum() * scale if members else 0.0
                   for best, members in zip(route.ids, route.members)]
        return weights, None
    if cfg.shared_expert_combine == "router":  # Inkling: the k chosen and S shared sigmoids over their sum
        e, s = cfg.num_experts, cfg.num_shared_slots
        sig = torch.sigmoid(row[route.ids + list(range(e, e + s))])  # [k + S]
        w = sig / sig.sum() * cfg.routed_scaling_factor
        return list(w[:len(route.ids)]), list(w[len(route.ids):])
    live = [e for e in range(cfg.choice_width) if finite[e]]
    scores = dict(zip(live, scored(row[live], cfg.scoring)))
    taken = [e for e in route.ids if finite[e]]
    if cfg.hash_table_size is not None:  # DeepSeek-V4's hash layer: its table's experts, / (sum + 1e-20)
        total = sum(scores[e] for e in taken) + HASH_EPS if cfg.renormalize else 1.0
    elif cfg.renormalize and taken:  # the family's + eps, or max(sum, clamp) (ERNIE-4.5), or the exact sum
        total = sum(scores[e] for e in taken)
        total = total + cfg.renorm_eps if cfg.renorm_eps else torch.clamp(total, min=cfg.renorm_clamp)
    else:
        total = 1.0
    return [scores[e] / total * scale if finite[e] else 0.0 for e in route.ids], None


def scored(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[.., W] finite or -inf logits -> scores: softmax over the last dim, sigmoid, or sqrt(softplus) as
    exp(log(softplus) / 2), log(softplus(l)) = l below -30 (float64: log1p(e^l) = e^l (1 - e^l / 2 ...), so the two
    agree to 1e-13 relative): the derivative e^(l/2) / 2 there, 0 at -inf, where sqrt's own backward reads inf x 0."""
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    low = logits < -30
    log_softplus = torch.where(low, logits, torch.log(torch.nn.functional.softplus(torch.where(low, 0.0, logits))))
    return torch.exp(log_softplus / 2)


def aux_loss(row: torch.Tensor, decided, cfg) -> torch.Tensor | None:
    """The configured aux loss from its closed forms on the capped logits [M, W] (choice columns only) and the
    router's choice before capacity (``RoutedTokens.selected_ids``: GShard's and Switch's f counts the router's
    assignments, not what capacity kept), one sequence of M tokens:
    load balance E' sum_e f_e P_e (f_e = assignments / M, P_e = mean softmax), DeepSeek-V3's sequence-wise
    sum_e (E' / (k M)) c_e mean_t(s_te / sum_j s_tj), z-loss mean_t logsumexp_t^2; E' = E + Z. A token with no live
    expert (every logit -inf: every expert masked) is left out, M counting the others; none left: 0."""
    if not (cfg.aux_loss_coef or cfg.seq_aux_loss_coef or cfg.z_loss_coef):
        return None
    live = [t for t in range(row.shape[0]) if torch.isfinite(row[t, :cfg.choice_width]).any()]
    width, (m, k) = cfg.choice_width, (len(live), cfg.top_k)
    logits = row[live, :width]  # [M live, E']
    counts = torch.zeros(width, dtype=torch.float64)  # [E'] the router's assignments
    for t in live:
        for expert in decided.routes[t].ids:
            counts[expert] += 1
    total = torch.zeros((), dtype=torch.float64)
    if m == 0:
        return total
    if cfg.aux_loss_coef:
        p = torch.exp(logits - torch.logsumexp(logits, 1, keepdim=True)).mean(0)  # [E']
        total = total + cfg.aux_loss_coef * width * (counts / m * p).sum()
    if cfg.seq_aux_loss_coef:
        s = torch.exp(logits - torch.logsumexp(logits, 1, keepdim=True)) if cfg.scoring == "softmax" else \
            scored(logits, cfg.scoring)  # [M, E']; 1 / (1 + exp(-x))'s backward reads inf / inf at a masked -inf
        p = (s / s.sum(1, keepdim=True)).mean(0)  # [E']
        total = total + cfg.seq_aux_loss_coef * (counts * width / (k * m) * p).sum()
    if cfg.z_loss_coef:
        total = total + cfg.z_loss_coef * torch.logsumexp(logits, 1).square().mean()
    return total


def check_grads(case: FuzzCase, backends, result: Outcome, quantized: bool = False) -> None:
    """Every backend's gradients of ``grad_case(case)`` against the float64 loop's; aux loss values too; ``quantized``
    (``trainable``): quantized cases too."""
    if not trainable(case, quantized):
        return
    trained = grad_case(case)
    case, r = trained.case, projection(case)
    for backend in backends:
        layer, x, _ = prepared(case, backend, result)
        if trained.masked_rows:
            with torch.no_grad():
                layer.gate.bias[trained.masked_rows] = float("-inf")
        try:
            got, forward = layer_grads(layer, x, r, token_ids(case, case.m))
        except (TypeError, ValueError) as err:  # the forward fuzzer checks the refusals themselves
            if "float64" in str(err) or "memory_budget_bytes" in str(err):
                continue
            result.fail(f"{backend}: gradient raised {type(err).__name__}: {err}")
            continue
        except NotImplementedError as err:  # every backend trains every variant (triton's by recomputation)
            result.fail(f"{backend}: gradient raised NotImplementedError: {err}")
            continue
        want = reference_grads(layer, case, x, forward.router_logits, r)
        if want is None:
            result.skipped_ambiguous += 1
            continue
        first = Outcome()
        compare(got, want, case, backend, first)
        if first.failures and case.dtype in (torch.float16, torch.bfloat16) and _clamped(case):
            with rounded_gate_up(case.dtype):  # the loop as a layer that rounds its gate-up product (_fuzz_experts)
                rounded = reference_grads(layer, case, x, forward.router_logits, r)
            second = Outcome()
            compare(got, rounded, case, backend, second)
            first = first if second.failures else second
        result.failures += first.failures
        result.compared += first.compared


def _clamped(case: FuzzCase) -> bool:
    """Whether the experts' or the shared MLP's activation is clamped (a kink a rounding may cross)."""
    specs = (case.config.activation, case.config.shared_activation)
    return any(getattr(spec, "limit", None) is not None for spec in specs)


def compare(got: Grads, want: Grads, case: FuzzCase, backend: str, result: Outcome) -> None:
    tol = grad_tolerance(case, "gate.weight")  # the aux losses read the logits only
    if (got.aux_loss is None) != (want.aux_loss is None):
        result.fail(f"{backend}: aux_loss {got.aux_loss}, the reference {want.aux_loss}")
    elif got.aux_loss is not None and not abs(got.aux_loss - want.aux_loss) <= tol * max(abs(want.aux_loss), 1e-3):
        result.fail(f"{backend}: aux_loss {got.aux_loss:.8g}, the reference {want.aux_loss:.8g}")
    largest = max((g.norm().item() for g in want.grads.values() if torch.isfinite(g).all()), default=0.0)
    for name, g in want.grads.items():
        mine = got.grads[name]
        err = float("inf") if not torch.isfinite(mine).all() else \
            ((mine - g).norm() / max(g.norm().item(), FLOOR * largest, 1e-3)).item()
        result.compared += 1
        if not err < grad_tolerance(case, name):
            result.fail(f"{backend}: grad {name} rel L2 {err:.3g} >= {grad_tolerance(case, name):g}")
