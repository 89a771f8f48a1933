"""One fuzz case through each backend, against the float64 loop of ``_fuzz_reference``: what ``test_fuzz_layer``
asserts and ``benchmarks/fuzz_layer.py`` counts.

Per backend: the layer's logits against the float64 gate GEMM; its output (a plain call and a stats call) against the
reference routed from the layer's own logits (a bf16 gate rounds them: the contract is the MoE of those logits),
relative L2 under the dtype's tolerance, near-tied tokens left out; the router's ids bit for bit, the counts, the
drops, the masked tokens; and every refusal met on the way names what it refuses.

Shapes: M tokens, K hidden, E routed experts, k = top_k, W = the router's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from _fuzz_cases import FuzzCase, build, token_ids
from _fuzz_reference import LayerWeights, reference_moe

# relative L2 against float64 (design.md's contract; float64 layers: float64 all the way)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float64: 1e-10}
# bf16 outputs of fewer values: three times the tolerance. The contract's 1e-2 bounds batches; on a few values the
# error is a statistic of the bf16 roundings (test_bf16_rounding: each path's rounding points, emulated in float64,
# are that path bit for bit). One token of K = 8, 4000 emulated draws (rnd39): grouped_mm's GEMM path on the CPU up to
# 1.65e-2 (0.15% over 1e-2 with expert biases, 0.47% without), its masked layout and the CPU loop 1.78e-2 (0.20% /
# 0.47%), none over 2e-2 nor from 64 values on; on CUDA 1.94e-2 (1.55% / 0.85%; 0.1-0.2% at 64-512 values); rounding
# as transformers' grouped_mm (session 38's paths) up to 2.7e-2 (1.6-2.2%). Nothing of it a bug
SMALL_BF16 = 64
SMALL_BF16_FACTOR = 3
FP8_TOLERANCE = 2e-2  # fp8_block: an activation on an e4m3 rounding boundary may round either way in float32
BACKENDS = ("reference", "grouped_mm", "triton")


@dataclass
class Outcome:
    """What one case did: the failures (each a line that names the backend and the check) and what was compared."""

    failures: list[str] = field(default_factory=list)
    compared: int = 0  # (backend, output) comparisons made
    skipped_ambiguous: int = 0  # comparisons left out: a near tie decided a capacity drop
    refusals: int = 0  # refusals checked to name their argument

    def fail(self, what: str) -> None:
        self.failures.append(what)


# a float64 layer routed in float32: the fused router's weights are float32 whatever the logits (its documented
# contract), router_dtype="float32" routes in float32 by definition
FUSED_ROUTER_FLOAT64 = 1e-6


def tolerance(case: FuzzCase) -> float:
    if case.scheme == "fp8_block":
        return FP8_TOLERANCE
    routed_in = case.fields.get("router_dtype")
    if case.dtype == torch.float64 and (case.router == "fused" or routed_in in ("float32", "bfloat16")):
        return FUSED_ROUTER_FLOAT64
    return TOLERANCE[case.dtype]


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64, the norm floored at 1e-3 (a token whose output is ~0); NaN: inf."""
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-3)).item()


def check_case(case: FuzzCase, backends=BACKENDS) -> Outcome:
    """Every backend of ``backends`` that takes the case, checked; the case's config refusals checked too."""
    result = Outcome()
    for refusal in case.refusals:
        result.refusals += 1
        if not refusal.names_a_field():
            result.fail(f"config refusal names none of {sorted(refusal.fields)}: {refusal.message}")
    for backend in backends:
        _check_backend(case, backend, result)
    return result


def prepared(case: FuzzCase, backend: str, result: Outcome):
    """The case's layer on ``backend`` with its grouped_mm options and router, x [M, K], and the router it got."""
    layer, x = build(case, backend)
    if backend == "grouped_mm" and case.grouped_mm_options:
        layer.backend_options = dict(case.grouped_mm_options)
        layer.backend = "grouped_mm"
    router = "fused" if case.router == "fused" and _fused_router_takes(layer, result) else "torch"
    return layer, x, router


def _check_backend(case: FuzzCase, backend: str, result: Outcome) -> None:
    layer, x, router = prepared(case, backend, result)
    try:
        ids, m = token_ids(case, case.m), case.m  # {} or a hash layer's token_ids [M]
        with torch.no_grad():
            plain = layer(x, **ids)  # [M, K]
            stats = layer(x, return_stats=True, **ids)
            # a repeated call, 3-D: the decode fast path, reshaped
            again = layer(x.view(1, *x.shape), **token_ids(case, 1, m)).view(x.shape)
            strided = layer(torch.stack([x, x], dim=-1)[..., 0], return_stats=True, **ids)  # x strides (2K, 2)
            routed = layer.route_tokens(x, **ids)
        # the weights need a gradient: the autograd paths' forward (its own gate GEMM)
        graded = layer(x, return_stats=True, **ids) if case.scheme is None else None
    except (TypeError, ValueError) as err:
        _check_refusal(case, backend, err, result)
        return
    name = f"{backend}/{router}"
    _check_logits(layer, x, stats.router_logits.double(), case, name, result)
    ref = _reference(layer, case, x, stats.router_logits, result)
    if ref is None:
        return
    rows = [t for t in range(case.m) if t not in set(ref.ambiguous_tokens)]
    for what, out in (("plain", plain), ("stats", stats.out), ("repeated", again)):
        check_output(out[rows], ref.out[rows], case, f"{name}: {what}", result)
    _check_routing(routed, stats.stats, ref, rows, case, name, result)
    for what, call in (("strided x", strided), ("autograd", graded)):
        # a gate GEMM of other strides or with autograd may round the logits otherwise (a bf16 ulp): the
        # reference routes from the call's own logits
        if call is not None:
            own = ref if torch.equal(call.router_logits, stats.router_logits) else \
                _reference(layer, case, x, call.router_logits, result)
            if own is not None:
                rows = [t for t in range(case.m) if t not in set(own.ambiguous_tokens)]
                check_output(call.out.detach()[rows], own.out[rows], case, f"{name}: {what}", result)


def _reference(layer, case: FuzzCase, x: torch.Tensor, logits: torch.Tensor, result: Outcome):
    """The float64 loop routed from ``logits`` [M, W], or None where a near tie decided a capacity drop."""
    fp8 = layer.w13.block_shape[1] if case.scheme == "fp8_block" else None
    ref = reference_moe(LayerWeights.of(layer), case.config, x, logits.detach().double(),
                        capacity_factor=case.capacity_factor, drop_policy=case.drop_policy, fp8_block=fp8,
                        hash_rows=hash_rows(case))
    if case.capacity_factor is not None and (ref.capacity_ambiguous or ref.ambiguous_tokens):
        result.skipped_ambiguous += 1
        return None
    return ref


def hash_rows(case: FuzzCase) -> list[list[int]] | None:
    """[M][k] the table rows of a hash case's tokens (the reference's choice), None for a top-k case."""
    return None if case.hash_table is None else [case.hash_table[t] for t in case.token_ids]


def check_output(out: torch.Tensor, want: torch.Tensor, case: FuzzCase, what: str, result: Outcome,
                 tol: float | None = None) -> None:
    """rel L2 of ``out`` against ``want`` under ``tol`` (None: the case's ``tolerance``)."""
    err, tol = rel_l2(out, want), tolerance(case) if tol is None else tol
    if case.dtype in (torch.bfloat16, torch.float16) and out.numel() < SMALL_BF16:
        tol *= SMALL_BF16_FACTOR
    result.compared += 1
    if not err < tol:
        result.fail(f"{what} output rel L2 {err:.3g} >= {tol:g}")


def _check_logits(layer, x, logits, case, name, result) -> None:
    """The layer's logits against the float64 gate GEMM, relative to |x| @ |W|^T (+ |b|); NaN exactly where a gate
    row is NaN."""
    w = LayerWeights.of(layer)
    want = x.double() @ w.gate.t() + (w.gate_bias if w.gate_bias is not None else 0.0)  # [M, W]
    if not torch.equal(torch.isnan(logits), torch.isnan(want)):
        result.fail(f"{name}: NaN logits where the gate has none, or none where it has")
        return
    finite = torch.isfinite(want)
    # rounding scales with sum |x_i w_i|, not with the logit: a cancelling dot product is measured against that
    scale = x.double().abs() @ w.gate.abs().t() + (w.gate_bias.abs() if w.gate_bias is not None else 0.0)  # [M, W]
    router_dtype = case.dtype if layer.config.router_dtype is None else getattr(torch, layer.config.router_dtype)
    tol = TOLERANCE[router_dtype] * (2 if router_dtype != case.dtype else 1)  # x and the weight both rounded to it
    err = ((logits[finite] - want[finite]).norm() / scale[finite].norm().clamp_min(1e-3)).item()
    if not err < max(tol, 1e-5):
        result.fail(f"{name}: router logits L2 error {err:.3g} of |x| @ |W|^T against the float64 gate")


def _check_routing(routed, stats, ref, rows, case, name, result) -> None:
    """The router's ids (bit for bit, in order, unambiguous tokens), and with every token unambiguous the counts,
    the drops, the identity counts and the masked tokens."""
    cfg = case.config
    ids = routed.selected_ids.long()  # [M, k]
    for t in rows:
        if ids[t].tolist() != ref.routes[t].ids:
            result.fail(f"{name}: token {t} routed to {ids[t].tolist()}, the reference to {ref.routes[t].ids}")
            return
    if len(rows) != case.m:
        return
    if stats.counts.tolist() != ref.counts:
        result.fail(f"{name}: counts {stats.counts.tolist()}, the reference {ref.counts}")
    if stats.dropped != ref.dropped:
        result.fail(f"{name}: dropped {stats.dropped}, the reference {ref.dropped}")
    if stats.masked_tokens != ref.masked_tokens:
        result.fail(f"{name}: masked_tokens {stats.masked_tokens}, the reference {ref.masked_tokens}")
    if cfg.num_identity_experts and stats.identity_counts.tolist() != ref.identity_counts:
        result.fail(f"{name}: identity_counts {stats.identity_counts.tolist()}, the reference {ref.identity_counts}")


def _fused_router_takes(layer, result: Outcome) -> bool:
    """``router="fused"`` on the layer, or False where the kernel does not compute its config (the layer keeps
    ``route``): then the refusal must say so, naming the router."""
    try:
        layer.router = "fused"
    except ValueError as err:
        result.refusals += 1
        if "router" not in str(err):
            result.fail(f"router='fused': refusal does not name the router: {err}")
        return False
    return True


# refusals a layer may meet at its first call, and what each must name
EXPECTED_REFUSALS = (("triton", "float64", "float64"), ("grouped_mm", "memory_budget_bytes", "memory_budget_bytes"))


def _check_refusal(case: FuzzCase, backend: str, err: Exception, result: Outcome) -> None:
    """An error at the layer's call: a refusal this case may meet must name its argument; anything else fails."""
    message = str(err)
    if case.m == 0 and "memory_budget_bytes" in message:  # an empty batch makes no experts call: no budget to meet
        result.fail(f"{backend}: M = 0 refused for its budget: {message}")
        return
    for refuser, cause, name in EXPECTED_REFUSALS:
        if backend == refuser and cause in message + str(case.dtype) + str(case.grouped_mm_options):
            result.refusals += 1
            if name not in message:
                result.fail(f"{backend}: refusal does not name {name}: {message}")
            return
    result.fail(f"{backend}: raised {type(err).__name__}: {message}")
