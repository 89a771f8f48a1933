"""The host side of the int4 gate-up that loads its packed words straight into mma.sync's register operand (decode
"gluon_words", issue #16 target 1, session 45; the kernel: ``_kernels/gluon_wo_words.py``, whose module docstring
gives the dot order): what it requires (``check_words``, refused by name), the activations in its order
(``x_words``), the launch (``words_gate_up_launch``) and h of a call (``gate_up_words``). Named, or since session 48
the default of the cells an H100 measured it faster in (``triton_wo_words_default``, ``wd48_device_check.py``).
mxfp4 (session 46): the same words and dot order, the e8m0 scales in the decode (``_kernels/words_mx.py``, host side
``triton_wo_words_mx``); the route's call as a plan with a lean launch: ``triton_wo_words_lean``; the kernels' operand
order mirrored in torch: ``triton_wo_words_twin``.

    [align or the tiny-batch shortcut] -> x_words (x in the dot order, its 128-column sums) -> gate_up_words_kernel -> h

Shapes: M tokens, k slots, A = M*k, E experts, N intermediate, K hidden, g the int4 group size, W warps a program.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.triton_bind import BoundLaunch

STEP = 256  # columns a step of the kernel (32 words of a row)
BLOCK_ROWS = (8, 16)  # BM: the block's rows, the MMA's N (8 or two 8-column MMAs)
NUM_WARPS = 4  # a program's warps (8 gate rows each); sm_90, Triton 3.6 / 3.9: 112-116 registers, 4 programs an SM


def dot_columns() -> torch.Tensor:
    """[256] int64: the weight column within a step that dot column d holds (``gluon_wo_words``: with d's bits p =
    d0, q = d1 + 2 d2, g = d3, h = d4, j = d5 + 2 d6, c = d7, column 128 c + 32 q + 8 j + 4 p + 2 h + g)."""
    d = torch.arange(STEP)
    bit = [(d >> i) & 1 for i in range(8)]
    p, q, g, h, j, c = bit[0], bit[1] + 2 * bit[2], bit[3], bit[4], bit[5] + 2 * bit[6], bit[7]
    return 128 * c + 32 * q + 8 * j + 4 * p + 2 * h + g


def stored_dot_columns() -> torch.Tensor:
    """[256] int64: the dot column stored at position m of a step of ``x_words`` (each thread's B fragment
    contiguous: m = 64 (d1 + 2 d2) + d0 + 2 d3 + 4 d4 + 8 d5 + 16 d6 + 32 d7)."""
    m = torch.arange(STEP)
    bit = [(m >> i) & 1 for i in range(8)]  # m's bits: d0, d3, d4, d5, d6, d7, d1, d2
    return bit[0] + 8 * bit[1] + 16 * bit[2] + 32 * bit[3] + 64 * bit[4] + 128 * bit[5] + 2 * bit[6] + 4 * bit[7]


@functools.cache
def _x_order(device: torch.device) -> torch.Tensor:
    return dot_columns()[stored_dot_columns()].to(device)


@dataclass(frozen=True)
class XWords:
    """The activations as the kernel reads them."""

    x: torch.Tensor  # [M, K] x.dtype: column 256 s + m holds x[:, 256 s + dot_columns()[stored_dot_columns()[m]]]
    sums: torch.Tensor  # [M, K / 128] float32: sums[:, i] = x[:, 128 i:128 (i + 1)].sum(1) of the bf16 values


def x_words_torch(x: torch.Tensor) -> XWords:
    """x [M, K] (K a multiple of 256) in the kernel's order, and its sums over each half step's 128 columns (the
    zero points' term: a half step lies in one group, but a group of 256 or more spans several half steps)."""
    m, k = x.shape
    stored = x.view(m, k // STEP, STEP)[:, :, _x_order(x.device)].reshape(m, k)
    return XWords(stored, x.float().view(m, k // 128, 128).sum(-1))


def x_words(x: torch.Tensor) -> XWords:
    """``x_words_torch`` in one launch (``_kernels/words_x.py``; x contiguous)."""
    from moekit.experts._kernels.words_x import x_words_kernel

    m, k = x.shape
    out = XWords(torch.empty_like(x), torch.empty(m, k // 128, dtype=torch.float32, device=x.device))
    launch = x_words_launch(x_words_kernel, m, k, k)
    launch(x, out.x, out.sums)
    return out


@functools.lru_cache(maxsize=64)
def x_words_launch(kernel, m: int, k: int, padded: int) -> BoundLaunch:
    """The reorder of x [m, k] into [m, padded] (zeros past k) and its sums [m, padded / 128]: pointers x, out,
    sums."""
    return BoundLaunch(kernel, (m, padded // STEP), 3, (k, k, padded, padded // 128), cached=True, num_warps=4)


def is_mx(w) -> bool:
    """Whether a ``WeightArgs`` is mxfp4 (e8m0 scales, no zero points) rather than int4."""
    return w.scale.dtype == torch.uint8


def _check_scheme(w, name: str, cols: int) -> None:
    """int4 (uint8 codes, zero points, groups of a multiple of 128 dividing the reduction ``cols``) or mxfp4 (uint8
    codes, e8m0 scales of 32 whose factors the decode holds: ``triton_wo_words_mx.check_mx_scales``), by name."""
    if w.q.dtype != torch.uint8 or 2 * w.q.shape[2] != cols or w.zero.dtype != torch.uint8:
        raise ValueError(f"decode='gluon_words' runs int4_w4a16 (with zero points) or mxfp4: {name}.q uint8 with "
                         f"{cols} / 2 bytes a row, got {w.q.dtype} {tuple(w.q.shape)}")
    if is_mx(w):
        from moekit.experts.triton_wo_words_mx import check_mx_scales

        if w.group_size != 32:
            raise ValueError(f"decode='gluon_words' on mxfp4 needs {name}.group_size 32, got {w.group_size}")
        check_mx_scales(w.scale, name)
    elif w.group_size % 128 or cols % w.group_size:
        raise ValueError(f"decode='gluon_words' needs {name}.group_size a multiple of 128 dividing {cols}, got "
                         f"{w.group_size}")


def check_words_x_k(x: torch.Tensor, w13) -> None:
    """x's K is w13's (refused by name before a padded copy is made of w13)."""
    if 2 * w13.q.shape[2] != x.shape[1]:
        raise ValueError(f"decode='gluon_words' needs x [M, K] with w13's K {2 * w13.q.shape[2]}, got {x.shape[1]}")


def check_words(x: torch.Tensor, w13, top_k: int, block_rows: int = 8, num_warps: int = NUM_WARPS,
                split: int = 1, cols: int | None = None) -> None:
    """The kernel's requirements of x and w13 (a ``triton_wo_plan.WeightArgs`` of int4 or mxfp4) and the gate-up's
    split, each refused by name. ``cols``: the reduction the kernel reads where it is not x's K (a padded copy's K':
    ``triton_wo_words_pad``)."""
    num_experts, two_n, half_k = w13.q.shape
    n, k = two_n // 2, x.shape[1] if cols is None else cols
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"decode='gluon_words' needs x contiguous bf16, got {x.dtype}")
    if split < 1 or k % (STEP * split):
        raise ValueError(f"decode='gluon_words' needs K a multiple of {STEP} x the gate-up's split, got K {k}, "
                         f"split {split}")
    _check_scheme(w13, "w13", k)
    if n % (8 * num_warps):
        raise ValueError(f"decode='gluon_words' needs N a multiple of {8 * num_warps} (8 gate rows a warp), got {n}")
    if w13.scale.stride(2) != 1 or w13.zero.stride(2) != 1:
        raise ValueError("decode='gluon_words' needs w13.scale and w13.zero with contiguous groups")
    if w13.q.stride(2) != 1 or w13.q.stride(1) % 16 or w13.q.stride(0) % 16 or w13.q.data_ptr() % 16:
        raise ValueError("decode='gluon_words' needs w13.q rows contiguous at 16-byte aligned strides and address")
    if block_rows not in BLOCK_ROWS or top_k < 1:
        raise ValueError(f"decode='gluon_words': block_rows must be one of {BLOCK_ROWS} and top_k >= 1, got "
                         f"{block_rows}, {top_k}")


# steps of words in flight (``gluon_wo_words.words_loop``): 1 the measured form (session 45 H100: 62-75% of a pure
# read); 2 (w4u45) three steps a loop, +22-24 registers (3 programs an SM, ~48 KB of words in flight against ~32 KB),
# selectable and unmeasured: the device decides
AHEADS = (1, 2)


def check_ahead(ahead: int) -> None:
    if ahead not in AHEADS:
        raise ValueError(f"decode='gluon_words': ahead must be one of {AHEADS} (steps of words in flight), got {ahead}")


@dataclass(frozen=True)
class WordsVariant:
    """What a call asks of the kernels' epilogues beyond plain SiLU (gpt-oss's experts: ``ActivationSpec``'s fields
    and the expert biases): ``_kernels/words_glu.store_h``, the down GEMM's b2."""

    b13: bool = False  # b13 [E, 2N] added to the gate-up's sums
    b2: bool = False  # b2 [E, K] added to the down GEMM's (before the routed weight)
    interleaved: bool = False  # w13's rows gate i at 2i, up i at 2i + 1
    limit: float = 0.0  # gate <= limit, |up| <= limit; 0: none
    alpha: float = 1.0  # glu = gate sigmoid(alpha gate) (up + up_shift)
    up_shift: float = 0.0
    limit_after: bool = False  # with a limit: min(gate sigmoid(alpha gate), limit), gate unclamped (Step-3.7)


PLAIN = WordsVariant()


def words_gate_up_launch(w13, num_assignments: int, top_k: int, blocks: int, naive: bool, block_rows: int = 8,
                         num_warps: int = NUM_WARPS, h_order: bool = False, split: int = 1,
                         ahead: int = 1) -> BoundLaunch:
    """The gate-up launch of a call (after ``check_words``): ``blocks`` blocks of ``block_rows`` rows (naive: one
    assignment each), pointers (x_words.x, x_words.sums, q, scale, zero, h, ids, sorted_ids, expert_ids,
    num_padded, b13; the routing's three None when naive, b13 None: plain SiLU, the route's ``words_plan`` binds a
    ``WordsVariant``). ``h_order``: h stored in the dot order (``stored_dot_columns``),
    for ``words_down_launch``. ``split`` > 1: K's steps in that many programs, the h pointer float32 partials
    p [split A, 2N] (``wo_split.split_glu_kernel``'s). ``ahead``: steps of words in flight (``AHEADS``). Kept per
    kind of call (no tensor held)."""
    check_ahead(ahead)
    return _gate_up_bound(tuple(w13.q.shape), w13.strides, w13.group_size, num_assignments, top_k, blocks, naive,
                          block_rows, num_warps, h_order, split, ahead, is_mx(w13))


@functools.lru_cache(maxsize=256)
def _gate_up_bound(shape: tuple, strides: tuple, group: int, num_assignments: int, top_k: int, blocks: int,
                   naive: bool, block_rows: int, num_warps: int, h_order: bool, split: int, ahead: int,
                   mx: bool = False, variant: WordsVariant = PLAIN) -> BoundLaunch:
    from moekit.experts._kernels.gluon_wo_words import gate_up_words_kernel

    num_experts, two_n, half_k = shape
    n, k = two_n // 2, 2 * half_k
    qe, qr, _, se, sr, _, ze, zr, _ = strides
    out_stride = 2 * n if split > 1 else n  # p's rows or h's
    scalars = (n, k, num_assignments, top_k, num_experts, k, k // 128, qe // 4, qr // 4, se, sr, ze, zr, out_stride,
               2 * n)  # b13 contiguous [E, 2N]
    v = variant
    return BoundLaunch(gate_up_words_kernel, (blocks * (n // (8 * num_warps)), split), 11, scalars, cached=True,
                       BM=block_rows, GROUP=group, NAIVE=naive, num_warps=num_warps, H_ORDER=h_order, SPLIT=split,
                       AHEAD=ahead, MXFP4=mx, BIASED=v.b13, INTERLEAVED=v.interleaved, LIMIT=v.limit, ALPHA=v.alpha,
                       UP_SHIFT=v.up_shift, LIMIT_AFTER=v.limit_after)


def gate_up_words(x: torch.Tensor, w13, topk_ids: torch.Tensor, layout=None, num_warps: int = NUM_WARPS,
                  split: int = 1, ahead: int = 1):
    """h [A, N] (x.dtype) = silu(x w_gate^T) * (x w_up^T) of each assignment through the kernel. ``layout``: a
    ``moekit.layouts.block_aligned.BlockAlignedLayout`` of 8- or 16-row blocks, or None for the tiny-batch shortcut
    (one assignment a program). ``split`` > 1: K split over that many programs, their float32 partials summed and
    activated by ``wo_split.split_glu_kernel`` (one launch more). For tools and the device check; not a route's
    launch."""
    num_tokens, top_k = topk_ids.shape
    naive = layout is None or layout.naive
    block_rows = 8 if naive else layout.block_size
    check_words(x, w13, top_k, block_rows, num_warps, split)
    a, n = num_tokens * top_k, w13.q.shape[1] // 2
    blocks = a if naive else layout.expert_ids.numel()
    launch = words_gate_up_launch(w13, a, top_k, blocks, naive, block_rows, num_warps, split=split, ahead=ahead)
    xw = x_words(x)
    h = torch.empty(a, n, dtype=x.dtype, device=x.device)
    out = h if split == 1 else torch.empty(split * a, 2 * n, dtype=torch.float32, device=x.device)
    rows = (None, None, None) if naive else (layout.sorted_ids, layout.expert_ids, layout.num_padded)
    launch(xw.x, xw.sums, w13.q, w13.scale, w13.zero, out, topk_ids.reshape(-1), *rows, None)
    if split > 1:
        _glu_bound(split, a, n, x.device)(out, h)
    return h


@functools.lru_cache(maxsize=256)
def _glu_bound(split: int, num_assignments: int, n: int, device: torch.device) -> BoundLaunch:
    """The existing launch summing a split gate-up's partials into h = silu(gate) * up (``triton_wo_gemv``)."""
    from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
    from moekit.experts.triton_wo_gemv import glu_launch

    return glu_launch(split, num_assignments, n, 0, resolve_launch_options(LaunchOptions(dependent_launch=False),
                                                                          device))


def check_words_down(w2, split: int, num_warps: int = NUM_WARPS) -> None:
    """The down kernel's requirements of w2 (int4 or mxfp4 ``WeightArgs`` [E, K, N]) and the split, each refused by
    name."""
    num_experts, k, half_n = w2.q.shape
    n = 2 * half_n
    if split < 1 or n % (STEP * split):
        raise ValueError(f"decode='gluon_words': N must be a multiple of {STEP} x the down GEMM's split, got N {n}, "
                         f"split {split}")
    if k % (16 * num_warps):
        raise ValueError(f"decode='gluon_words' needs K a multiple of {16 * num_warps}, got {k}")
    _check_scheme(w2, "w2", n)
    if w2.q.stride(2) != 1 or w2.q.stride(1) % 16 or w2.q.stride(0) % 16 or w2.q.data_ptr() % 16:
        raise ValueError("decode='gluon_words' needs w2.q rows contiguous at 16-byte aligned strides and address")
    if w2.scale.stride(2) != 1 or w2.zero.stride(2) != 1:
        raise ValueError("decode='gluon_words' needs w2.scale and w2.zero with contiguous groups")


def words_down_launch(w2, num_assignments: int, blocks: int, naive: bool, split: int, block_rows: int = 8,
                      num_warps: int = NUM_WARPS, ahead: int = 1) -> BoundLaunch:
    """The down launch (after ``check_words_down``): pointers (h in the dot order, q, scale, zero, y [split A, K]
    (float32 when split), the routed weights [A] float32, ids, sorted_ids, expert_ids, num_padded, b2 (None: none)).
    Kept per kind."""
    check_ahead(ahead)
    return _down_bound(tuple(w2.q.shape), w2.strides, w2.group_size, num_assignments, blocks, naive, split,
                       block_rows, num_warps, ahead, is_mx(w2))


@functools.lru_cache(maxsize=256)
def _down_bound(shape: tuple, strides: tuple, group: int, num_assignments: int, blocks: int, naive: bool, split: int,
                block_rows: int, num_warps: int, ahead: int, mx: bool = False, biased: bool = False) -> BoundLaunch:
    from moekit.experts._kernels.gluon_wo_words_down import down_words_kernel

    num_experts, k, half_n = shape
    n = 2 * half_n
    qe, qr, _, se, sr, _, ze, zr, _ = strides
    scalars = (k, n, num_assignments, num_experts, n // STEP // split, n, qe // 4, qr // 4, se, sr, ze, zr, k, k)
    return BoundLaunch(down_words_kernel, (blocks * (k // (16 * num_warps)), split), 11, scalars, cached=True,
                       BM=block_rows, GROUP=group, NAIVE=naive, SPLIT=split, num_warps=num_warps, AHEAD=ahead, MXFP4=mx,
                       BIASED=biased)


def experts_words(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layout=None,
                  split: int = 1, ahead: int = 1) -> torch.Tensor:
    """The whole call on the words kernels (out [M, K], x.dtype): x in the dot order, the gate-up storing h in the
    dot order the down GEMM reads, the down GEMM (``split`` partials along N), the existing k-sum launch. ``layout``:
    as ``gate_up_words``'. ``ahead``: both kernels' steps of words in flight (``AHEADS``). For the device check and
    tools; no route takes it (selectable only)."""
    num_tokens, top_k = topk_ids.shape
    naive = layout is None or layout.naive
    block_rows = 8 if naive else layout.block_size
    check_words(x, w13, top_k, block_rows)
    check_words_down(w2, split)
    a, n, k = num_tokens * top_k, w13.q.shape[1] // 2, x.shape[1]
    blocks = a if naive else layout.expert_ids.numel()
    ids = topk_ids.reshape(-1)
    rows = (None, None, None) if naive else (layout.sorted_ids, layout.expert_ids, layout.num_padded)
    xw = x_words(x)
    h = torch.empty(a, n, dtype=x.dtype, device=x.device)
    gate_up = words_gate_up_launch(w13, a, top_k, blocks, naive, block_rows, h_order=True, ahead=ahead)
    gate_up(xw.x, xw.sums, w13.q, w13.scale, w13.zero, h, ids, *rows, None)
    y = torch.empty(split * a, k, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    down = words_down_launch(w2, a, blocks, naive, split, block_rows, ahead=ahead)
    down(h, w2.q, w2.scale, w2.zero, y, topk_weights.reshape(-1).float(), ids, *rows, None)
    out = torch.empty_like(x)
    _sum_bound(num_tokens, k, top_k, w13.q.shape[0], split, x.device)(y, ids, ids, out)
    return out


@functools.lru_cache(maxsize=256)
def _sum_bound(num_tokens: int, k: int, top_k: int, num_experts: int, split: int, device: torch.device):
    """The existing k-sum launch (``triton_plan.sum_launch``) over the down GEMM's splits and slots."""
    from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
    from moekit.experts.triton_plan import sum_launch

    options = resolve_launch_options(LaunchOptions(dependent_launch=False), device)
    return sum_launch(num_tokens, k, top_k, num_experts, None, options, split)


MIN_DOWN_PROGRAMS = 512  # the down GEMM splits along N until it has this many programs (4 an SM): a rule, unmeasured


def down_split(n: int, k: int, blocks: int, num_warps: int = NUM_WARPS) -> int:
    """The smallest split of the down GEMM's N steps (one dividing them) giving MIN_DOWN_PROGRAMS programs, else the
    finest."""
    steps = n // STEP
    splits = [s for s in range(1, steps + 1) if steps % s == 0]
    return next((s for s in splits if blocks * (k // (16 * num_warps)) * s >= MIN_DOWN_PROGRAMS), splits[-1])


@dataclass(frozen=True)
class WordsLayout:
    """The 8-row aligned blocks the words kernels read (what they take of ``BlockAlignedLayout``), built by the
    route's Triton alignment (``triton_align.plan_align``)."""

    sorted_ids: torch.Tensor  # [R] int32, A on padding rows
    expert_ids: torch.Tensor  # [R / 8] int32 (blocks past num_padded unread)
    num_padded: torch.Tensor  # [1] int32
    block_size: int = 8
    naive: bool = False


def words_layout(ids: torch.Tensor, num_experts: int) -> WordsLayout | None:
    """The words kernels' layout of a call (ids [M, k] contiguous): None for the tiny-batch shortcut (A * 4 <= E:
    the kernels read each block's expert from ids, so no layout is built), else 8-row blocks aligned by the pick's
    own launches (``triton_align``: 1-3 Triton launches, where ``align_block`` is ~15 torch ops a call)."""
    from moekit.experts.triton_align import run_align

    a = ids.numel()
    if words_layout_naive(a, num_experts):
        return None
    plan = _align_plan(a, num_experts, ids.device)
    b = {name: torch.empty(shape, dtype=dtype, device=ids.device) for name, dtype, shape in plan.regions}
    run_align(plan, ids, None, b)
    return WordsLayout(b["sorted_ids"], b["expert_ids"], b["num_padded"])


def words_layout_naive(num_assignments: int, num_experts: int) -> bool:
    """Whether the words kernels take the tiny-batch shortcut (A * 4 <= E: one assignment a block, read from ids)."""
    from moekit.layouts.block_aligned import use_naive

    return use_naive(num_assignments, num_experts, None)


@functools.lru_cache(maxsize=256)
def _align_plan(num_assignments: int, num_experts: int, device: torch.device):
    from moekit.experts.triton_align import plan_align
    from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
    from moekit.layouts.grouping import max_padded_rows

    rows = -(-max_padded_rows(num_assignments, num_experts, 8) // 8) * 8  # whole blocks
    options = resolve_launch_options(LaunchOptions(dependent_launch=False), device)
    return plan_align(num_assignments, num_experts, 8, None, rows, options)
