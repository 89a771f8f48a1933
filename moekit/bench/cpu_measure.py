"""The CPU experts path against transformers' experts implementations and the dense matmul rate
(``moekit bench --cpu-experts``; the table is ``moekit.bench.cpu_report``).

Same weights and the same uniform random routing for every implementation (k distinct experts per
token, softmax weights). Rows:
- ``moekit`` (what ``backend="auto"`` runs on the CPU: ``moekit.experts.cpu_packed``'s per-expert loop on
  prepacked weights, within the cache's budget, recorded as ``pack_budget_bytes`` / ``packed_bytes``, with
  whole experts split across one single-threaded worker per torch thread, experts of fewer than 4 rows through
  torch's BLAS where ``cpu_packed.blas_plain_rows`` says; below 32 tokens timed online against the same loop unsplit
  in phases, ``moekit.experts.cpu_split_choice``), the same loop with oneDNN for every expert
  (``onednn_packed_split``: what ``auto`` runs off Intel CPUs with MKL from 32 tokens), the same loop unsplit on
  multi-threaded GEMMs (``onednn_packed``) and on plain weights (``onednn_fused``), and each explicit layout / GEMM
  strategy of ``moekit.experts.grouped_mm`` (``contiguous+onednn_loop``: the CPU default until session 6 ...);
- transformers' ``grouped_mm``, ``batched_mm`` and ``eager`` (the model class's own per-expert loop),
  called as a transformers experts module calls them; ``batched_mm`` gathers a [2N, K] + [K, N] weight
  copy per assignment and is skipped above BATCHED_MM_MAX_BYTES of copies (or half the free memory).
  Without transformers these rows are skipped and the document's ``notes`` say so;
- ``dense``: the fp32 rate ceiling, [A, K] x [K, 2N] by ``torch.mm`` and by oneDNN's linear; the
  faster one is the ceiling. Every rate counts 6*N*K FLOPs per routed token (2*A*K*2N for dense).

The variants run interleaved (one call of each per round, the order shuffled every round), so a burst of
load on a shared machine hits them all; each gets the median over the rounds and the spread (IQR /
median, ``moekit.bench.timing``). Each experts row records its relative L2 error against transformers'
eager loop. The document records the thread count, the load average before and after, and the commit.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moekit.bench import cpu_quant_rows
from moekit.bench.run import commit_id
from moekit.bench.timing import Timing
from moekit.experts.cpu_packed import cpuinfo_field, onednn_linear, packed_weight_cache
from moekit.experts.grouped_mm import experts_grouped_mm, plan_grouped_mm

DEFAULT_BATCHES = (1, 8, 64, 512)
DEFAULT_REPEATS = 7  # interleaved rounds: >= 5 for a median that ignores 2 outliers
# transformers' batched_mm copies [2N, K] + [K, N] weights per assignment: 1.2 GB at M=8 for Qwen3-30B-A3B,
# 9.7 GB at M=64. Above this it is skipped: a first run at M=64 pushed the machine into memory pressure
# that slowed every variant interleaved with it 2-5x.
BATCHED_MM_MAX_BYTES = 2 << 30
MOEKIT_VARIANTS = {  # row name -> experts_grouped_mm options; "moekit" is the default the layer runs
    "moekit": {},
    "onednn_packed_split": {"cpu_gemm": "onednn_packed_split"},  # moekit's loop with oneDNN for every expert
    "onednn_packed": {"cpu_gemm": "onednn_packed"},  # the packed loop with multi-threaded GEMMs, not split by experts
    "onednn_fused": {"cpu_gemm": "onednn_fused"},  # moekit's per-expert loop on the plain (unpacked) weights
    "contiguous+onednn_loop": {"layout": "contiguous", "cpu_gemm": "onednn_loop"},
    "contiguous+mm_loop": {"layout": "contiguous", "cpu_gemm": "mm_loop"},
    "contiguous+grouped_mm": {"layout": "contiguous", "cpu_gemm": "grouped_mm"},
    "masked_measured_cap+bmm": {"layout": "masked_measured_cap"},
}
HF_ROWS = ("hf_grouped_mm", "hf_batched_mm", "hf_eager")
ROWS = (*MOEKIT_VARIANTS, *HF_ROWS)  # the experts rows one can ask for; the dense rows always run
NO_TRANSFORMERS = "transformers is not installed: its rows (hf_*) are skipped and no errors are recorded"


@dataclass(frozen=True)
class ExpertsShape:
    """One MoE layer's expert shapes."""

    experts: int  # E
    intermediate: int  # N: each expert's FFN width (w13 is [E, 2N, K])
    hidden: int  # K
    top_k: int  # k experts per token

    @classmethod
    def parse(cls, text: str) -> "ExpertsShape":
        """``"E,N,K,k"``; ``ValueError`` beginning with ``shape:`` for anything else."""
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1 or values[3] > values[0]:
            raise ValueError(f"shape: expected E,N,K,k as four positive integers with k <= E, got {text!r}")
        return cls(*values)


QWEN3_30B_A3B = ExpertsShape(experts=128, intermediate=768, hidden=2048, top_k=8)


@dataclass(frozen=True)
class ExpertsProblem:
    """One batch: the weights every implementation shares, the tokens and their routing."""

    w13: torch.Tensor  # [E, 2N, K] fp32 (bf16 with --act-dtype bfloat16)
    w2: torch.Tensor  # [E, K, N] in w13's dtype
    x: torch.Tensor  # [M, K] in w13's dtype
    ids: torch.Tensor  # [M, k] int32: distinct experts per token
    weights: torch.Tensor  # [M, k] fp32: softmax over the k


def expert_weights(shape: ExpertsShape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w13 [E, 2N, K] and w2 [E, K, N], scaled so outputs stay O(1)."""
    e, n, k = shape.experts, shape.intermediate, shape.hidden
    w13 = torch.randn(e, 2 * n, k, generator=gen) * k**-0.5
    w2 = torch.randn(e, k, n, generator=gen) * n**-0.5
    return w13, w2


def problem(num_tokens: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, gen: torch.Generator) -> ExpertsProblem:
    """M tokens with uniform random routing: k distinct experts per token, softmax weights over the k."""
    x = torch.randn(num_tokens, w13.shape[2], generator=gen).to(w13.dtype)  # [M, K] in the weights' dtype
    scores = torch.rand(num_tokens, w13.shape[0], generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)  # [M, k], uniform over the k-subsets
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)  # [M, k]
    return ExpertsProblem(w13, w2, x, ids, weights)


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or "cpu"


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def hf_experts(w13: torch.Tensor, w2: torch.Tensor, top_k: int):
    """A transformers Qwen3-MoE experts module holding w13/w2 (shared, not copied), and its eager forward."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    num_experts, two_n, hidden = w13.shape
    cfg = Qwen3MoeConfig(num_experts=num_experts, hidden_size=hidden, moe_intermediate_size=two_n // 2,
                         num_experts_per_tok=top_k, hidden_act="silu")
    with torch.device("meta"):  # no [E, 2N, K] allocation: the weights are ours
        module = Qwen3MoeExperts(cfg)
    module.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return module, Qwen3MoeExperts.forward.__wrapped__  # the class's own loop, under the interface wrapper


def _hf_calls(p: ExpertsProblem) -> dict[str, Callable[[], torch.Tensor]]:
    """transformers' rows, called as its experts module calls them; none without transformers."""
    if transformers_version() is None:
        return {}
    from transformers.integrations import moe as hf_moe

    module, eager = hf_experts(p.w13, p.w2, p.ids.shape[1])
    ids64 = p.ids.long()  # transformers' routers return int64
    calls = {"hf_grouped_mm": lambda: hf_moe.grouped_mm_experts_forward(module, p.x, ids64, p.weights),
             "hf_eager": lambda: eager(module, p.x, ids64, p.weights)}
    gathered = p.ids.numel() * (p.w13[0].numel() + p.w2[0].numel()) * p.w13.element_size()
    if gathered <= min(BATCHED_MM_MAX_BYTES, available_bytes() // 2):
        calls["hf_batched_mm"] = lambda: hf_moe.batched_mm_experts_forward(module, p.x, ids64, p.weights)
    return calls


def variants(p: ExpertsProblem, rows: set[str]) -> dict[str, Callable[[], torch.Tensor]]:
    """Row name -> a zero-argument call, for one batch; rows not asked for or not runnable left out."""
    calls = {name: (lambda o=opts: experts_grouped_mm(p.x, p.w13, p.w2, p.ids, p.weights, **o))
             for name, opts in MOEKIT_VARIANTS.items()}
    calls.update(_hf_calls(p))
    a_rows = torch.randn(p.ids.numel(), p.x.shape[1]).to(p.x.dtype)  # [A, K]
    dense_w = p.w13[0].clone()  # [2N, K]: the same GEMM shape as the gate-up projection over all A rows
    calls["dense_mm"] = lambda: torch.mm(a_rows, dense_w.t())
    linear = onednn_linear(p.x.dtype)  # None where oneDNN has no linear of the dtype here (bf16 on an AVX2 CPU)
    if linear is not None:
        calls["dense_onednn"] = lambda: linear(a_rows, dense_w, None, "none", [], "")
    return {name: fn for name, fn in calls.items() if name in rows or name.startswith("dense")}


def interleaved(calls: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, Timing]:
    """One call of each per round, in an order shuffled each round (seeded by the round); a warm-up round first.
    Shuffled, not rotated: a rotation keeps each call after the same predecessor in every round, and on the CPU
    what runs before a call matters (OpenMP threads still spinning after a multi-threaded call take a core from
    the next call's single-threaded workers: ~1.5 ms at M = 1 on the 2-core Xeon)."""
    samples = shuffled_seconds(calls, rounds)
    return {name: Timing.from_samples([t * 1e6 for t in s]) for name, s in samples.items()}


def shuffled_seconds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """``interleaved``'s rounds: name -> its wall seconds in each round (a warm-up call each first)."""
    names = list(calls)
    for name in names:
        calls[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        order = list(names)
        random.Random(r).shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t0)
    return samples


def errors_vs_eager(calls: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Relative L2 error of each experts row against transformers' eager loop (fp32 both)."""
    if "hf_eager" not in calls:
        return {}
    ref = calls["hf_eager"]().double()
    return {name: float((fn().double() - ref).norm() / ref.norm().clamp_min(1e-30))
            for name, fn in calls.items() if not name.startswith("dense")}


def measure_batch(p: ExpertsProblem, rows: set[str], rounds: int, quantized: dict | None = None) -> dict:
    """Every asked-for row on one batch (and every quantized row of ``quantized``'s schemes,
    ``moekit.bench.cpu_quant_rows``): timings, rates, % of the dense ceiling, errors, weight bytes read."""
    num_tokens, top_k = p.ids.shape
    quantized = quantized or {}
    with torch.inference_mode():
        calls = variants(p, rows)
        errs = errors_vs_eager(calls)
        qcalls = cpu_quant_rows.quant_calls(p.x, p.ids, p.weights, quantized)
        ref_errs = cpu_quant_rows.errors_vs_reference(qcalls, p.x, p.ids, p.weights, quantized)
        timings = interleaved({**calls, **qcalls}, rounds)
    n_dim, hidden = p.w2.shape[2], p.w2.shape[1]
    flops = 6 * n_dim * hidden * num_tokens * top_k
    dense_flops = 2 * num_tokens * top_k * hidden * 2 * n_dim
    out = {}
    for name, t in timings.items():
        rate = (dense_flops if name.startswith("dense") else flops) / (t.us * 1e-6)
        out[name] = {"us": t.us, "min_us": t.min_us, "max_us": t.max_us, "spread_pct": t.spread_pct,
                     "noisy": t.noisy, "repeats": t.repeats, "gflops": rate / 1e9,
                     "rel_err_vs_hf_eager": errs.get(name), "rel_err_vs_reference": ref_errs.get(name),
                     "weight_bytes": None if name.startswith("dense") else cpu_quant_rows.bytes_read(
                         name, p.ids, p.w13, p.w2, quantized)}
    ceiling = max(r["gflops"] for n, r in out.items() if n.startswith("dense"))
    for r in out.values():
        r["pct_of_dense"] = 100 * r["gflops"] / ceiling
    plan = plan_grouped_mm(num_tokens, top_k, p.w13.shape[0], hidden, n_dim, p.w13.dtype)
    return {"M": num_tokens, "dense_gflops": ceiling, "moekit_plan": plan.layout,
            "moekit_chunk_tokens": plan.chunk_tokens,
            "packed_bytes": packed_weight_cache().used_bytes(), "rows": out}


def _loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def measure_cpu_experts(shape: ExpertsShape, batches: list[int], repeats: int, rows: set[str],
                        log: Callable[[str], None], seed: int = 0, schemes: list[str] = (),
                        dtype: torch.dtype = torch.float32, on_batch: Callable[[dict], None] | None = None) -> dict:
    """The whole run: one document (the JSON schema of ``benchmarks/results/*-cpu-experts-*.json``).
    Runs at the current ``torch.get_num_threads()``; ``log`` gets one line per batch done, ``on_batch`` the document
    so far (the CLI keeps it on disk). ``schemes``: weight-only schemes whose rows join every batch (quantized from the
    float32 weights); ``dtype``: x's and the unquantized weights'."""
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = expert_weights(shape, gen)
    quantized = cpu_quant_rows.quantized_weights(w13, w2, list(schemes))
    w13, w2 = w13.to(dtype), w2.to(dtype)
    hf = transformers_version()
    doc = {"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "commit": commit_id(),
           "torch": torch.__version__, "transformers": hf, "threads": torch.get_num_threads(),
           "shape": {"E": shape.experts, "N": shape.intermediate, "K": shape.hidden, "k": shape.top_k},
           "dtype": str(dtype).removeprefix("torch."), "schemes": list(schemes), "repeats": repeats, "seed": seed,
           "pack_budget_bytes": packed_weight_cache().budget_bytes,
           "notes": [] if hf else [NO_TRANSFORMERS], "loadavg_before": _loadavg(), "batches": []}
    start = time.perf_counter()
    for i, m in enumerate(batches):
        batch = measure_batch(problem(m, w13, w2, shape.top_k, gen), rows, repeats, quantized)
        doc["batches"].append(batch)
        moekit = batch["rows"].get("moekit")
        took = f", moekit {moekit['us'] / 1e3:.2f} ms" if moekit else ""
        log(f"[{i + 1}/{len(batches)}] M={m} done{took}, {time.perf_counter() - start:.1f} s, "
            f"load {os.getloadavg()[0]:.1f}")
        if on_batch is not None:
            on_batch(doc)
    doc["loadavg_after"] = _loadavg()
    return doc
