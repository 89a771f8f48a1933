"""Which tuned file served a bench cell's launch config (``configs.served_by``), for the JSON and the report: the
device's own ("NVIDIA_H100_80GB_HBM3"), a sibling device's ("NVIDIA_H200 (sibling)", ``configs.tuned_files``), or
"heuristic" (no file).

Said for the ``triton`` backend's unquantized and fp8_block cells, whose lookups are one file per shape. Not for the
weight-only schemes: their route takes measured table rows (the Gluon cells, the winners, ``MMA_CONFIGS``) ahead of
any file and picks the decode whose files it reads, so no single file name would be true of them.
"""

from __future__ import annotations

import torch

from moekit.bench.cells import Shape
from moekit.bench.quant_cells import FP8
from moekit.experts.configs import device_key, served_by

SOURCE_BACKENDS = ("triton",)  # the backends whose cells carry it


def cell_config_source(shape: Shape, num_tokens: int, dtype: str, device: torch.device) -> str | None:
    """The file ``served_by`` names for this cell's lookup (``dtype``: the cell's, a torch dtype's name for the
    unquantized cells), named as ``moekit tune`` names the file it writes (``scheme_for(dtype).file_name``); None for
    the weight-only schemes (the module's docstring)."""
    from moekit.bench.tuning import FLOAT_DTYPES, scheme_for  # here: tuning imports the sweep, which imports this

    if dtype != FP8 and dtype not in FLOAT_DTYPES:
        return None
    file_name = scheme_for(dtype).file_name
    return served_by(num_tokens, lambda dev: file_name(shape.num_experts, shape.n, shape.k, dev), device_key(device))
