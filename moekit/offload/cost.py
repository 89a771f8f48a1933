"""Where a missed expert is cheaper: copied over the host link to the GPU, or computed on the CPU.

A miss fetched costs its weight bytes over the link (``link_bytes_per_s``); a miss computed on the
CPU costs its tokens' FLOPs (6·N·K per assignment) at the CPU's expert rate (``cpu_flops``). The two
run side by side (the CPU computes while the GPU fetches and computes), so a batch's misses take
about max(fetch time, CPU time). ``split_misses`` picks the assignment with the smallest predicted
max among all-fetch, all-CPU and a greedy mix. Both rates are measured on this machine
(``measure_link_bandwidth``, ``measure_cpu_flops``) or passed in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MissCosts:
    """The two rates the split decides by."""

    link_bytes_per_s: float  # host -> GPU copy rate from pinned memory, large copies
    cpu_flops: float  # FLOP/s of the CPU experts path at decode-sized groups


@dataclass(frozen=True)
class MissSplit:
    """Which missed experts go where, and the predicted time of each side."""

    fetch: list[int]  # experts copied to the GPU
    cpu: list[int]  # experts computed on the CPU
    fetch_s: float  # predicted link time of ``fetch``
    cpu_s: float  # predicted CPU time of ``cpu``


def split_misses(tokens: dict[int, int], expert_bytes: int, flops_per_token: float, costs: MissCosts) -> MissSplit:
    """Assign each missed expert (``tokens``: expert -> its routed assignments) to the link or the CPU.

    Greedy over experts by token count, largest first: each goes where the running max of the two
    sides grows least. The result is compared with all-fetch and all-CPU and the smallest predicted
    max(fetch_s, cpu_s) is returned, so the mix is never predicted slower than either pure choice.
    """
    fetch_one = expert_bytes / costs.link_bytes_per_s
    cpu_time = {e: t * flops_per_token / costs.cpu_flops for e, t in tokens.items()}
    fetch, cpu, t_fetch, t_cpu = [], [], 0.0, 0.0
    for e in sorted(tokens, key=lambda e: (-tokens[e], e)):
        if max(t_fetch + fetch_one, t_cpu) <= max(t_fetch, t_cpu + cpu_time[e]):
            fetch.append(e)
            t_fetch += fetch_one
        else:
            cpu.append(e)
            t_cpu += cpu_time[e]
    options = [
        MissSplit(sorted(fetch), sorted(cpu), t_fetch, t_cpu),
        MissSplit(sorted(tokens), [], fetch_one * len(tokens), 0.0),
        MissSplit([], sorted(tokens), 0.0, sum(cpu_time.values())),
    ]
    return min(options, key=lambda s: max(s.fetch_s, s.cpu_s))


def measure_link_bandwidth(device: torch.device | str, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Host -> ``device`` bytes/s from pinned memory, the best of ``repeats`` copies of ``nbytes``."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_cpu_flops(n_dim: int, k_dim: int, dtype: torch.dtype, tokens: int = 8, repeats: int = 5) -> float:
    """FLOP/s of one expert's MLP on the CPU for ``tokens`` rows (gate-up, act, down), best of ``repeats``."""
    x = torch.randn(tokens, k_dim, dtype=dtype)
    w13 = torch.randn(2 * n_dim, k_dim, dtype=dtype)
    w2 = torch.randn(k_dim, n_dim, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        h = x @ w13.t()
        _ = (torch.nn.functional.silu(h[:, :n_dim]) * h[:, n_dim:]) @ w2.t()
        best = min(best, time.perf_counter() - start)
    return 6 * n_dim * k_dim * tokens / best
