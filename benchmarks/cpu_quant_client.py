"""The real client on the CPU: a transformers gpt-oss model decoding greedily, its MoE block as transformers runs it,
through moekit (``moe_from_hf``), and through moekit with weight-only quantized experts (``quantize_``); tok/s.

The model: one decoder layer at gpt-oss-20b's widths (hidden 2880, 32 experts of intermediate 2880, top-4, 64 heads,
8 KV heads; biases, interleaved gate / up, clamped swiglu), random weights, bf16 (or --dtype), vocab 1024: the real
201088-token embedding and head would add 1.2e9 parameters and a 201088-wide GEMV a token that are no part of the
experts. One model; each variant's block is swapped into the layer before its decode, so the attention and the
head are the same tensors for every variant.

Per round, every variant (order rotated per round) prefills the same --prompt tokens and decodes --steps tokens one
at a time with the KV cache (``torch.no_grad``, as ``generate`` runs); each step is timed. A variant's figure is the
median step over all rounds -> tok/s, beside the step's ratio to the ``moekit`` (unquantized) variant of the run. The
pre-session-30 numbers: the same script with an older tree first on PYTHONPATH (its quantized variants dequantize
all 32 experts per step), the two runs' ratios to their own ``moekit`` compared.

    PYTHONPATH=$PWD python3 benchmarks/cpu_quant_client.py --schemes mxfp4,int4_w4a16,int8_w8a16 --out FILE.json

Shapes: T prompt tokens, S decode steps, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import transformers

from moekit.bench.cpu_measure import cpu_name
from moekit.bench.run import commit_id
from moekit.hf import moe_from_hf

GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64)


@dataclass(frozen=True)
class Variant:
    name: str  # "transformers", "moekit", "moekit[<scheme>]"
    block: torch.nn.Module  # what sits in model.model.layers[0].mlp while it decodes


def build(vocab: int, dtype: torch.dtype, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(**GPT_OSS_20B, vocab_size=vocab, num_hidden_layers=1,
                                    layer_types=["full_attention"])
    return transformers.GptOssForCausalLM(cfg).to(dtype).eval()


class ScoresPair(torch.nn.Module):
    """A moekit MoE in gpt-oss's decoder layer, which unpacks (hidden, router scores) from its mlp."""

    def __init__(self, moe: torch.nn.Module):
        super().__init__()
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.moe(x), None


def variants(model, schemes: list[str]) -> list[Variant]:
    block = model.model.layers[0].mlp
    out = [Variant("transformers", block), Variant("moekit", ScoresPair(moe_from_hf(block)))]
    for scheme in schemes:
        out.append(Variant(f"moekit[{scheme}]", ScoresPair(moe_from_hf(copy.deepcopy(block)).quantize_(scheme))))
    return out


def decode(model, variant: Variant, prompt: torch.Tensor, steps: int) -> tuple[list[float], list[int]]:
    """Prefill ``prompt`` [1, T], then ``steps`` greedy tokens: (each step's ms, the tokens)."""
    model.model.layers[0].mlp = variant.block
    times, tokens = [], []
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)  # [1, 1]
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - t0) * 1e3)
            tokens.append(int(token))
    return times, tokens


def logits_error(model, variant: Variant, reference: Variant, prompt: torch.Tensor) -> float:
    """Relative L2 of the variant's prefill logits against the reference variant's."""
    with torch.no_grad():
        model.model.layers[0].mlp = reference.block
        want = model(input_ids=prompt).logits.double()
        model.model.layers[0].mlp = variant.block
        got = model(input_ids=prompt).logits.double()
    return float((got - want).norm() / want.norm())


def run(args) -> dict:
    model = build(args.vocab, getattr(torch, args.dtype), args.seed)
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))
    vs = variants(model, args.schemes)
    errors = {v.name: logits_error(model, v, vs[0], prompt) for v in vs}
    for v in vs:  # warm-up: packing, repacking, first-call probes
        decode(model, v, prompt, 2)
    steps = {v.name: [] for v in vs}
    tokens = {}
    load_before = os.getloadavg()
    for r in range(args.rounds):
        for v in vs[r % len(vs):] + vs[:r % len(vs)]:
            times, tokens[v.name] = decode(model, v, prompt, args.steps)
            steps[v.name] += times
    rows = {}
    for name, t in steps.items():
        ms = statistics.median(t)
        rows[name] = {"step_ms": ms, "tok_s": 1e3 / ms, "steps": len(t), "logits_rel_err_vs_transformers": errors[name],
                      "tokens": tokens[name]}
    unq = rows["moekit"]["step_ms"]
    for r in rows.values():
        r["step_vs_moekit"] = r["step_ms"] / unq
    return {"cpu": cpu_name(), "commit": commit_id(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
            "config": {**GPT_OSS_20B, "vocab": args.vocab},
            "prompt": args.prompt, "steps": args.steps, "rounds": args.rounds, "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()), "rows": rows}


def table(doc: dict) -> list[str]:
    lines = [f"{doc['cpu']} threads={doc['threads']} {doc['dtype']} commit {doc['commit'][:12]} "
             f"load {doc['loadavg_before'][0]:.1f}/{doc['loadavg_after'][0]:.1f}",
             f"{'variant':22} {'step ms':>9} {'tok/s':>7} {'/ moekit':>9} {'logits err':>10}"]
    for name, r in doc["rows"].items():
        lines.append(f"{name:22} {r['step_ms']:9.1f} {r['tok_s']:7.2f} {r['step_vs_moekit']:9.2f} "
                     f"{r['logits_rel_err_vs_transformers']:10.1e}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schemes", type=lambda s: [x for x in s.split(",") if x], default=["mxfp4"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    doc = run(args)
    print("\n".join(table(doc)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
