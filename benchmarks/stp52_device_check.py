"""Session 52 (branch ``stp52``): Step-3.7's compiled decode through moekit_blocks, before and after the fix.

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/stp52_device_check.py --out $OUT/stp52 --deadline 80
    PYTHONPATH=$PWD python3 benchmarks/stp52_device_check.py --tiny --out /tmp/stp52   # CPU smoke: tiny, float32
    PYTHONPATH=$PWD timeout 100 python3 benchmarks/stp52_device_check.py --out $OUT/stp52 --deadline 80 --layers 2 \
        --counts qwen3,mixtral,gpt-oss-20b,deepseek-v3,step-3.7    # only: each model's moekit rows' graph counts

Session 50 on an H100 (transformers 5.17): Step-3.7 (4 layers) decoded 67.8 tok/s eager through moekit_blocks and
53.5 compiled. transformers 5.17 builds its unclamped layers' experts and shared MLP with ``limit = inf``, which
moekit refused, so 3 of the 4 blocks stayed on transformers' own loop, whose ``nonzero`` breaks the compiled graph.
Variants (each a way to run the same model):

    eager          transformers' own experts loop: the reference
    blocks_before  moekit_blocks with every unclamped layer's block on its own forward: what 5.17 ran with 681b677a
                   (under 5.25, whose unclamped layers hold None, the old code swapped them: the CPU smoke only)
    blocks_after   moekit_blocks, every block swapped: this branch

Checks first (PASS / FAIL): each block swapped (after); each swapped block against a float64 loop of the Step-3.7
block written here (8 tokens); after's prefill logits and its compiled decode's first-step logits against eager's.
Then eager decode: ROUNDS interleaved rounds over the variants, each a ``generate`` of T tokens and of 1 token
(medians; step tok/s = (T - 1) / (T-token - 1-token)). Then the compiled decode (static cache, inductor
"reduce-overhead") of after, before and eager, each on a fresh dynamo state, warmed then timed the same way, with
dynamo's graphs and graph breaks in the warm-up and frames recompiled in the timed passes; blocks_after always runs,
a later variant is skipped where the one before it took longer than the time left to the deadline (x 1.3). Table
last; JSON ``<out>/stp52.json``. ``--counts``: instead, each named ``bench --hf`` model (real widths unless
``--tiny``) with moekit's two rows compiled by dynamo alone, its kernels on the device: graphs a decode step (1: one
graph), breaks, recompiles after the warm-up; JSON ``<out>/stp52_counts.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from moekit.bench import hf_measure as hm
from moekit.bench.hf_compile_counts import (
    GraphCalls, counting_backend, dynamo_counts, fresh_dynamo, recompile_limit)
from moekit.bench.hf_models import build_model, hf_config, not_run, use_impl
from moekit.hf.blocks import moe_blocks
from moekit.hf.swap import SWAP_ATTR
from moekit.hf.variants import module_limit

VARIANTS = ("eager", "blocks_before", "blocks_after")
ROUNDS, BLOCK_TOKENS = 3, 8
BLOCK_TOL, LOGITS_TOL = 2e-2, 5e-2  # bf16 (the tiny float32 run: far inside); a wrong function is off by O(1)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


@dataclass
class Result:
    variant: str
    mode: str  # "eager" or "compiled"
    decode_s: list[float] = field(default_factory=list)  # T-token generates
    one_s: list[float] = field(default_factory=list)  # 1-token generates
    graphs: int | None = None  # compiled: dynamo's graphs in the warm-up
    graph_breaks: int | None = None  # compiled: graph breaks in the warm-up
    recompiles: int | None = None  # compiled: frames dynamo compiled in the timed passes
    warm_s: float | None = None  # compiled: the warm-up generate (compiles)
    note: str = ""

    def rates(self, tokens: int) -> tuple[float | None, float | None]:
        if not self.decode_s:
            return None, None
        whole = statistics.median(self.decode_s)
        steps = whole - statistics.median(self.one_s) if self.one_s else 0.0
        return tokens / whole, (tokens - 1) / steps if steps > 0 else None


def use_variant(model, variant: str) -> None:
    """Run ``model`` as ``variant`` (see the module doc)."""
    if variant == "eager":
        use_impl(model, "eager")
        return
    use_impl(model, "moekit_blocks")
    if variant == "blocks_before":
        for site in moe_blocks(model):
            site.block.__dict__[SWAP_ATTR].active = module_limit(site.block.experts) is not None


def step_block_float64(block, x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> the Step-3.7 block's output [T, K] in float64, a loop over tokens and chosen experts: sigmoid scores,
    the choice by score + correction bias, the chosen scores renormalised, x routed scaling; each expert and the shared
    MLP silu(gate) * up, clamped after the activation where the module holds a limit (inf clamps nothing)."""
    with torch.no_grad():
        return _step_block_float64(block, x.double())


def _step_block_float64(block, x: torch.Tensor) -> torch.Tensor:
    scores = (x @ block.gate.weight.double().T).sigmoid()  # [T, E]
    choice = (scores + block.gate.e_score_correction_bias.double()).topk(block.gate.top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, choice)
    weights = weights / weights.sum(-1, keepdim=True)  # [T, k]
    experts, mlp = block.experts, block.shared_experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(choice[t].tolist()):
            gate, up = (experts.gate_up_proj[e].double() @ x[t]).chunk(2)
            down = experts.down_proj[e].double() @ _glu(gate, up, getattr(experts, "limit", None))
            out[t] += weights[t, j] * down
    out *= block.routed_scaling_factor
    gate, up = x @ mlp.gate_proj.weight.double().T, x @ mlp.up_proj.weight.double().T
    return out + _glu(gate, up, getattr(mlp, "limit", None)) @ mlp.down_proj.weight.double().T


def _glu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    act = F.silu(gate)
    if limit is None:
        return act * up
    return act.clamp(max=limit) * up.clamp(-limit, limit)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def check(failed: list[str], name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


def checks(model, prompt: torch.Tensor, failed: list[str]) -> dict:
    """The PASS / FAIL lines before any timing; returns the figures."""
    use_variant(model, "blocks_after")
    sites = moe_blocks(model)
    active = [site.path for site in sites if SWAP_ATTR in site.block.__dict__ and site.block.__dict__[SWAP_ATTR].active]
    check(failed, "every block swapped", len(active) == len(sites), f"{len(active)} of {len(sites)}")
    hidden = model.config.get_text_config().hidden_size
    g = torch.Generator().manual_seed(3)
    errs = {}
    for site in sites:
        x = (torch.randn(BLOCK_TOKENS, hidden, generator=g) * 4).to(prompt.device, model.dtype)  # [T, K]
        with torch.no_grad():
            got = site.block(x[None])[0]  # [T, K]
        errs[site.path] = rel(got, step_block_float64(site.block, x))
        limit = module_limit(site.block.experts)
        check(failed, f"{site.path} vs float64 loop", errs[site.path] < BLOCK_TOL,
              f"rel {errs[site.path]:.2e} (experts limit {limit}, stored {getattr(site.block.experts, 'limit', None)})")
    logits = {}
    for variant in ("eager", "blocks_after"):
        use_variant(model, variant)
        logits[variant] = hm.prefill(model, prompt, all_logits=True).logits.float()
    prefill = rel(logits["blocks_after"], logits["eager"])
    check(failed, "blocks_after prefill logits vs eager", prefill < LOGITS_TOL, f"rel {prefill:.2e}")
    return {"active_blocks": active, "block_rel_err_vs_fp64": errs, "prefill_rel_err_vs_eager": prefill}


def timed(model, prompt: torch.Tensor, result: Result, tokens: int, compiled) -> None:
    """One round: a T-token and a 1-token generate of ``result.variant``."""
    use_variant(model, result.variant)
    result.decode_s.append(hm.decode(model, prompt, tokens, compiled=compiled).seconds)
    result.one_s.append(hm.decode(model, prompt, 1, compiled=compiled).seconds)


def eager_rounds(model, prompt: torch.Tensor, tokens: int) -> list[Result]:
    results = [Result(v, "eager") for v in VARIANTS]
    for r in results:  # warm each once
        use_variant(model, r.variant)
        hm.decode(model, prompt, tokens)
    for rnd in range(ROUNDS):
        for r in results:
            timed(model, prompt, r, tokens, None)
        log(f"eager round {rnd + 1}/{ROUNDS}: " + ", ".join(f"{r.variant} {tokens / r.decode_s[-1]:.1f} tok/s"
                                                            for r in results))
    return results


def compiled_variant(model, prompt: torch.Tensor, variant: str, tokens: int, config, ref: hm.Decode, failed) -> Result:
    """``variant``'s compiled decode on a fresh dynamo state: warm-up (compile) with its counts, then ROUNDS rounds."""
    result = Result(variant, "compiled")
    use_variant(model, variant)
    fresh_dynamo()
    before = dynamo_counts()
    t = time.perf_counter()
    dec = hm.decode(model, prompt, tokens, compiled=config, keep_logits=True)
    result.warm_s = time.perf_counter() - t
    warm = dynamo_counts() - before
    result.graphs, result.graph_breaks = warm.graphs, warm.graph_breaks
    log(f"compiled warm {variant}: {result.warm_s:.1f} s, {warm.graphs} graphs, {warm.graph_breaks} graph breaks")
    if variant == "blocks_after":  # step 0 is generate's (uncompiled) prefill: step 1 is the first compiled one
        step1 = rel(dec.logits[1], ref.logits[1])
        check(failed, "blocks_after compiled step 1 logits vs eager mode's", step1 < LOGITS_TOL and
              bool(dec.tokens[0] == ref.tokens[0]), f"rel {step1:.2e}, step 0's token equal")
        check(failed, "blocks_after compiles without a graph break", warm.graph_breaks == 0,
              f"{warm.graphs} graphs, {warm.graph_breaks} breaks")
    before = dynamo_counts()
    for _ in range(ROUNDS):
        timed(model, prompt, result, tokens, config)
    result.recompiles = (dynamo_counts() - before).frames
    log(f"compiled {variant}: {tokens / statistics.median(result.decode_s):.1f} tok/s, "
        f"{result.recompiles} recompiles")
    return result


def compiled_rounds(model, prompt, tokens: int, deadline: float, ref: hm.Decode, failed) -> list[Result]:
    config = hm.compile_config(prompt.device, "inductor" if prompt.device.type == "cuda" else "eager")
    results, spent = [], 0.0  # the last variant's warm-up and rounds: what the next one is guessed to take
    with recompile_limit():
        for variant in ("blocks_after", "blocks_before", "eager"):  # blocks_after, the point of the check, always
            left = deadline - (time.perf_counter() - T0)
            if left < 1.3 * spent:
                results.append(Result(variant, "compiled", note=f"skipped: {left:.0f} s left"))
                log(f"compiled {variant}: skipped, {left:.0f} s to the deadline")
                continue
            t = time.perf_counter()
            try:
                results.append(compiled_variant(model, prompt, variant, tokens, config, ref, failed))
            except Exception as err:  # noqa: BLE001  (a variant that cannot compile is a result: FAIL, the rest run)
                check(failed, f"{variant} compiled decode runs", False, hm.error_text(err))
                results.append(Result(variant, "compiled", note=hm.error_text(err)[:60]))
            spent = time.perf_counter() - t
    fresh_dynamo()
    return results


COUNT_IMPLS, COUNT_TOKENS = ("moekit", "moekit_blocks"), 4  # 3 compiled steps a generate (step 0: the prefill)


def graph_counts(models: list[str], layers: int, tiny: bool, device: torch.device, deadline: float,
                 failed: list[str]) -> list[dict]:
    """Each model's moekit rows compiled by dynamo alone (no code generation: graph breaks and recompiles are
    dynamo's), its kernels on this device: warm-up, then a T-token, a 1-token and a T-token generate and one of a prompt
    2 longer and T - 2 tokens (the same static cache: its eager prefill must leave no guard failing), counting the
    graphs each decode step calls (``counting_backend``), the graph breaks and the frames recompiled."""
    found = []
    for name in models:
        left = deadline - (time.perf_counter() - T0)
        if left < 15:
            log(f"counts {name}: skipped, {left:.0f} s to the deadline")
            continue
        model = build_model(hf_config(name, layers, tiny=tiny), torch.float32 if tiny else torch.bfloat16, device)
        prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
        for impl in COUNT_IMPLS:
            reason = not_run(model, impl, None, device, compiled=True)  # Step-3.7's "moekit" under transformers 5.17
            if reason is None:
                found.append(_impl_counts(model, prompt, name, impl, failed))
            else:
                log(f"counts {name} {impl}: {reason}")
        fresh_dynamo()  # its graphs hold the model's weights
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fresh_dynamo()
    return found


def _impl_counts(model, prompt: torch.Tensor, name: str, impl: str, failed: list[str]) -> dict:
    use_impl(model, impl)
    calls = GraphCalls()
    config = hm.compile_config(prompt.device, counting_backend(calls))
    fresh_dynamo()
    before = dynamo_counts()
    t = time.perf_counter()
    hm.decode(model, prompt, COUNT_TOKENS, compiled=config)
    warm, warm_s = dynamo_counts() - before, time.perf_counter() - t
    calls.count, before = 0, dynamo_counts()
    for tokens in (COUNT_TOKENS, 1, COUNT_TOKENS):
        hm.decode(model, prompt, tokens, compiled=config)
    longer = torch.cat([prompt, prompt[:, :2]], dim=1)  # [1, P + 2]: the same cache, another eager prefill
    hm.decode(model, longer, COUNT_TOKENS - 2, compiled=config)
    after = dynamo_counts() - before
    per_step = calls.count / (2 * (COUNT_TOKENS - 1) + COUNT_TOKENS - 3)
    check(failed, f"{name} {impl} one graph a decode step", per_step == 1 and warm.graph_breaks == 0
          and after.frames == 0, f"{per_step:.1f} graphs a step, {warm.graph_breaks} breaks in the warm-up "
          f"({warm_s:.1f} s), {after.frames} recompiles after it")
    return {"model": name, "impl": impl, "graphs_a_step": per_step, "warm_graphs": warm.graphs,
            "warm_graph_breaks": warm.graph_breaks, "recompiles": after.frames, "warm_s": warm_s}


def table(results: list[Result], tokens: int) -> str:
    lines = [f"{'variant':14} {'mode':9} {'decode tok/s':>12} {'step tok/s':>10} {'graphs/breaks/recomp':>21} "
             f"{'warm s':>7}  note"]
    for r in results:
        decode, step = r.rates(tokens)
        counts = "-" if r.graphs is None else f"{r.graphs}/{r.graph_breaks}/{r.recompiles}"
        lines.append(f"{r.variant:14} {r.mode:9} {_num(decode):>12} {_num(step):>10} {counts:>21} "
                     f"{_num(r.warm_s):>7}  {r.note}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline", type=float, default=80.0, help="seconds from the start: no compiled variant past it")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="tiny widths, float32, on the CPU (the smoke run)")
    p.add_argument("--counts", default=None, help="comma-separated bench --hf models: only their moekit rows' graph "
                   "counts (dynamo alone, --layers layers), no Step-3.7 timing")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.counts:
        return counts_main(args, device)
    import transformers

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(hf_config("step-3.7", args.layers, tiny=args.tiny), dtype, device)
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "layers": args.layers, "dtype": str(dtype),
            "tiny": args.tiny, "decode_tokens": args.decode_tokens, "prompt_len": args.prompt_len}
    log(f"step-3.7 built: {info}")
    failed: list[str] = []
    figures = checks(model, prompt, failed)
    use_variant(model, "blocks_after")
    ref = hm.decode(model, prompt, 2, keep_logits=True)  # eager mode's first two steps
    results = eager_rounds(model, prompt, args.decode_tokens)
    results += compiled_rounds(model, prompt, args.decode_tokens, args.deadline, ref, failed)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {"info": info, "checks": figures, "failed": failed, "results": [asdict(r) | dict(zip(
        ("decode_tok_s", "step_tok_s"), r.rates(args.decode_tokens))) for r in results]}
    (args.out / "stp52.json").write_text(json.dumps(doc, indent=1))
    print(f"\nstep-3.7 ({args.layers} layers, {'tiny' if args.tiny else 'real'} widths) on {info['device']}, "
          f"transformers {info['transformers']}; decode {args.decode_tokens} tokens after {args.prompt_len}, "
          f"median of {ROUNDS}; FAILED: {failed or 'none'}")
    print(table(results, args.decode_tokens))
    return 1 if failed else 0


def counts_main(args, device: torch.device) -> int:
    import transformers

    failed: list[str] = []
    log(f"graph counts on {device}, transformers {transformers.__version__}, torch {torch.__version__}")
    found = graph_counts(args.counts.split(","), args.layers, args.tiny, device, args.deadline, failed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stp52_counts.json").write_text(json.dumps({"counts": found, "failed": failed}, indent=1))
    print(f"\n{'model':12} {'impl':14} graphs/step breaks recompiles warm s; FAILED: {failed or 'none'}")
    for c in found:
        print(f"{c['model']:12} {c['impl']:14} {c['graphs_a_step']:11.1f} {c['warm_graph_breaks']:6} "
              f"{c['recompiles']:10} {c['warm_s']:6.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
