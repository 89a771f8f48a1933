"""Where a DeepSeek-V4 hash layer's host time goes (session 49, branch hash49): one eager decode call, on the CPU with
every ``BoundLaunch`` stubbed (``wl46_host_cpu.stub_launches``: nothing runs on a kernel's behalf; torch ops on the CPU
do run), the layers next to V4's top-k layer on its fast path, resident and offloaded.

    PYTHONPATH=$PWD python3 benchmarks/hash49_host_cpu.py                 # ~1 min on one core
    PYTHONPATH=/tmp/base-tree python3 benchmarks/hash49_host_cpu.py       # the same cells on another tree (before)

The hash router's two checks are asserted as a GPU asserts them, not as the interpreter does (a host read of the flags,
~15 µs here that no GPU pays): a tree whose ``FusedHashRouter`` takes ``assert_in_kernel`` (session 49's) as the
compiled kernel does, in the kernel (no flags, nothing after the launch); an older tree with two ``torch._assert_async``
on the flags, its GPU branch. The gate through ``F.linear`` runs a real CPU GEMM here (K 64, E 32: a few µs), where a
GPU pays cuBLAS's host setup instead (13-36 µs on the H200, ``routing/gate.py``); the gate kernel is a stubbed launch.

Cells (bf16, E 32, top-6, K 64, N 32, V 1024, the shared expert fused; M = 1 and 8): µs a call, the median of
ROUNDS interleaved rounds of CALLS calls:
  topk fast      V4's top-k layer (sqrt(softplus), the correction bias), ``router="fused"``: ``layer_fast``
  hash fast      ``HashMoE(router="fused")`` on its fast path (``layer_hash_fast``)
  hash full      the same layer with the fast path off (``layer_fast.ENABLED = False``): the full forward
  off topk/hash  ``OffloadedMoE.from_moe`` of each, every expert cached, no prefetch
and the hash fast path's stages, each timed alone on the kept entry: gate, route launch, the flags' asserts, the
experts (``layer_fast.run_experts``: the kept call, its launches stubbed); "checks" = the call less those (forward's
and the fast path's Python).
"""

from __future__ import annotations

import inspect
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused routers and the Triton experts bind on the CPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from host48_device_check import switched  # noqa: E402
from wl46_host_cpu import per_call_us, stub_launches  # noqa: E402

import moekit  # noqa: E402
from moekit import HashMoE, MoE, MoEConfig, layer_fast  # noqa: E402
from moekit.offload import OffloadedMoE  # noqa: E402
from moekit.routing import hash_fused  # noqa: E402

K, N, E, V = 64, 32, 32, 1024
V4_HASH = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=6, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5, shared_expert_intermediate_size=N, hash_table_size=V)
V4_TOPK = V4_HASH.replace(hash_table_size=None, use_correction_bias=True)
IN_KERNEL = "assert_in_kernel" in inspect.signature(hash_fused.FusedHashRouter).parameters  # session 49's tree


def _gpu_assert_flags(ok, logits, token_ids, table_rows) -> None:
    """``assert_flags``' GPU branch (two device-side asserts, no host read), on the CPU."""
    torch._assert_async(ok[0], "router_logits contains NaN or infinite values")
    torch._assert_async(ok[1], "token_ids outside [0, hash_table_size)")


def as_on_the_gpu(hashed: HashMoE) -> None:
    """The kept entries and bound launches of ``hashed`` assert as on a GPU (the module doc)."""
    hash_fused.assert_flags = _gpu_assert_flags  # FusedHashRouter.__call__'s (an older tree's GPU branch)
    for bound in hash_fused._BOUND.values():
        if IN_KERNEL:
            bound.ok = None  # the compiled kernel asserts: no flags
    for entry in hashed._hash_decode._entries.values():
        if IN_KERNEL:
            entry.ok = entry.flags = None
        else:
            entry.flags = (entry.ok[0], entry.ok[1])


def build() -> dict:
    torch.manual_seed(0)
    layers = {"topk": MoE(V4_TOPK, backend="triton", router="fused", dtype=torch.bfloat16).eval(),
              "hash": HashMoE(V4_HASH, backend="triton", router="fused", dtype=torch.bfloat16).eval()}
    for name in ("topk", "hash"):
        layers[f"off {name}"] = OffloadedMoE.from_moe(layers[name], cache_experts=E, prefetch=None)
    return layers


def cells(layers: dict, m: int) -> dict:
    g = torch.Generator().manual_seed(m)
    x, ids = torch.randn(m, K, generator=g).bfloat16(), torch.randint(0, V, (m,), generator=g)
    hashed = layers["hash"]
    fns = {"topk fast": lambda: layers["topk"](x), "hash fast": lambda: hashed(x, token_ids=ids),
           "hash full": switched(lambda: hashed(x, token_ids=ids), False),
           "off topk": lambda: layers["off topk"](x), "off hash": lambda: layers["off hash"](x, token_ids=ids)}
    for fn in fns.values():
        for _ in range(3):  # kept (the fast paths), then served
            switched(fn, True)()
    as_on_the_gpu(hashed)
    return fns | stages(hashed, x, ids)


def stages(layer: HashMoE, x: torch.Tensor, ids: torch.Tensor) -> dict:
    """The hash fast path's stages on its kept entry, each alone."""
    entry = layer._hash_decode._entries[x.shape[0]]
    weight, table = layer.gate.weight, layer.tid2eid
    gate = getattr(entry, "gate", None)
    logits = layer._gate(x, weight, None, None)  # [M, E]
    flag_arg = entry.flag_arg if IN_KERNEL else entry.ok
    out = {"stage gate": (lambda: gate(x, weight, None, entry.logits)) if gate is not None
           else (lambda: layer._gate(x, weight, None, None)),
           "stage route launch": lambda: entry.launch(logits, ids, table, entry.ids, entry.weights, flag_arg),
           "stage experts": lambda: layer_fast.run_experts(layer, entry, x, layer.w13, layer.w2, entry.ids,
                                                           entry.weights, None, None)}
    if entry.flags is not None:
        flags = entry.flags
        out["stage flag asserts"] = lambda: (torch._assert_async(flags[0], "a"), torch._assert_async(flags[1], "b"))
    return out


def main() -> int:
    stub_launches()
    torch.set_num_threads(1)
    print(f"moekit at {os.path.dirname(moekit.__file__)}; hash checks asserted "
          f"{'in the kernel' if IN_KERNEL else 'by two torch._assert_async'} (host µs a call, launches stubbed)")
    layers = build()
    with torch.no_grad():
        for m in (1, 8):
            fns = {name: switched(fn, name != "hash full") for name, fn in cells(layers, m).items()}
            us = per_call_us(fns)
            staged = sum(v for k, v in us.items() if k.startswith("stage"))
            us["stage checks (the rest)"] = us["hash fast"] - staged
            print(f"M={m} | " + " | ".join(f"{k} {v:.1f}" for k, v in us.items()), flush=True)
    layer_fast.ENABLED = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
