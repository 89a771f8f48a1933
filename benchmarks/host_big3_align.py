"""The alignment variants ``host_big3_device_check.py`` times (its align part): today's launches (``two``: hist +
place up to align_two_launch_max, else the fused hist + scan and the scatter) and the one-pass launch of
``_kernels/align_one_pass.py`` at 1 and 2 programs per SM (``one1``, ``one2``), from the plans themselves.
"""

from __future__ import annotations

import torch

from moekit.experts.triton_align import plan_align
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.layouts.grouping import max_padded_rows


def align_variants(num_assignments: int, num_experts: int, block: int) -> dict:
    device = torch.device("cuda")
    options = resolve_launch_options(LaunchOptions(), device)
    rows = max_padded_rows(num_assignments, num_experts, block)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plans = {"two": plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0)}
    for per in (1, 2):
        plans[f"one{per}"] = plan_align(num_assignments, num_experts, block, None, rows, options, arrival_slot=0,
                                        one_pass=per * sms)
    return plans
