"""``offload_cal_device_check.py``'s passes before its table: the CPU branch against its model (``cpu_check``),
every mode's output against the float32 oracle at the run's shapes (``exactness``), and the CPU branch taken
apart (``anatomy``).

``exactness``: one ``OffloadedMoE`` per mode (gpu / cpu / auto, a cache of half the experts, the run's costs)
over a few random routings at each M, against ``experts_reference`` in float32 on the device from the
same host weights: PASS when the relative L2 error is below bf16's 1e-2.

``anatomy``: where a CPU branch's time goes at the calibrated thread count and GEMM, on cold experts with 1
row each (a decode layer's misses): the whole branch (``CpuPhases``: stage, wait, compute, back), and
inside its compute the plain GEMMs alone (``x @ w13[e]^T``, the gated activation, ``@ w2[e]^T`` per expert,
torch ops on the same host weights, no layout or combine), at the branch's thread count and at 1 thread.
compute - gemms is what moekit's CPU call adds around the GEMMs; gemms at t threads over gemms at 1 thread
is what the thread team buys on the weights' read.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from moekit.experts.reference import experts_reference
from moekit.offload import CpuOptions, OffloadedMoE
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CPU_GEMMS, torch_threads
from moekit.routing import Routing

BF16_TOLERANCE = 1e-2
GAP_S = 0.005  # ``cpu_check``'s idle host time before a branch: about a decode layer's GPU-path host work


def cpu_check(shell, costs, device, repeats: int = 4, gap_s: float = GAP_S) -> list[dict]:
    """The CPU branch against its calibrated model by link state, experts per call (1 row each), thread
    count (torch's and the calibration's) and the host's idle time before it (none, or ``gap_s`` asleep:
    a decode step's branch follows the host's GPU-path work, the probe and the calibration follow
    branches), on cold experts, the settings interleaved in each repeat: is the model's shape right at a
    decode layer's few experts, does a busy link slow the CPU, does an idle host wake slowly? Where the
    calibration's count is not torch's, it is also run with torch's count set to it throughout: does
    switching the thread team's size at every branch (``cpu_path.torch_threads``) stall it?"""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    k, gemm = max(layer.config.top_k, 2), costs.cpu_gemm or CPU_GEMMS[0]
    threads = sorted({torch.get_num_threads(), costs.cpu_threads or torch.get_num_threads()}, reverse=True)
    groups, got, torch_count = cold_groups(layer.config.num_experts, k, 1000), {}, torch.get_num_threads()
    settings = [(t, False) for t in threads] + [(t, True) for t in threads if t != torch_count]
    for _ in range(repeats):
        for t, fixed in settings:  # fixed: torch's count set to t throughout, so the branch switches no team size
            torch.set_num_threads(t if fixed else torch_count)
            for n in (1, 2, 4, 8):
                for busy in (False, True):
                    for gap in (0.0, gap_s):
                        time.sleep(gap)
                        total = branch(layer, next(groups), n, 1, t, gemm, busy=busy)
                        p = layer.last_cpu
                        got.setdefault((t, fixed, n, busy, gap), []).append(
                            (total, p.compute_s, p.wait_s + p.stage_s + p.back_s))
            torch.set_num_threads(torch_count)
    return [{"threads": t, "fixed": fixed, "experts": n, "busy": busy, "gap_ms": gap * 1e3,
             "ms": statistics.median(x for x, _, _ in v) * 1e3,
             "max_ms": max(x for x, _, _ in v) * 1e3, "compute_ms": statistics.median(c for _, c, _ in v) * 1e3,
             "copies_ms": statistics.median(w for _, _, w in v) * 1e3, "model_ms": costs.cpu_side_s([1] * n) * 1e3}
            for (t, fixed, n, busy, gap), v in sorted(got.items())]


def exactness(shell, costs, device, batches: tuple[int, ...], modes: tuple[str, ...], seeds: int = 3) -> list[dict]:
    """Per (mode, M): the largest relative L2 error of the offloaded layer's output over ``seeds`` forwards."""
    c = shell.config
    w13, w2 = shell.w13.to(device), shell.w2.to(device)  # [E, 2N, K], [E, K, N] in the host's dtype
    out = []
    for mode in modes:
        layer = OffloadedMoE.from_moe(shell, cache_experts=c.num_experts // 2, prefetch=None, compute_misses_on=mode,
                                      costs=costs, device=device, cpu_options=CpuOptions())
        for m in batches:
            worst = 0.0
            for seed in range(seeds):
                g = torch.Generator(device="cpu").manual_seed(1000 * m + seed)
                ids = torch.rand(m, c.num_experts, generator=g).topk(c.top_k, dim=1).indices.to(torch.int32)  # [M, k]
                weights = torch.rand(m, c.top_k, generator=g).softmax(dim=1)  # [M, k] float32
                x = torch.randn(m, c.hidden_size, generator=g).to(device, w13.dtype)  # [M, K]
                routing = Routing(ids.to(device), weights.to(device))
                with torch.no_grad():
                    got = layer.run_routed(x, routing).float()
                    want = experts_reference(x.float(), w13, w2, routing.topk_ids, routing.topk_weights,
                                             activation=c.activation)
                worst = max(worst, ((got - want).norm() / want.norm()).item())
            out.append({"mode": mode, "M": m, "rel_l2": worst, "pass": worst < BF16_TOLERANCE,
                        "cpu_experts": layer.cache.stats.cpu_experts})
        del layer
    del w13, w2
    return out


def anatomy(shell, costs, device, counts: tuple[int, ...] = (1, 4, 8), repeats: int = 6) -> list[dict]:
    """Per experts count (1 row each): medians over ``repeats`` of the branch's phases on cold experts, its
    compute again on the same (now warm) experts, its compute with each other CPU GEMM (cold), and the plain
    GEMMs at the branch's threads (cold, then warm) and at 1 thread (cold), in ms."""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    threads, gemm = costs.cpu_threads or torch.get_num_threads(), costs.cpu_gemm or CPU_GEMMS[0]
    others = [g for g in CPU_GEMMS if g != gemm]
    host = layer.cache.host(layer.layer_id)
    w13, w2 = host.rebuild(host.parts)[:2]  # host [E, 2N, K], [E, K, N]
    groups = cold_groups(layer.config.num_experts, max(counts), 3000)
    got: dict[int, list[tuple[float, ...]]] = {}
    for _ in range(repeats):
        for n in counts:
            group = next(groups)
            branch(layer, group, n, 1, threads, gemm, busy=False)
            p = layer.last_cpu
            branch(layer, group, n, 1, threads, gemm, busy=False)
            warm = layer.last_cpu.compute_s
            other = []
            for g in others:
                branch(layer, next(groups), n, 1, threads, g, busy=False)
                other.append(layer.last_cpu.compute_s)
            x = torch.randn(1, layer.config.hidden_size, dtype=w13.dtype)  # [1, K]
            plain, one = next(groups)[:n], next(groups)[:n]
            times = [_gemms(x, w13, w2, plain, threads), _gemms(x, w13, w2, plain, threads), _gemms(x, w13, w2, one, 1)]
            got.setdefault(n, []).append((p.total_s, p.stage_s, p.wait_s, p.compute_s, p.back_s, warm, *times, *other))
    names = ("total", "stage", "wait", "compute", "back", "compute_warm", "gemms", "gemms_warm", "gemms_1t",
             *(f"compute_{g}" for g in others))
    return [{"experts": n, "threads": threads, "gemm": gemm, "others": others,
             **{f"{name}_ms": statistics.median(v[i] for v in got[n]) * 1e3 for i, name in enumerate(names)}}
            for n in counts]


def _gemms(x, w13, w2, experts: list[int], threads: int) -> float:
    """Host seconds of the experts' plain GEMMs and gated SiLU for one row x [1, K], at ``threads``."""
    n_dim = w2.shape[2]
    with torch_threads(threads), torch.no_grad():
        start = time.perf_counter()
        for e in experts:
            h = x @ w13[e].t()  # [1, 2N]
            a = torch.nn.functional.silu(h[:, :n_dim]) * h[:, n_dim:]  # [1, N]
            a @ w2[e].t()  # [1, K]
        return time.perf_counter() - start


def passes(shell, costs, device, batches: tuple[int, ...], modes: tuple[str, ...], repeats: int) -> dict:
    """Both passes, printed as they end: {"exact": ``exactness``'s rows, "anatomy": ``anatomy``'s}."""
    out = {"exact": exactness(shell, costs, device, batches, modes)}
    out["anatomy"] = anatomy(shell, costs, device, repeats=repeats)
    print_passes(out["exact"], out["anatomy"])
    sys.stdout.flush()
    return out


def print_passes(exact: list[dict], parts: list[dict]) -> None:
    for r in exact:
        print(f"exact {r['mode']:>4} M={r['M']:<3} rel_l2 {r['rel_l2']:.2e} (cpu experts so far {r['cpu_experts']}) "
              f"{'PASS' if r['pass'] else 'FAIL'}")
    if parts:
        print(f"CPU branch anatomy (1 row an expert, cold, idle link; ms medians) at {parts[0]['threads']} threads, "
              f"{parts[0]['gemm']}: total = stage + wait + compute + back; compute warm (same experts again), with "
              f"{' / '.join(parts[0]['others'])}; gemms: the plain GEMMs alone (cold / warm / 1 thread cold)")
    for r in parts:
        print(f"  n{r['experts']}: total {r['total_ms']:.3f} = {r['stage_ms']:.3f} + {r['wait_ms']:.3f} + "
              f"{r['compute_ms']:.3f} + {r['back_ms']:.3f}; compute warm {r['compute_warm_ms']:.3f}, others "
              + " / ".join(f"{r[f'compute_{g}_ms']:.3f}" for g in r["others"])
              + f"; gemms {r['gemms_ms']:.3f} / {r['gemms_warm_ms']:.3f} / {r['gemms_1t_ms']:.3f}; "
              f"compute - gemms {r['compute_ms'] - r['gemms_ms']:.3f}")


def main(argv: list[str]) -> int:
    """``--host E T``: the anatomy alone on this machine's CPU (both "devices" the CPU), Qwen3-30B-A3B expert
    widths in bf16 with E experts (0.3 GB of weights at 32), the branch at T threads, each CPU GEMM kept in turn."""
    from moekit.bench.offload_hosts import host_shell
    from moekit.config import MoEConfig
    from moekit.offload import MissCosts

    if "--host" not in argv or len(argv) < argv.index("--host") + 3:
        raise SystemExit("usage: offload_cpu_anatomy.py --host EXPERTS THREADS")
    experts, threads = (int(v) for v in argv[argv.index("--host") + 1:argv.index("--host") + 3])
    config = MoEConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=experts, top_k=8)
    shell = host_shell(config, torch.bfloat16, torch.device("cpu"))
    for gemm in CPU_GEMMS:
        costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_threads=threads, cpu_gemm=gemm)
        print_passes([], anatomy(shell, costs, torch.device("cpu"), repeats=8))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
