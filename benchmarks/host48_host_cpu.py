"""The host Python of one eager decode forward, the fast path off / on (``layer_fast.ENABLED``), for the layers session
48's host48 put on it: a quantized layer with a shared expert (``quantize_`` un-fuses it) and a DeepSeek-V4 hash layer
(``HashMoE``, the one-launch hash router); on the CPU with every ``BoundLaunch`` stubbed
(``wl46_host_cpu.stub_launches``: nothing runs on a kernel's behalf; torch ops on the CPU do run).

    PYTHONPATH=$PWD python3 benchmarks/host48_host_cpu.py        # ~1 min on one core

Cells (M = 1 and 8): DeepSeek-V3's routing (E 32 here, top-8, 4 groups of 8 pick 2, the correction bias) int4_w4a16
experts and its separate bf16 shared MLP, hidden K = 64 and width N = 32 (the shared MLP's two GEMMs run on the CPU
for real in both columns: small); V4's hash layer (E 32, top-6, sqrt(softplus), V 1024, K 64, N 32, bf16, the shared
expert fused). Per cell µs a call, the median of ROUNDS interleaved rounds of CALLS calls. The CPU asserts the hash
router's two flags with a host read (``assert_flags``' CPU branch), the GPU with two ``torch._assert_async``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused routers and the Triton experts bind on the CPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from host48_device_check import switched  # noqa: E402
from wl46_host_cpu import per_call_us, stub_launches  # noqa: E402

from moekit import HashMoE, MoE, MoEConfig, layer_fast  # noqa: E402

K, N, E = 64, 32, 32
DS3 = MoEConfig.preset("deepseek-v3").replace(hidden_size=K, moe_intermediate_size=N, num_experts=E, n_group=4,
                                              topk_group=2, shared_expert_intermediate_size=N)
V4_HASH = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=6, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5, shared_expert_intermediate_size=N, hash_table_size=1024)


def cells() -> dict:
    """name -> (the layer's call of M rows) for M in 1, 8."""
    torch.manual_seed(0)
    ds3 = MoE(DS3, backend="triton", router="fused", dtype=torch.bfloat16).eval().quantize_("int4_w4a16",
                                                                                             group_size=32)
    hashed = HashMoE(V4_HASH, backend="triton", router="fused", dtype=torch.bfloat16).eval()
    out = {}
    for m in (1, 8):
        x = torch.randn(m, K).bfloat16()
        ids = torch.randint(0, V4_HASH.hash_table_size, (m,))
        out[f"deepseek-v3 int4 + shared MLP M={m}"] = lambda x=x: ds3(x)
        out[f"v4 hash M={m}"] = lambda x=x, ids=ids: hashed(x, token_ids=ids)
    return out


def main() -> int:
    stub_launches()
    torch.set_num_threads(1)
    print("cell | fast path off | on  (host µs a call, launches stubbed)")
    with torch.no_grad():
        for name, fn in cells().items():
            for on in (True, False, True):  # kept (on), then the full forward primed
                switched(fn, on)()
            us = per_call_us({"off": switched(fn, False), "on": switched(fn, True)})
            print(f"{name} | {us['off']:.1f} | {us['on']:.1f}", flush=True)
    layer_fast.ENABLED = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
