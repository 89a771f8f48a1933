"""Dense block-scaled fp8 GEMMs for ``fp8pre_device_check.py`` (issue 15 at prefill): the fp8 Gluon GEMM kernel on one
expert holding every row (no routing, no padding, no per-block expert lookups that differ), and what torch offers for
DeepSeek-V3's recipe (1 x 128 activation scales, 128 x 128 weight scales) on Hopper, at the MoE calls' GEMM shapes
and at 8192^3. Each product is checked against a float32 product of the dequantized operands on its first rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

GROUP = 128
CHECK_ROWS = 1024  # rows of each product compared with the float32 reference


@dataclass
class DenseGemm:
    """One dense problem: a [T, R] e4m3 with a_s [T, R/128], w [1, W_ROWS, R] e4m3 with w_s [1, W_ROWS/128, R/128];
    gated: out = silu(gate) * up (W_ROWS = 2C, h e4m3 [T, C] + scales), else out bf16 [T, W_ROWS]."""

    name: str
    a: torch.Tensor
    a_s: torch.Tensor
    w: torch.Tensor
    w_s: torch.Tensor
    gated: bool

    @property
    def flops(self) -> float:
        return 2.0 * self.a.shape[0] * self.a.shape[1] * self.w.shape[1]


def make_dense(name: str, rows: int, reduce_dim: int, w_rows: int, gated: bool, dev) -> DenseGemm:
    g = torch.Generator(device=dev).manual_seed(rows + reduce_dim + w_rows)
    a = torch.randn(rows, reduce_dim, device=dev, generator=g).to(torch.float8_e4m3fn)  # [T, R]
    w = torch.randn(1, w_rows, reduce_dim, device=dev, generator=g).to(torch.float8_e4m3fn)  # [1, W_ROWS, R]
    a_s = 0.5 + torch.rand(rows, reduce_dim // GROUP, device=dev, generator=g)  # [T, R/128]
    w_s = 0.01 * (0.5 + torch.rand(1, w_rows // GROUP, reduce_dim // GROUP, device=dev, generator=g))
    return DenseGemm(name, a, a_s, w, w_s, gated)


def reference(p: DenseGemm, rows: int = CHECK_ROWS) -> torch.Tensor:
    """float32 [rows, W_ROWS] product of the dequantized operands (before any activation)."""
    a = p.a[:rows].float() * p.a_s[:rows].repeat_interleave(GROUP, 1)  # [rows, R]
    w = p.w[0].float() * p.w_s[0].repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)  # [W_ROWS, R]
    return a @ w.T


def gluon_call(p: DenseGemm, tile) -> tuple[Callable, Callable]:
    """(launch, result) of the fp8 Gluon GEMM with ``tile`` on one expert: result() -> float32 [CHECK_ROWS, C]
    (gated: h dequantized; compare with silu(gate) * up of the reference)."""
    from moekit.experts.triton_gluon_fp8_launch import launch_gemm_fp8

    rows, dev = p.a.shape[0], p.a.device
    cols = p.w.shape[1] // 2 if p.gated else p.w.shape[1]
    out = torch.empty(rows, cols, device=dev, dtype=torch.float8_e4m3fn if p.gated else torch.bfloat16)
    out_s = torch.empty(rows, cols // GROUP, device=dev) if p.gated else None
    experts = torch.zeros(rows // GROUP, dtype=torch.int32, device=dev)  # every row block is expert 0's
    used = torch.tensor([rows], dtype=torch.int32, device=dev)

    def launch():
        launch_gemm_fp8(p.a, p.a_s, p.w, p.w_s, out, out_s, experts, used, tile, p.gated, cols)

    def result() -> torch.Tensor:
        if p.gated:
            return out[:CHECK_ROWS].float() * out_s[:CHECK_ROWS].repeat_interleave(GROUP, 1)
        return out[:CHECK_ROWS].float()

    return launch, result


def expected(p: DenseGemm) -> torch.Tensor:
    ref = reference(p)
    if p.gated:
        cols = ref.shape[1] // 2
        return torch.nn.functional.silu(ref[:, :cols]) * ref[:, cols:]
    return ref


def torch_blockwise(p: DenseGemm) -> tuple[str, Callable] | tuple[str, None]:
    """(how, launch) of torch's block-scaled fp8 mm on this problem (not gated: the plain product), the first
    spelling this torch takes whose first rows match the reference (rel L2 < 2e-2); (why not, None) otherwise."""
    a, w = p.a, p.w[0]  # [T, R], [W_ROWS, R]
    ref = reference(p)
    tries = []
    sa_outer = p.a_s.t().contiguous().t()  # [T, R/128], the rows' dimension outermost in memory
    sw = p.w_s[0]  # [W_ROWS/128, R/128]
    try:
        from torch.nn.functional import ScalingType, scaled_mm

        for sa_name, sa in (("a_s outer-major", sa_outer), ("a_s row-major", p.a_s.contiguous())):
            for sw_name, s_w in (("w_s^T", sw.t()), ("w_s", sw), ("w_s^T contiguous", sw.t().contiguous())):
                tries.append((f"F.scaled_mm 1x128 / 128x128, {sa_name}, {sw_name}",
                              lambda sa=sa, s_w=s_w: scaled_mm(a, w.t(), sa, ScalingType.BlockWise1x128, s_w,
                                                               ScalingType.BlockWise128x128,
                                                               output_dtype=torch.bfloat16)))
    except ImportError as exc:
        tries.append((f"no F.scaled_mm ({exc})", None))
    for sw_name, s_w in (("w_s^T", sw.t()), ("w_s", sw)):
        tries.append((f"torch._scaled_mm a_s outer-major, {sw_name}",
                      lambda s_w=s_w: torch._scaled_mm(a, w.t(), scale_a=sa_outer, scale_b=s_w,
                                                       out_dtype=torch.bfloat16)))
    why = []
    for how, fn in tries:
        if fn is None:
            why.append(how)
            continue
        try:
            out = fn()
            torch.cuda.synchronize()
            err = ((out[:CHECK_ROWS].float() - ref).norm() / ref.norm()).item()
            if err < 2e-2:
                return f"{how} (rel L2 {err:.2e})", fn
            why.append(f"{how}: rel L2 {err:.2e}")
        except Exception as exc:  # noqa: BLE001 (each spelling reported)
            why.append(f"{how}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
    return "; ".join(why), None
