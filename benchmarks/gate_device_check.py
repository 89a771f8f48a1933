"""The gate kernel's two tile paths against cuBLAS on the GPU, by batch size (``moekit.routing.gate``).

    PYTHONPATH=. OUT=/tmp/gate python benchmarks/gate_device_check.py

For the routers of Qwen3-30B-A3B (E=128, K=2048), Mixtral-8x7B (E=8, K=4096) and DeepSeek-V3 (E=256,
K=7168), bf16, M = 1, 2, 4, 8, 12, 16, 32: the CUDA-graph µs of ``F.linear`` (cuBLAS), of the kernel's
row-at-a-time path (``bcast``: a W tile loaded once per K step, each row multiplied into it and summed)
and of its tensor-core path (``dot``: rows masked up to a 16-row tile), each one's largest error against
a float64 matmul (relative to the largest logit), and which path ``DOT_MIN_TOKENS`` picks. A short table
is printed last; JSON goes to $OUT.
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


def with_path(dot_from: int):
    """gate.gate_logits with the tensor-core path taken from ``dot_from`` rows (caches cleared)."""
    def call(x, w):
        saved = gate.DOT_MIN_TOKENS
        gate.DOT_MIN_TOKENS = dot_from
        gate.clear_launch_caches()
        try:
            out = gate.gate_logits(x, w)
            bound = gate._BOUND[next(iter(gate._BOUND))]
        finally:
            gate.DOT_MIN_TOKENS = saved
            gate.clear_launch_caches()
        return out, bound
    return call


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
            row = {"preset": preset, "M": m, "default_dot": m >= gate.DOT_MIN_TOKENS}
            _, bcast = with_path(1 << 30)(x, w)
            _, dot = with_path(1)(x, w)
            out_b, out_d = x.new_empty(m, cfg.num_experts), x.new_empty(m, cfg.num_experts)
            fns = {"cublas": lambda: torch.nn.functional.linear(x, w),
                   "bcast": lambda: bcast(x, w, None, out_b), "dot": lambda: dot(x, w, None, out_d)}
            for name, fn in fns.items():
                got = fn()
                torch.cuda.synchronize()
                row[f"{name}_err"] = (got.double() - ref).abs().max().item() / scale
                row[f"{name}_us"] = time_calls([fn] * 20, dev, graph=True)  # per call
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir / "gate.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'preset':<15}{'M':>4}{'cublas':>9}{'bcast':>9}{'dot':>9}  {'default':<8}{'err b':>9}{'err d':>9}{'err cublas':>11}"
          "   (GPU µs per call, graph replay)")
    for r in rows:
        print(f"{r['preset']:<15}{r['M']:>4}{r['cublas_us']:>9.2f}{r['bcast_us']:>9.2f}{r['dot_us']:>9.2f}  "
              f"{'dot' if r['default_dot'] else 'bcast':<8}{r['bcast_err']:>9.1e}{r['dot_err']:>9.1e}{r['cublas_err']:>11.1e}")


if __name__ == "__main__":
    main()
