"""One real-client fuzz case checked (``check_case``): the model on transformers' eager experts against the same
model on ``set_experts_implementation("moekit")`` per backend (logits, and for some seeds the gradients of the input
embeddings and of every experts weight); ``moe_from_hf`` on one MoE block against the block's forward;
``use_moekit_blocks`` on the whole model; ``use_moekit_blocks(quant=...)`` against the float64 twin over its
dequantized weights; ``torch.compile``.

Tolerances, rel. L2 (``TOLERANCES``): float32 1e-5, float64 1e-12, bfloat16 3e-2. transformers' own batched_mm
experts against its eager, the same model and batch (``--spread`` of ``benchmarks/fuzz_hf.py``, 304 seeds): float32
median 9.5e-8, max 4.5e-7 (the reduction orders of an expert's GEMM and of the combine); float64 median 0 (max 1.1e-7
where a family's experts code rounds through float32, below): the float32 bound is ~20x the worst and still catches
experts off by 0.01% (a test shows it). In
bfloat16 eager rounds every linear's output and the weighted sum to bf16, moekit once from float32: one experts call
measured 3e-3 to 1.1e-2 off eager over 12 seeds (transformers' batched_mm up to 8e-3 off its eager in the logits),
so 3e-2; bf16 draws no gradients (their rounding would need a bound of its own). A float64 model whose experts
code casts to float32 itself (``rounds_through_float32``: Beam) is held to float32's bound.

Each experts call's output is held to the bound too (``call_verdict``): an experts error of 1e-4 can shrink below
1e-5 in the logits. A near tie: moekit's experts output is off eager's by its rounding, so the next layer's router
can choose another expert where two scores are within that rounding. A case is left out (not failed) only when the
first experts call whose routes differ got inputs within the tolerance and every call before it returned outputs
within it: the change of route came from a tie, not from an error before it.

Shapes: B sequences, S tokens, M = B * S rows of an experts call, K hidden, k routes a row.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch

import moekit.hf as moekit_hf
from moekit.hf.blocks import moe_blocks
from moekit.hf.set_check import is_interface_experts

from _hf_fuzz_cases import FuzzCase
from _hf_fuzz_models import model_output
from _swap_helpers import dequantized_float64_logits

TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}
# moe_from_hf routes in the model's dtype; most families' own routers compute in float32 whatever it is (``.float()``
# logits, ``softmax(dtype=torch.float)``): in float64 the block's routed weights carry float32 rounding (its output
# measured 2e-8 to 1e-7 off moekit's float64 layer; gpt-oss, AFMoE, Aria route in float64: 5e-17 to 2e-16), so a
# float64 block is held to float32's bound
BLOCK_TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 3e-2}
GRAD_TOLERANCES = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 3e-2}
REFUSALS = (ValueError, TypeError, NotImplementedError)  # moe_from_hf / use_moekit_blocks saying "not this block"


@dataclass
class Call:
    """One experts call: its inputs and output."""

    x: torch.Tensor  # [M, K]
    ids: torch.Tensor  # [M, k]
    weights: torch.Tensor  # [M, k]
    out: torch.Tensor  # [M, K]


@dataclass
class Run:
    out: torch.Tensor  # [B, S, V] logits (a text model: [B, S, K] last hidden state)
    calls: list[Call]


@dataclass
class Outcome:
    compared: int = 0
    left_out: list[str] = field(default_factory=list)  # comparisons left out for a near tie, with where
    refusals: list[str] = field(default_factory=list)  # moe_from_hf / use_moekit_blocks refusing the block, why
    failures: list[str] = field(default_factory=list)
    spread: float | None = None  # rel. L2 of transformers' batched_mm against its eager (``spread=True``)


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||, float64; NaN where either has one (never within a tolerance)."""
    if torch.isnan(got).any() or torch.isnan(ref).any():
        return float("nan")
    diff = (got.double() - ref.double()).norm()
    return float(diff / ref.double().norm()) if ref.norm() > 0 else float(diff)


def run(model: torch.nn.Module, implementation: str, inputs: dict, backend: str | None = None) -> Run:
    """The model's output and every experts call on ``implementation`` (``backend``: moekit.hf.HF_BACKEND)."""
    calls: list[Call] = []

    def record(module, args, kwargs, out):
        x, ids, weights = (list(args) + [kwargs.get(n) for n in ("hidden_states", "top_k_index", "top_k_weights")
                                         if n in kwargs])[:3]
        calls.append(Call(x.detach().clone(), ids.detach().clone(), weights.detach().clone(), out.detach().clone()))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in model.modules() if is_interface_experts(m)]
    saved = moekit_hf.HF_BACKEND
    try:
        moekit_hf.HF_BACKEND = backend or saved
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            out = model_output(model(**inputs))
    finally:
        moekit_hf.HF_BACKEND = saved
        for h in handles:
            h.remove()
    return Run(out, calls)


def _same_routes(a: Call, b: Call) -> bool:
    return a.ids.shape == b.ids.shape and torch.equal(a.ids.sort(-1).values, b.ids.sort(-1).values)


def call_verdict(eager: Run, ours: Run, tol: float) -> str | None:
    """Every experts call in order: same routes and outputs within ``tol``, or a near tie (routes changed on inputs
    within ``tol``: "tie at call i"; the calls after it are not comparable). None: all calls agree; else the error."""
    if len(ours.calls) != len(eager.calls):
        return f"error: {len(ours.calls)} experts calls, eager made {len(eager.calls)}"
    for i, (a, b) in enumerate(zip(eager.calls, ours.calls)):
        if not _same_routes(a, b):
            err = rel_l2(b.x, a.x)
            return f"tie at call {i}" if err <= tol else f"error: call {i}'s inputs rel L2 {err:.2e}, routes changed"
        err = rel_l2(b.out, a.out)
        if not err <= tol:
            return f"error: experts call {i} (of {len(eager.calls)}) rel L2 {err:.2e}"
    return None


def rounds_through_float32(model) -> bool:
    """An experts class of ``model`` casts to float32 in its own code or its submodules' (Beam's ``_apply_gate``:
    ``act(gate.float()) * up.float()``, cast back; Muse Spark's ``post_expert_norm``, an RMSNorm computed in float32):
    in float64 its eager output carries float32 rounding (8e-8 measured, seed 200; Muse Spark's norm weight gradient
    2.3e-8, seed 50001: eager sums it over each expert's rows, moekit's composed path over all rows at once)."""
    experts = [m for m in model.modules() if is_interface_experts(m)]
    classes = {type(m) for m in experts} | {type(c) for m in experts for c in m.modules() if c is not m}
    sources = [inspect.getsource(getattr(c, n)) for c in classes for n in ("forward", "_apply_gate") if hasattr(c, n)]
    return any(".float()" in src or "float32" in src for src in sources)


def bound(case: FuzzCase, model) -> float:
    """The dtype's bound; float32's for a float64 model whose experts code rounds through float32."""
    if case.dtype == torch.float64 and rounds_through_float32(model):
        return TOLERANCES[torch.float32]
    return TOLERANCES[case.dtype]


def _check_logits(case: FuzzCase, model, inputs: dict, eager: Run, outcome: Outcome) -> None:
    """Each experts call's output, then the logits (an experts error of 1e-4 can shrink below 1e-5 in logits that
    the residual stream and the shared experts dominate: the calls are held to the bound themselves)."""
    tol = bound(case, model)
    for backend in case.backends:
        ours = run(model, "moekit", inputs, backend)
        verdict = call_verdict(eager, ours, tol)
        if verdict is not None and verdict.startswith("tie"):
            outcome.left_out.append(f"{backend}: near {verdict}")
            continue
        err = rel_l2(ours.out, eager.out)
        if verdict is None and err <= tol:
            outcome.compared += 1
            continue
        outcome.failures.append(f"{backend} logits rel L2 {err:.2e} (bound {tol:g}); {verdict or 'calls agree'}")


def gradients(model, implementation: str, inputs: dict, backend: str | None, seed: int) -> dict[str, torch.Tensor]:
    """d(sum(out * R)) / d(input embeddings) and / d(every experts weight), R fixed by the seed; zeros where no
    gradient reached a weight (an expert no row chose). The embeddings' gradient is kept by a hook on the embedding
    (the model still gets input_ids: DeepSeek-V4's hash routing reads them, seed 183)."""
    saved = moekit_hf.HF_BACKEND
    params = {n: p for n, p in model.named_parameters() if ".experts." in f".{n}" and p.requires_grad}
    kept = []

    def keep(module, args, out):
        out.retain_grad()
        kept.append(out)

    handle = model.get_input_embeddings().register_forward_hook(keep)
    try:
        moekit_hf.HF_BACKEND = backend or saved
        model.set_experts_implementation(implementation)
        model.zero_grad(set_to_none=True)
        out = model_output(model(**inputs))
        r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        (out * r.to(out.dtype)).sum().backward()
    finally:
        moekit_hf.HF_BACKEND = saved
        handle.remove()
    grads = {"inputs_embeds": kept[0].grad}
    grads |= {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return grads


def _check_grads(case: FuzzCase, model, inputs: dict, eager: Run, outcome: Outcome) -> None:
    tol = max(GRAD_TOLERANCES[case.dtype], bound(case, model))
    backend = case.backends[0]
    want = gradients(model, "eager", inputs, None, case.seed)
    got = gradients(model, "moekit", inputs, backend, case.seed)
    bad = {n: rel_l2(got[n], w) for n, w in want.items() if not rel_l2(got[n], w) <= tol}
    if not bad:
        outcome.compared += len(want)
        return
    if (call_verdict(eager, run(model, "moekit", inputs, backend), bound(case, model)) or "").startswith("tie"):
        outcome.left_out.append(f"{backend} gradients: near tie")
        return
    outcome.failures.append(f"{backend} gradients rel L2 > {tol:g}: "
                            + ", ".join(f"{n} {e:.2e}" for n, e in list(bad.items())[:4]))


def _unless_refused(outcome: Outcome, what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its warnings silenced; None where it refuses (counted, with its reason)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except REFUSALS as err:
        outcome.refusals.append(f"{what}: {str(err)[:160]}")
        return None


def _check_block(case: FuzzCase, model, outcome: Outcome) -> None:
    """moe_from_hf on the first MoE block against the block's forward (eager experts), on x [B, S, K] ~ N(0, 1)
    (and random input ids where it hash-routes: DeepSeek-V4's)."""
    sites = moe_blocks(model)
    if not sites:
        outcome.refusals.append("moe_from_hf: no block with .gate/.router and .experts")
        return
    block = sites[0].block
    moe = _unless_refused(outcome, f"moe_from_hf {type(block).__name__}", moekit_hf.moe_from_hf, block,
                          fuse_shared=case.fuse_shared, backend=case.backends[0])
    if moe is None:
        return
    hidden = model.get_input_embeddings().weight.shape[1]
    x = torch.randn(case.batch, case.seq, hidden, generator=torch.Generator().manual_seed(case.seed), dtype=case.dtype)
    model.set_experts_implementation("eager")
    ids = {}  # a hash block's (DeepSeek-V4's first): the same random input ids to the block and its HashMoE
    if getattr(moe, "takes_token_ids", False):
        ids = {"input_ids": torch.randint(0, moe.config.hash_table_size, x.shape[:-1],
                                          generator=torch.Generator().manual_seed(case.seed))}
    with torch.no_grad():
        want = block(x, **ids)
        want = want[0] if isinstance(want, tuple) else want
        got = moe(x, token_ids=ids["input_ids"]) if ids else moe(x)
    err = rel_l2(got.reshape(want.shape), want)
    if err <= BLOCK_TOLERANCES[case.dtype]:
        outcome.compared += 1
    else:
        outcome.failures.append(f"moe_from_hf {type(block).__name__} (fuse_shared={case.fuse_shared}) rel L2 "
                                f"{err:.2e}")


def _check_swap(case: FuzzCase, inputs: dict, eager: Run, outcome: Outcome) -> None:
    """use_moekit_blocks (every block moekit's whole layer: its router too) against the eager model's output, at the
    blocks' bound (moekit routes in the model's dtype, most families in float32)."""
    model = case.model()
    report = _unless_refused(outcome, "use_moekit_blocks", moekit_hf.use_moekit_blocks, model,
                             backend=case.backends[0], fuse_shared=case.fuse_shared)
    if report is None:
        return
    if not report.swapped:
        outcome.refusals.append(f"use_moekit_blocks: no block swapped ({report.left[0].reason[:120]})")
        return
    got = run(model, "eager", inputs).out  # blocks it left run transformers' eager experts
    err = rel_l2(got, eager.out)
    if err <= BLOCK_TOLERANCES[case.dtype]:
        outcome.compared += 1
    elif _tie_sensitive(case, inputs):
        outcome.left_out.append("use_moekit_blocks: near tie (eager float32 vs float64)")
    else:
        outcome.failures.append(f"use_moekit_blocks (fuse_shared={case.fuse_shared}, {len(report.swapped)} swapped, "
                                f"{len(report.left)} left) rel L2 {err:.2e}")


def _check_quant(case: FuzzCase, inputs: dict, outcome: Outcome) -> None:
    """use_moekit_blocks(quant=scheme) in float32 against the float64 twin over the same dequantized weights."""
    model = case.model(torch.float32)
    report = _unless_refused(outcome, f"use_moekit_blocks(quant={case.scheme})", moekit_hf.use_moekit_blocks, model,
                             quant=case.scheme, backend=case.backends[0])
    if report is None:
        return
    if not report.swapped:
        outcome.refusals.append(f"use_moekit_blocks(quant={case.scheme}): no block swapped ({report.left[0].reason})")
        return
    with torch.no_grad():
        got = model_output(model(**inputs, use_cache=False))
    want = dequantized_float64_logits(model, inputs)
    err = rel_l2(got, want)
    if err <= TOLERANCES[torch.float32]:
        outcome.compared += 1
    elif _tie_sensitive(case, inputs):
        outcome.left_out.append(f"use_moekit_blocks(quant={case.scheme}): near tie (eager float32 vs float64)")
    else:
        outcome.failures.append(f"use_moekit_blocks(quant={case.scheme}) vs its float64 dequantized twin rel L2 "
                                f"{err:.2e}")


def _tie_sensitive(case: FuzzCase, inputs: dict) -> bool:
    """The float model's eager logits in float32 and float64 differ beyond float32's tolerance: a route flips
    between the two precisions (a near tie), so a float32-vs-float64 comparison of this case says nothing."""
    f32 = run(case.model(torch.float32), "eager", inputs).out
    f64 = run(case.model(torch.float64), "eager", inputs).out
    return not rel_l2(f32, f64) <= TOLERANCES[torch.float32]


def _compiled_output(model, inputs: dict, implementation: str, backend: str) -> torch.Tensor:
    saved = moekit_hf.HF_BACKEND
    try:
        moekit_hf.HF_BACKEND = backend
        model.set_experts_implementation(implementation)
        moekit_hf.prepare(model)
        torch._dynamo.reset()
        with torch.no_grad():
            return model_output(torch.compile(model)(**inputs))
    finally:
        moekit_hf.HF_BACKEND = saved
        torch._dynamo.reset()


def _check_compiled(case: FuzzCase, model, inputs: dict, eager: Run, outcome: Outcome) -> None:
    """torch.compile of the model on "moekit" (the first backend) against torch.compile of it on transformers' eager
    experts: inductor's own kernels around the experts differ from eager's (7.6e-8 in float64 measured, GraniteMoE-
    Shared, seed 107, with either experts implementation), so the compiled eager model is the reference."""
    backend = case.backends[0]
    want = _compiled_output(model, inputs, "eager", backend)
    got = _compiled_output(model, inputs, "moekit", backend)
    err = rel_l2(got, want)
    if err <= bound(case, model):
        outcome.compared += 1
    elif (call_verdict(eager, run(model, "moekit", inputs, backend), bound(case, model)) or "").startswith("tie"):
        outcome.left_out.append("compiled: near tie")
    else:
        outcome.failures.append(f"torch.compile on moekit ({backend}) vs on eager experts rel L2 {err:.2e}")


def check_case(case: FuzzCase, *, spread: bool = False) -> Outcome:
    outcome = Outcome()
    model = case.model()
    inputs = case.inputs()
    eager = run(model, "eager", inputs)
    if not eager.calls:
        outcome.failures.append("no experts call on eager: the draw left no MoE layer")
        return outcome
    if not torch.isfinite(eager.out).all():  # seed 50084: GraniteMoE-SWA in float64, left padded (its attention's
        # softmax(dtype=float32) reads a masked row's float64 min as -inf: NaN, then 0 x NaN in every later layer)
        outcome.left_out.append("eager's own output is not finite: nothing to hold moekit to")
        return outcome
    if spread:
        outcome.spread = rel_l2(run(model, "batched_mm", inputs).out, eager.out)
    _check_logits(case, model, inputs, eager, outcome)
    if case.grad:
        _check_grads(case, model, inputs, eager, outcome)
    if case.block:
        _check_block(case, model, outcome)
    if case.swap:
        _check_swap(case, inputs, eager, outcome)
    if case.scheme:
        _check_quant(case, inputs, outcome)
    if case.compiled:
        _check_compiled(case, model, inputs, eager, outcome)
    return outcome
