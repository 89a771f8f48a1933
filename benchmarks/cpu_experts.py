"""The CPU experts path against transformers' experts implementations and the dense matmul rate.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/cpu_experts.py [--batches 1,8,64,512] [--repeats 7]
    PYTHONPATH=. python benchmarks/cpu_experts.py --shape 8,16,32,2 --batches 1,4 --repeats 3  # a smoke run

Same weights and the same uniform random routing for every implementation (k distinct experts per
token, softmax weights). Rows:
- ``moekit`` (what ``backend="auto"`` runs on the CPU: ``moekit.experts.cpu_packed``'s per-expert loop on
  prepacked weights, within the cache's budget, recorded as ``pack_budget_bytes`` / ``packed_bytes``, with
  whole experts split across one single-threaded worker per torch thread: ``cpu_gemm="onednn_packed_split"``),
  the same loop unsplit on multi-threaded GEMMs (``onednn_packed``) and on plain weights (``onednn_fused``),
  and each explicit layout / GEMM strategy of
  ``moekit.experts.grouped_mm`` (``contiguous+onednn_loop``: the CPU default until session 6 ...);
- transformers' ``grouped_mm``, ``batched_mm`` and ``eager`` (the model class's own per-expert loop),
  called as a transformers experts module calls them; ``batched_mm`` gathers a [2N, K] + [K, N] weight
  copy per assignment and is skipped above BATCHED_MM_MAX_BYTES of copies (or half the free memory);
- ``dense``: the fp32 rate ceiling, [A, K] x [K, 2N] by ``torch.mm`` and by oneDNN's linear; the
  faster one is the ceiling. Every rate counts 6*N*K FLOPs per routed token (2*A*K*2N for dense).

The variants run interleaved (one call of each per round, the order rotated every round), so a burst of
load on a shared machine hits them all; each gets the median over the rounds and the spread (IQR /
median, ``moekit.bench.timing``). Writes ``benchmarks/results/<cpu>-cpu-experts-<date>.json`` (never
overwriting: ``-2``, ``-3`` ...) with the thread count, the load average and the commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import torch

from moekit.bench.report import write_json
from moekit.bench.run import commit_id
from moekit.bench.timing import Timing
from moekit.experts.cpu_packed import packed_weight_cache
from moekit.experts.grouped_mm import experts_grouped_mm, plan_grouped_mm

QWEN3_30B_A3B = (128, 768, 2048, 8)  # E, N, K, k
# transformers' batched_mm copies [2N, K] + [K, N] weights per assignment: 1.2 GB at M=8 for Qwen3-30B-A3B,
# 9.7 GB at M=64. Above this it is skipped: a first run at M=64 pushed the machine into memory pressure
# that slowed every variant interleaved with it 2-5x.
BATCHED_MM_MAX_BYTES = 2 << 30
RESULTS = Path(__file__).resolve().parent / "results"
MOEKIT_VARIANTS = {  # row name -> experts_grouped_mm options; "moekit" is the default the layer runs
    "moekit": {},
    "onednn_packed": {"cpu_gemm": "onednn_packed"},  # the packed loop with multi-threaded GEMMs, not split by experts
    "onednn_fused": {"cpu_gemm": "onednn_fused"},  # moekit's per-expert loop on the plain (unpacked) weights
    "contiguous+onednn_loop": {"layout": "contiguous", "cpu_gemm": "onednn_loop"},
    "contiguous+mm_loop": {"layout": "contiguous", "cpu_gemm": "mm_loop"},
    "contiguous+grouped_mm": {"layout": "contiguous", "cpu_gemm": "grouped_mm"},
    "masked_measured_cap+bmm": {"layout": "masked_measured_cap"},
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


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


def routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    """Uniform random routing: k distinct experts per token, softmax weights over the k."""
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)  # [M, k], uniform over the k-subsets
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)  # [M, k]
    return ids, weights


def variants(x, w13, w2, ids, weights, impls: set[str]) -> dict:
    """Row name -> a zero-argument call, for one batch; rows not asked for or not runnable left out."""
    from transformers.integrations import moe as hf_moe

    module, eager = hf_experts(w13, w2, ids.shape[1])
    ids64 = ids.long()  # transformers' routers return int64
    calls = {name: (lambda o=opts: experts_grouped_mm(x, w13, w2, ids, weights, **o))
             for name, opts in MOEKIT_VARIANTS.items()}
    calls["hf_grouped_mm"] = lambda: hf_moe.grouped_mm_experts_forward(module, x, ids64, weights)
    calls["hf_eager"] = lambda: eager(module, x, ids64, weights)
    gathered = ids.numel() * (w13[0].numel() + w2[0].numel()) * w13.element_size()
    if gathered <= min(BATCHED_MM_MAX_BYTES, available_bytes() // 2):
        calls["hf_batched_mm"] = lambda: hf_moe.batched_mm_experts_forward(module, x, ids64, weights)
    a_rows = torch.randn(ids.numel(), x.shape[1])  # [A, K]
    dense_w = w13[0].clone()  # [2N, K]: the same GEMM shape as the gate-up projection over all A rows
    calls["dense_mm"] = lambda: torch.mm(a_rows, dense_w.t())
    linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if linear is not None:
        calls["dense_onednn"] = lambda: linear(a_rows, dense_w, None, "none", [], "")
    return {name: fn for name, fn in calls.items() if name in impls or name.startswith("dense")}


def interleaved(calls: dict, rounds: int) -> dict[str, Timing]:
    """One call of each per round, the order rotated each round; a warm-up round first."""
    names = list(calls)
    for name in names:
        calls[name]()
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            calls[name]()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    return {name: Timing.from_samples(s) for name, s in samples.items()}


def errors_vs_eager(calls: dict) -> dict[str, float]:
    """Relative L2 error of each experts row against transformers' eager loop (fp32 both)."""
    if "hf_eager" not in calls:
        return {}
    ref = calls["hf_eager"]().double()
    return {name: float((fn().double() - ref).norm() / ref.norm().clamp_min(1e-30))
            for name, fn in calls.items() if not name.startswith("dense")}


def measure_batch(num_tokens: int, weights_set, impls: set[str], rounds: int, gen) -> dict:
    w13, w2, top_k = weights_set
    x = torch.randn(num_tokens, w13.shape[2], generator=gen)
    ids, weights = routing(num_tokens, w13.shape[0], top_k, gen)
    with torch.inference_mode():
        calls = variants(x, w13, w2, ids, weights, impls)
        errs = errors_vs_eager(calls)
        timings = interleaved(calls, rounds)
    n_dim, hidden = w2.shape[2], w2.shape[1]
    flops = 6 * n_dim * hidden * num_tokens * top_k
    dense_flops = 2 * num_tokens * top_k * hidden * 2 * n_dim
    rows = {}
    for name, t in timings.items():
        rate = (dense_flops if name.startswith("dense") else flops) / (t.us * 1e-6)
        rows[name] = {"us": t.us, "min_us": t.min_us, "max_us": t.max_us, "spread_pct": t.spread_pct,
                      "noisy": t.noisy, "repeats": t.repeats, "gflops": rate / 1e9, "rel_err_vs_hf_eager": errs.get(name)}
    ceiling = max(r["gflops"] for n, r in rows.items() if n.startswith("dense"))
    for r in rows.values():
        r["pct_of_dense"] = 100 * r["gflops"] / ceiling
    plan = plan_grouped_mm(num_tokens, top_k, w13.shape[0], hidden, n_dim, w13.dtype)
    return {"M": num_tokens, "dense_gflops": ceiling, "moekit_plan": plan.layout, "moekit_chunk_tokens": plan.chunk_tokens,
            "packed_bytes": packed_weight_cache().used_bytes(), "rows": rows}


def print_table(doc: dict) -> None:
    print(f"{doc['cpu']}  threads={doc['threads']}  load avg before/after={doc['loadavg_before']}/{doc['loadavg_after']}")
    print(f"{'M':>5} {'implementation':26} {'ms':>10} {'spread%':>8} {'GFLOP/s':>8} {'% dense':>8} {'err':>9}")
    starred = False
    for batch in doc["batches"]:
        best_hf = min((r["us"] for n, r in batch["rows"].items() if n.startswith("hf_")), default=None)
        for name, r in batch["rows"].items():
            mark = " *" if name == "moekit" and best_hf is not None and r["us"] > best_hf else ""
            starred = starred or bool(mark)
            err = "-" if r["rel_err_vs_hf_eager"] is None else f"{r['rel_err_vs_hf_eager']:.1e}"
            print(f"{batch['M']:>5} {name:26} {r['us'] / 1e3:10.2f} {r['spread_pct']:8.0f} {r['gflops']:8.1f} "
                  f"{r['pct_of_dense']:8.0f} {err:>9}{mark}")
    if starred:
        print("* moekit slower than the best transformers implementation at this M")


def results_file(out_dir: Path, cpu: str, date: str, tag: str) -> Path:
    stem = f"{cpu.replace(' ', '_')}-cpu-experts-{date}" + (f"-{tag}" if tag else "")
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():  # never overwrite an earlier run
        n += 1
        path = out_dir / f"{stem}-{n}.json"
    return path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,64,512")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (>= 5 for a median that ignores 2)")
    p.add_argument("--shape", default=",".join(map(str, QWEN3_30B_A3B)), help="E,N,K,k")
    p.add_argument("--impls", default=",".join([*MOEKIT_VARIANTS, "hf_grouped_mm", "hf_batched_mm", "hf_eager"]))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as OMP_NUM_THREADS)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--tag", default="", help="appended to the file name")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    num_experts, n_dim, hidden, top_k = map(int, args.shape.split(","))
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * n_dim, hidden, generator=gen) * hidden**-0.5  # [E, 2N, K]
    w2 = torch.randn(num_experts, hidden, n_dim, generator=gen) * n_dim**-0.5  # [E, K, N]
    doc = {"cpu": cpu_name(), "date": datetime.date.today().isoformat(), "commit": commit_id(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "shape": {"E": num_experts, "N": n_dim,
           "K": hidden, "k": top_k}, "dtype": "float32", "repeats": args.repeats,
           "pack_budget_bytes": packed_weight_cache().budget_bytes,
           "loadavg_before": [round(v, 2) for v in os.getloadavg()], "batches": []}
    batches = [int(m) for m in args.batches.split(",")]
    if min(batches) < 1:
        p.error(f"--batches must be >= 1 (an empty batch has no rate), got {args.batches}")
    for m in batches:
        doc["batches"].append(measure_batch(m, (w13, w2, top_k), set(args.impls.split(",")), args.repeats, gen))
        print(f"M={m} done, load {os.getloadavg()[0]:.1f}", flush=True)
    doc["loadavg_after"] = [round(v, 2) for v in os.getloadavg()]
    print_table(doc)
    path = write_json(doc, results_file(args.out_dir, doc["cpu"], doc["date"], args.tag))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
