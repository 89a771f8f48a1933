"""The CPU branch's small moves and switches at M = 1, each alone (``offload_step_anatomy.py``'s first part):
what the branch's "stage", "wait" and "back" phases and its call cost are made of on this host.

Each step repeated (medians, host microseconds):

    touched          the layer's one sync: a histogram of the ids on the device, its counts read (``.tolist()``)
    touched+staged   the same counts and the branch's [x, ids, weights] in one device -> host copy into a
                     pinned buffer, one event waited for: the fold of the staging into the touched set's copy
    stage / wait     ``staging.to_host`` of [x, ids, weights] (reused pinned buffers), then its event waited for
    back             ``staging.to_device`` of a [1, K] result (reused pinned buffer, asynchronous)
    threads          ``cpu_path.torch_threads(t)`` entered and left with nothing inside (a team-size switch)
    threads+op       the same around one small CPU add (the team used once at the new size)
    direct empty     ``cpu_direct.experts_direct`` with no CPU expert (its host work without the GEMMs)
    stage views      the candidate: one D2H copy per tensor straight into typed pinned views kept from the
                     last forward of the same shapes, one reused event (no cat, no views made per forward)
    wait views       its event waited for
    back view        the candidate's back: the result into a kept typed pinned view, one copy, a reused event
    team asleep op   a parallel CPU op (an add over 1M float32) at ``threads`` after 2 ms of host idle (the
                     OpenMP team's workers asleep: what waking them costs the branch's first GEMM)
    team awake op    the same op again at once (the workers still spinning)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from moekit.offload import staging
from moekit.offload.cpu_direct import experts_direct
from moekit.offload.cpu_path import torch_threads

PARTS = ("touched", "touched+staged", "stage", "wait", "back", "threads", "threads+op", "direct empty",
         "stage views", "wait views", "back view", "team asleep op", "team awake op")


@dataclass
class Setup:
    """The moved tensors, at M = 1, and the buffers and events each way of staging keeps."""

    x: torch.Tensor  # [1, K] device
    ids: torch.Tensor  # [1, k] int32 device
    weights: torch.Tensor  # [1, k] float32 device
    y: torch.Tensor  # [1, K] host: a branch's result
    pin: bool
    bufs: staging.Buffers
    fold: staging.Buffers
    kept: list[torch.Tensor]  # typed pinned tensors shaped as x, ids, weights (the candidate's)
    back_view: torch.Tensor  # typed pinned, shaped as y
    events: list  # the candidate's two reused CUDA events (None on the CPU)
    big: torch.Tensor  # [1M] float32 host: above the parallel grain


def staging_parts(shell, device, threads: int | None, repeats: int = 200) -> dict[str, float]:
    """{part: median host microseconds} (module docstring) at M = 1 with ``shell``'s widths and host weights."""
    c, pin = shell.config, device.type == "cuda"
    x = torch.randn(1, c.hidden_size, device=device, dtype=shell.w13.dtype)
    ids = torch.randperm(c.num_experts, device=device)[: c.top_k].to(torch.int32).view(1, -1)
    weights = torch.full((1, c.top_k), 1.0 / c.top_k, device=device)
    y = torch.randn(1, c.hidden_size, dtype=shell.w13.dtype)
    s = Setup(x, ids, weights, y, pin, staging.Buffers(pin=pin), staging.Buffers(pin=pin),
              [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in (x, ids, weights)],
              torch.empty(y.shape, dtype=y.dtype, pin_memory=pin),
              [torch.cuda.Event() if pin else None for _ in range(2)], torch.zeros(1 << 20))
    got: dict[str, list[float]] = {p: [] for p in PARTS}
    for _ in range(repeats):
        for part in (_touched, _current, _host_work, _candidate, _team):
            _sync(device)
            part(s, shell, device, threads, got)
    return {p: statistics.median(v) * 1e6 for p, v in got.items()}


def _touched(s: Setup, shell, device, threads, got) -> None:
    bins = shell.config.num_experts + 2
    t = time.perf_counter()
    counts = torch.histc(s.ids.float(), bins=bins, min=-1.5, max=bins - 1.5)  # [bins]
    counts.tolist()
    got["touched"].append(time.perf_counter() - t)
    _sync(device)
    t = time.perf_counter()
    counts = torch.histc(s.ids.float(), bins=bins, min=-1.5, max=bins - 1.5)
    views, event = staging.to_host([counts, s.x, s.ids, s.weights], pin=s.pin, buffers=s.fold)
    if event is not None:
        event.synchronize()
    views[0].tolist()
    got["touched+staged"].append(time.perf_counter() - t)


def _current(s: Setup, shell, device, threads, got) -> None:
    t = time.perf_counter()
    views, event = staging.to_host([s.x, s.ids, s.weights], pin=s.pin, buffers=s.bufs)
    t1 = time.perf_counter()
    if event is not None:
        event.synchronize()
    t2 = time.perf_counter()
    staging.to_device(s.y, device, pin=s.pin, buffers=s.bufs)
    t3 = time.perf_counter()
    got["stage"].append(t1 - t)
    got["wait"].append(t2 - t1)
    got["back"].append(t3 - t2)


def _host_work(s: Setup, shell, device, threads, got) -> None:
    t = time.perf_counter()
    with torch_threads(threads):
        pass
    t1 = time.perf_counter()
    with torch_threads(threads):
        s.y.add_(0)
    t2 = time.perf_counter()
    experts_direct(s.kept[0], shell.w13, shell.w2, s.kept[1], s.kept[2], [], activation=shell.config.activation)
    t3 = time.perf_counter()
    got["threads"].append(t1 - t)
    got["threads+op"].append(t2 - t1)
    got["direct empty"].append(t3 - t2)


def _candidate(s: Setup, shell, device, threads, got) -> None:
    stage_event, back_event = s.events
    t = time.perf_counter()
    for dst, src in zip(s.kept, (s.x, s.ids, s.weights)):
        dst.copy_(src, non_blocking=s.pin)
    if stage_event is not None:
        stage_event.record()
    t1 = time.perf_counter()
    if stage_event is not None:
        stage_event.synchronize()
    t2 = time.perf_counter()
    s.back_view.copy_(s.y)
    s.back_view.to(device, non_blocking=s.pin)
    if back_event is not None:
        back_event.record()
    t3 = time.perf_counter()
    got["stage views"].append(t1 - t)
    got["wait views"].append(t2 - t1)
    got["back view"].append(t3 - t2)


def _team(s: Setup, shell, device, threads, got) -> None:
    with torch_threads(threads):
        time.sleep(0.002)
        t = time.perf_counter()
        s.big.add_(1.0)
        t1 = time.perf_counter()
        s.big.add_(1.0)
        t2 = time.perf_counter()
    got["team asleep op"].append(t1 - t)
    got["team awake op"].append(t2 - t1)


def staging_line(parts: dict[str, float]) -> str:
    return "staging parts, host us (median): " + ", ".join(f"{p} {v:.1f}" for p, v in parts.items())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
