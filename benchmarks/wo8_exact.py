"""The decode-exactness check of ``wo8_device_check.py``: the weight-only down GEMM (``launch_gemm_wo``) on one-hot
rows returns the decoded weights themselves (one product 1 x w a float32 sum: exact; int8's scale then multiplies
it in float32 as ``dequantize_wo`` does), so each variant's bf16 bits can be held against the base's (the session-27
decode, which the twin models) and against ``dequantize_wo`` rounded to bf16.

Weights: the shape's w2 [E, K, N] for its first (up to) 8 experts, random codes, random scales (int8, int4), random
zero points (int4, group 128) and random e8m0 100 .. 150 (mxfp4: past 128 too, where 2^(e8m0 - 127) > 2). Row r of
expert e's 128-row block is one-hot at column 67 r mod N: every position of a 64-wide step (67 r mod 64 = 3 r mod 64
takes all 64 values) and steps across the reduction. (CK1's columns r * N / 128 read positions 0 mod 16 only, which a
wrong pair order within a word leaves alone.)
"""

from __future__ import annotations

import torch

from moekit.bench.cells import Shape
from moekit.experts.triton_gluon_launch import BLOCK_M, down_tile
from moekit.experts.triton_gluon_wo import GluonWoOptions, launch_gemm_wo
from moekit.experts.triton_wo import WoWeight, dequantize_wo


def random_w2(scheme: str, s: Shape, experts: int, dev) -> WoWeight:
    """w2 [experts, K, N] of ``scheme`` with random codes and scales (group 128 for int4)."""
    g = torch.Generator(device=dev).manual_seed(7)
    rows, cols = s.k, s.n

    def ints(low: int, high: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g, device=dev, dtype=dtype)

    if scheme == "int8_w8a16":
        scale = torch.rand(experts, rows, generator=g, device=dev) / 64
        return WoWeight(scheme, ints(-128, 128, (experts, rows, cols), torch.int8), scale)
    q = ints(0, 256, (experts, rows, cols // 2), torch.uint8)
    if scheme == "int4_w4a16":
        scale = torch.rand(experts, rows, cols // 128, generator=g, device=dev) / 64
        return WoWeight(scheme, q, scale, ints(0, 16, (experts, rows, cols // 128), torch.uint8), 128)
    return WoWeight(scheme, q, ints(100, 151, (experts, rows, cols // 32), torch.uint8), None, 32)


def decoded(w2: WoWeight, scheme: str, options: GluonWoOptions, s: Shape, columns: torch.Tensor) -> torch.Tensor:
    """[E * 128, K] bf16: row r of expert e's block the decoded weights w2[e, :, columns[r]]."""
    experts = w2.q.shape[0]
    rows = experts * BLOCK_M
    a = torch.zeros(rows, s.n, device=w2.q.device, dtype=torch.bfloat16)
    a[torch.arange(rows, device=a.device), columns.repeat(experts)] = 1.0
    block_experts = torch.arange(experts, device=a.device, dtype=torch.int32)
    rows_used = torch.tensor([rows], device=a.device, dtype=torch.int32)
    out = torch.full((rows, s.k), float("nan"), device=a.device, dtype=torch.bfloat16)
    launch_gemm_wo(a, w2, out, block_experts, rows_used, down_tile(s.n), False, scheme, options=options)
    return out


def decode_mismatches(s: Shape, dev, variants: dict) -> dict:
    """"<scheme> <variant>" -> [bf16 values differing from the base's, from ``dequantize_wo`` rounded to bf16] for
    ``variants`` {scheme: {name: GluonWoOptions}} (the base first). Compared as values: a weight -0 comes out +0
    (the float32 sum starts at +0), and a NaN (none expected) counts as differing."""
    experts = min(8, s.num_experts)
    columns = torch.arange(BLOCK_M, device=dev) * 67 % s.n
    out = {}
    for scheme, options in variants.items():
        w2 = random_w2(scheme, s, experts, dev)
        want = torch.cat([dequantize_wo(w2, s.n, e)[:, columns].t() for e in range(experts)]).to(torch.bfloat16)
        base = None
        for name, opt in options.items():
            got = decoded(w2, scheme, opt, s, columns)
            base = got if base is None else base
            out[f"{scheme.split('_')[0]} {name}"] = [int((got != base).sum()), int((got != want).sum())]
    return out
