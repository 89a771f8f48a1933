"""Which fused decode a weight-only call with expert biases or an activation variant (gpt-oss as it ships) takes
where the device measured it apart from a plain call of its shape: ``VARIANT_DECODE_MEASURED``, read by
``triton_wo_plan._usable_decode`` before the plain chooser (``choose_decode``). Where no entry covers a call, it takes
the plain call's decode when that is one of ``triton_wo_gemm.VARIANT_DECODES`` (tile, register, mma), else
"register"; the scratch decode has its own rule (``triton_wo_scratch.VARIANT_SCRATCH_FROM``).

    measured_variant_decode(scheme, M, E, N, K, k) -> the entry of the nearest measured M (log2 distance) among
    those of the call's tile-height bucket (``height_bucket``), as ``DECODE_MEASURED`` is read; None without one

Shapes: M tokens, k slots, E local experts, N intermediate, K hidden.
"""

from __future__ import annotations

from moekit.experts.configs import nearest
from moekit.experts.triton_wo_configs import height_bucket

# (scheme, E, N, K) -> {M: the decode measured faster for variant calls at M}. An entry goes in only where the device
# check (``benchmarks/wom40_device_check.py``: gpt-oss-20b's experts with b13 / b2 and its spec, the mma decode
# against the decode the route ran, graph µs) read every check PASS and the new decode >= 3% faster in 5/5 rounds;
# its comment names the run and the figures. Empty until then: variant calls of gpt-oss-20b's shape (E 32, N = K =
# 2880, top-4) take the plain chooser's tile (mxfp4, int8; int4 from M = 128) or register (int4 to M = 127) decode.
VARIANT_DECODE_MEASURED: dict[tuple[str, int, int, int], dict[int, str]] = {}


def measured_variant_decode(scheme: str, num_tokens: int, num_experts: int, n: int, k: int, top_k: int) -> str | None:
    """The VARIANT_DECODE_MEASURED entry of the nearest measured M in the call's tile-height bucket, or None."""
    bucket = height_bucket(num_tokens, num_experts, top_k)
    measured = {m: decode for m, decode in VARIANT_DECODE_MEASURED.get((scheme, num_experts, n, k), {}).items()
                if height_bucket(m, num_experts, top_k) == bucket}
    return measured[nearest({m: m for m in measured}, num_tokens)] if measured else None
