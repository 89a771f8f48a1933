"""Where a missed expert is cheaper: copied over the host link to the GPU, or computed on the CPU.

A miss fetched costs its weight bytes over the link (``link_bytes_per_s``); a miss computed on the
CPU costs a fixed time per expert (streaming its weights from host memory once) plus a time per
routed token (its 6·N·K FLOPs): ``cpu_expert_s + tokens · cpu_token_s``, fitted from two timings
(``measure_cpu_costs``; for quantized experts the bytes are the packed ones and the CPU time includes
dequantizing them). The two sides run at once (the CPU computes while the GPU fetches and
computes), so a batch's misses take about max(fetch time, CPU time). ``split_misses`` picks the
assignment with the smallest predicted max among all-fetch, all-CPU and a greedy mix. The rates are
measured on this machine or passed in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moekit.quant import quantize


@dataclass(frozen=True)
class MissCosts:
    """The two rates the split decides by."""

    link_bytes_per_s: float  # host -> GPU copy rate from pinned memory, large copies
    cpu_expert_s: float  # CPU seconds per expert computed, whatever its tokens (its weights read once)
    cpu_token_s: float  # CPU seconds per routed token of an expert, on top

    def cpu_time(self, tokens: int) -> float:
        return self.cpu_expert_s + tokens * self.cpu_token_s


@dataclass(frozen=True)
class MissSplit:
    """Which missed experts go where, and the predicted time of each side."""

    fetch: list[int]  # experts copied to the GPU
    cpu: list[int]  # experts computed on the CPU
    fetch_s: float  # predicted link time of ``fetch``
    cpu_s: float  # predicted CPU time of ``cpu``


def split_misses(tokens: dict[int, int], expert_bytes: int, costs: MissCosts) -> MissSplit:
    """Assign each missed expert (``tokens``: expert -> its routed assignments) to the link or the CPU.

    Greedy over experts by token count, largest first: each goes where the running max of the two
    sides grows least. The result is compared with all-fetch and all-CPU and the smallest predicted
    max(fetch_s, cpu_s) is returned, so the mix is never predicted slower than either pure choice.
    """
    fetch_one = expert_bytes / costs.link_bytes_per_s
    cpu_time = {e: costs.cpu_time(t) for e, t in tokens.items()}
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


def measure_cpu_costs(n_dim: int, k_dim: int, dtype: torch.dtype, repeats: int = 5,
                      scheme: str | None = None) -> tuple[float, float]:
    """(seconds per expert, seconds per token) of one expert's MLP on the CPU, fitted from the best of
    ``repeats`` timings at 1 and 33 tokens (time = per_expert + tokens · per_token). With a
    ``moekit.quant`` ``scheme`` the timing includes dequantizing the expert's packed weights to ``dtype``
    first, as the CPU path does for a quantized miss."""
    w13 = torch.randn(1, 2 * n_dim, k_dim, dtype=dtype)
    w2 = torch.randn(1, k_dim, n_dim, dtype=dtype)
    packed = None if scheme is None else (quantize(w13, scheme), quantize(w2, scheme))

    def best(tokens: int) -> float:
        x = torch.randn(tokens, k_dim, dtype=dtype)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            a, b = (w13, w2) if packed is None else (packed[0].dequantize(dtype), packed[1].dequantize(dtype))
            h = x @ a[0].t()
            _ = (torch.nn.functional.silu(h[:, :n_dim]) * h[:, n_dim:]) @ b[0].t()
            times.append(time.perf_counter() - start)
        return min(times)

    one, many = best(1), best(33)
    per_token = max(many - one, 0.0) / 32
    return max(one - per_token, 0.0), per_token
