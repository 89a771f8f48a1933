"""Where moekit's bf16 experts output departs from transformers' eager one (issue 13's "logits error no worse
than grouped_mm's"): one experts call at real widths, computed in torch on the CPU with each implementation's
bf16 rounding points, against eager's result and against float64.

    eager       gate/up GEMM rounded, act(gate) rounded, x up rounded, down GEMM rounded, x routed weight
                rounded, then index_add_ in bf16 in expert order (transformers' Qwen3MoeExperts / MixtralExperts)
    grouped_mm  the same roundings, the k-sum in float32 in slot order, rounded once
    moekit      fp32 accumulators: act(gate) * up rounded once (the gate-up epilogue), routed weight x the fp32
                down accumulator rounded once (the down epilogue), the k-sum in float32 in slot order, rounded once
    moekit+...  moekit with one or two of eager's extra rounding points added

GEMMs accumulate in float32 here (cuBLAS and the Triton kernels do too, in other orders: the GPU adds an
accumulation-order difference this leaves out). Random bf16 weights (std 0.02, transformers' init), x ~ N(0, 1)
(what RMSNorm hands the experts), softmax top-k routing renormalised.

    python benchmarks/hf_rounding_cpu.py [--tokens 8]
"""

from __future__ import annotations

import argparse

import torch

BF16 = torch.bfloat16
MODELS = {"qwen3 (E 128, K 2048, N 768, k 8)": (128, 2048, 768, 8),
          "mixtral (E 8, K 4096, N 14336, k 2)": (8, 4096, 14336, 2)}
# name -> (gate/up rounded, act rounded, down rounded before the routed weight, k-sum)
RECIPES = {
    "eager": (True, True, True, "bf16 index_add_"), "grouped_mm": (True, True, True, "fp32"),
    "moekit": (False, False, False, "fp32"), "moekit+gate/up": (True, False, False, "fp32"),
    "moekit+act": (False, True, False, "fp32"), "moekit+down": (False, False, True, "fp32"),
    "moekit+gate/up+act": (True, True, False, "fp32"),
}


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16).float()


def experts(x, w13, w2, ids, weights, round_gate_up: bool, round_act: bool, round_down: bool, ksum: str):
    """[M, K] float32 holding bf16 values: x [M, K], w13 [E, 2N, K], w2 [E, K, N], ids / weights [M, k]."""
    num_tokens, hidden = x.shape
    n, top_k = w13.shape[1] // 2, ids.shape[1]
    experts_of = ids.reshape(-1).tolist()  # [A]
    rows = x.float().repeat_interleave(top_k, 0)  # [A, K]
    acc = torch.stack([w13[e].float() @ row for e, row in zip(experts_of, rows)])  # [A, 2N]
    gate, up = acc[:, :n], acc[:, n:]
    if round_gate_up:
        gate, up = _round(gate), _round(up)
    act = gate * torch.sigmoid(gate)
    if round_act:
        act = _round(act)
    h = _round(act * up)  # [A, N]
    down = torch.stack([w2[e].float() @ row for e, row in zip(experts_of, h)])  # [A, K]
    if round_down:
        down = _round(down)
    y = _round(down * weights.reshape(-1, 1).float()).view(num_tokens, top_k, hidden)
    if ksum == "fp32":
        return _round(y.sum(1))
    out = torch.zeros(num_tokens, hidden)  # index_add_ in bf16, one expert after another
    order = torch.argsort(ids, dim=1, stable=True)
    for j in range(top_k):
        out = _round(out + y.gather(1, order[:, j, None, None].expand(num_tokens, 1, hidden))[:, 0])
    return out


def float64(x, w13, w2, ids, weights) -> torch.Tensor:
    num_tokens, hidden = x.shape
    n, top_k = w13.shape[1] // 2, ids.shape[1]
    experts_of = ids.reshape(-1).tolist()
    acc = torch.stack([w13[e].double() @ row for e, row in zip(experts_of, x.double().repeat_interleave(top_k, 0))])
    h = acc[:, :n] * torch.sigmoid(acc[:, :n]) * acc[:, n:]
    down = torch.stack([w2[e].double() @ row for e, row in zip(experts_of, h)])
    return (down * weights.reshape(-1, 1).double()).view(num_tokens, top_k, hidden).sum(1)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, (num_experts, hidden, n, top_k) in MODELS.items():
        x = torch.randn(args.tokens, hidden).to(BF16)
        w13 = (torch.randn(num_experts, 2 * n, hidden) * 0.02).to(BF16)
        w2 = (torch.randn(num_experts, hidden, n) * 0.02).to(BF16)
        probs, ids = torch.softmax(torch.randn(args.tokens, num_experts), -1).topk(top_k, -1)
        weights = (probs / probs.sum(-1, keepdim=True)).to(BF16)
        truth = float64(x, w13, w2, ids, weights)
        outs = {recipe: experts(x, w13, w2, ids, weights, *how) for recipe, how in RECIPES.items()}
        print(f"{name}, M = {args.tokens}: rel. error of one experts call")
        for recipe, out in outs.items():
            print(f"  {recipe:20s} vs eager {rel(out, outs['eager']):.3e}   vs float64 {rel(out, truth):.3e}",
                  flush=True)


if __name__ == "__main__":
    main()
