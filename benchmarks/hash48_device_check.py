"""hash48: DeepSeek-V4's hash layers on the GPU, resident, offloaded and expert-parallel (one rank). No kernel changed.

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/hash48_device_check.py --out $OUT/hash48 --deadline 70   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/hash48_device_check.py --smoke     # CPU: tiny shapes, the cache's "GPU" the CPU

Phases (each skipped past the deadline; <out>/hash48.json rewritten after each):
  correct   float32 on the device against a float64 reference written here (the table's experts per token, weighted
            by sqrt(softplus) scores / their sum x the scale, + the shared MLP; rel-L2 < 1e-5): a resident
            ``HashMoE``; ``OffloadedMoE.from_moe`` of it (an ``OffloadedHashMoE``) with every expert cached, with 3
            slots (rounds), misses on the CPU; a linked hash -> hash -> top-k chain (prefetch="router": the second
            hash layer's experts prefetched exactly, checked by the cache's contents) against the plain chain; an
            ``EPHashMoE`` on a one-rank NCCL group (gloo in the smoke) against the ``HashMoE``.
  time      host and wall µs a call (``bench_run.host_and_wall_us``: 7 interleaved rounds, medians) at M = 1 and 32,
            bf16, E 64, K 2048, N 1024, k 6, V 129280: the resident ``HashMoE`` vs the resident top-k ``MoE`` of the
            same experts (sqrtsoftplus, correction bias), and both offloaded with every expert cached (all hits, no
            prefetch). At hash48's commit both layers took the full forward: the fused router did not compute V4's
            sqrtsoftplus, so the top-k layer routed with ``route`` in torch and its decode fast path never kept it;
            the hash layer routes in torch by design. Hash vs top-k was torch vs torch routing; since v4r48 the top-k
            layer takes the fused router and its fast path (``benchmarks/v4r48_device_check.py``).
The table is printed last: medians, hash / top-k.
"""

from __future__ import annotations

import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases, warm_then_time  # noqa: E402

from moekit import HashMoE, MoE, MoEConfig  # noqa: E402
from moekit.offload import ExpertCache, OffloadedMoE, link_layers  # noqa: E402

SMOKE = "--smoke" in sys.argv
ROUNDS = 2 if SMOKE else 7
E, K, N, TOP_K, V = (8, 32, 16, 2, 50) if SMOKE else (64, 2048, 1024, 6, 129280)
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, scoring="sqrtsoftplus",
                   routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=N)
RUN = RunLog("hash48: DeepSeek-V4's hash layers on the GPU (µs a call, medians of interleaved rounds)", stall_s=60)
RESULT: dict = {"run": {}, "failed": RUN.failed}
NEEDS_S = {"time": 20}


def hash_layer(seed: int, dev, dtype=torch.float32, **kwargs) -> HashMoE:
    torch.manual_seed(seed)
    moe = HashMoE(CONFIG, dtype=dtype, device=dev, **kwargs).eval()
    table = torch.randint(0, E, (V, TOP_K), generator=torch.Generator().manual_seed(seed + 100))
    return moe.load_table_(table.to(dev))


def reference(moe: HashMoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """x [M, K], ids [M] -> [M, K] float64: per token its table row's experts, weighted by sqrt(softplus(x @ W^T)) at
    them / their sum + 1e-20 x the scale, plus the shared MLP (moe built fuse_shared=False)."""
    xd = x.double()
    rows = moe.tid2eid[ids]  # [M, k]
    s = torch.nn.functional.softplus(xd @ moe.gate.weight.double().T).sqrt().gather(1, rows)  # [M, k]
    w = s / (s.sum(-1, keepdim=True) + 1e-20) * CONFIG.routed_scaling_factor  # [M, k]

    def mlp(w13, w2, v):  # w13 [.., 2n, K], w2 [.., K, n], v [.., K]
        h = (w13.double() @ v.unsqueeze(-1)).squeeze(-1)  # [.., 2n]
        g, u = h.chunk(2, dim=-1)
        return (w2.double() @ (torch.nn.functional.silu(g) * u).unsqueeze(-1)).squeeze(-1)  # [.., K]

    out = mlp(moe.shared_w13, moe.shared_w2, xd)  # [M, K]
    for j in range(TOP_K):  # a slot at a time: [M, 2N, K] of weights gathered, not [M, k, 2N, K]
        out = out + w[:, j:j + 1] * mlp(moe.w13[rows[:, j]], moe.w2[rows[:, j]], xd)
    return out


def correct_phase(dev) -> None:
    res = RESULT["correct"] = {}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, K, generator=g).to(dev)
    ids = torch.randint(0, V, (13,), generator=g).to(dev)
    moe = hash_layer(0, dev, fuse_shared=False)
    want = reference(moe, x, ids)
    cells = {"resident HashMoE": moe}
    for name, slots, place in (("offloaded, all cached", E, "gpu"), ("offloaded, 3 slots", 3, "gpu"),
                               ("offloaded, misses on the CPU", 3, "cpu")):
        cells[name] = OffloadedMoE.from_moe(moe, cache_experts=slots, compute_misses_on=place, prefetch=None,
                                            device=dev)
    with torch.no_grad():
        for name, layer in cells.items():
            err = res[name] = rel_l2(layer(x, token_ids=ids), want)
            RUN.check(f"{name} vs float64", err < 1e-5, f"rel_l2={err:.2e} ({type(layer).__name__})")
    chain_phase(dev, x, ids, res)
    ep_phase(dev, moe, x, ids, res)


def chain_phase(dev, x, ids, res) -> None:
    plain = [hash_layer(0, dev), hash_layer(1, dev), MoE(CONFIG.replace(hash_table_size=None), device=dev).eval()]
    cache = ExpertCache(3 * E, device=dev, policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="router") for m in plain]
    link_layers(layers)
    with torch.no_grad():
        h = layers[0](x, token_ids=ids)
        exact = set(cache.cached(layers[1].layer_id)) == set(plain[1].tid2eid[ids].reshape(-1).tolist())
        got = layers[2](layers[1](h, token_ids=ids))
        want = plain[2](plain[1](plain[0](x, token_ids=ids), token_ids=ids))
    res["chain"] = rel_l2(got, want)
    RUN.check("hash -> hash prefetch: the next table's rows exactly", exact)
    RUN.check("hash -> hash -> top-k offloaded chain vs plain", res["chain"] < 1e-5, f"rel_l2={res['chain']:.2e}")


def ep_phase(dev, moe, x, ids, res) -> None:
    import torch.distributed as dist

    from moekit.parallel import EPMoE

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29548")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        ep = EPMoE.from_moe(moe)
        with torch.no_grad():
            res["ep one rank"] = rel_l2(ep(x, token_ids=ids), moe(x, token_ids=ids))
        RUN.check("EPHashMoE, one rank, vs HashMoE", type(ep).__name__ == "EPHashMoE" and res["ep one rank"] < 1e-6,
                  f"rel_l2={res['ep one rank']:.2e}")
    finally:
        dist.destroy_process_group()


def time_phase(dev) -> None:
    top_k_config = CONFIG.replace(hash_table_size=None, use_correction_bias=True)
    res = RESULT["time_us"] = {}
    for m in (1, 32):
        torch.manual_seed(0)
        hashed = hash_layer(0, dev, torch.bfloat16)
        top_k = MoE(top_k_config, dtype=torch.bfloat16, device=dev).eval()
        x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
        ids = torch.randint(0, V, (m,), device=dev)
        off_hash = OffloadedMoE.from_moe(hashed, cache_experts=E, prefetch=None)
        off_top = OffloadedMoE.from_moe(top_k, cache_experts=E, prefetch=None)
        fns = {"hash": lambda: hashed(x, token_ids=ids), "top-k": lambda: top_k(x),
               "offloaded hash": lambda: off_hash(x, token_ids=ids), "offloaded top-k": lambda: off_top(x)}
        res[m], med = warm_then_time(RUN, f"timing M={m}", fns, dev, 5 if SMOKE else 30, ROUNDS)  # the cache fills
        for kind in ("", "offloaded "):
            a, b = med[f"{kind}hash"], med[f"{kind}top-k"]
            RUN.summary.append(f"| {kind or 'resident '}M={m} | {a[0]:.1f} / {b[0]:.1f} ({a[0] / b[0]:.2f}x) | "
                               f"{a[1]:.1f} / {b[1]:.1f} ({a[1] / b[1]:.2f}x) |")


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    phases = {"correct": lambda: correct_phase(dev), "time": lambda: time_phase(dev)}
    args = phase_args(__doc__, phases, "hash48.json")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    RESULT["run"] = {**run_info(), "smoke": SMOKE, "shape": [E, K, N, TOP_K, V], "phases": args.phases}
    RUN.summary.append("| cell | host µs hash / top-k | wall µs hash / top-k |\n|---|---|---|")
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
