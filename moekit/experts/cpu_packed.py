"""The CPU inference loop of ``experts_grouped_mm``, one expert at a time, on oneDNN weights packed once.

    for each expert e with m_e > 0 rows: xs = x[tokens of e] -> h = xs @ w13[e]^T (+ b13[e]) -> glu
        -> y = h' @ w2[e]^T (+ b2[e]) -> out[tokens of e] += weight * y

Every buffer is [m_e, .] (a few hundred KB), so no [A, K] permuted copy of x is written; the
combine weight multiplies the [m_e, N] activation (the [m_e, K] output where there is a b2), and the
weighted sum over the k slots is one ``index_add_`` per expert after all of them ran, in expert order and serial
over the rows, hence deterministic. With ``workers`` > 1 (``cpu_gemm="onednn_packed_split"``, what ``auto`` runs,
save that ``auto`` sends experts of fewer than ``PACKED_MIN_ROWS`` rows through torch's BLAS where
``blas_plain_rows`` says: float32, MKL, an Intel CPU) the experts, largest first, go to whichever of that many
threads of one intra-op thread each is free (``moekit.experts.cpu_workers``); the combine order stays the expert
order, so the bits are those of ``workers=1``. ~32 rows per expert (M = 512 at k=8, E=128) are too few for oneDNN to
split one GEMM over 2 cores well; whole experts per core are not. Below 32 tokens ``auto`` times this split loop
against the same loop unsplit in phases (``moekit.experts.cpu_phased``, the same bits) and runs the faster
(``moekit.experts.cpu_split_choice``: OpenMP's spinning threads after a 2-thread op cost the split at decode).

oneDNN's linear re-lays a plain [out, in] weight into its blocked format inside every call. At
Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, fp32) and ~32 rows per expert that is ~20% of
the GEMM time, and every call streams all 2.4 GB of weights (``moekit bench --cpu-experts``). The
``PackedWeightCache`` keeps the blocked copy (``torch.ops.mkldnn._reorder_linear_weight``) per
expert, made the first time that expert gets ``PACKED_MIN_ROWS`` rows (decode batches never pack),
as long as the cache holds at most its ``budget_bytes`` (a copy costs as much as the weight itself;
past the budget the plain weight is used). Packing is paid once, in the first call that routes >= 4
rows to an expert: ~3.4 s for both matrices of all 128 Qwen3 experts on the 2-core EPYC (6.7 s for two
layouts in the hint A/B). An entry is keyed by the weight tensor (its storage base
for a view) and rebuilt when the tensor's ``_version`` (an in-place update), data pointer, strides,
dtype or device change; it dies with the tensor (``torch.utils.weak.WeakIdKeyDictionary``). Writes
through ``.data`` bypass the version counter: call ``clear_packed_weights()`` after them. Inference
tensors have no version counter and are never packed.

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate, R = 2N (gated) or N rows of w13.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from moekit.activations import ActivationSpec, apply_glu, get_activation
from moekit.experts.cpu_quant import QuantKernels, RepackCache, expert_linear, weight_only
from moekit.experts.cpu_workers import largest_first, run_dynamic
from moekit.layouts.grouping import aligned_positions, assignments_of_rows
from moekit.quant import QuantizedWeight

PACK_BATCH_HINT = 32  # the blocked format oneDNN picks for this many rows (4 to 64 measured alike)
# Below this many rows an expert reads its plain weight: packed copies measured 25% slower at 1 row,
# equal at 2, 32% faster at 4 and 20% at 32 (``benchmarks/results/raw/AMD_EPYC-2026-11-30-cpu-packed-hint-ab.log``).
PACKED_MIN_ROWS = 4


def default_budget_bytes() -> int:
    """1/8 of the machine's physical memory (0 where unknown): room for one Qwen3-30B-A3B layer's
    2.4 GB of fp32 experts on a 24 GB machine, never the weights of a whole large model."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (AttributeError, ValueError, OSError):
        return 0


@functools.cache
def onednn_linear(dtype: torch.dtype):
    """oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``, what inductor calls for CPU linears) if
    this torch has it and it runs ``dtype``; None otherwise."""
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        a, w = torch.ones(3, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
        return op if torch.equal(op(a, w, None, "none", [], ""), a @ w.t()) else None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


@functools.cache
def blas_plain_rows(dtype: torch.dtype) -> bool:
    """Whether ``cpu_gemm="auto"`` runs an expert of fewer than ``PACKED_MIN_ROWS`` rows (read from its plain weight:
    decode) through torch's BLAS instead of oneDNN's linear: float32 where that BLAS is MKL on an Intel CPU. MKL
    picks its code paths by CPU vendor: on the 2-core Sapphire Rapids Xeon its 1-2 row GEMMs beat oneDNN's linear,
    which also re-lays the plain weight inside every call (M = 1 / 8 / 64: 5.4 / 33.2 / 104.3 ms against 5.7 / 38.2
    / 113.1), while on the AMD EPYC oneDNN's ran 1.4-2x faster than MKL's
    (``benchmarks/results/Intel_Xeon-cpu-experts-2026-12-05.md``). bf16 / fp16: oneDNN (BLAS measured slower)."""
    return dtype == torch.float32 and torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string (e.g. GenuineIntel, AuthenticAMD); "" where unknown."""
    return cpuinfo_field("vendor_id")


def cpuinfo_field(key: str) -> str:
    """The first ``key : value`` line's value in ``/proc/cpuinfo`` (e.g. "model name"); "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """Whether ``_reorder_linear_weight`` exists here and oneDNN's linear takes its result for ``dtype``."""
    reorder = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_linear_weight", None)
    linear = onednn_linear(dtype)
    if reorder is None or linear is None:
        return False
    try:
        a, w = torch.ones(3, 16, dtype=dtype), torch.ones(8, 16, dtype=dtype)
        return torch.equal(linear(a, reorder(w, PACK_BATCH_HINT), None, "none", [], ""), a @ w.t())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _signature(w: torch.Tensor, batch_hint: int) -> tuple:
    """What the packed copies were made from; any difference means they are stale."""
    return (w._version, w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device, batch_hint)


@dataclass
class _Entry:
    signature: tuple
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # expert -> its packed [out, in]
    nbytes: int = 0


class PackedWeightCache:
    """oneDNN-packed copies of expert weights, per weight tensor and expert, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int | None = None, batch_hint: int = PACK_BATCH_HINT):
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self.batch_hint = batch_hint
        self._entries = WeakIdKeyDictionary()  # storage base tensor -> {view geometry: _Entry}

    def used_bytes(self) -> int:
        return sum(e.nbytes for views in self._entries.values() for e in views.values())

    def clear(self) -> None:
        self._entries.clear()

    def weight(self, w: torch.Tensor, expert: int) -> torch.Tensor:
        """w[expert] [out, in] packed (made now if new or stale, and the budget allows), else the plain view.
        An inference tensor (made under ``torch.inference_mode``) has no version counter to watch: never packed."""
        if w.is_inference():
            return w[expert]
        base = w if w._base is None else w._base
        views = self._entries.get(base)
        if views is None:
            views = self._entries[base] = {}
        geometry = (w.storage_offset(), tuple(w.shape), w.stride())
        signature = _signature(w, self.batch_hint)
        entry = views.get(geometry)
        if entry is None or entry.signature != signature:
            entry = views[geometry] = _Entry(signature)  # a stale entry's copies are released here
        packed = entry.experts.get(expert)
        if packed is not None:
            return packed
        plain = w[expert]  # [out, in]
        nbytes = plain.numel() * plain.element_size()
        if not packing_supported(w.dtype) or self.used_bytes() + nbytes > self.budget_bytes:
            return plain
        packed = entry.experts[expert] = torch.ops.mkldnn._reorder_linear_weight(plain, self.batch_hint)
        entry.nbytes += nbytes
        return packed


_CACHE = PackedWeightCache()
_REPACK_CACHE = RepackCache(default_budget_bytes())


def packed_weight_cache() -> PackedWeightCache:
    """The process-wide cache that ``cpu_gemm="auto"`` / ``"onednn_packed"`` use; set its ``budget_bytes``
    to bound it (0 turns packing off)."""
    return _CACHE


def repack_cache() -> RepackCache:
    """The process-wide cache of experts repacked for torch's CPU kernels (``moekit.experts.cpu_quant``);
    its ``budget_bytes`` bounds it as ``packed_weight_cache``'s does."""
    return _REPACK_CACHE


def clear_packed_weights() -> None:
    """Drop every packed copy (needed only after writes that bypass ``_version``, such as ``w.data.copy_``)."""
    _CACHE.clear()
    _REPACK_CACHE.clear()


@dataclass(frozen=True)
class ExpertParams:
    """One call's expert parameters as the contract passes them (weights may be strided views)."""

    w13: torch.Tensor | QuantizedWeight  # [E, R, K]; quantized: weight-only, in the inference loop only
    w2: torch.Tensor | QuantizedWeight  # [E, K, N]
    b13: torch.Tensor | None  # [E, R]
    b2: torch.Tensor | None  # [E, K]
    spec: ActivationSpec

    def need_grad(self) -> bool:
        return any(t is not None and t.requires_grad for t in (self.w13, self.w2, self.b13, self.b2))


def fused_loop_supported(dtype: torch.dtype) -> bool:
    return onednn_linear(dtype) is not None


# int64 index buffers per assignment alive at once: the grouping's ids, destinations and sort (at most 6),
# then src, tokens and the grouping's two kept ones through the loop (the combine weights are counted apart)
_INDEX_BYTES_PER_ASSIGNMENT = 6 * 8


def fused_loop_peak_bytes(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int,
                          dtype: torch.dtype, workers: int) -> int:
    """An upper bound on the bytes ``experts_cpu_fused`` allocates at once for M = ``num_tokens`` (weights
    and x excluded): the index buffers, the combine weights [A] and every expert's weighted rows [A, K]
    (acc) kept until the combine, plus the larger of the combine's out [M, K] (acc) and the rows in flight:
    ``workers`` experts of at most M rows each (at most A), each holding xs [m, K], h [m, 2N], the
    activation [m, N] and w2's output [m, K] in ``dtype``, and for a dtype narrower than acc the activation's
    acc buffers before its one rounding (``glu_rounded_once``: h [m, 2N] and act(gate) [m, N]). "At most M rows"
    holds when a token's k ids are distinct (``route()``'s; the masked layout's estimate assumes the same); ids
    repeated within a token can put more on one expert, and the in-flight term then undercounts unless ``workers``
    >= k."""
    a = num_tokens * top_k
    elem, acc = dtype.itemsize, torch.promote_types(dtype, torch.float32).itemsize
    row = (2 * hidden_size + 3 * intermediate_size) * elem + (3 * intermediate_size * acc if acc != elem else 0)
    in_flight = min(a, workers * num_tokens) * row
    kept = a * (_INDEX_BYTES_PER_ASSIGNMENT + acc + hidden_size * acc)
    return kept + max(in_flight, num_tokens * hidden_size * acc)


def experts_cpu_fused(x: torch.Tensor, ex: ExpertParams, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      expert_map: torch.Tensor | None, cache: PackedWeightCache | None,
                      workers: int = 1, quant: QuantKernels = QuantKernels(),
                      blas_plain: bool = False, one_row_blas: bool = False) -> torch.Tensor:
    """x [M, K] -> [M, K] in float32, the experts contract by the per-expert loop; ``cache`` None reads the
    plain weights. Inference only (no autograd through oneDNN's op); dtypes ``fused_loop_supported``.
    Weight-only quantized w13 / w2: each touched expert through ``quant``'s kernel (``moekit.experts.cpu_quant``).
    ``blas_plain``: experts of fewer than ``PACKED_MIN_ROWS`` rows on plain weight tensors (never packed) run through
    torch's BLAS, not oneDNN (``blas_plain_rows``); ``one_row_blas``: experts of one row on plain weights do (the
    caller says which: ``cpu_loop.one_row_blas_rows``; bf16: ``torch.mv`` on an AMX CPU, else mm: ``_blas_rows``).

    ``workers`` > 1 hands the experts to that many threads of one intra-op thread each as they free up
    (``moekit.experts.cpu_workers``); each expert's weighted rows are kept apart and added per token in
    expert order at the end, so the result has the same bits on every run and for every ``workers``."""
    top_k = topk_ids.shape[1]
    num_assignments = topk_ids.numel()
    pos = aligned_positions(topk_ids, ex.w13.shape[0], 1, expert_map)
    src = assignments_of_rows(pos.dst, num_assignments)  # [A] assignment of each sorted row; A past the routed
    acc = torch.promote_types(x.dtype, torch.float32)
    slot_weights = torch.cat([topk_weights.reshape(-1).to(acc), topk_weights.new_zeros(1, dtype=acc)])[src]  # [A]
    counts = pos.counts.tolist()  # no sync on the CPU
    starts = [0] * len(counts)
    for expert in range(1, len(counts)):
        starts[expert] = starts[expert - 1] + counts[expert - 1]
    # the weights each expert reads, resolved here in expert order: the cache is not thread-safe, and its
    # budget fills in the same order whatever the worker count
    linear = onednn_linear(x.dtype)
    blas = blas_plain and not weight_only(ex.w13)  # quantized experts bring their own GEMM
    one_row = one_row_blas and not weight_only(ex.w13)
    weights = {e: expert_weights(ex, e, cache if c >= PACKED_MIN_ROWS else None, quant, x.dtype,
                                 None if (blas and c < PACKED_MIN_ROWS) or (one_row and c == 1) else linear, c)
               for e, c in enumerate(counts) if c}
    loop = _ExpertLoop(x, ex, weights, counts, starts, src // top_k, slot_weights, acc, [None] * len(counts))
    order = largest_first(counts)
    run_dynamic(order, workers, loop.run)
    return loop.combine(sorted(order))


@dataclass(frozen=True)
class ExpertWeights:
    w13: object  # [R, K], plain view or packed; or a quantized expert's linear (``cpu_quant.expert_linear``)
    w2: object  # [K, N], the same
    b13: torch.Tensor | None  # [R]
    b2: torch.Tensor | None  # [K]
    linear: object  # oneDNN's linear; None: torch's BLAS (plain weights only)


def expert_weights(ex: ExpertParams, expert: int, cache: PackedWeightCache | None, quant: QuantKernels,
                   dtype: torch.dtype, linear, rows: int) -> ExpertWeights:
    """What ``expert`` reads: its weights packed through ``cache`` (None: plain views) or its quantized linears
    (``rows``: the expert's rows this call, which picks a quantized kernel)."""
    def one(w):
        if weight_only(w):
            return expert_linear(w, expert, dtype, quant, _REPACK_CACHE, rows)
        return w[expert] if cache is None else cache.weight(w, expert)

    return ExpertWeights(one(ex.w13), one(ex.w2), None if ex.b13 is None else ex.b13[expert],
                         None if ex.b2 is None else ex.b2[expert], linear)


@dataclass(frozen=True)
class _ExpertLoop:
    """One call's per-expert loop: ``run`` computes one expert's weighted rows (on any worker thread: it
    writes only that expert's slot of ``ys``), ``combine`` sums them per token in expert order."""

    x: torch.Tensor  # [M, K]
    ex: ExpertParams
    weights: dict[int, ExpertWeights]  # expert -> what it reads, for every expert with rows
    counts: list[int]  # [E] rows per expert
    starts: list[int]  # [E] its first sorted row
    tokens: torch.Tensor  # [A] token of each sorted row
    slot_weights: torch.Tensor  # [A] combine weight of each sorted row (acc)
    acc: torch.dtype
    ys: list[torch.Tensor | None]  # [E] each expert's weighted output [m_e, K] (acc), once ``run`` made it

    def run(self, expert: int) -> None:
        rows = slice(self.starts[expert], self.starts[expert] + self.counts[expert])
        xs = self.x.index_select(0, self.tokens[rows])  # [m, K]
        self.ys[expert] = _expert(xs, self.ex, self.weights[expert], self.slot_weights[rows, None], self.acc)

    def combine(self, experts: list[int]) -> torch.Tensor:
        """out [M, K] (acc): every expert's rows added in ``experts`` order (ascending), one serial
        ``index_add_`` each on one thread (on 2 threads OpenMP's barriers cost far more than the adds
        when a neighbour holds a core), so the same bits whichever worker ran what, and for any count."""
        out = self.x.new_zeros(self.x.shape[0], self.x.shape[1], dtype=self.acc)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for expert in experts:
                start = self.starts[expert]
                out.index_add_(0, self.tokens[start:start + self.counts[expert]], self.ys[expert])
        finally:
            torch.set_num_threads(threads)
        return out


def _expert(xs: torch.Tensor, ex: ExpertParams, w: ExpertWeights, scale: torch.Tensor,
            acc: torch.dtype) -> torch.Tensor:
    """xs [m, K] -> scale * (w2 @ glu(w13 @ xs^T + b13) + b2) as [m, K] (acc) for one expert's weights ``w``,
    ``scale`` [m, 1] (acc). With no b2 and xs already in acc, ``scale`` multiplies the [m, N] activation instead
    of the [m, K] output."""
    h = linear_rows(w.linear, xs, w.w13, w.b13)  # [m, R], the bias fused: one rounding
    a = glu_rounded_once(h, ex.spec, acc)  # [m, N] in xs's dtype, contiguous for oneDNN
    if w.b2 is None and a.dtype == acc:
        return linear_rows(w.linear, a.mul_(scale), w.w2, None)
    return linear_rows(w.linear, a, w.w2, w.b2).to(acc).mul_(scale)


def glu_rounded_once(h: torch.Tensor, spec: ActivationSpec, acc: torch.dtype) -> torch.Tensor:
    """An inference loop's activation: h [m, R] -> glu [m, N] in h's dtype, computed in ``acc`` (float32 for bf16 /
    fp16) and rounded once, as the second GEMM's operand (a bf16 activation rounded act(gate), then its product);
    a plain gated activation's product in place. No autograd (in place). A plain activation reads the gate as a
    strided view of h, so it iterates one row at a time whatever the rows (the phased loop's bits, ``glu_rows``)."""
    if not spec.plain:
        return apply_glu(h.to(acc), spec).to(h.dtype)
    wide, n_dim = h.to(acc), h.shape[1] // 2  # [m, R] acc (h itself when h is in acc)
    a = get_activation(spec.name).fn(wide[:, :n_dim])  # [m, N] acc, contiguous
    return a.mul_(wide[:, n_dim:]).to(h.dtype)


def linear_rows(linear, a: torch.Tensor, w, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, in] @ w [out, in]^T (+ bias [out]) -> [m, out]: oneDNN's ``linear`` on a weight tensor (plain or packed),
    torch's BLAS where ``linear`` is None (a plain weight, any strides), or a quantized expert's own (dequantized on
    this worker into oneDNN's ``linear``, or torch's weight-only kernel). Into ``out`` [m, out] when given (BLAS writes
    there, the others' result is copied)."""
    if not isinstance(w, torch.Tensor):
        result = w(a, bias, blas_linear if linear is None else linear)
    elif linear is None:
        return _blas_rows(a, w, bias, out)
    else:
        result = linear(a, w, bias, "none", [], "")
    return result if out is None else out.copy_(result)


@functools.cache
def bf16_row_gemv() -> bool:
    """Whether ``_blas_rows`` runs one bf16 row as a matrix-vector product (``torch.mv``), else as ``torch.mm``: on a
    CPU with AMX tiles. At Qwen3-30B-A3B's expert shapes on the Sapphire Rapids Xeon (AMX), 2 threads, 8 experts in
    cache, mv took 1.45 against mm's 1.97 ms (gate-up [1536, 2048]) and 0.89 against 1.29 (down [2048, 768]), the bits
    of mm (session 34). On the AMD EPYC (Zen 4: AVX-512 bf16, no AMX), 1 thread, 8 of 128 experts from DRAM, mv took
    10.2 against mm's 5.5 ms (gate-up) and 8.9 against 4.6 (down), and the gate-up's bits differed from mm's and
    oneDNN's linear (session 42, ``benchmarks/triton-notes.md``)."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return amx is not None and bool(amx())


def blas_linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, *_options) -> torch.Tensor:
    """oneDNN linear's call form on torch's BLAS, for quantized experts' linears where ``onednn_linear`` is None (bf16
    on an AVX2-only CPU); a float32 bias beside bf16 (as oneDNN takes it) added in float32 before the one rounding."""
    if bias is None or bias.dtype == a.dtype:
        return _blas_rows(a, w, bias, None)
    return torch.addmm(bias.float(), a.float(), w.float().t()).to(a.dtype)


def _blas_rows(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """``linear_rows`` on torch's BLAS: a [m, in] @ w [out, in]^T (+ bias [out]) -> [m, out]. One bf16 row on a weight
    of row-major rows runs as a matrix-vector product (``torch.mv``) where ``bf16_row_gemv`` says (fp32 sums rounded
    once either way; tested)."""
    if a.shape[0] == 1 and a.dtype == torch.bfloat16 and w.stride(1) == 1 and bf16_row_gemv():
        row = None if out is None else out[0]  # [out]
        y = torch.mv(w, a[0], out=row) if bias is None else torch.addmv(bias, w, a[0], out=row)
        return y.unsqueeze(0) if out is None else out
    return torch.mm(a, w.t(), out=out) if bias is None else torch.addmm(bias, a, w.t(), out=out)
