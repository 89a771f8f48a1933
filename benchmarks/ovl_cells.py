"""The cells and calls of ``ovl_device_check.py``: a cell's inputs (the bench's weights and routing), the bound
kernel's configurations (``ovl_kernels``) with their checks against the twins (``ovl_plan``), moekit's own call
(the bench's route) and cuBLAS on the same per-expert rows, each a zero-argument call timed in graph replay.

Cell spec: "bf16:<preset>:<M>" or "fp8:<preset>:<M>". Shapes: E experts, N intermediate, K hidden, k slots, M tokens,
T = M·k / E rows an expert (the bound's and cuBLAS's even split of the cell's real rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import ovl_plan as op

CELLS = ("bf16:mixtral-8x7b:512", "bf16:mixtral-8x7b:1024", "bf16:qwen3-30b-a3b:512", "bf16:qwen3-30b-a3b:1024",
         "bf16:qwen3-30b-a3b:4096", "bf16:deepseek-v3:4096", "bf16:qwen3-30b-a3b:16384",
         "fp8:mixtral-8x7b:512", "fp8:mixtral-8x7b:1024", "fp8:qwen3-30b-a3b:512", "fp8:qwen3-30b-a3b:1024",
         "fp8:qwen3-30b-a3b:4096", "fp8:qwen3-30b-a3b:16384", "fp8:deepseek-v3:4096", "fp8:deepseek-v3:16384")


@dataclass(frozen=True)
class BoundCfg:
    """One bound-kernel launch: consumer warpgroups, reduction columns a box, tokens a wgmma asked (<= T), ring
    depth, the fp8 promotion, MODE."""

    consumers: int
    block_k: int
    tn: int
    stages: int
    promote: int = 0  # fp8: 1 the per-128 promotion, each wgmma waited; 2 pipelined (``ovl_kernels``)
    mode: str = "both"

    @property
    def name(self) -> str:
        head = {"both": "bound", "loads": "loads alone", "mmas": "MMAs alone"}[self.mode]
        return f"{head} {self.consumers}c bk{self.block_k} tn{self.tn} s{self.stages}" + ("", " prom", " pipe")[
            self.promote]

    def with_mode(self, mode: str) -> "BoundCfg":
        return BoundCfg(self.consumers, self.block_k, self.tn, self.stages, self.promote, mode)


# SMEM: stages x consumers x 64 x BK x bytes + (1 or 2) x TN x BK x bytes <= 208 KB at every entry (TN <= 256). bf16
# keeps BK = 64 (128 bytes, the TMA box's widest row under the 128-byte swizzle).
# One consumer keeps TN <= 128 (at 256 ptxas fails: "Internal Triton PTX codegen error", Triton 3.6 and 3.9).
# A second resident tile where a box takes several chunks (T > TN): 2 x 32 KB at TN 256, so those entries keep 9 stages.
SWEEP = {"bf16": [BoundCfg(2, 64, 256, 9), BoundCfg(1, 64, 128, 16), BoundCfg(2, 64, 128, 10),
                  BoundCfg(2, 64, 256, 5)],
         "fp8": [BoundCfg(2, 128, 128, 10, 1), BoundCfg(2, 128, 128, 10, 2), BoundCfg(1, 128, 128, 16, 2),
                 BoundCfg(2, 128, 128, 4, 1), BoundCfg(2, 128, 128, 4, 2), BoundCfg(2, 128, 256, 9),
                 BoundCfg(1, 128, 128, 16)]}


def bound_cfgs(dtype: str) -> list[BoundCfg]:
    """The sweep, then the first entry's loads alone and MMAs alone (fp8: also the MMAs alone of the first
    pipelined and the first plain entry)."""
    first = SWEEP[dtype][0]
    more = [next(c for c in SWEEP[dtype] if c.promote == p) for p in (2, 0)] if dtype == "fp8" else []
    return SWEEP[dtype] + [first.with_mode("loads"), first.with_mode("mmas")] + [c.with_mode("mmas") for c in more]


@dataclass
class Cell:
    """A cell's inputs."""

    spec: str
    dtype: str  # "bf16" or "fp8"
    shape: object  # moekit.bench.cells.Shape
    m: int
    w13: torch.Tensor  # [E, 2N, K] bf16 or e4m3
    w2: torch.Tensor  # [E, K, N]
    scales: tuple = ()  # fp8: (w13 scale [E, 2N/128, K/128], w2 scale [E, K/128, N/128]) float32
    sets: list = field(default_factory=list)  # [(x [M, K] bf16, ids [M, k] int32, weights [M, k] float32)]

    @property
    def rows(self) -> int:
        return self.m * self.shape.top_k


def cell_inputs(spec: str, dev, empty: bool = False) -> Cell:
    """The bench's weights (``empty``: uninitialized, for compiling only), fp8: quantized as the bench does; two
    uniform routing sets."""
    from moekit.bench.cells import Shape, make_sets, make_weights

    dtype, preset, m = spec.split(":")
    s, m = Shape.from_preset(preset), int(m)
    if empty:
        wdt = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
        w13 = torch.empty(s.num_experts, 2 * s.n, s.k, device=dev, dtype=wdt)
        w2 = torch.empty(s.num_experts, s.k, s.n, device=dev, dtype=wdt)
    else:
        w = make_weights(s, torch.bfloat16, dev)
        w13, w2 = w.w13, w.w2
        del w  # (fp8: each bf16 copy freed once quantized)
    sets = [(c.x, c.topk_ids, c.topk_weights) for c in make_sets(s, m, 2, torch.bfloat16, dev)]
    if dtype == "bf16":
        return Cell(spec, dtype, s, m, w13, w2, sets=sets)
    if empty:
        blocks = lambda r, c: torch.ones(s.num_experts, r // 128, c // 128, device=dev)  # noqa: E731
        return Cell(spec, dtype, s, m, w13, w2, (blocks(2 * s.n, s.k), blocks(s.k, s.n)), sets)
    from prefill_device_check import quantize_chunked

    q13, s13 = quantize_chunked(w13)
    del w13
    q2, s2 = quantize_chunked(w2)
    return Cell(spec, dtype, s, m, q13, q2, (s13, s2), sets)


def plan_of(c: Cell, cfg: BoundCfg, programs: int) -> op.OvlPlan:
    s = c.shape
    return op.plan_for(s.num_experts, s.n, s.k, c.rows, 64 * cfg.consumers, cfg.block_k, cfg.tn, programs)


@dataclass
class Call:
    """A zero-argument call per input set, and its check's verdict."""

    name: str
    fns: list
    status: str = ""


def bound_call(c: Cell, cfg: BoundCfg, programs: int, check: bool = True) -> Call:
    """The bound kernel at this cell; checked (programs 0 and G - 1) against ``ovl_twin`` / ``ring_twin``."""
    from bench_run import rel_l2
    from ovl_kernels import launch_ovl

    plan = plan_of(c, cfg, programs)
    s, dev = c.shape, c.w13.device
    w13, w2 = c.w13.view(-1, s.k), c.w2.view(-1, s.n)  # [E·2N, K], [E·K, N]
    g = torch.Generator(device=dev).manual_seed(3)
    a = torch.randn(plan.resident_rows, cfg.block_k, device=dev, generator=g).to(w13.dtype)  # the resident tile
    out = torch.empty(plan.programs, plan.consumers, op.HALF_ROWS, plan.tn, device=dev)
    fn = lambda: launch_ovl(plan, w13, w2, a, out, cfg.mode, cfg.promote, cfg.stages)  # noqa: E731
    call = Call(cfg.name, [fn])
    if not check:
        return call
    fn()
    torch.cuda.synchronize()
    if cfg.mode == "loads":
        ok, detail = bool(torch.all(out == 0)), "out all zero (no MMA)"
    else:
        if cfg.mode == "mmas":
            ref = op.ring_twin(plan, w13, a, cfg.stages, bool(cfg.promote), list(range(plan.programs)))
        else:
            ref = op.ovl_twin(plan, w13, w2, a, bool(cfg.promote))
        err = rel_l2(out, ref)
        worst = max(rel_l2(out[p], ref[p]) for p in range(plan.programs))
        cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
        tol = tolerance(w13.element_size() == 1 and not cfg.promote, cfg.mode)
        ok, detail = worst < tol, f"rel L2 vs twin {err:.2e}, worst program {worst:.2e} (< {tol:g}), cos {cos:.4f}"
    call.status = f"{'PASS' if ok else 'FAIL'} {detail}; T {plan.tokens} = {plan.nchunk} x {plan.tn}, " \
                  f"{plan.boxes} boxes, {plan.weight_bytes(w13.element_size()) / 1e9:.3f} GB, " \
                  f"{plan.flops() / 1e9:.1f} GFLOP"
    return call


def tolerance(plain_fp8: bool, mode: str) -> float:
    """The bound's check: float32 sums of 5-20k boxes a program in another order than the twin's (bf16, the fp8
    promotion). Plain fp8 keeps the e4m3 wgmma's own accumulation (about 14 bits of the running sum) over as many:
    0.15; MMAs alone its ring's STAGES boxes add up coherently (the sum grows linearly, so each product loses more
    bits: CK1b's DeepSeek-V3 read 0.34 / 0.50 where the same path over distinct boxes read 8e-3): 0.6. Every chunk
    multiplies its own rows of the resident tile, so a merged or skipped wgmma changes the values."""
    if not plain_fp8:
        return 5e-3
    return 0.6 if mode == "mmas" else 0.15


def route_call(c: Cell, check: bool = True) -> Call:
    """moekit's own call as the bench makes it (``run_experts``, backend triton), both sets; checked on set 0
    against the Gluon path's twin."""
    from bench_run import rel_l2

    from moekit.experts import run_experts

    if c.dtype == "bf16":
        from moekit.experts.triton_gluon import experts_gluon_twin

        w13, w2 = c.w13, c.w2
        twin = lambda x, i, r: experts_gluon_twin(x, w13, w2, i, r)  # noqa: E731
    else:
        from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin
        from moekit.quant.fp8_block import Fp8BlockWeight

        w13 = Fp8BlockWeight(q=c.w13, scale=c.scales[0], block_shape=(128, 128))
        w2 = Fp8BlockWeight(q=c.w2, scale=c.scales[1], block_shape=(128, 128))
        twin = lambda x, i, r: experts_gluon_fp8_twin(x, c.w13, c.scales[0], c.w2, c.scales[1], i, r)  # noqa: E731
    fns = [lambda t=t: run_experts(*t[:1], w13, w2, *t[1:], backend="triton") for t in c.sets]
    out = fns[0]()
    if not check:
        return Call("route", fns)
    try:
        ref = twin(*c.sets[0])
    except ValueError:  # a call the Gluon path does not take: the reference backend
        ref = run_experts(*c.sets[0][:1], w13, w2, *c.sets[0][1:], backend="reference")
    err = rel_l2(out, ref)
    tol = 1e-2
    return Call("route", fns, f"{'PASS' if err < tol else 'FAIL'} rel L2 vs the Gluon twin {err:.2e} (< {tol:g})")


def cublas_call(c: Cell) -> Call:
    """cuBLAS on T rows an expert: bf16, two ``bmm`` (x [E, T, K] @ w13^T, then [E, T, N] @ w2^T); fp8, per
    expert ``torch._scaled_mm`` (per-tensor scales, bf16 out) for each GEMM. Checked: the bf16 up GEMM of expert
    0 against a float32 matmul; fp8, finite."""
    s, dev = c.shape, c.w13.device
    t = -(-c.rows // s.num_experts)
    x = torch.randn(s.num_experts, t, s.k, device=dev).to(c.w13.dtype)  # [E, T, K]
    h = torch.randn(s.num_experts, t, s.n, device=dev).to(c.w13.dtype)  # [E, T, N]
    up = torch.empty(s.num_experts, t, 2 * s.n, device=dev, dtype=torch.bfloat16)
    y = torch.empty(s.num_experts, t, s.k, device=dev, dtype=torch.bfloat16)
    if c.dtype == "bf16":
        def fn():
            torch.bmm(x, c.w13.transpose(1, 2), out=up)
            torch.bmm(h, c.w2.transpose(1, 2), out=y)
    else:
        one = torch.ones((), device=dev)

        def fn():
            for e in range(s.num_experts):
                up[e] = torch._scaled_mm(x[e], c.w13[e].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                y[e] = torch._scaled_mm(h[e], c.w2[e].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    fn()
    ref = x[0].float() @ c.w13[0].float().t()
    err = ((up[0].float() - ref).norm() / ref.norm()).item()
    ok = err < 1e-2 and bool(torch.isfinite(y).all())
    return Call("cuBLAS", [fn], f"{'PASS' if ok else 'FAIL'} expert 0's up GEMM rel L2 {err:.2e} (< 0.01), "
                                f"T {t}")
