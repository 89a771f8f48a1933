"""The work of ``ovl_kernels``' bound kernel (issues 15, 19 at the ridge): a cell's weight bytes cut into [BW, BK]
TMA boxes, the boxes split evenly over the programs, and the torch twin of what each program computes.

Shapes: E experts (the touched ones: every expert at each cell measured), N intermediate, K hidden, T tokens an
expert (M·k / E: the cell's real rows spread evenly), BW weight rows a box (64 a consumer warpgroup), BK reduction
columns a box, TN tokens a wgmma (<= 256; T = NCHUNK·TN), G programs (one an SM).

The weights are w13 viewed [E·2N, K] and w2 viewed [E·K, N]. A unit is one BW-row block of either, streamed along
its reduction dim in steps of BK: w13 has E·2N/BW units of K/BK boxes, w2 E·K/BW units of N/BK boxes. Boxes are
numbered w13 first, unit by unit, step by step; program p takes boxes [p·B/G, (p+1)·B/G) (B boxes in all: stream-K
balance, no program more than one box above another). Each box feeds NCHUNK wgmmas of [BW rows, BK] x [BK, TN]
(swap-AB: the weights are the MMA's M side, the tokens its N side, so a cell's rows round up to 8, not 64), all into
one float32 accumulator per consumer warpgroup: the tensor work of the cell's real rows, its weights read once,
with no second accumulator and no epilogue but one store at the end. Every real grouped GEMM reads at least these
bytes and runs at least these MMAs, so the kernel's time bounds them on this GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_ROWS = 64  # weight rows of one consumer warpgroup's wgmma (the MMA's M)


@dataclass(frozen=True)
class OvlPlan:
    """One cell's boxes and their split."""

    experts: int  # E
    n: int  # N
    k: int  # K
    tokens: int  # T rows an expert (a multiple of 8)
    block_w: int  # BW weight rows a box
    block_k: int  # BK reduction columns a box
    tn: int  # TN tokens a wgmma
    programs: int  # G

    def __post_init__(self):
        if self.tokens % self.tn or self.tn % 8 or self.tn > 256:
            raise ValueError(f"tokens {self.tokens} must be a multiple of tn {self.tn} (a multiple of 8, <= 256)")
        for dim, blk in ((2 * self.n, self.block_w), (self.k, self.block_w), (self.k, self.block_k),
                         (self.n, self.block_k)):
            if dim % blk:
                raise ValueError(f"{dim} is not a multiple of {blk}")

    @property
    def steps13(self) -> int:
        return self.k // self.block_k

    @property
    def steps2(self) -> int:
        return self.n // self.block_k

    @property
    def boxes13(self) -> int:
        return self.experts * 2 * self.n // self.block_w * self.steps13

    @property
    def boxes(self) -> int:
        return self.boxes13 + self.experts * self.k // self.block_w * self.steps2

    @property
    def nchunk(self) -> int:
        return self.tokens // self.tn

    @property
    def resident_rows(self) -> int:
        """Rows of the resident token tiles: two tiles of TN where NCHUNK > 1, chunk c multiplies tile c mod 2."""
        return self.tn * min(self.nchunk, 2)

    @property
    def consumers(self) -> int:
        return self.block_w // HALF_ROWS

    def span(self, p: int) -> tuple[int, int]:
        """Boxes [lo, hi) of program p (the kernel's own arithmetic)."""
        return p * self.boxes // self.programs, (p + 1) * self.boxes // self.programs

    def box(self, b: int) -> tuple[int, int, int]:
        """(0: w13 / 1: w2, first row of the 2-D view, first column) of box b."""
        if b < self.boxes13:
            return 0, b // self.steps13 * self.block_w, b % self.steps13 * self.block_k
        b -= self.boxes13
        return 1, b // self.steps2 * self.block_w, b % self.steps2 * self.block_k

    def weight_bytes(self, element_size: int) -> int:
        return self.boxes * self.block_w * self.block_k * element_size

    def flops(self) -> int:
        """The MMAs' multiply-adds x 2: each box's [BW, BK] x [BK, T]."""
        return 2 * self.boxes * self.block_w * self.block_k * self.tokens


def plan_for(experts: int, n: int, k: int, rows: int, block_w: int, block_k: int, tn: int, programs: int) -> OvlPlan:
    """``rows`` real rows over E experts (M·k): T = rows / E rounded up to 8; tn = min(tn, T)."""
    tokens = -(-rows // experts)
    tokens = -(-tokens // 8) * 8
    tn = min(tn, tokens)
    while tokens % tn:
        tn -= 8
    return OvlPlan(experts, n, k, tokens, block_w, block_k, tn, programs)


def box_scale(i: int) -> float:
    """The weight block scale the fp8 promotion applies at a program's i-th box (the kernel computes it; real
    kernels load it): 1 + (i mod 4) / 8."""
    return 1.0 + (i % 4) * 0.125


def chunks_summed(plan: OvlPlan, a: torch.Tensor) -> torch.Tensor:
    """[BK, TN] float32: the sum over a box's chunks of the tile each multiplies (chunk c: tile c mod 2)."""
    tile = lambda c: a[c % 2 * plan.tn:(c % 2 + 1) * plan.tn].float()  # noqa: E731
    return sum(tile(c) for c in range(plan.nchunk)).t()


def box_scales(n: int, promote: bool, device) -> torch.Tensor:
    """``box_scale`` of a program's boxes 0 .. n - 1 [n] float32 (ones without the promotion)."""
    i = torch.arange(n, device=device)
    return 1.0 + (i % 4).float() * 0.125 if promote else torch.ones(n, device=device)


def token_scales(tn: int) -> torch.Tensor:
    """The per-token activation scales [TN] of the fp8 promotion: 1 + (t mod 8) / 16."""
    return 1.0 + (torch.arange(tn) % 8).double() / 16


def boxes_of(plan: OvlPlan, w13: torch.Tensor, w2: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Boxes lo .. hi - 1 [hi - lo, BW, BK] float32 (w13 [E·2N, K], w2 [E·K, N]; bf16 or e4m3)."""
    parts = []
    for w, first, count, steps in ((w13, 0, plan.boxes13, plan.steps13),
                                   (w2, plan.boxes13, plan.boxes - plan.boxes13, plan.steps2)):
        a, b = max(lo, first), min(hi, first + count)
        if a < b:
            idx = torch.arange(a - first, b - first, device=w.device)
            raw = w.view(torch.uint8 if w.element_size() == 1 else torch.int16)  # indexing takes any dtype so
            four = raw.view(-1, plan.block_w, steps, plan.block_k)  # [units, BW, steps, BK]
            parts.append(four[idx // steps, :, idx % steps, :].view(w.dtype).float())  # [b - a, BW, BK]
    return torch.cat(parts)


def ovl_twin(plan: OvlPlan, w13: torch.Tensor, w2: torch.Tensor, a: torch.Tensor, promote: bool,
             programs: list[int] | None = None) -> torch.Tensor:
    """out [P, C, 64, TN] float32 on a's device: what consumer c of each of ``programs`` (default: all G)
    accumulates over its boxes; w13 [E·2N, K], w2 [E·K, N], a [``resident_rows``, BK] (the resident tiles: chunk c
    multiplies rows [(c mod 2)·TN, +TN)).
    promote: each box's product is scaled by ``token_scales`` (per column) x ``box_scale`` (the i-th box of the
    program) before it is added. Sums the boxes first (the products are linear in them): float32 sums in
    another order than the kernel's."""
    programs = list(range(plan.programs)) if programs is None else programs
    at = chunks_summed(plan, a)  # [BK, TN]
    cols = token_scales(plan.tn).float().to(a.device) if promote else torch.ones(plan.tn, device=a.device)
    out = torch.zeros(len(programs), plan.consumers, HALF_ROWS, plan.tn, device=a.device)
    for j, p in enumerate(programs):
        lo, hi = plan.span(p)
        if lo == hi:
            continue
        scale = box_scales(hi - lo, promote, a.device)  # [hi - lo]
        summed = (boxes_of(plan, w13, w2, lo, hi) * scale[:, None, None]).sum(0)  # [BW, BK]
        out[j] = ((summed @ at) * cols[None, :]).view(plan.consumers, HALF_ROWS, plan.tn)
    return out


def ring_twin(plan: OvlPlan, w13: torch.Tensor, a: torch.Tensor, stages: int, promote: bool,
              programs: list[int]) -> torch.Tensor:
    """``ovl_twin`` of the MMAs-alone mode: a program's i-th box multiplies ring stage i mod STAGES, which holds
    w13's rows [(s·C + c)·64, +64) x columns [0, BK) for consumer c (filled once)."""
    at = chunks_summed(plan, a)  # [BK, TN]
    cols = token_scales(plan.tn).float().to(a.device) if promote else torch.ones(plan.tn, device=a.device)
    ring = w13[:stages * plan.block_w, :plan.block_k].float().view(stages, plan.consumers, HALF_ROWS, plan.block_k)
    out = torch.zeros(len(programs), plan.consumers, HALF_ROWS, plan.tn, device=a.device)
    for j, p in enumerate(programs):
        lo, hi = plan.span(p)
        i = torch.arange(hi - lo, device=a.device)
        weight = torch.zeros(stages, device=a.device).index_add_(0, i % stages, box_scales(hi - lo, promote, a.device))
        summed = (ring * weight[:, None, None, None]).sum(0)  # [C, 64, BK]
        out[j] = (summed @ at) * cols[None, None, :]
    return out
