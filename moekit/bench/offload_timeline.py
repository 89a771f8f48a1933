"""Where a traced step's time goes, layer by layer (``moekit.offload.StepTrace``'s marks), a linear fit of
step times over their fetch counts, and the host's price of each CUDA step a fetch adds (``host_op_costs``)
(``f6f35e93:benchmarks/offload_fetch_device_check.py``).

Per layer (``layer_times``), host clock: the period from the layer's "start" to the next one's (the
step's "step_end" for the last), the host's wait for the touched set ("counted" -> "touched"), the
period less that wait (the host's own work) and the next layer's wait (where this layer's GPU work
shows), its bookkeeping before the fetch ("touched" -> "copy_start:fetch"), its tail after the last call; GPU
clock: the fetch batch's copy, the lag from its issue to its start (the two clocks aligned at the
"touched" marks, where the device is idle: the host has just synchronised with it), the lag from its
last byte to the fetched call's start, each call's kernels. NaN where a layer had no such phase.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, fields

import torch

from moekit.offload.trace import Mark

NAN = math.nan


@dataclass(frozen=True)
class LayerTimes:
    """One layer's forward in a traced step, seconds (module docstring); NaN where it had no such phase."""

    fetched: int  # experts this forward fetched (its stats)
    period_s: float  # host: "start" to the next layer's "start" (the last layer: to "step_end")
    d2h_wait_s: float  # host: "counted" -> "touched" (the touched set's copy and the sync)
    host_busy_s: float  # host: the period less its own wait for the touched set (issuing, bookkeeping)
    wait_after_s: float  # host: the next layer's wait for its touched set (the last: "end" -> "step_end"),
    #                      where this layer's GPU work (its fetched call, the copy it waits for) shows
    host_before_copy_s: float  # host: "touched" -> "copy_start:fetch"
    copy_issue_s: float  # host: "copy_start:fetch" -> "copy_end:fetch" (queueing the copies)
    copy_lag_s: float  # the copy's GPU start after the host reached "copy_start:fetch"
    copy_s: float  # GPU: the fetch batch's bytes
    land_to_call_s: float  # GPU: the last byte landed -> the fetched call's first kernel
    hits_call_s: float  # GPU: the hits' call
    fetched_call_s: float  # GPU: the fetched experts' call (or the one call of hits and fetched, "mixed")
    host_tail_s: float  # host: the last "call_end" -> "end"


def _at(marks: list[Mark], name: str, gpu: bool) -> float:
    for m in marks:
        if m.name == name:
            t = m.gpu_s if gpu else m.host_s
            return NAN if t is None else t
    return NAN


def layer_times(marks: list[Mark], fetched: dict[int, int]) -> list[LayerTimes]:
    """The layers of one traced step (``marks``: ``StepTrace.read()``, with "step_end" last), in order;
    ``fetched``: layer id -> experts it fetched."""
    order = [m.layer for m in marks if m.name == "start"]
    by_layer = {layer: [m for m in marks if m.layer == layer] for layer in order}
    offsets = [_at(ms, "touched", False) - _at(ms, "touched", True) for ms in by_layer.values()]
    offsets = [o for o in offsets if not math.isnan(o)]
    offset = statistics.median(offsets) if offsets else NAN  # host clock - GPU clock
    end = _at(marks, "step_end", False)
    out = []
    for i, layer in enumerate(order):
        ms = by_layer[layer]
        nxt = _at(by_layer[order[i + 1]], "start", False) if i + 1 < len(order) else end
        host = {m.name: m.host_s for m in reversed(ms)}  # the first of each name wins
        gpu = {m.name: (NAN if m.gpu_s is None else m.gpu_s) for m in reversed(ms)}
        last_call = max((m.host_s for m in ms if m.name.startswith("call_end")), default=NAN)
        group = "fetched" if "call_start:fetched" in gpu else "mixed"  # its own call, or one with the hits
        wait = host.get("touched", NAN) - host.get("counted", NAN)
        if i + 1 < len(order):
            after = _at(by_layer[order[i + 1]], "touched", False) - _at(by_layer[order[i + 1]], "counted", False)
        else:
            after = end - host.get("end", NAN)
        out.append(LayerTimes(
            fetched=fetched.get(layer, 0), period_s=nxt - host["start"], d2h_wait_s=wait,
            host_busy_s=nxt - host["start"] - wait, wait_after_s=after,
            host_before_copy_s=host.get("copy_start:fetch", NAN) - host.get("touched", NAN),
            copy_issue_s=host.get("copy_end:fetch", NAN) - host.get("copy_start:fetch", NAN),
            copy_lag_s=gpu.get("copy_start:fetch", NAN) + offset - host.get("copy_start:fetch", NAN),
            copy_s=gpu.get("copy_end:fetch", NAN) - gpu.get("copy_start:fetch", NAN),
            land_to_call_s=gpu.get(f"call_start:{group}", NAN) - gpu.get("copy_end:fetch", NAN),
            hits_call_s=gpu.get("call_end:hits", NAN) - gpu.get("call_start:hits", NAN),
            fetched_call_s=gpu.get(f"call_end:{group}", NAN) - gpu.get(f"call_start:{group}", NAN),
            host_tail_s=host.get("end", NAN) - last_call))
    return out


def mean_times(layers: list[LayerTimes]) -> dict[str, float]:
    """Each field's mean over ``layers`` (NaNs left out; NaN when none has it), ``layers`` their count."""
    out: dict[str, float] = {"layers": float(len(layers))}
    for f in fields(LayerTimes):
        values = [getattr(t, f.name) for t in layers if not math.isnan(getattr(t, f.name))]
        out[f.name] = statistics.fmean(values) if values else NAN
    return out


@dataclass(frozen=True)
class StepFit:
    """Least-squares terms of step seconds (``fit_steps``); ``rms_s`` the residuals' root mean square."""

    names: tuple[str, ...]
    terms_s: tuple[float, ...]
    rms_s: float
    steps: int


def fit_steps(target_s: list[float], columns: dict[str, list[float]]) -> StepFit:
    """``target_s`` (one per step) ~ sum of each column x its term, by least squares (float64). At least
    as many steps as columns, else the terms are NaN."""
    names = tuple(columns)
    if len(target_s) < len(names) or not names:
        return StepFit(names, tuple(NAN for _ in names), NAN, len(target_s))
    a = torch.tensor([[columns[n][i] for n in names] for i in range(len(target_s))], dtype=torch.float64)
    b = torch.tensor(target_s, dtype=torch.float64).reshape(-1, 1)
    terms = torch.linalg.lstsq(a, b, driver="gelsd").solution
    rms = float(((a @ terms - b) ** 2).mean().sqrt())
    return StepFit(names, tuple(terms.reshape(-1).tolist()), rms, len(target_s))


def host_op_costs(device: torch.device, repeats: int = 200) -> dict[str, float]:
    """Host microseconds of each CUDA-touching step of a fetching forward, alone (the median of 5 batches of
    ``repeats``; the device synchronised between batches): what a forward with a fetch pays the host beyond
    an all-hit one. {} off CUDA."""
    if device.type != "cuda":
        return {}
    stream, event = torch.cuda.Stream(device), torch.cuda.Event()
    event.record()
    table = [-1] * 128
    pinned = torch.tensor(table, dtype=torch.int32, pin_memory=True)
    src = torch.empty((2, 3 << 20), dtype=torch.uint8, pin_memory=True)  # two 3 MiB rows
    dst = torch.empty((2, 3 << 20), dtype=torch.uint8, device=device)

    def stream_switch():
        with torch.cuda.stream(stream):
            pass

    def new_event():
        torch.cuda.Event().record()

    def copy_row():
        with torch.cuda.stream(stream):
            dst[1:2].copy_(src[1:2], non_blocking=True)

    ops = {"current_stream": lambda: torch.cuda.current_stream(device), "stream_switch": stream_switch,
           "event_new_record": new_event, "event_record": event.record,
           "stream_wait_event": lambda: torch.cuda.current_stream(device).wait_event(event),
           "pinned_map_tensor": lambda: torch.tensor(table, dtype=torch.int32, pin_memory=True),
           "map_to_device": lambda: pinned.to(device, non_blocking=True),
           "copy_3MiB_on_side_stream": copy_row,
           "kernel_launch": lambda: dst[0, :1].add_(1)}
    out = {}
    for name, op in ops.items():
        batches = []
        for _ in range(5):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                op()
            batches.append((time.perf_counter() - start) / repeats * 1e6)
        out[name] = statistics.median(batches)
    torch.cuda.synchronize(device)
    return out
