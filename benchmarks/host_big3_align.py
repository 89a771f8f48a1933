"""The alignment variants ``host_big3_device_check.py`` times (its align part): today's launches without the one-pass
(``two``: the fused hist + scan and the scatter) and the one-pass launch
of ``_kernels/align_one_pass.py`` as the plans build it (``one``: at most two programs per SM), at any A.
"""

from __future__ import annotations

import torch

from moekit.experts.triton_align import one_pass_programs, plan_align
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.layouts.grouping import max_padded_rows


def align_variants(num_assignments: int, num_experts: int, block: int) -> dict:
    device = torch.device("cuda")
    rows = max_padded_rows(num_assignments, num_experts, block)
    plans = {}
    for name, start in (("two", 0), ("one", 1)):
        options = resolve_launch_options(LaunchOptions(align_one_pass_from=start), device)
        plans[name] = plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0,
                                 one_pass=one_pass_programs(options, device))
    return plans
