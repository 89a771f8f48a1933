"""What one repeated eager experts call runs on the host, per shape and M, with the real shapes' H200 configs and
the kernels stubbed (no GPU needed): does the path differ between Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B?

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/host_mid_trace.py

Weights at their real shapes are ``torch.empty`` (never touched: the OS backs no page of them), x and the
routing real; every Triton kernel is ``layer_host_cpu``'s launch-free stand-in; config lookups name the H200
(``configs.device_key`` patched), so each plan takes the tuned config the GPU takes. Under the interpreter h and y
are float32 (twice the GPU's bf16 bytes), so the pool's ``max_bytes`` is doubled to take the GPU's decision of
which workspaces are allocated per call. Per (shape, M), the third call of ``experts_triton`` (the kept entry's
path) traced with ``sys.setprofile``: Python functions called, C functions called, launches (stub calls),
``torch.empty``-family allocations; and the plan: tuned config, how the rows are aligned, launches, workspace
MiB and whether h and y are fresh per call. A table is printed.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import layer_host_cpu  # noqa: E402
from moekit.bench.cells import Shape, uniform_routing  # noqa: E402
from moekit.experts import triton_plan  # noqa: E402
from moekit.experts.triton import _DEFAULT_OPTIONS, _WORKSPACES, experts_triton  # noqa: E402
from moekit.experts.triton_cache import REUSE_MAX_BYTES  # noqa: E402

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (1, 8, 64, 256, 512, 1024)
ALLOCATIONS = ("empty", "empty_like", "new_empty", "zeros", "new_zeros")


def trace_call(fn) -> Counter:
    """Counts of one call of ``fn``: Python calls, C calls, allocations, launches (the stub's ``_no_launch``)."""
    counts = Counter()

    def hook(frame, event, arg):
        if event == "call":
            counts["py"] += 1
            if frame.f_code.co_name == "_no_launch":
                counts["launches"] += 1
        elif event == "c_call":
            counts["c"] += 1
            if getattr(arg, "__name__", "") in ALLOCATIONS:
                counts["allocs"] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def plan_facts(x, w13, w2, ids, weights) -> dict:
    """The plan this call's kind runs: config, rows, launches, workspace (the GPU's bf16 bytes)."""
    plan = triton_plan.plan_for(x, w13, w2, ids, weights, None, "silu", None, _DEFAULT_OPTIONS)  # the kept one
    align = plan.align
    kind = "naive" if align is None else ("folded" if align.folded else f"{align.launches} launch(es)")
    c = plan.config
    spec = plan.workspace
    gpu_bytes = spec.nbytes // 2 if spec.names[:2] == ("h", "y") else spec.nbytes  # fp32 here, bf16 there
    return {"BLOCK_M": c.BLOCK_M, "up": f"{c.up.BLOCK_N}x{c.up.BLOCK_K}", "down": f"{c.down.BLOCK_N}x{c.down.BLOCK_K}",
            "align": kind, "ksum": "folded" if plan.down_sum is not None else "own launch",
            "ws_MiB": round(gpu_bytes / 2**20, 1), "h_y_fresh": gpu_bytes > REUSE_MAX_BYTES}


def main() -> None:
    torch.set_num_threads(1)
    layer_host_cpu.stub_kernels()
    from moekit.experts import configs

    configs.device_key = lambda device=None: "NVIDIA_H200"
    triton_plan.device_key = configs.device_key
    _WORKSPACES.max_bytes = 2 * REUSE_MAX_BYTES  # fp32 h and y here: the GPU's bf16 decision
    rows = []
    with torch.no_grad():
        for preset in PRESETS:
            shape = Shape.from_preset(preset)
            w13 = torch.empty(shape.num_experts, 2 * shape.n, shape.k, dtype=torch.bfloat16)
            w2 = torch.empty(shape.num_experts, shape.k, shape.n, dtype=torch.bfloat16)
            for m in BATCHES:
                x = torch.randn(m, shape.k, dtype=torch.bfloat16)
                routing = uniform_routing(m, shape, torch.device("cpu"), seed=m)
                args = (x, w13, w2, routing.topk_ids, routing.topk_weights)
                for _ in range(3):
                    experts_triton(*args)
                counts = trace_call(lambda: experts_triton(*args))
                rows.append({"shape": preset, "M": m, **plan_facts(*args), "py_calls": counts["py"],
                             "c_calls": counts["c"], "launches": counts["launches"], "allocs": counts["allocs"]})
                print(rows[-1], flush=True)
            del w13, w2
    cols = list(rows[0])
    print(" ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" ".join(f"{str(r[c]):>13}" for c in cols))


if __name__ == "__main__":
    main()
