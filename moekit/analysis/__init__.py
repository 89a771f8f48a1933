"""The byte model: what an MoE layer costs, from shapes and counts alone (no kernels imported).

- ``touch``: distinct experts a batch touches (uniform, non-uniform, measured) and B_p.
- ``roofline``: FLOPs, compulsory weight bytes, arithmetic intensity, ridge batch, time floors.
- ``padding``: the expected padding factor of block-aligned / contiguous layouts, and measured ones.
- ``bills``: total and active parameters of a whole model; ``memory``: weight GB/GiB and GPU fit.
- ``gpus``: accelerator specs with sources; ``formats``: bytes per weight of bf16 / fp8 / int8 / int4 / mxfp4.
- ``report``: all of the above for one model, GPU and format over a batch sweep (``moekit analyze``).
- ``plots``: the report's figure (matplotlib, imported only when drawing; not imported here).
"""

from moekit.analysis.bills import ParamBill, param_bill
from moekit.analysis.formats import FORMATS, WeightFormat, get_format
from moekit.analysis.gpus import GPUS, GpuSpec, get_gpu
from moekit.analysis.memory import Fit, MemoryBill, fit_on_gpus, weight_memory
from moekit.analysis.padding import contiguous_padding_factor, padding_factor, padding_factor_from_counts
from moekit.analysis.report import Report, analyze, report_to_json
from moekit.analysis.roofline import BatchCost, batch_cost, dense_step_floor_s, ridge_batch
from moekit.analysis.touch import (
    batch_for_fraction,
    experts_touched,
    experts_touched_from_counts,
    experts_touched_from_inclusion,
    inclusion_from_counts,
    inclusion_from_weights,
)

__all__ = [
    "FORMATS", "GPUS", "BatchCost", "Fit", "GpuSpec", "MemoryBill", "ParamBill", "Report", "WeightFormat",
    "analyze", "batch_cost", "batch_for_fraction", "contiguous_padding_factor", "dense_step_floor_s", "experts_touched",
    "experts_touched_from_counts", "experts_touched_from_inclusion", "fit_on_gpus", "get_format", "get_gpu",
    "inclusion_from_counts", "inclusion_from_weights", "padding_factor", "padding_factor_from_counts",
    "param_bill", "report_to_json", "ridge_batch", "weight_memory",
]
