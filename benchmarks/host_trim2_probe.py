"""Where the host time of one eager experts call goes, step by step (``host_mid_device_check``'s
probe; written for ``f6f35e93:benchmarks/host_trim2_device_check.py``).

A kept call (``triton_fast``'s entry: its ``LaunchSequence``) is launched the way ``triton_lean.launch_lean``
does it, with a clock read between steps: the output's allocation, h and y's byte buffer (above the pool's
size), the stream and the call's addresses, then each launch (named by its kernel), then the buffer's free.
Three ways: ``idle`` (a sync before each call), ``busy`` (a ~2 ms sleep kernel queued before each call: the
launches queue behind work), ``stream`` (calls back to back after one sync, as an eager model runs; the first
call left out). Each with the call's tensors handed over as addresses and as tensors (``PASS_ADDRESSES``).
Controls, idle: ``torch.empty_like(x)``, the h and y buffer's ``torch.empty`` (and its free), a raw launch of
the first step with tensors against addresses. The probe's output must equal the real call's bit for bit.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

from moekit.experts import triton_fast, triton_lean
from moekit.experts.triton_plan import plan_launches
from moekit.triton_bind import current_stream

SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's clock: longer than any call's host time


def kept_entry(x, w13, w2, ids, weights):
    """The fast path's entry of this call (the public call's default options), or None."""
    from moekit.experts.triton import _DEFAULT_OPTIONS

    return triton_fast._MEMO.get(triton_fast._key(x, w13, w2, ids, weights, "silu", _DEFAULT_OPTIONS))


def step_names(entry) -> list[str]:
    """The kernel of each launch of the entry's sequence, in order (the plan's launches as the lean path takes
    them: with the pool's counters wherever the plan keeps some)."""
    plan = entry.plan
    counters = object() if plan.workspace.counters else None
    launches = plan_launches(plan, defaultdict(lambda: None), None, None, None, None, None, None, None, None, None,
                             None, counters)
    return [launch.kernel.fn.__name__ for launch, _ in launches]


def timed_call(sequence, x, ids, weights, w13, w2, addresses: bool) -> tuple[torch.Tensor, list[float]]:
    """``launch_lean`` with a clock read after each step: (out, [µs of each step])."""
    clock = time.perf_counter
    t = [clock()]
    out = torch.empty_like(x)
    t.append(clock())
    buffer = h = y = None
    if sequence.large is not None:
        buffer = torch.empty(sequence.large.nbytes, dtype=torch.uint8, device=x.device)
        h, y = triton_lean._large_regions(sequence.large, buffer, sequence.raw)
    t.append(clock())
    values = [x, ids, weights, out, None, None, None, w13, w2, h, y]
    stream = current_stream() if sequence.raw else 0
    if addresses and sequence.addressed is not None:
        for index in sequence.addressed:
            value = values[index]
            if value is not None and value.__class__ is not int:
                values[index] = value.data_ptr()
    t.append(clock())
    for entry, template, slots, raw in sequence.steps:
        args = template.copy()
        for position, index in slots:
            args[position] = values[index]
        if raw:
            args[3] = stream
        entry(*args)
        t.append(clock())
    del buffer
    t.append(clock())
    return out, [(b - a) * 1e6 for a, b in zip(t, t[1:])]


def _medians(rows: list[list[float]], names: list[str]) -> dict:
    return {name: round(statistics.median(col), 2) for name, col in zip(names, zip(*rows))}


def probe(args: tuple, want: torch.Tensor, device: torch.device, reps: int = 15, stream_calls: int = 12) -> dict:
    """Per-step host µs (medians) of the kept call of ``args`` (x, w13, w2, ids, weights), each way; ``want``:
    the real call's output (the probe's must equal it)."""
    x, w13, w2, ids, weights = args
    entry = kept_entry(*args)
    if entry is None:
        return {"error": "no kept entry for this call (the fast path did not keep it)"}
    sequence = entry.sequence
    names = ["alloc_out", "alloc_h_y", "stream_addresses"] + step_names(entry) + ["free_h_y"]
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    result = {"steps": names, "raw": sequence.raw, "all_raw": sequence.addressed is not None,
              "large_bytes": None if sequence.large is None else sequence.large.nbytes}
    for addresses in (True, False):
        tag = "addr" if addresses else "tensor"
        out, _ = timed_call(sequence, x, ids, weights, w13, w2, addresses)
        sync()
        result[f"same_{tag}"] = torch.equal(out, want)
        for way in ("idle", "busy"):
            rows = []
            for _ in range(reps):
                sync()
                if way == "busy" and cuda:
                    torch.cuda._sleep(SLEEP_CYCLES)
                rows.append(timed_call(sequence, x, ids, weights, w13, w2, addresses)[1])
            result[f"{way}_{tag}"] = _medians(rows, names)
        sync()
        rows = [timed_call(sequence, x, ids, weights, w13, w2, addresses)[1] for _ in range(stream_calls)][1:]
        result[f"stream_{tag}"] = _medians(rows, names)
        sync()
    result["control_us"] = controls(x, sequence, device, reps)
    return result


def controls(x, sequence, device: torch.device, reps: int) -> dict:
    """Idle host µs of an output's allocation, of h and y's buffer (allocated and freed), and of the first
    launch handed tensors against addresses (``raw_tensor`` / ``raw_addr``)."""
    cuda = device.type == "cuda"

    def idle(fn) -> float:
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return round(statistics.median(times), 2)

    result = {"empty_like_x": idle(lambda: torch.empty_like(x))}
    if sequence.large is not None:
        result["empty_h_y"] = idle(lambda: torch.empty(sequence.large.nbytes, dtype=torch.uint8, device=device))
    entry, template, slots, raw = sequence.steps[0]
    if raw:
        for tag, value in (("raw_tensor", x), ("raw_addr", x.data_ptr())):
            args = template.copy()
            for position, index in slots:
                args[position] = value  # every call slot pointed at x: a launch of the right shape and cost
            args[3] = current_stream()
            result[tag] = idle(lambda a=args: entry(*a))
    return result
