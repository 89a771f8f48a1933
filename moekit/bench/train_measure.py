"""``moekit bench --train``: forward + backward of the experts path, routing included, per implementation.

    x [M, K] -> gate GEMM -> route (softmax top-k, renormalised) -> experts (w13, SiLU-and-mul, w2, weight)
      -> out [M, K]
    loss = sum(out * R) (R a fixed random [M, K]) -> backward: grads of x, the gate, w13, w2

Shapes: M tokens, K hidden, N expert intermediate, E experts, k experts per token.

Implementations, on the same weights and tokens:
- ``moekit:<backend>``: ``moekit.routing.route`` and the moekit experts backend (``triton`` on CUDA once
  its backward is registered, ``grouped_mm``);
- ``moekit:triton_train`` and ``moekit:triton_kept`` (where ``triton`` is available): the same with
  ``experts_triton_train``, the training entry point (its forward runs on x permuted into the layout's rows where
  TUNED says so), its backward recomputing the gate-up product (``triton_train``) or reading it kept from the
  forward (``triton_kept``, ``experts_triton_kept``). ``backend="auto"`` trains a plain layer on the kept one from
  1024 tokens and on the recomputing one from 16384 (``auto_train.TRAINING_RULES``): at the GPU's M = 4096 auto runs
  ``triton_kept``, at 16384 ``triton_train``;
- ``transformers:grouped_mm``: transformers' own experts module (``Qwen3MoeExperts``; the SiLU gated
  experts of Mixtral and DeepSeek-V3 compute the same function) with ``experts_implementation=
  "grouped_mm"`` (``torch._grouped_mm`` autograd, what transformers trains with), behind its router's
  formula (softmax in float32, top-k, renormalise, weights in the model dtype).

Per row: the median time of a training step (gradients set to None first, as ``zero_grad`` does),
TFLOP/s = 3 x the forward's expert FLOPs (6*N*K per routed token; the router's 2*K*E per token, under
1% here, is not counted) over that time, and the peak memory of one step above what was allocated
before it (``torch.cuda.max_memory_allocated``), also without the gradients' own bytes (the same for
every implementation): the activations and workspaces. On the GPU: bf16, the real shapes, M = 4096
and 16384. On the CPU: float32, shapes divided by ``CPU_SCALE``, small M (a smoke run; memory not measured).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moekit.bench.cells import CPU_SCALE, PRESETS, Shape
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.report import format_flops
from moekit.bench.run import commit_id, device_name
from moekit.bench.timing import time_stats
from moekit.config import MoEConfig
from moekit.experts import available_backends, backend_fn, call_backend
from moekit.routing import route

GPU_TOKENS = (4096, 16384)
CPU_TOKENS = (64, 256)
TRANSFORMERS_IMPL = "transformers:grouped_mm"
TRAIN_IMPL = "moekit:triton_train"  # ``experts_triton_train``, the gate-up product recomputed in the backward
KEPT_IMPL = "moekit:triton_kept"  # ``experts_triton_kept``: the gate-up product kept from the forward


@dataclass
class TrainRow:
    shape: str
    tokens: int  # M
    impl: str
    ms: float | None  # median ms per forward + backward; None when the implementation failed
    spread_pct: float | None  # interquartile range of the timed passes / median * 100
    tflops: float | None  # 3 * 6*N*K*M*k / time, 1e12 FLOP/s
    pct_mm: float | None  # tflops over the dense matmul rate measured in the same run * 100
    peak_gib: float | None  # peak memory of one step above the memory before it, GiB (CUDA only)
    activation_gib: float | None  # peak_gib without the gradients' bytes: activations and workspaces
    rel_err_dx: float | None  # ||dx - dx_transformers|| / ||dx_transformers||: the grads agree
    rel_err_dgate: float | None  # the same for the gate weight's gradient (the routing weights' path)
    error: str | None = None  # why the implementation could not run (no backward registered, OOM, ...)


@dataclass
class _Problem:
    """One (shape, M) cell's tensors, shared by every implementation."""

    config: MoEConfig
    x: torch.Tensor  # [M, K], requires grad
    r: torch.Tensor  # [M, K], the fixed tensor of the loss
    gate: torch.Tensor  # [E, K], requires grad
    w13: torch.nn.Parameter  # [E, 2N, K]
    w2: torch.nn.Parameter  # [E, K, N]

    @property
    def leaves(self) -> list[torch.Tensor]:
        return [self.x, self.gate, self.w13, self.w2]


def default_impls(device: torch.device) -> list[str]:
    names = [f"moekit:{b}" for b in available_backends(device) if b != "reference"]
    return names + ([TRAIN_IMPL, KEPT_IMPL] if "moekit:triton" in names else []) + [TRANSFORMERS_IMPL]


def _problem(shape: Shape, tokens: int, dtype: torch.dtype, device: torch.device) -> _Problem:
    g = torch.Generator(device=device).manual_seed(0)
    e, n, k = shape.num_experts, shape.n, shape.k

    def rand(*size, scale):
        return (torch.randn(*size, generator=g, device=device, dtype=dtype) * scale).requires_grad_(True)

    cfg = MoEConfig(hidden_size=k, moe_intermediate_size=n, num_experts=e, top_k=shape.top_k)
    return _Problem(cfg, rand(tokens, k, scale=1.0), rand(tokens, k, scale=1.0).detach(), rand(e, k, scale=k**-0.5),
                    torch.nn.Parameter(rand(e, 2 * n, k, scale=k**-0.5)),
                    torch.nn.Parameter(rand(e, k, n, scale=n**-0.5)))


def _moekit_step(p: _Problem, backend: str) -> Callable[[], None]:
    if f"moekit:{backend}" in (TRAIN_IMPL, KEPT_IMPL):
        import moekit.experts.triton_backward as tb  # imports Triton: only when asked

        fn = tb.experts_triton_train if f"moekit:{backend}" == TRAIN_IMPL else tb.experts_triton_kept
    else:
        fn = backend_fn(backend, p.x.device)

    def step() -> None:
        logits = F.linear(p.x, p.gate)  # [M, E]
        routing = route(logits, p.config)
        out = call_backend(fn, p.x, p.w13, p.w2, routing.topk_ids, routing.topk_weights)  # [M, K]
        (out * p.r).sum().backward()

    return step


def _transformers_step(p: _Problem) -> Callable[[], None]:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    c = p.config
    hf = Qwen3MoeConfig(hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
                        num_experts=c.num_experts, num_experts_per_tok=c.top_k, hidden_act="silu")
    hf._experts_implementation = "grouped_mm"
    with torch.device("meta"):  # no second copy of the weights: the module gets the shared ones
        experts = Qwen3MoeExperts(hf)
    experts.gate_up_proj, experts.down_proj = p.w13, p.w2  # [E, 2N, K], [E, K, N]: transformers v5's layout

    def step() -> None:
        logits = F.linear(p.x, p.gate)  # [M, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, c.top_k, dim=-1)  # [M, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(p.x.dtype)
        out = experts(p.x, ids, weights)  # [M, K]
        (out * p.r).sum().backward()

    return step


def _clear_grads(p: _Problem) -> None:
    for t in p.leaves:
        t.grad = None


def _peak_gib(step: Callable[[], None], p: _Problem) -> tuple[float, float]:
    """(peak above the start, the same without the gradients' bytes), GiB, of one step from no grads."""
    _clear_grads(p)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = sum(t.numel() * t.element_size() for t in p.leaves)
    return peak / 2**30, (peak - grads) / 2**30


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _measure(impl: str, p: _Problem, shape: Shape, tokens: int, mm_tflops: float, reference: dict) -> TrainRow:
    """One row; ``reference`` holds the transformers row's grads once it ran (its own row fills it)."""
    step = _transformers_step(p) if impl == TRANSFORMERS_IMPL else _moekit_step(p, impl.split(":", 1)[1])

    def timed() -> None:
        _clear_grads(p)
        step()

    _clear_grads(p)
    step()  # first call: compilation, autotuning; its grads are the ones compared
    grads = {"dx": p.x.grad.detach().clone(), "dgate": p.gate.grad.detach().clone()}
    errors = {k: (_rel(v, reference[k]) if reference else None) for k, v in grads.items()}
    if impl == TRANSFORMERS_IMPL:
        reference.update(grads)
    cuda = p.x.device.type == "cuda"
    timing = time_stats([timed], p.x.device, budget_s=1.0 if cuda else 0.2)
    peak, activation = _peak_gib(timed, p) if cuda else (None, None)
    _clear_grads(p)
    flops = 3 * 6 * shape.n * shape.k * tokens * shape.top_k
    tflops = flops / (timing.us * 1e-6) / 1e12
    return TrainRow(shape.name, tokens, impl, timing.us / 1e3, timing.spread_pct, tflops, 100 * tflops / mm_tflops,
                    peak, activation, errors["dx"], errors["dgate"])


def _failed(shape: Shape, tokens: int, impl: str, err: BaseException) -> TrainRow:
    message = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
    return TrainRow(shape.name, tokens, impl, None, None, None, None, None, None, None, None, error=message)


def measure_train(device: torch.device | str, shapes=None, tokens=None, impls=None,
                  on_progress: Callable[[str], None] | None = None) -> dict:
    """Every (shape, M, implementation) row, as a JSON-ready dict. ``shapes``: preset names (default:
    Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B); ``tokens``: M values (default 4096, 16384 on the GPU);
    ``impls``: names as ``default_impls`` gives them. The transformers row of a cell runs first, so the
    moekit rows' gradients are compared with it. Callable from a device script; one failing
    implementation (no backward registered, out of memory) is recorded as an error row, not raised."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    impls = list(impls or default_impls(device))
    order = sorted(impls, key=lambda name: name != TRANSFORMERS_IMPL)  # the reference grads first
    ceilings = measure_ceilings(device)
    rows = []
    for name in shapes or PRESETS:
        shape = Shape.from_preset(name, 1 if cuda else CPU_SCALE)
        for m in tokens or (GPU_TOKENS if cuda else CPU_TOKENS):
            problem, reference = _problem(shape, m, dtype, device), {}
            for impl in order:
                try:
                    row = _measure(impl, problem, shape, m, ceilings.mm_TFLOPs, reference)
                except Exception as err:  # noqa: BLE001 - recorded in its row (and printed), the next one runs
                    _clear_grads(problem)
                    row = _failed(shape, m, impl, err)
                rows.append(row)
                if on_progress is not None:
                    on_progress(_line(row))
            del problem
            if cuda:
                torch.cuda.empty_cache()
    return {"kind": "train", "device": device_name(device), "date": datetime.date.today().isoformat(),
            "commit": commit_id(), "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."),
            "ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows], "speedups": speedups(rows)}


def speedups(rows: list[TrainRow]) -> list[dict]:
    """Per (shape, M) and moekit implementation: the transformers row's time over its time."""
    base = {(r.shape, r.tokens): r.ms for r in rows if r.impl == TRANSFORMERS_IMPL and r.ms}
    return [{"shape": r.shape, "tokens": r.tokens, "impl": r.impl,
             "speedup_vs_transformers": base[(r.shape, r.tokens)] / r.ms}
            for r in rows if r.impl != TRANSFORMERS_IMPL and r.ms and (r.shape, r.tokens) in base]


def _line(row: TrainRow) -> str:
    if row.error:
        return f"{row.shape} M={row.tokens} {row.impl}: failed: {row.error}"
    memory = (f", peak +{row.peak_gib:.2f} GiB (activations {row.activation_gib:.2f})" if row.peak_gib is not None
              else "")
    check = f", dx err {row.rel_err_dx:.1e}" if row.rel_err_dx is not None else ""
    return (f"{row.shape} M={row.tokens} {row.impl}: {row.ms:.3f} ms, {format_flops(row.tflops * 1e12)} "
            f"({row.pct_mm:.0f}% of matmul){memory}{check}")
