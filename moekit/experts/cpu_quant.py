"""Weight-only quantized experts in the CPU inference loop (``cpu_packed.experts_cpu_fused``), at the cost of the
experts a call touches.

    for each expert e with rows (on the worker that runs it):
        h = x_e @ w13[e]^T: w13[e] dequantized a tile of TILE_BYTES at a time, each tile through oneDNN's linear
            ("dequant"), torch's integer GEMM on the int8 codes and x's digits ("int8mm"), or torch's weight-only
            CPU kernel on the packed codes ("int8pack" / "int4pack")
        y = glu(h) @ w2[e]^T: the same

Until session 30 such a call dequantized all E experts of both matrices to x's dtype, then ran the dense loop:
at Qwen3-30B-A3B decode (E = 128, k = 8, M = 1 touches 8 experts) 16x the bytes the step needs. A tile (64 rows
of K = 2048 fp32, 512 KB) stays in L2 between its dequantize and its GEMM, and is small enough that the
allocator reuses its pages (a whole [1536, 2048] fp32 expert allocated per call page-faults: ~10 ms).

Kernels (``QuantKernels``; "auto" = the measured best for x's dtype: "int8mm" for float32 int8 / mxfp4 (3.7-14x
faster than "dequant" at Qwen3-30B-A3B, M = 1..512, ``benchmarks/results/Intel_Xeon-cpu-int8mm-*``) and for float32
int4 experts of few rows (``INT4_INT8MM_MAX_ROWS``), "dequant" for larger float32 int4 experts, torch's kernel for
bf16 (2.3-23x faster than "dequant", ``benchmarks/results/*-cpu-quant-*.md``) but "int8mm" for bf16 int8 / mxfp4
experts of many rows (``BF16_INT8MM_MIN_ROWS``; ``benchmarks/results/Intel_Xeon-cpu-s32-2026-12-05.md``):
- "dequant" (every scheme): ``QuantizedWeight.dequantize_expert`` (bit-identical to the whole ``dequantize``),
  then the same oneDNN linear as the dense loop;
- "int8mm" (int8_w8a16, mxfp4; float32 or bf16 x): x's rows as 30-bit (bf16: 22-bit) fixed point in four (three)
  int8 digits, times the int8 codes by ``torch._int_mm`` (exact int32), combined in float64 and rounded once to
  float32 (``moekit.experts.cpu_int8mm``; bf16: then to bf16): 1 byte a weight read as stored (int8) or from mxfp4's
  cached int8 form, closer to float64 than "dequant" and torch's int8pack;
- "int8mm" (int4_w4a16; float32 x): the same digits, one ``torch._int_mm`` a group of g columns on the expert's
  int8 form (code - zero, ``int4_as_int8``, made once and cached: 1 byte a weight beside int4's 0.5), each group's
  exact sums times its scale summed in float64;
- "bf16mm" (every scheme; bf16 x, session 33): the int8 form (int8's codes, mxfp4's or int4's cached form) converted
  to bf16 in the call, then oneDNN's bf16 GEMM (``moekit.experts.cpu_bf16mm``): mxfp4 exact to one rounding, int8
  two roundings, int4 a weight rounded to bf16; "auto" takes it for mxfp4 experts of many rows;
- "int8pack" (int8_w8a16): ``torch._weight_int8pack_mm(x, q[e], scale[e])``, the scale in x's dtype (bf16:
  rounded, 2**-9 relative) and applied after the dot product, so not the dequantized path's bits (C a multiple
  of 16: ``PACK_MULTIPLE``);
- "int8pack" (mxfp4, bf16 x): the same kernel on the expert's exact int8 form (``mxfp4_as_int8``, made once and
  cached: 1 byte a weight beside mxfp4's 0.53);
- "int4pack" (int4_w4a16): ``torch._weight_int4pack_mm_for_cpu``, whose weight is (code - 8) * s + z: moekit's
  (code - zero) * scale with s = scale, z = (8 - zero) * scale (one float32 rounding; then x's dtype), on codes
  repacked by ``torch._convert_weight_to_int4pack_for_cpu``, once per expert and cached (``RepackCache``).
  An odd K is padded to whole groups (codes 0 against x's zeros: each pad term is 0 * a finite weight); R a
  multiple of 16.

Shapes: m rows of one expert, R output features (2N for w13, K for w2), C input features, G groups of g columns.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from moekit.experts.cpu_bf16mm import Bf16CodesLinear, Bf16GroupsLinear
from moekit.experts.cpu_int8mm import MAX_COLS, Int8GroupsLinear, Int8MMLinear, int8mm_supported
from moekit.quant import QuantizedWeight
from moekit.quant.base import decode_nibbles, pad_cols, unpack_nibbles
from moekit.quant.mxfp4 import E2M1_CODE_VALUES, E8M0_BIAS, MX_BLOCK

TILE_BYTES = 512 << 10  # fp32 rows of one dequantized tile: 64 rows at C = 2048, in L2 with its GEMM
WEIGHT_ONLY_SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")
SCHEME_KERNELS = {  # scheme -> its kernels besides "auto", the last one torch's (what "auto" takes for a bf16 x)
    "int8_w8a16": ("dequant", "int8mm", "bf16mm", "int8pack"),
    "int4_w4a16": ("dequant", "int8mm", "bf16mm", "int4pack"),
    "mxfp4": ("dequant", "int8mm", "bf16mm", "int8pack")}
# "auto" runs float32 int4 experts of fewer rows on "int8mm": one _int_mm a group costs more per row than the
# dequantized GEMM (measured at ~4 rows an expert 2.3x faster, at ~32 rows 1.5x slower: results/*-cpu-int8mm-*)
INT4_INT8MM_MAX_ROWS = 16
# "auto" runs bf16 int8 / mxfp4 experts of this many rows on "int8mm" (3 digits a row): torch's int8pack costs ~linear
# in the rows (one expert [1536, 2048], 1 thread: 0.16 / 0.29 / 0.55 / 2.26 ms at 1 / 4 / 8 / 32 rows), int8mm 0.31
# / 0.36 / 0.42 / 1.0. Whole calls at Qwen3-30B-A3B (session 32), this threshold against int8pack everywhere: M = 64
# 0.83-0.85x at 4 (8: 0.98x), M = 8 / 16 level; at 3 or fewer M = 8 lost 1-5%.
BF16_INT8MM_MIN_ROWS = 4
# "auto" runs bf16 mxfp4 experts of this many rows on "bf16mm" (``moekit.experts.cpu_bf16mm``: the exact int8 form
# converted to bf16, the bf16 GEMM): its conversion is a fixed cost an expert where int8mm's grows with the rows.
# Whole calls at Qwen3-30B-A3B (session 33, ``results/Intel_Xeon-cpu-s33-2026-12-05.md``): from 48 rows 0.59-0.65x
# int8mm at M = 1024 and 0.30-0.49x at 2048; from 20 or 24 rows 4-11% slower at M = 384. Not taken for int8_w8a16
# (its arbitrary row scales round the result twice: rel-L2 5.3e-3 against int8mm's 4.3e-3) nor int4 (0.45-0.56x
# int4pack at M = 2048, but a weight rounded to bf16: 5.17e-3 against int4pack's 5.13e-3)
MXFP4_BF16MM_MIN_ROWS = 48
# mxfp4 as int8pack's per-row form: 2 * e2m1 is an integer (0, 1, 2, 3, 4, 6, 8, 12), so e2m1 * 2**(s - 127) =
# (2 e2m1 * 2**(s - lo)) * 2**(lo - 128), exact in int8 where a row's scale bytes s stay within 3 of their least lo
# (12 * 2**3 = 96 <= 127); a row spanning more keeps its expert on "dequant".
MX_INT8_SPAN = 3
TWICE_E2M1 = tuple(2 * v for v in E2M1_CODE_VALUES)
# torch 2.13's CPU kernels: int8pack with a 16-bit x segfaults or returns garbage (rel-L2 0.23) unless the input
# features C are a multiple of 16; the int4 repack refuses output features R not a multiple of 16. Else "dequant".
PACK_MULTIPLE = 16
INT4_PACK_INNER_K_TILES = 1  # the CPU repack ignores it (one layout), but takes it


@dataclass(frozen=True)
class QuantKernels:
    """Which kernel runs each weight-only scheme's expert GEMMs in the CPU loop (module docstring)."""

    int8_w8a16: str = "auto"
    int4_w4a16: str = "auto"
    mxfp4: str = "auto"

    def __post_init__(self) -> None:
        for scheme, allowed in SCHEME_KERNELS.items():
            if getattr(self, scheme) not in ("auto", *allowed):
                raise ValueError(f"{scheme} kernel must be one of {('auto', *allowed)}, got {getattr(self, scheme)!r}")

    def resolve(self, scheme: str, dtype: torch.dtype, rows: int = 1) -> str:
        """The kernel that runs ``scheme`` for x of ``dtype`` on an expert of ``rows`` rows: "auto" takes torch's
        weight-only kernel for a bf16 x where this torch runs it (faster than "dequant" at every M), but "int8mm" for
        bf16 int8 / mxfp4 experts of ``BF16_INT8MM_MIN_ROWS`` rows or more (int8pack's time grows with the rows),
        "bf16mm" for bf16 mxfp4 experts of ``MXFP4_BF16MM_MIN_ROWS`` rows or more;
        "int8mm" for a float32 x on int8 / mxfp4 (3.7-14x faster than "dequant" at M = 1..512, and 10x closer to
        float64) and on int4 experts of fewer than ``INT4_INT8MM_MAX_ROWS`` rows (2.3-2.6x faster at M = 1..64, 1.5x
        slower at 32 rows an expert), "dequant" for larger float32 int4 experts (torch's float32 kernels tie at M = 1
        and measured 1.4-15x slower from M = 64), for float16 (not measured; mxfp4's row scales 2**(lo - 128) may
        underflow it) and wherever the kernel is missing."""
        kernel = getattr(self, scheme)
        if kernel == "auto" and dtype == torch.float32:
            small = scheme != "int4_w4a16" or rows < INT4_INT8MM_MAX_ROWS
            kernel = "int8mm" if small else "dequant"
        elif kernel == "auto" and dtype == torch.bfloat16:
            kernel = _bf16_auto(scheme, rows)
        elif kernel == "auto":
            kernel = "dequant"
        if kernel == "int8pack" and not int8pack_supported(dtype):
            return "dequant"
        if kernel == "int4pack" and not int4pack_supported(dtype):
            return "dequant"
        if kernel == "int8mm" and not (dtype in (torch.float32, torch.bfloat16) and int8mm_supported()):
            return "dequant"
        if kernel == "bf16mm" and dtype != torch.bfloat16:
            return "dequant"
        return kernel


def _bf16_auto(scheme: str, rows: int) -> str:
    """"auto"'s kernel for a bf16 x on an expert of ``rows`` rows (``QuantKernels.resolve``)."""
    if scheme == "mxfp4" and rows >= MXFP4_BF16MM_MIN_ROWS:
        return "bf16mm"
    return "int8mm" if scheme != "int4_w4a16" and rows >= BF16_INT8MM_MIN_ROWS else SCHEME_KERNELS[scheme][-1]


def weight_only(w) -> bool:
    """Whether ``w`` is a weight-only QuantizedWeight (the schemes this loop dequantizes per expert)."""
    return isinstance(w, QuantizedWeight) and w.scheme in WEIGHT_ONLY_SCHEMES


@functools.cache
def int8pack_supported(dtype: torch.dtype) -> bool:
    """Whether this torch has ``_weight_int8pack_mm`` for x and scales of ``dtype`` on the CPU (probed once)."""
    op = getattr(torch, "_weight_int8pack_mm", None)
    if op is None:
        return False
    try:
        a, q = torch.ones(2, 64, dtype=dtype), torch.ones(8, 64, dtype=torch.int8)
        return bool((op(a, q, torch.full((8,), 0.5, dtype=dtype)) == 32).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def int4pack_supported(dtype: torch.dtype) -> bool:
    """Whether this torch has the CPU int4 repack and GEMM for x of ``dtype``, with (code - 8) * s + z (probed)."""
    repack = getattr(torch, "_convert_weight_to_int4pack_for_cpu", None)
    op = getattr(torch, "_weight_int4pack_mm_for_cpu", None)
    if repack is None or op is None:
        return False
    try:
        packed = repack(torch.full((16, 64), 9, dtype=torch.int32), INT4_PACK_INNER_K_TILES)
        scale_zeros = torch.tensor([0.5, 1.0], dtype=dtype).expand(2, 16, 2).contiguous()  # w = 1 * 0.5 + 1
        return bool((op(torch.ones(2, 64, dtype=dtype), packed, 32, scale_zeros) == 96).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@dataclass(frozen=True)
class DequantLinear:
    """One expert's a [m, C] @ w[e]^T (+ bias) -> [m, R]: w's rows dequantized a tile at a time on this thread."""

    w: QuantizedWeight  # [E, R, C]
    expert: int

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        rows_total, cols = self.w.shape[1], self.w.shape[2]
        tile = max(1, TILE_BYTES // max(4 * cols, 1))
        if tile >= rows_total:
            return linear(a, self.w.dequantize_expert(self.expert, a.dtype), bias, "none", [], "")
        out = None
        for start in range(0, rows_total, tile):
            rows = slice(start, min(start + tile, rows_total))
            part = linear(a, self.w.dequantize_expert(self.expert, a.dtype, rows), None if bias is None else bias[rows],
                          "none", [], "")  # [m, tile]
            out = a.new_empty(a.shape[0], rows_total, dtype=part.dtype) if out is None else out
            out[:, rows] = part
        return out


@dataclass(frozen=True)
class Int8PackLinear:
    """a [m, C] @ (q[e] * scale[e])^T (+ bias) by ``torch._weight_int8pack_mm``."""

    q: torch.Tensor  # [R, C] int8
    scale: torch.Tensor  # [R] float32

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        out = torch._weight_int8pack_mm(a, self.q, self.scale.to(a.dtype))  # [m, R] in a.dtype
        return out if bias is None else out.add_(bias)


@dataclass(frozen=True)
class Int4PackLinear:
    """a [m, C] @ w[e]^T (+ bias) by ``torch._weight_int4pack_mm_for_cpu`` on codes repacked once."""

    packed: torch.Tensor  # [R, G*g/2] uint8, torch's CPU layout
    scale_zeros: torch.Tensor  # [G, R, 2] in a's dtype: (scale, (8 - zero) * scale)
    group_size: int

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        a = pad_cols(a, self.group_size)  # [m, G*g]: an odd K's last group, zeros against zero-point codes
        out = torch._weight_int4pack_mm_for_cpu(a.contiguous(), self.packed, self.group_size, self.scale_zeros)
        return out if bias is None else out.add_(bias)


def int4_repacked(w, expert: int, dtype: torch.dtype) -> Int4PackLinear:
    """w (an Int4Weight) [E, R, C]'s expert in torch's CPU int4 layout, scale and zero folded for x of ``dtype``."""
    codes = pad_cols(unpack_nibbles(w.q[expert], w.cols).to(torch.int32), w.group_size)  # [R, G*g], pad codes 0
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, INT4_PACK_INNER_K_TILES)
    scale = w.scale[expert]  # [R, G] float32
    scale_zeros = torch.stack([scale, (8 - w.zero[expert].float()) * scale], dim=2).transpose(0, 1)  # [G, R, 2]
    return Int4PackLinear(packed, scale_zeros.to(dtype).contiguous(), w.group_size)


def mxfp4_as_int8(w, expert: int, dtype: torch.dtype) -> Int8PackLinear | None:
    """w (an Mxfp4Weight) [E, R, C]'s expert as int8 codes [R, C] and a power-of-two scale per row, the same values
    exactly (``MX_INT8_SPAN``); None where a row's scale bytes span more, or C is not a multiple of 16."""
    scale = w.scale[expert].to(torch.int32)  # [R, G]
    lo = scale.amin(dim=1, keepdim=True) if scale.numel() else scale[:, :1]  # [R, 1]
    shift = scale - lo  # [R, G]
    if w.cols % PACK_MULTIPLE or (shift.numel() and int(shift.max()) > MX_INT8_SPAN):
        return None
    r, groups = scale.shape
    codes = pad_cols(decode_nibbles(w.q[expert], TWICE_E2M1, torch.int32), MX_BLOCK).view(r, groups, MX_BLOCK)
    q = (codes * (2 ** shift)[:, :, None]).view(r, groups * MX_BLOCK)[:, :w.cols].to(torch.int8).contiguous()
    return Int8PackLinear(q, torch.pow(2.0, (lo[:, 0] - E8M0_BIAS - 1).float()))  # [R, C], [R]


def int4_as_int8(w, expert: int, dtype: torch.dtype) -> Int8GroupsLinear:
    """w (an Int4Weight) [E, R, C]'s expert as int8 codes less their group's zero [R, G*g] (pad columns: -zero,
    against x's zero padding) and its scales, for ``_int8mm_groups`` (1 byte a weight beside int4's 0.5)."""
    scale, zero = w.scale[expert], w.zero[expert]  # [R, G]
    r, groups = scale.shape
    codes = pad_cols(unpack_nibbles(w.q[expert], w.cols), w.group_size).view(r, groups, w.group_size)
    shifted = codes.to(torch.int16) - zero.to(torch.int16)[:, :, None]  # [R, G, g] in [-15, 15]
    return Int8GroupsLinear(shifted.to(torch.int8).view(r, groups * w.group_size).contiguous(), scale.contiguous(),
                            w.group_size)


_REPACKERS = {  # (scheme, kernel) -> the repacker whose results the cache keeps
    ("int4_w4a16", "int4pack"): int4_repacked, ("int4_w4a16", "int8mm"): int4_as_int8,
    ("mxfp4", "int8pack"): mxfp4_as_int8, ("mxfp4", "int8mm"): mxfp4_as_int8,
    ("int4_w4a16", "bf16mm"): int4_as_int8, ("mxfp4", "bf16mm"): mxfp4_as_int8}
_DTYPE_FREE = (int4_as_int8, mxfp4_as_int8)  # the same form for every x dtype: kept once (mxfp4's for both kernels)


def _tensor_bytes(linear) -> int:
    return sum(t.numel() * t.element_size() for t in vars(linear).values() if isinstance(t, torch.Tensor))


def _signature(w: QuantizedWeight) -> tuple:
    return tuple((t._version, t.data_ptr(), tuple(t.shape), t.stride()) for t in w.tensors().values())


@dataclass
class _Entry:
    signature: tuple
    experts: dict[tuple[int, torch.dtype | None, str], object] = field(default_factory=dict)  # (expert, x dtype
    # where the form depends on it, repacker) -> the form; None: it does not fit
    nbytes: int = 0


class RepackCache:
    """Experts repacked for a kernel (``_REPACKERS``: int4 for int4pack or as int8 for int8mm; mxfp4 as int8), per
    weight (keyed by its q tensor, dying with it) and (expert, form; x dtype where the form depends on it), within
    ``budget_bytes`` (mxfp4's int8 form serves int8pack and int8mm, for any x dtype, once); rebuilt when
    any tensor's version, pointer or strides change. Past the budget, for inference tensors (no version counter to
    watch), or for an expert that does not fit the kernel, ``get`` returns None."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._entries = WeakIdKeyDictionary()  # q tensor -> _Entry

    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()

    def get(self, w, expert: int, dtype: torch.dtype, kernel: str):
        if any(t.is_inference() for t in w.tensors().values()):
            return None
        signature = _signature(w)
        entry = self._entries.get(w.q)
        if entry is None or entry.signature != signature:
            entry = self._entries[w.q] = _Entry(signature)
        repacker = _REPACKERS[(w.scheme, kernel)]
        key = (expert, None if repacker in _DTYPE_FREE else dtype, repacker.__name__)
        if key in entry.experts:
            return entry.experts[key]
        if self.used_bytes() + 2 * w.nbytes_per_expert > self.budget_bytes:  # 2x: the int8 forms, the most
            return None
        found = entry.experts[key] = repacker(w, expert, dtype)
        entry.nbytes += 0 if found is None else _tensor_bytes(found)
        return found


def expert_linear(w: QuantizedWeight, expert: int, dtype: torch.dtype, kernels: QuantKernels,
                  cache: RepackCache, rows: int = 1):
    """What computes a [rows, C] @ w[expert]^T for x of ``dtype``: resolved on the calling thread (the cache is
    not thread-safe), called on the worker."""
    kernel = kernels.resolve(w.scheme, dtype, rows)
    if kernel == "bf16mm":
        return bf16mm_linear(w, expert, dtype, cache)
    if kernel == "int8mm" and w.scheme == "int8_w8a16" and w.shape[2] <= MAX_COLS:
        return Int8MMLinear(w.q[expert], w.scale[expert])
    if kernel == "int8mm" and w.scheme == "int4_w4a16":
        found = cache.get(w, expert, dtype, kernel)
        if found is not None:
            return found
    if kernel == "int8mm" and w.scheme == "mxfp4" and w.shape[2] <= MAX_COLS:
        as_int8 = cache.get(w, expert, dtype, kernel)  # mxfp4's exact int8 form
        if as_int8 is not None:
            return Int8MMLinear(as_int8.q, as_int8.scale)
    if kernel == "int8pack" and w.scheme == "int8_w8a16" and w.shape[2] % PACK_MULTIPLE == 0:
        return Int8PackLinear(w.q[expert], w.scale[expert])
    if (kernel == "int4pack" and w.shape[1] % PACK_MULTIPLE == 0) or (kernel == "int8pack" and w.scheme == "mxfp4"):
        repacked = cache.get(w, expert, dtype, kernel)
        if repacked is not None:
            return repacked
    return DequantLinear(w, expert)


def bf16mm_linear(w: QuantizedWeight, expert: int, dtype: torch.dtype, cache: RepackCache):
    """The "bf16mm" linear (``moekit.experts.cpu_bf16mm``) of ``w``'s expert: its codes as stored (int8) or its cached
    int8 form (mxfp4, int4); "dequant" where the form is missing (past the cache's budget, an mxfp4 row's scales
    spanning more than ``MX_INT8_SPAN``)."""
    if w.scheme == "int8_w8a16":
        return Bf16CodesLinear(w.q[expert], w.scale[expert], pow2=False)
    found = cache.get(w, expert, dtype, "bf16mm")
    if found is None:
        return DequantLinear(w, expert)
    if w.scheme == "mxfp4":
        return Bf16CodesLinear(found.q, found.scale, pow2=True)
    return Bf16GroupsLinear(found.codes, found.scale, found.group_size)
