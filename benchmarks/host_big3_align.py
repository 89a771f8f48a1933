"""The alignment variants ``host_big3_device_check.py`` times (its align part): today's two launches and the
one-launch kernels of ``_kernels/align_one_pass.py`` in their launch forms, built from the plans' own launches.

    two      fused hist + scan, then the scatter (the plan with the kept counters' arrival slot)
    oneN     align_one_pass_kernel, N programs per SM, cooperative
    one1nc   the same with 1 per SM as a plain launch (what the driver's co-residency check costs)
    ranges1  align_one_pass_ranges_kernel: min(SMs, chunks) programs, each a contiguous range of chunks
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit.experts.triton_align import plan_align
from moekit.experts.triton_launch import LaunchOptions, kernels, resolve_launch_options
from moekit.layouts.grouping import max_padded_rows
from moekit.triton_bind import BoundLaunch


def align_variants(num_assignments: int, num_experts: int, block: int) -> dict:
    device = torch.device("cuda")
    options = resolve_launch_options(LaunchOptions(), device)
    rows = max_padded_rows(num_assignments, num_experts, block)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plans = {"two": plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0)}
    for per in (1, 2, 4):
        plans[f"one{per}"] = plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0,
                                        one_pass=per * sms)
    plans["one1nc"] = replace(plans["one1"], one=_not_cooperative(plans["one1"].one))
    plans["ranges1"] = replace(plans["one1"], one=_ranges(plans["one1"].one, sms))
    return plans


def _ranges(launch: BoundLaunch, sms: int) -> BoundLaunch:
    """``align_one_pass_ranges_kernel`` in the place of ``launch`` (the one-pass kernel's): min(SMs, chunks)
    programs, each owning a contiguous range of chunks (its hist / chunk_base row: the plan's [chunks, EP] regions
    have that many rows)."""
    split = len(launch.tail) - len(launch._named)
    scalars, named = launch.tail[:split], {**dict(zip(launch._named, launch.tail[split:])), **launch.options}
    num_chunks, items = scalars[6], scalars[7]
    programs = min(sms, num_chunks)
    per = -(-num_chunks // programs)
    programs = -(-num_chunks // per)  # none without a chunk
    kernel = kernels("align_one_pass").align_one_pass_ranges_kernel
    return BoundLaunch(kernel, (programs,), 10, (*scalars[:7], items - num_chunks, scalars[8], per), launch.cached,
                       launch.raw, **named)

def _not_cooperative(launch: BoundLaunch) -> BoundLaunch:
    """``launch`` as a plain launch (no co-residency check by the driver; the grid fits one program per SM)."""
    split = len(launch.tail) - len(launch._named)
    named = {**dict(zip(launch._named, launch.tail[split:])), **launch.options, "launch_cooperative_grid": False}
    return BoundLaunch(launch.kernel, launch.grid[:1], 10, launch.tail[:split], launch.cached, launch.raw, **named)
