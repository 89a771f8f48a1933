"""What ``hfg32_device_check.py`` installs in the real client (a transformers Qwen3-MoE model decoding through
``generate``) to see where the experts call's time goes: experts implementations registered under their own names
that time each call on the host, moekit's forward staged (a copy of ``moekit_experts_forward`` with a clock between
its steps), the triton backend's routes counted (the fast path's hits and misses, the full path), a candidate forward
("moekit_cc": the module's own ``ExpertsCallCache``, the check once per weight set), a per-step clock for ``generate``
and the summary of a ``torch.profiler`` trace per experts call (launches, syncs, allocations, GPU µs).

    t_<impl>       the implementation <impl>, its host ns per call recorded (``HOST[<impl>]``, M = 1 calls only)
    moekit_staged  moekit's forward with its steps timed (``STAGES``: plan, backend, check, call; run_fast inside)
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

HOST: dict = defaultdict(list)  # impl -> host ns of each M = 1 experts call
STAGES: dict = defaultdict(list)  # stage -> ns of each M = 1 call (moekit_staged)
ROUTES: dict = defaultdict(int)  # fast_hit / fast_miss / full_path (the triton backend's, every call)
STAGING = [False]  # while True (inside ``staged_forward``), run_fast's time is a stage
PROFILE = [False]  # while True, each timed call is a ``record_function`` range "hfg32::experts"
RANGE = "hfg32::experts"


def _timed(name: str, forward):
    def timed(self, hidden_states, top_k_index, top_k_weights):
        ctx = torch.profiler.record_function(RANGE) if PROFILE[0] and hidden_states.shape[0] == 1 else None
        if ctx is not None:
            ctx.__enter__()
        t0 = time.perf_counter_ns()
        out = forward(self, hidden_states, top_k_index, top_k_weights)
        t1 = time.perf_counter_ns()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if hidden_states.shape[0] == 1:
            HOST[name].append(t1 - t0)
        return out

    return timed


def cc_forward(self, hidden_states, top_k_index, top_k_weights):
    """The candidate: ``moekit_experts_forward`` with the module's own ``ExpertsCallCache`` in place of
    ``call_backend`` (the backend's fast path first, then the check skipped while the weights are the same)."""
    import moekit.hf as mh
    from moekit.experts import ExpertsCallCache, backend_fn

    plan = self.__dict__[mh.PLAN_ATTR]
    calls = self.__dict__.get("_hfg32_calls")
    if calls is None:
        calls = self.__dict__["_hfg32_calls"] = ExpertsCallCache()
    fn = backend_fn(mh.HF_BACKEND, hidden_states.device)
    return calls(fn, hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights,
                 activation=plan.activation)


def staged_forward(self, hidden_states, top_k_index, top_k_weights):
    """``moekit_experts_forward`` for a fused, untransposed, bias-free plan, its steps timed (M = 1 calls)."""
    import moekit.hf as mh
    from moekit.experts import backend_fn, call_checked_backend, check_experts_args
    from moekit.hf.variants import experts_plan

    t0 = time.perf_counter_ns()
    plan = getattr(self, mh.PLAN_ATTR, None) or experts_plan(self)
    w13, w2 = getattr(self, plan.up_name), self.down_proj
    t1 = time.perf_counter_ns()
    fn = backend_fn(mh.HF_BACKEND, hidden_states.device)
    torch.compiler.is_compiling()
    t2 = time.perf_counter_ns()
    check_experts_args(hidden_states, w13, w2, top_k_index, top_k_weights, None, activation=plan.activation)
    t3 = time.perf_counter_ns()
    STAGING[0] = True
    out = call_checked_backend(fn, hidden_states, w13, w2, top_k_index, top_k_weights, activation=plan.activation)
    t4 = time.perf_counter_ns()
    STAGING[0] = False
    if hidden_states.shape[0] == 1:
        for name, ns in (("plan + weights", t1 - t0), ("backend_fn + compile test", t2 - t1),
                         ("check_experts_args", t3 - t2), ("backend call", t4 - t3)):
            STAGES[name].append(ns)
    return out


def install() -> list[str]:
    """Register the timed implementations and the candidates with transformers; wrap the triton backend's route
    functions to count (and time ``run_fast``). Returns the names registered."""
    import moekit.experts.triton as tri
    import moekit.hf as mh
    from moekit.bench.hf_models import _no_experts_forward, register_no_experts
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    register_no_experts()
    base = {"moekit": mh.moekit_experts_forward, "moekit_cc": cc_forward, "grouped_mm": grouped_mm_experts_forward,
            "no_experts": _no_experts_forward, "moekit_staged": staged_forward}
    ExpertsInterface.register("moekit_cc", cc_forward)
    for name, forward in base.items():
        ExpertsInterface.register(f"t_{name}", _timed(name, forward))
    fast, full = tri.run_fast, tri._unchecked

    def run_fast(*args, **kwargs):
        t0 = time.perf_counter_ns()
        out = fast(*args, **kwargs)
        ROUTES["fast_hit" if out is not None else "fast_miss"] += 1
        if STAGING[0] and args[1].shape[0] == 1:
            STAGES["  of which run_fast"].append(time.perf_counter_ns() - t0)
        return out

    def unchecked(*args, **kwargs):
        ROUTES["full_path"] += 1
        return full(*args, **kwargs)

    tri.run_fast, tri._unchecked = run_fast, unchecked
    return ["moekit_cc"] + [f"t_{n}" for n in base]


def clear() -> None:
    for d in (HOST, STAGES, ROUTES):
        d.clear()


def us_summary(samples: list) -> dict:
    """ns samples -> {median, p10, p90, mean, n} in µs."""
    if not samples:
        return {"n": 0}
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))] / 1e3  # noqa: E731
    return {"median": round(statistics.median(s) / 1e3, 2), "p10": round(pick(0.1), 2), "p90": round(pick(0.9), 2),
            "mean": round(statistics.fmean(s) / 1e3, 2), "n": len(s)}


class StepClock:
    """A ``generate`` logits processor that stamps the host clock at each step (generate waits for the step's
    token before the next: the stamps are wall time); ``steps_ms()``: the steps after the first, ms each."""

    def __init__(self):
        self.stamps: list[int] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter_ns())
        return scores

    def steps_ms(self) -> list[float]:
        return [(b - a) / 1e6 for a, b in zip(self.stamps, self.stamps[1:])]


_LAUNCH, _SYNC = ("LaunchKernel", "cuLaunch", "GraphLaunch"), ("Synchronize", "cudaMemcpy", "EventSync")


def _interval_counts(events: list, start: float, end: float) -> dict:
    got = defaultdict(int)
    for e in events:
        t = e.time_range.start
        if t < start or t > end or e.name == RANGE:
            continue
        name = e.name
        if any(k in name for k in _LAUNCH):
            got["launches"] += 1
        elif any(k in name for k in _SYNC):
            got["syncs"] += 1
            got["sync:" + name] += 1
        elif name.startswith("aten::"):
            got["aten_ops"] += 1  # nested ones counted too
            got["allocs"] += name.startswith("aten::empty")
    return got


def profile_summary(prof, steps: int) -> dict:
    """One profiled generate: per M = 1 experts range (the host µs, launches, syncs, allocations, aten ops:
    medians over the ranges) and per step of the generate (GPU kernel µs, kernels, launches, the host's µs in syncs
    and copies: its wait on the GPU)."""
    events = list(prof.events())
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = [e for e in cpu if e.name == RANGE]
    per = [dict(_interval_counts(cpu, r.time_range.start, r.time_range.end),
                host_us=r.time_range.end - r.time_range.start) for r in ranges]
    keys = sorted({k for p in per for k in p})
    ranges_out = {k: statistics.median(p.get(k, 0) for p in per) for k in keys} if per else {}
    waits = [e for e in cpu if any(k in e.name for k in _SYNC)]  # the host waiting on the GPU (or a copy)
    wait_us = sum(e.time_range.end - e.time_range.start for e in waits)
    launches = sum(any(k in e.name for k in _LAUNCH) for e in cpu)
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.time_range.end - e.time_range.start for e in gpu)
    avg = next((a for a in prof.key_averages() if a.key == RANGE), None)
    range_gpu = None
    if avg is not None and avg.count:
        total = getattr(avg, "device_time_total", None)
        range_gpu = (total if total is not None else getattr(avg, "cuda_time_total", 0)) / avg.count
    return {"experts_ranges": len(ranges), "per_experts_call": ranges_out, "experts_gpu_us": range_gpu,
            "gpu_us_per_step": gpu_us / max(steps, 1), "kernels_per_step": len(gpu) / max(steps, 1),
            "launches_per_step": launches / max(steps, 1), "sync_wait_us_per_step": wait_us / max(steps, 1)}
