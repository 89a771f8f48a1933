"""The gate kernel against cuBLAS on the GPU, by batch size (``moekit.routing.gate``).

    PYTHONPATH=. OUT=/tmp/gate python benchmarks/gate_device_check.py

For the routers of Qwen3-30B-A3B (E=128, K=2048), Mixtral-8x7B (E=8, K=4096) and DeepSeek-V3 (E=256,
K=7168), bf16, M = 1, 2, 4, 8, 12, 16, 32: the CUDA-graph µs of ``F.linear`` (cuBLAS) and of the
kernel (``bcast``: a W tile loaded once per K step, each row multiplied into it and summed; run past
``MAX_TOKENS`` here to show where it stops paying), each one's largest error against a float64 matmul
(relative to the largest logit), and which of the two the layer takes. A short table is printed last;
JSON goes to $OUT. (The first run also timed a tensor-core tile, since removed:
``benchmarks/results/raw/NVIDIA_H200-2026-12-01-718988d-gate_device_check.log``.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moekit.bench.timing import time_calls
from moekit.config import MoEConfig
from moekit.routing import gate

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
BATCHES = (1, 2, 4, 8, 12, 16, 32)


def bound_kernel(x, w):
    """The kernel's bound launch for this kind of call, at any M (``MAX_TOKENS`` lifted; caches cleared)."""
    saved = gate.MAX_TOKENS
    gate.MAX_TOKENS = 1 << 30
    gate.clear_launch_caches()
    try:
        gate.gate_logits(x, w)
        return gate._BOUND[next(iter(gate._BOUND))]
    finally:
        gate.MAX_TOKENS = saved
        gate.clear_launch_caches()


def main() -> None:
    dev = torch.device("cuda")
    out_dir = Path(os.environ.get("OUT", "gate_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in PRESETS:
        cfg = MoEConfig.preset(preset)
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(cfg.num_experts, cfg.hidden_size, device=dev, generator=g).to(torch.bfloat16) * 0.02
        for m in BATCHES:
            x = torch.randn(m, cfg.hidden_size, device=dev, generator=g).to(torch.bfloat16)
            ref = x.double() @ w.double().T
            scale = ref.abs().max().item()
            row = {"preset": preset, "M": m, "layer_takes": "kernel" if m <= gate.MAX_TOKENS else "cublas"}
            bcast, out_b = bound_kernel(x, w), x.new_empty(m, cfg.num_experts)
            fns = {"cublas": lambda: torch.nn.functional.linear(x, w), "bcast": lambda: bcast(x, w, None, out_b)}
            for name, fn in fns.items():
                got = fn()
                torch.cuda.synchronize()
                row[f"{name}_err"] = (got.double() - ref).abs().max().item() / scale
                row[f"{name}_us"] = time_calls([fn] * 20, dev, graph=True)  # per call
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "gate.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'preset':<15}{'M':>4}{'cublas':>9}{'bcast':>9}  {'layer':<8}{'err b':>9}{'err cublas':>11}"
          "   (GPU µs per call, graph replay)")
    for r in rows:
        print(f"{r['preset']:<15}{r['M']:>4}{r['cublas_us']:>9.2f}{r['bcast_us']:>9.2f}  {r['layer_takes']:<8}"
              f"{r['bcast_err']:>9.1e}{r['cublas_err']:>11.1e}")


if __name__ == "__main__":
    main()
