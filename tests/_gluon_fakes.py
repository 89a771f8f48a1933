"""Stand-ins for the Gluon GEMM kernels on the CPU (Gluon does not run in Triton's interpreter): objects that a
``BoundLaunch`` and the plain launchers call like a kernel (``kernel[grid](*args, **kwargs)``, the real kernel's
``fn`` for its signature) and that compute in torch, per row block of the rows in use (bf16: the descriptor's
block rows; fp8: 128), what the kernel writes; each launch's arguments are logged, bound to the kernel's
parameters, with the compile options Triton would take from it (its keyword arguments that are not parameters,
and ``num_warps`` where it comes by keyword), each launch noted by ``_fusion_guard`` (FP fusion asked for).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

import _fusion_guard

BLOCK = 128


def _dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q [R, C] with one float32 scale per row per 128 columns s [R, >= ceil(C/128)], in float32."""
    return q.float() * s[:, : -(-q.shape[1] // BLOCK)].repeat_interleave(BLOCK, 1)[:, : q.shape[1]]


def _quant_rows(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [R, C] float32 -> e4m3 per row per 128 columns (s = amax / 448, 1 for a zero group), and s."""
    groups = v.view(v.shape[0], -1, BLOCK)
    amax = groups.abs().amax(dim=2)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (groups / s[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(v.shape)
    return q, s


def bf16_gemm(a_desc, w_desc, c_desc, experts_ptr, used_ptr, W_ROWS, GATE_OFFSET, GATED, **_):
    a, w, c = a_desc.base, w_desc.base, c_desc.base
    cols, block_m = c.shape[1], a_desc.block_shape[0]  # the tile's rows: the layout's alignment (64 or 128)
    for block in range(int(used_ptr[0]) // block_m):
        e, rows = int(experts_ptr[block]), slice(block * block_m, (block + 1) * block_m)
        first = e * W_ROWS
        product = a[rows].float() @ w[first:first + cols].float().T  # [block_m, C]
        if GATED:
            up = a[rows].float() @ w[first + GATE_OFFSET:first + GATE_OFFSET + cols].float().T
            product = torch.nn.functional.silu(product) * up
        c[rows] = product.to(c.dtype)


def gather_gemm(x_ptr, sorted_ptr, dst_ptr, w_desc, c_desc, experts_ptr, used_ptr, num_assignments, stride_x,
                TOP_K, W_ROWS, GATE_OFFSET, **_):
    """The gate-up GEMM gathering its rows in its loader: row r reads x[sorted[r] // TOP_K] (zeros for padding),
    and dst[sorted[r]] = r for the real rows."""
    w, c = w_desc.base, c_desc.base
    cols = c.shape[1]
    assert x_ptr.stride(0) == stride_x
    for block in range(int(used_ptr[0]) // BLOCK):
        e, rows = int(experts_ptr[block]), torch.arange(block * BLOCK, (block + 1) * BLOCK)
        a = sorted_ptr[rows].long()
        real = a < num_assignments
        dst_ptr[a[real]] = rows[real].to(dst_ptr.dtype)
        xa = torch.where(real[:, None], x_ptr[torch.where(real, a // TOP_K, 0)], 0).float()  # [128, K]
        first = e * W_ROWS
        gate = xa @ w[first:first + cols].float().T
        up = xa @ w[first + GATE_OFFSET:first + GATE_OFFSET + cols].float().T
        c[rows] = (torch.nn.functional.silu(gate) * up).to(c.dtype)


def _wo_rows(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, first: int, count: int, group: int, scheme: int):
    """Rows [first, first + count) of one expert's stored weight as the weight-only GEMM multiplies them, float32
    [count, R]: int8 the codes (scaled after the product), int4 (code - zero) * scale, mxfp4 e2m1 * 2^(e8m0 - 127),
    rounded to bf16."""
    rows, q = slice(first, first + count), q.view(torch.uint8) if q.dtype == torch.int32 else q  # int4: words
    if scheme == 0:
        return q[rows].float()
    codes = torch.stack((q[rows] & 15, q[rows] >> 4), dim=-1).reshape(count, -1)  # low nibble first
    per = torch.arange(codes.shape[1]) // group
    if scheme == 2:  # mxfp4: e2m1 codes (sign bit 3), e8m0 scales
        magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes.long() & 7]
        values = torch.where(codes >= 8, -magnitude, magnitude)
        return (values * torch.exp2(s[rows][:, per].float() - 127)).bfloat16().float()
    return ((codes.float() - z[rows][:, per].float()) * s[rows][:, per]).bfloat16().float()


def wo_gemm(a_desc, q_desc, c_desc, experts_ptr, used_ptr, s_ptr, z_ptr, W_ROWS, GATE_OFFSET, GATED, SCHEME, GROUP,
            **_):
    """The weight-only GEMM: int8 the codes' products, each output column times its row's scale (epilogue order);
    int4 / mxfp4 the products with the weights dequantized (one bf16 rounding)."""
    a, q, c = a_desc.base, q_desc.base, c_desc.base
    cols = c.shape[1]
    for block in range(int(used_ptr[0]) // BLOCK):
        e, rows = int(experts_ptr[block]), slice(block * BLOCK, (block + 1) * BLOCK)
        q_e, scale = q[e * W_ROWS:(e + 1) * W_ROWS], s_ptr[e]
        ones = torch.ones(W_ROWS) if SCHEME else scale  # int8: the scale after the product; int4: inside the weight
        product = (a[rows].float() @ _wo_rows(q_e, scale, z_ptr[e], 0, cols, GROUP, SCHEME).T) * ones[:cols]
        if GATED:
            up = a[rows].float() @ _wo_rows(q_e, scale, z_ptr[e], GATE_OFFSET, cols, GROUP, SCHEME).T
            product = torch.nn.functional.silu(product) * (up * ones[GATE_OFFSET:GATE_OFFSET + cols])
        c[rows] = product.to(c.dtype)


def _tma_rows(w: torch.Tensor, first: int) -> torch.Tensor:
    """Rows first .. first + 127 of the 2-D weight view w [E * W_ROWS, R] as a TMA load reads them: zeros past its
    last row, float32 [128, R]."""
    tile = torch.zeros(BLOCK, w.shape[1])
    rows = w[first:first + BLOCK].float()
    tile[:rows.shape[0]] = rows
    return tile


def _scaled(tile: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A weight tile [128, R] times its row block's scale of each 128-column K-step (scales [ceil(R/128)])."""
    return tile * scales.repeat_interleave(BLOCK)[: tile.shape[1]]


def _glu_of(gate, up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER):
    """``gemm._glu`` of the constexprs, by ``moekit.activations``' torch definition."""
    from moekit.activations import ACTIVATIONS, ActivationSpec, apply_glu

    name = next(n for n, a in ACTIVATIONS.items() if a.kernel_id == ACT)
    return apply_glu(torch.cat((gate, up), dim=1), ActivationSpec(name, alpha=ALPHA, limit=LIMIT, up_shift=UP_SHIFT,
                                                                  limit_after_act=LIMIT_AFTER))


def fp8_gemm(a_desc, w_desc, c_desc, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr, num_col_blocks, w_rows,
             gate_offset, GATED, WIDE=False, bias_ptr=None, INTERLEAVED=False, ACT=0, ALPHA=1.0, LIMIT=None,
             UP_SHIFT=0.0, LIMIT_AFTER=False, **_):
    """Tile by tile as the kernel addresses them: column block cb's weight rows cb * step.. (step 256 with WIDE or
    INTERLEAVED, else 128) and gate_offset + those (gated, WIDE), each tile read past the view's last row as zeros
    and scaled by its row block's scale (INTERLEAVED: the second tile's block clamped to the expert's last), + the
    bias rows, the interleaved pairs split (rows past W_ROWS zeroed first), the activation, h quantized per 128
    columns, the output clipped at C (TMA's store); so a wrong num_col_blocks, gate_offset, scale block or bias row
    leaves NaN columns or wrong ones."""
    a, w, c = a_desc.base, w_desc.base, c_desc.base
    cols, half, last = c.shape[1], BLOCK // 2, -(-w_rows // BLOCK) - 1
    step = 2 * BLOCK if WIDE or INTERLEAVED else BLOCK  # weight rows per column block
    width = 2 * BLOCK if WIDE else BLOCK  # output columns per tile
    for block in range(int(used_ptr[0]) // BLOCK):
        e = int(experts_ptr[block])
        for first in (block * BLOCK, block * BLOCK + half):  # the two consumers' 64-row halves
            rows = slice(first, first + half)
            a_deq = _dequant_rows(a[rows], as_ptr[rows])  # [64, R]
            out = torch.full((half, num_col_blocks * width), float("nan"))
            for cb in range(num_col_blocks):
                row_a = cb * step  # the expert's weight row of the first tile
                blocks = (cb * step // BLOCK, min(2 * cb + 1, last) if INTERLEAVED else (row_a + gate_offset) // BLOCK)
                offsets = (row_a, row_a + gate_offset)
                prods = [a_deq @ _scaled(_tma_rows(w, e * w_rows + r), ws_ptr[e, b]).T  # [64, 128] each
                         for r, b in zip(offsets[:2 if GATED or WIDE else 1], blocks)]
                if bias_ptr is not None:
                    for j, r in enumerate(offsets[:len(prods)]):
                        idx = r + torch.arange(BLOCK)
                        prods[j] = prods[j] + torch.where(idx < w_rows, bias_ptr[e, idx.clamp(max=w_rows - 1)].float(),
                                                          0.0)
                if WIDE:
                    out[:, cb * width:(cb + 1) * width] = torch.cat(prods, dim=1)
                elif not GATED:
                    out[:, cb * width:(cb + 1) * width] = prods[0]
                elif INTERLEAVED:
                    p0, p1 = (torch.where((r + torch.arange(BLOCK) < w_rows)[None, :], p, 0.0)
                              for r, p in zip(offsets, prods))
                    gate, up = torch.cat((p0[:, 0::2], p1[:, 0::2]), 1), torch.cat((p0[:, 1::2], p1[:, 1::2]), 1)
                    out[:, cb * width:(cb + 1) * width] = _glu_of(gate, up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
                else:
                    out[:, cb * width:(cb + 1) * width] = _glu_of(prods[0], prods[1], ACT, ALPHA, LIMIT, UP_SHIFT,
                                                                      LIMIT_AFTER)
            if GATED:
                q, scales = _quant_rows(out)
                c[rows], cs_ptr[rows, :num_col_blocks] = q[:, :cols], scales
            else:
                c[rows] = out[:, :cols].to(c.dtype)


def _folded(experts_ptr, sorted_ptr, used_ptr, num_assignments, tail) -> list[bool]:
    """Per used block b: b takes block b + 1's first ``tail`` rows (b + 1 the same expert's last block, its row
    ``tail`` padding when tail < 128)."""
    nrb = int(used_ptr[0]) // BLOCK
    ex = [int(e) for e in experts_ptr[:nrb]]
    return [b + 1 < nrb and ex[b + 1] == ex[b] and not (b + 2 < nrb and ex[b + 2] == ex[b])
            and (tail == BLOCK or int(sorted_ptr[(b + 1) * BLOCK + tail]) >= num_assignments) for b in range(nrb)]


def tail_down(a_desc, t_desc, w_desc, c_desc, ct_desc, experts_ptr, sorted_ptr, used_ptr, num_assignments, W_ROWS,
              **_):
    """The bf16 down GEMM with folded tails: a folding block also writes block b + 1's first ``tail`` rows; b + 1's
    own tiles write nothing."""
    a, w, c = a_desc.base, w_desc.base, c_desc.base
    cols, tail = c.shape[1], t_desc.block_shape[0]
    folds = _folded(experts_ptr, sorted_ptr, used_ptr, num_assignments, tail)
    for block, fold in enumerate(folds):
        if block and folds[block - 1]:
            continue
        e, first = int(experts_ptr[block]), block * BLOCK
        rows = slice(first, first + BLOCK + (tail if fold else 0))
        c[rows] = (a[rows].float() @ w[e * W_ROWS:e * W_ROWS + cols].float().T).to(c.dtype)


def _blk256_live(ex: list[int], sorted_ptr, block: int, nrb: int, num_assignments: int) -> int:
    """64-row sub-tiles from block's first row on, at most four, inside its expert's blocks and before its padding."""
    live = 0
    while live < 4:
        row = block * BLOCK + live * 64
        if row // BLOCK >= nrb or ex[row // BLOCK] != ex[block] or int(sorted_ptr[row]) >= num_assignments:
            break
        live += 1
    return live


def blk256_gemm(a_desc, w_desc, c_desc, experts_ptr, used_ptr, sorted_ptr, num_assignments, num_col_blocks, W_ROWS,
                GATE_OFFSET, **_):
    """The 256-row gate-up GEMM: a tile starts at each even block counted from its expert's first and covers that
    expert's 64-row sub-tiles from there (at most four) up to its first padding row; column block by column block
    (cb * C columns, C = the output block's; gate rows cb * C.., up rows GATE_OFFSET + cb * C..)."""
    a, w, c = a_desc.base, w_desc.base, c_desc.base
    sub, cols = c_desc.block_shape
    assert a_desc.block_shape[0] == sub == 64 and w_desc.block_shape[0] == cols
    nrb, ex = int(used_ptr[0]) // BLOCK, [int(e) for e in experts_ptr]
    for block in range(nrb):
        first = block
        while first > 0 and ex[first - 1] == ex[block]:
            first -= 1
        if (block - first) % 2:
            continue
        rows = slice(block * BLOCK, block * BLOCK + sub * _blk256_live(ex, sorted_ptr, block, nrb, num_assignments))
        for cb in range(num_col_blocks):
            w0 = ex[block] * W_ROWS + cb * cols
            gate = a[rows].float() @ w[w0:w0 + cols].float().T  # [live * 64, C]
            up = a[rows].float() @ w[w0 + GATE_OFFSET:w0 + GATE_OFFSET + cols].float().T
            c[rows, cb * cols:(cb + 1) * cols] = (torch.nn.functional.silu(gate) * up).to(c.dtype)


class FakeKernel:
    """``kernel[grid](*args, **kwargs)`` -> ``body`` on the arguments bound to ``real``'s parameters."""

    def __init__(self, real, body):
        self.fn, self.body, self.log = real.fn, body, []
        self._params = list(inspect.signature(real.fn).parameters)
        self._defaults = {n: p.default for n, p in inspect.signature(real.fn).parameters.items()
                          if p.default is not inspect.Parameter.empty}  # what Triton binds where none is passed

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = dict(zip(self._params, args))
            bound.update((k, v) for k, v in kwargs.items() if k in self._params)
            bound = {**{k: v for k, v in self._defaults.items() if k not in bound}, **bound}
            options = {k: v for k, v in kwargs.items() if k not in self._params}  # Triton's compile options
            _fusion_guard.note(self.fn, options)
            if "num_warps" in kwargs:  # Triton compiles with num_warps only when it comes by keyword
                options["num_warps"] = kwargs["num_warps"]
            self.log.append((tuple(grid) + (1,) * (3 - len(grid)), bound, options))
            self.body(**bound)

        return launch


def install_fakes(setattr_=setattr) -> dict:
    """Both Gluon GEMM kernels replaced by their torch stand-ins (in their modules, where every launcher looks them
    up) and the Gluon paths' device checks passed, through ``setattr_`` (a monkeypatch's, to be undone);
    returns {"bf16", "fp8", "gather", "tail", "wo", "wo_swap", "blk256": FakeKernel} (the gather: the bf16 gate-up
    GEMM with the gather in its loader; tail: the bf16 down GEMM folding an expert's mostly empty last block; wo: the
    weight-only GEMM; wo_swap: the swapped int8 one, the same product; blk256: the bf16 gate-up GEMM on 256-row
    tiles)."""
    import moekit.experts.triton_gluon as tg
    import moekit.experts.triton_gluon_fp8 as tgf
    from moekit.experts.triton import clear_launch_caches

    fakes = {}
    for name, module, attr, body in (("bf16", "gluon_gemm", "grouped_gemm_kernel", bf16_gemm),
                                     ("fp8", "gluon_gemm_fp8", "grouped_gemm_fp8_kernel", fp8_gemm),
                                     ("gather", "gluon_gemm_gather", "gather_gate_up_kernel", gather_gemm),
                                     ("tail", "gluon_gemm_tail", "tail_down_kernel", tail_down),
                                     ("wo", "gluon_gemm_wo", "grouped_gemm_wo_kernel", wo_gemm),
                                     ("wo_swap", "gluon_gemm_wo_swap", "grouped_gemm_wo_swap_kernel", wo_gemm),
                                     ("blk256", "gluon_gemm_blk256", "blk256_gemm_kernel", blk256_gemm)):
        mod = importlib.import_module(f"moekit.experts._kernels.{module}")
        fakes[name] = FakeKernel(getattr(mod, attr), body)
        setattr_(mod, attr, fakes[name])
    setattr_(tg, "gluon_supported", lambda device: True)
    setattr_(importlib.import_module("moekit.experts.triton_gluon_wo"), "gluon_supported", lambda device: True)
    setattr_(tgf, "gluon_fp8_supported", lambda device: True)
    clear_launch_caches()  # no plan holding another kernel
    return fakes


@pytest.fixture
def fake_gemms(monkeypatch):
    """``install_fakes`` for one test."""
    from moekit.experts.triton import clear_launch_caches

    yield install_fakes(monkeypatch.setattr)
    clear_launch_caches()
