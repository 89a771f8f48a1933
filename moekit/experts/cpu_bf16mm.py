"""bf16 activations on weight-only experts through oneDNN's bf16 GEMM (session 33, kernel "bf16mm"): each touched
expert's int8 form converted to bf16 once per call, then one dense GEMM (AMX where the CPU has it).

    mxfp4, int8_w8a16: q [R, C] int8 -> bf16, exact (|q| <= 128 has at most 8 significant bits)
        -> a @ q^T, float32 sums rounded once to bf16 by oneDNN                                   [m, R]
        -> times the row scale: mxfp4's int8 form has a power of two a row (``cpu_quant.mxfp4_as_int8``), so this
           is exact and the result is a @ w^T rounded once (the bias, divided by the power of two, added inside
           the GEMM before that rounding); int8_w8a16's scale is any float32: a second rounding
    int4_w4a16: (code - zero) [R, G*g] int8 times its group's scale in float32, rounded to bf16 (one rounding a
        weight, as torch's int4pack rounds its scale and zero term), then the GEMM

Accuracy against a float64 loop (``tests/test_cpu_bf16mm.py``): mxfp4 as close as "int8mm" (one rounding of the
float32 sums where int8mm rounds the exact sum to float32, then bf16); int8_w8a16 ~1.2x int8mm's error (the two
roundings), so "auto" never takes it there; int4 as close as int4pack.

Why: "int8mm" runs 3 digit rows of integer GEMM for every row of a, so its cost grows 3x as fast in the rows as the
bf16 GEMM's; the conversion is a fixed cost an expert. One expert [1536, 2048] at 1 thread of the 2-core Xeon
(session 33): the int8 -> bf16 copy 0.47 ms, the GEMM on the plain bf16 weight 0.52 / 0.98 ms at 32 / 128 rows,
int8mm 1.0 / 5.3 ms. Whole calls (``cpu_quant.MXFP4_BF16MM_MIN_ROWS``): from ~48 rows an expert on.

Shapes: m rows of one expert, R output features, C input features, G groups of g columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_BYTES = 1 << 20  # int4: float32 rows dequantized at a time (128 rows at C = 2048: 1.79 ms an expert, one pass
# over the whole expert in float32 2.2 ms, ``torch.mul`` of int8 by float32 into bf16 5.6 ms; session 33)


@dataclass(frozen=True)
class Bf16CodesLinear:
    """One expert's a [m, C] bf16 @ (q * scale[:, None])^T (+ bias) by the bf16 GEMM on q converted to bf16."""

    q: torch.Tensor  # [R, C] int8
    scale: torch.Tensor  # [R] float32
    pow2: bool  # every row's scale a power of two (mxfp4's int8 form): applied exactly after the GEMM's rounding

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        w = self.q.to(torch.bfloat16)  # [R, C], exact
        if self.pow2 and (bias is None or bias.dtype == torch.bfloat16):
            scale = self.scale.to(torch.bfloat16)  # exact
            inner = None if bias is None else bias / scale  # exact (a power of two), added before the rounding
            return linear(a, w, inner, "none", [], "").mul_(scale)  # [m, R]
        out = linear(a, w, None, "none", [], "").float().mul_(self.scale)  # [m, R] float32
        return (out if bias is None else out.add_(bias)).to(torch.bfloat16)


@dataclass(frozen=True)
class Bf16GroupsLinear:
    """One int4_w4a16 expert's a [m, C] bf16 @ w^T (+ bias): w = (code - zero) * scale per group, in float32 a chunk
    of rows at a time (``CHUNK_BYTES``), rounded once to bf16, then the bf16 GEMM."""

    codes: torch.Tensor  # [R, G*g] int8: code - zero (``cpu_quant.int4_as_int8``)
    scale: torch.Tensor  # [R, G] float32
    group_size: int

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        rows, groups = self.scale.shape
        cols = groups * self.group_size
        w = torch.empty(rows, cols, dtype=torch.bfloat16)
        step = max(1, CHUNK_BYTES // (4 * cols))  # float32 rows of one chunk, in L2 between the product and the copy
        for start in range(0, rows, step):
            part = self.codes[start:start + step].float().view(-1, groups, self.group_size)  # exact
            part.mul_(self.scale[start:start + step, :, None])  # one float32 rounding
            w[start:start + step].copy_(part.view(-1, cols))  # bf16: the weight's one rounding
        if cols != a.shape[1]:  # the last group's padding columns dropped
            w = w[:, :a.shape[1]].contiguous()  # [R, C]
        inner = bias is None or bias.dtype == torch.bfloat16
        out = linear(a, w, bias if inner else None, "none", [], "")  # [m, R]
        return out if inner else out.add_(bias)
