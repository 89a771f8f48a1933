"""Issue #19's own reference table: the best peer's µs per (shape, M), quoted once as the issue's data.

Measured by the issue's author on one H200 (torch 2.11, Triton 3.6; CUDA-graph replay for M <= 1024,
``do_bench`` with an L2 flush above; routing excluded): the fastest of vLLM's Triton ``fused_moe_kernel``
(its shipped H200 configs, its alignment step excluded), torch ``_grouped_mm`` and transformers'
``grouped_mm``. ``moekit bench --targets`` reads it for #19's peer targets when the bench JSON's cells carry
no ``peer_us`` of their own. Only the real presets (a CPU run's scaled-down shapes have no peer here).
"""

from __future__ import annotations

ISSUE_19_PEER_US = {  # (preset, M) -> the best peer's µs, from issue #19's table
    **dict(zip((("qwen3-30b-a3b", m) for m in (1, 8, 64, 512, 1024, 4096, 16384)),
               (36.4, 132, 301, 344, 407, 886, 2962))),
    **dict(zip((("mixtral-8x7b", m) for m in (1, 8, 64, 512, 1024, 4096, 16384)),
               (214, 520, 678, 1006, 1545, 5226, 20010))),
    **dict(zip((("deepseek-v3", m) for m in (1, 8, 64, 512, 1024, 4096, 16384)),
               (203, 1221, 4596, 7323, 7657, 12903, 32769))),
}
ISSUE_19_SOURCE = ("issue #19's own table (H200, torch 2.11, Triton 3.6: the best of vLLM's fused_moe_kernel, "
                   "torch _grouped_mm and transformers' grouped_mm; 21 cells, M = 1, 8, 64, 512, 1024, 4096, "
                   "16384)")
