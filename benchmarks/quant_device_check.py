"""GPU checks of ``moekit.quant`` (no kernels of its own): the quantizers and the exact definitions on
CUDA equal the CPU's, and the accuracy figures at real shapes.

    PYTHONPATH=. python benchmarks/quant_device_check.py [--small]

Steps:
  same      per scheme, one Qwen3-30B-A3B-shaped w13 slice [8, 1536, 2048] quantized on CUDA and on the
            CPU: q, scale, zero bit-equal; the fp8 activation quantizer on a [512, 2048] bf16 x bit-equal
  figures   per (preset shape, scheme): MoE(bf16, reference backend) on Gaussian x (M=512) quantized in
            place; relative L2 of the layer output vs the unquantized layer, per-weight relative RMS error
            of w13, packed MiB per expert (what the byte model counts); fp8 weight-only figure beside
            w8a8 (the issue quotes vLLM's 6.3-6.5% w8a8, 2.6% weight-only)
Prints one line per check and the figures table last; writes $OUT/quant_device_check.json when OUT is
set; exit 1 on any failure. ``--small`` shrinks the shapes (a CPU smoke run).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import moekit.quant as Q
from moekit.config import MoEConfig
from moekit.experts import run_experts
from moekit.layer import MoE

SCHEMES = ("fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4")
# (name, K, N, E, k): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 (its 256 experts cut to 32: the
# figures are per expert, so fewer experts change nothing but the run time)
SHAPES = (("qwen3_30b_a3b", 2048, 768, 128, 8), ("mixtral_8x7b", 4096, 14336, 8, 2),
          ("deepseek_v3_32e", 7168, 2048, 32, 8))
SMALL_SHAPES = (("small", 256, 384, 8, 2),)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t on the CPU as comparable bits (fp8 compares as its bytes)."""
    t = t.cpu()
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def check_same(device: str, small: bool) -> list[str]:
    """CUDA and CPU quantize to the same bits."""
    failures = []
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2 if small else 8, 384 if small else 1536, 256 if small else 2048, generator=g) * 0.02
    for scheme in SCHEMES:
        cpu, dev = Q.quantize(w, scheme), Q.quantize(w.to(device), scheme)
        same = all(torch.equal(_bits(t), _bits(cpu.tensors()[k])) for k, t in dev.tensors().items())
        print(f"same      {scheme:11s} cuda == cpu: {same}")
        failures += [] if same else [f"same {scheme}"]
    x = torch.randn(512, w.shape[2], generator=g).bfloat16()
    a_cpu, a_dev = Q.quantize_activations_fp8(x), Q.quantize_activations_fp8(x.to(device))
    same = torch.equal(_bits(a_cpu.q), _bits(a_dev.q)) and torch.equal(_bits(a_cpu.scale), _bits(a_dev.scale))
    print(f"same      fp8 activations cuda == cpu: {same}")
    return failures + ([] if same else ["same activations"])


def figures(device: str, small: bool) -> list[dict]:
    rows = []
    for name, k_dim, n_dim, e, top_k in SMALL_SHAPES if small else SHAPES:
        config = MoEConfig(hidden_size=k_dim, moe_intermediate_size=n_dim, num_experts=e, top_k=top_k)
        x = torch.randn(64 if small else 512, k_dim,
                        generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
        for scheme in SCHEMES:
            torch.manual_seed(0)
            moe = MoE(config, backend="reference", dtype=torch.bfloat16, device=device)
            with torch.no_grad():
                ref = moe(x)
                w13 = moe.w13.detach().clone()
                moe.quantize_(scheme)
                row = {"shape": name, "scheme": scheme, "layer_rel_l2": _rel(moe(x), ref),
                       "w13_rel_rms": _rel(moe.w13.dequantize(), w13),
                       "MiB_per_expert": (moe.w13.nbytes_per_expert + moe.w2.nbytes_per_expert) / 2**20}
                if scheme == "fp8_block":
                    routing = moe.route_tokens(x).routing
                    dense = run_experts(x, moe.w13.dequantize(torch.bfloat16), moe.w2.dequantize(torch.bfloat16),
                                        routing.topk_ids, routing.topk_weights, backend="reference")
                    row["weight_only_layer_rel_l2"] = _rel(dense, ref)
            print(f"figures   {name:16s} {scheme:11s} layer {row['layer_rel_l2']:.4%}  w13 {row['w13_rel_rms']:.4%}")
            rows.append(row)
            del moe
    return rows


def main() -> int:
    small = "--small" in sys.argv
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = check_same(device, small) if device == "cuda" else []
    rows = figures(device, small)
    print(f"\n{'shape':16s} {'scheme':11s} {'layer rel L2':>12s} {'w13 rel RMS':>12s} {'MiB/expert':>10s}")
    for r in rows:
        extra = f"  (weight-only {r['weight_only_layer_rel_l2']:.4%})" if "weight_only_layer_rel_l2" in r else ""
        print(f"{r['shape']:16s} {r['scheme']:11s} {r['layer_rel_l2']:12.4%} {r['w13_rel_rms']:12.4%} "
              f"{r['MiB_per_expert']:10.3f}{extra}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "quant_device_check.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "figures": rows,
                       "failures": failures, "torch": torch.__version__}, f, indent=1)
    print("FAILURES: " + ", ".join(failures) if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
