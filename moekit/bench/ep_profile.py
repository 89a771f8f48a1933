"""``python -m moekit.bench.ep --profile``: where each EP phase's host and device time go.

    [Route] -> [Dispatch] -> [Experts] -> [Combine], and the whole layer, each under torch.profiler

Every phase runs ``CALLS`` times inside a ``record_function`` range on every rank (the collectives pair
up); per call, rank 0 reports:
- ``launches``: on CUDA the kernel launch and async copy calls the host made (runtime and driver API,
  NCCL's included); on the CPU the leaf ATen ops that do work (views excluded): the launches they would
  be on a GPU, the host cost the exact dispatch is made of at small M;
- ``host_syncs``: reads of device values on the host (``moekit::host_sync`` ranges, scalar reads) and, on
  CUDA, blocking synchronisations (stream/event synchronize, blocking copies) not inside one (on the CPU
  a ``.tolist()`` outside a ``moekit::host_sync`` range goes unseen);
- ``host_us`` / ``device_us``: the range's host time (on CUDA up to the end of its GPU work: each call
  ends with a synchronize) and the summed durations of the kernels it launched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

CALLS = 3
_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync",
             "cudaMemcpyAsync", "cudaLaunchCooperativeKernel"}
_BLOCKING = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
_HOST_READS = {"moekit::host_sync", "aten::_local_scalar_dense"}  # the latter: every .item(), int(t), bool(t)
# ATen ops that only make views or allocate (no kernel on a GPU).
_NO_WORK = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
            "aten::t", "aten::transpose", "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze",
            "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::detach",
            "aten::alias", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::unbind",
            "aten::split", "aten::chunk", "aten::narrow", "aten::view_as", "aten::contiguous", "aten::result_type",
            "aten::is_nonzero", "aten::_unsafe_view", "aten::unflatten", "aten::flatten", "aten::numpy_T",
            "aten::to", "aten::_to_copy", "detach", "aten::set_", "aten::record_stream", "aten::split_with_sizes",
            "aten::promote_types", "aten::resize_", "aten::scalar_tensor"}


@dataclass
class PhaseProfile:
    """One phase, per call (the mean of CALLS profiled calls)."""

    launches: float  # kernel launches (CUDA) or working leaf ATen ops (CPU)
    host_syncs: float  # host reads of device values and blocking synchronisations
    host_us: float  # the range's host time
    device_us: float  # summed durations of the kernels launched in the range, NCCL's included (0 on the CPU)


def profile_phases(phases: dict[str, Callable[[], object]], device: torch.device) -> dict[str, PhaseProfile]:
    """Each phase ``CALLS`` times under the profiler, in its own ``ep::<name>`` range. Collective."""
    for fn in phases.values():  # warm-up outside the profile
        fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    dist.barrier()
    with torch.profiler.profile(activities=activities) as prof:
        for name, fn in phases.items():
            for _ in range(CALLS):
                with torch.profiler.record_function(f"ep::{name}"):
                    fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
    events = list(prof.events())
    return {name: _summarise(events, f"ep::{name}", device.type == "cuda") for name in phases}


def _summarise(events, range_name: str, cuda: bool) -> PhaseProfile:
    host_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]  # not the GPU-side annotations
    ranges = [e for e in host_events if e.name == range_name]
    launches = syncs = host = dev = 0.0
    for r in ranges:
        inside = [e for e in host_events if e is not r and e.thread == r.thread and _within(e, r)]
        reads = [e for e in inside if e.name in _HOST_READS]
        if cuda:
            launches += sum(e.name in _LAUNCHES for e in inside)
            # cudaDeviceSynchronize: the benchmark's own, closing each call (not the phase's)
            blocking = [e for e in inside if e.name in _BLOCKING and e.name != "cudaDeviceSynchronize"]
            syncs += len(reads) + sum(not any(_within(b, x) for x in reads) for b in blocking)
        else:
            launches += sum(_is_working_leaf(e) for e in inside)
            syncs += len(reads)
        host += r.time_range.elapsed_us()
        dev += getattr(r, "device_time_total", getattr(r, "cuda_time_total", 0.0))
    n = max(len(ranges), 1)
    return PhaseProfile(launches / n, syncs / n, host / n, dev / n)


def _within(inner, outer) -> bool:
    return outer.time_range.start <= inner.time_range.start and inner.time_range.end <= outer.time_range.end


def _is_working_leaf(event) -> bool:
    if not event.name.startswith("aten::") or event.name in _NO_WORK:
        return False
    return not any(c.name.startswith("aten::") and c.name not in _NO_WORK for c in event.cpu_children)


def print_profiles(title: str, profiles: dict[str, PhaseProfile]) -> None:
    print(f"profile: {title}, per call (mean of {CALLS}; rank 0)")
    print(f"{'phase':>14} {'launches':>9} {'host_syncs':>10} {'host_us':>10} {'device_us':>10}")
    for name, p in profiles.items():
        print(f"{name:>14} {p.launches:>9.1f} {p.host_syncs:>10.1f} {p.host_us:>10.1f} {p.device_us:>10.1f}")


def as_json(profiles: dict[str, PhaseProfile]) -> dict[str, dict]:
    return {name: asdict(p) for name, p in profiles.items()}
