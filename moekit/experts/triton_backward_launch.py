"""The launches of the Triton experts backward (``_kernels/gemm_backward.py``). ``triton_backward`` holds
the custom ops and the autograd on top; ``triton_train_forward`` the forwards that keep x_p / h_p for it.

    align (recomputed, never the naive shortcut) -> grad_gate_up [dh, w*g, d weight partials]
      -> dX: gather_gemm "dh @ W13" per assignment -> the forward's k-sum kernel
      -> dW13 = dh^T x, dW2 = dout^T (w g): weight_grad per expert tile (split over M: fp32 partials,
         summed here in a fixed order)

Weight grads two ways (``KernelTiles.contiguous``): the gathering kernel reads each expert's rows by
index (pointer loads); the contiguous one reads operands laid out in the layout's rows, each expert's
rows one range, through TMA descriptors. With both weight grads contiguous, grad_gate_up writes dh and
w*g in the layout's rows ([P, ..], P = rows of sorted_ids, padding rows 0; dX reads dh there) and only
x and dout are permuted (``permute_rows``: [P, K] each, transient). A ``contiguous`` grad tile as well:
they are permuted first and grad_gate_up reads them through TMA too (``triton_backward_sorted``).

Tiles: ``BackwardTiles`` (the layout's block and one ``KernelTiles`` per GEMM), from ``backward_tiles``
(``TUNED`` by ``shape_class`` on the H200, else a heuristic) unless the caller passes its own
(``experts_backward(tiles=...)``; ``benchmarks/backward_tune.py`` times them).

Nothing here is cached between calls (a training step's GEMMs dwarf the host time) and nothing syncs
with the host. Under the interpreter the intermediates are float32, as in the forward (``triton.py``).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate, B = BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import get_activation
from moekit.experts.triton_align import plan_block_rows, run_align
from moekit.experts.triton_launch import LaunchOptions, cdiv, interpreting, kernels, next_pow2, resolve_launch_options
from moekit.experts.triton_plan import sum_launch
from moekit.experts.triton_wgrad import weight_grad_persistent
from moekit.triton_bind import COMPILE_OPTIONS

# The activations whose derivative ``_kernels/gemm_backward._act_and_grad`` knows.
BACKWARD_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "relu")
TARGET_PROGRAMS = 528  # a weight-grad grid this small is split over M: 4 programs per SM of a 132-SM H200
MAX_SPLIT_BYTES = 1 << 30  # the fp32 partials of a split weight grad stay under 1 GiB


@dataclass(frozen=True)
class KernelTiles:
    """One backward GEMM's tile: a program computes ``rows x cols`` of its output, ``red`` at a time."""

    cols: int  # output columns per program: grad_gate_up N, gather_gemm its OUT, weight_grad C
    red: int  # reduction step: grad_gate_up K, gather_gemm its RED, weight_grad layout rows (a power of 2, any)
    num_warps: int
    num_stages: int
    rows: int = 0  # weight_grad: output rows per program (R); 0 for the row-gathering kernels (the layout's block)
    split: int = 0  # weight_grad: ways an expert's rows split (``choose_split`` when 0, 1 = none); 0 elsewhere
    desc: bool = False  # grad_gate_up, gather_gemm: the weights through TMA descriptors where ``descriptor`` allows;
    # weight_grad with ``contiguous``: both permuted operands through TMA descriptors where ``descriptor`` allows
    contiguous: bool = False  # weight_grad: operands permuted once into the layout's rows (``red`` divides the block);
    # grad_gate_up: dout and x so (``triton_backward_sorted``; ``rows`` its M-block, 0 = the layout's); dX: dh
    # read in the layout's rows (``dx_sorted``, with both weight grads contiguous)
    group: int = 1  # weight_grad with ``contiguous``: row tiles of an expert that sweep its column tiles together;
    # grad_gate_up, dX with ``contiguous``: M-blocks that sweep the N tiles together
    dg_cols: int = 0  # grad_gate_up with ``contiguous``: 0 = dY @ W2 in the same K loop; else its own GEMM, this wide
    persistent: int = 0  # weight_grad with ``contiguous``, ``desc``, split 1: this many programs per SM walk the
    # tiles in one flat loop (``triton_wgrad``); 0 = a program per tile
    store_desc: bool = False  # weight_grad with ``persistent``: the output stored through a TMA descriptor
    flat: bool = True  # weight_grad with ``persistent``: one loop over tiles x steps per expert (else nested)


@dataclass(frozen=True)
class BackwardTiles:
    """The tiles of one backward call: the layout's block and each GEMM's tile."""

    block_m: int  # the layout's block: the M-block of grad_gate_up and gather_gemm
    grad: KernelTiles  # grad_gate_up: dY @ W2 (+ the gate-up recompute) and the act-and-mul backward
    dx: KernelTiles  # gather_gemm: dX's dh @ W13
    dw13: KernelTiles  # weight_grad: dh^T x, [2N, K] per expert
    dw2: KernelTiles  # weight_grad: dout^T (w g), [K, N] per expert
    fwd13: KernelTiles | None = None  # ``experts_triton_train``'s forward on x permuted (``triton_train_forward``):
    fwd2: KernelTiles | None = None  # its gate-up and down GEMMs (None: the inference forward, ``fused_experts``)


def shape_class(num_assignments: int, num_experts: int, n: int) -> str:
    """The key of ``TUNED``: the intermediate width (narrow N <= 1024, mid <= 4096, wide) and the rows
    per expert on average (few <= 256, some <= 1024, many)."""
    width = "narrow" if n <= 1024 else "mid" if n <= 4096 else "wide"
    rows = num_assignments // max(num_experts, 1)
    return f"{width}/{'few' if rows <= 256 else 'some' if rows <= 1024 else 'many'}"


def _tiles(cols: int, red: int, num_warps: int, num_stages: int, rows: int = 0) -> KernelTiles:
    return KernelTiles(cols, red, num_warps, num_stages, rows=rows)


def _sorted(cols: int, num_stages: int, dg_cols: int = 0) -> KernelTiles:
    """A grad_gate_up tile on dout and x permuted into the layout's rows (``triton_backward_sorted``):
    128 x ``cols``, 64-wide K steps, 8 warps, TMA loads, 8 M-blocks per sweep; ``dg_cols`` as the field."""
    return KernelTiles(cols, 64, 8, num_stages, rows=128, desc=True, contiguous=True, group=8, dg_cols=dg_cols)


def _contiguous(cols: int, num_stages: int, group: int, persistent: int = 0, flat: bool = True) -> KernelTiles:
    """A contiguous weight-grad tile: 128 x ``cols``, 64-row steps, 8 warps, TMA (``persistent``: stores too)."""
    return KernelTiles(cols, 64, 8, num_stages, rows=128, split=1, desc=True, contiguous=True, group=group,
                       persistent=persistent, store_desc=persistent > 0, flat=flat)


def _rows_tile(cols: int, num_stages: int, num_warps: int = 8) -> KernelTiles:
    """dX or the training forward on the layout's rows: 128 x ``cols``, 64-wide steps, TMA, 8 M-blocks per sweep."""
    return KernelTiles(cols, 64, num_warps, num_stages, rows=128, desc=True, contiguous=True, group=8)


# Measured winners on the H200 (sm_90, bf16) by ``shape_class``, one cell per class (the preset and M in each comment),
# 2026-12-01: grad_gate_up and dX from ``benchmarks/backward_tune.py``; the weight grads from ``wgrad_device_check.py``
# (commit 1caf1a8: the contiguous TMA kernel 17-85% of the bf16 mm against the gathering kernel's 17-36%; forward +
# backward at M=16384: Qwen3 11.6 -> 9.2 ms, DeepSeek-V3 119.5 -> 97.7, Mixtral 98.5 -> 74.6); grad_gate_up on permuted
# operands (``_sorted``) from ``train_ggu_device_check.py`` (commit d075047: DeepSeek-V3 29.2 -> 22.9 ms at 16384,
# Mixtral 24.4 -> 22.1, Qwen3 2.87 -> 2.72; at Qwen3 M=4096 the gathering kernel stays); the persistent weight grad,
# dX from dh in the layout's rows and Mixtral's forward on permuted rows from ``train_ds_device_check.py`` (commit
# 5a3df12, at 16384: DeepSeek-V3 dW13 15.57 -> 14.74 ms, dW2 7.62 -> 7.18, dX 13.20 -> 12.48; Mixtral forward + backward
# 73.87 -> 72.99). On the H100, "wide/few" and "mid/many" (no entry before: the heuristic) from
# ``benchmarks/trn50_device_check.py`` (session 50, at a7e00a0e): a training step 11.6 -> 7.0 ms at Mixtral M=1024 and
# 19.8 -> 13.1 at DeepSeek-V2-Lite M=16384. Classes not here take the heuristic below.
TUNED: dict[str, BackwardTiles] = {
    "narrow/few": BackwardTiles(  # qwen3-30b-a3b M=4096
        block_m=128, grad=_tiles(64, 64, 8, 4), dx=_tiles(256, 64, 8, 4),
        dw13=_contiguous(128, 3, 1), dw2=_contiguous(128, 3, 1)),
    "narrow/some": BackwardTiles(  # qwen3-30b-a3b M=16384
        block_m=128, grad=_sorted(64, 4), dx=_tiles(256, 64, 8, 4),
        dw13=_contiguous(256, 3, 8), dw2=_contiguous(256, 3, 8)),
    "mid/few": BackwardTiles(  # deepseek-v3 M=4096
        block_m=128, grad=_sorted(64, 4, dg_cols=256), dx=_tiles(256, 64, 8, 4),
        dw13=_contiguous(128, 3, 1), dw2=_contiguous(128, 3, 8)),
    "mid/some": BackwardTiles(  # deepseek-v3 M=16384
        block_m=128, grad=_sorted(128, 4, dg_cols=256), dx=_rows_tile(256, 4, 16),
        dw13=_contiguous(256, 3, 8, 1), dw2=_contiguous(256, 3, 8, 1, flat=False)),
    "wide/few": BackwardTiles(  # mixtral-8x7b M=1024 (H100): "wide/some"'s grad and dX, both weight grads persistent
        block_m=128, grad=_sorted(128, 4, dg_cols=256), dx=_tiles(256, 64, 8, 4),
        dw13=_contiguous(256, 3, 8, 1), dw2=_contiguous(256, 3, 8, 1)),
    "wide/some": BackwardTiles(  # mixtral-8x7b M=4096
        block_m=128, grad=_sorted(128, 4, dg_cols=256), dx=_tiles(256, 64, 8, 4),
        dw13=_contiguous(256, 3, 8), dw2=_contiguous(256, 3, 8)),
    "wide/many": BackwardTiles(  # mixtral-8x7b M=16384
        block_m=128, grad=_sorted(64, 3), dx=_rows_tile(256, 3), dw13=_contiguous(256, 3, 8, 1, flat=False),
        dw2=_contiguous(256, 4, 8), fwd13=_rows_tile(128, 4), fwd2=_rows_tile(128, 3)),
}
TUNED["mid/many"] = TUNED["mid/some"]  # deepseek-v2-lite M=16384 (H100)


def backward_tiles(num_assignments: int, num_experts: int, n: int, dtype: torch.dtype,
                   device: torch.device | None = None) -> BackwardTiles:
    """Small tiles under the interpreter (every tail masked at the tests' K=33, N=17); ``TUNED[shape_class]`` for bf16
    on an sm_90 device; else the forward's first guess: 128-row blocks from 256 rows per expert on average, else 64
    (less padding); float32 smaller weight tiles and 2 stages to stay in sm_90's 227 KB of shared memory."""
    if interpreting():
        small = KernelTiles(32, 16, 1, 1, rows=32)
        return BackwardTiles(16, KernelTiles(16, 32, 1, 1), KernelTiles(32, 16, 1, 1), small, small)
    tuned = TUNED.get(shape_class(num_assignments, num_experts, n))
    if (tuned is not None and dtype == torch.bfloat16 and device is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0)):
        return tuned
    block_m = 128 if num_assignments >= 256 * num_experts else 64
    if dtype == torch.float32:
        weight = KernelTiles(64, block_m, 8, 2, rows=64)
        return BackwardTiles(block_m, KernelTiles(64, 64, 8, 2), KernelTiles(128, 64, 8, 2), weight, weight)
    weight = KernelTiles(128, block_m, 8, 3, rows=128)
    return BackwardTiles(block_m, KernelTiles(64, 64, 8, 3), KernelTiles(128, 64, 8, 3), weight, weight)


def _precision(dtype: torch.dtype) -> dict:
    return dict(UPCAST=interpreting(), PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if interpreting() else x.dtype


def _options(device: torch.device) -> LaunchOptions:
    return resolve_launch_options(LaunchOptions(dependent_launch=False, cached_launcher=False), device)


@dataclass
class Layout:
    """The block-aligned layout the backward kernels walk (``moekit.layouts.block_aligned``'s fields)."""

    sorted_ids: torch.Tensor  # [R] int32, assignment of each row, A on padding rows
    expert_ids: torch.Tensor  # [R/B] int32, expert of each block, -1 past num_padded
    num_padded: torch.Tensor  # [1] int32, rows in use
    counts: torch.Tensor  # [E] int32, real rows per expert
    num_pid_m: int  # R/B
    num_assignments: int  # A; also the padding sentinel
    block_m: int  # B: each expert's rows padded to a multiple of it


def align(ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int) -> Layout:
    """The forward's alignment, recomputed (cheap against the GEMMs; never the naive shortcut)."""
    num_assignments = ids.numel()
    rows = plan_block_rows(num_assignments, num_experts, block_m, expert_map, _options(ids.device), shortcut=False)
    plan, num_pid_m = rows.align, rows.num_pid_m
    b = {name: torch.empty(shape, dtype=dtype, device=ids.device) for name, dtype, shape in plan.regions}
    run_align(plan, ids, expert_map, b)
    return Layout(b["sorted_ids"], b["expert_ids"], b["num_padded"], b["counts"], num_pid_m, num_assignments,
                  block_m)


def descriptor(w: torch.Tensor, block: list[int], red_rows: int = 0):
    """A TMA descriptor over w [E, rows, cols] as [E*rows, cols] with ``block``, or None where the pointer
    loads must stay: not 16-bit, not contiguous, rows not 16-byte aligned, or (``red_rows``, the
    reduction step of a reduction over rows) a step that would cross into the next expert's rows."""
    if (w.element_size() != 2 or not w.is_contiguous() or w.data_ptr() % 16 or w.shape[2] * 2 % 16
            or (red_rows and w.shape[1] % red_rows)):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(w.detach().view(-1, w.shape[2]), block)


def gather_gemm(a: torch.Tensor, a_div: int, w: torch.Tensor, out_dim: int, red_dim: int, out: torch.Tensor,
                layout: Layout, tile: KernelTiles, scale: torch.Tensor | None = None) -> None:
    """out[a] = scale[a] * W[e] a_src[a // a_div] over the layout's rows, W[e] read with w's dims
    (``out_dim``, ``red_dim``) as [OUT, RED]; a [S, RED] contiguous (``a_div`` 0: a's rows are the
    layout's rows, ``grad_gate_up(sorted_out=True)``), out [A, OUT] contiguous. ``tile.desc``: the weight
    through a TMA descriptor where ``descriptor`` allows it."""
    num_out, num_red = w.shape[out_dim], w.shape[red_dim]
    red_rows = red_dim == 1
    w_desc = None
    if tile.desc:
        w_desc = descriptor(w, [tile.red, tile.cols] if red_rows else [tile.cols, tile.red],
                            tile.red if red_rows else 0)
    grid = (layout.num_pid_m * cdiv(num_out, tile.cols),)
    kernels("gemm_backward").gather_gemm_kernel[grid](
        a, w if w_desc is None else w_desc, out, scale if scale is not None else a,
        layout.sorted_ids, layout.expert_ids, layout.num_padded,
        num_out, num_red, layout.num_assignments, a_div, layout.num_pid_m,
        a.stride(0), w.stride(0), w.stride(out_dim), w.stride(red_dim), out.stride(0),
        BLOCK_M=layout.block_m, BLOCK_N=tile.cols, BLOCK_K=tile.red, GROUP_M=8, HAS_SCALE=scale is not None,
        W_DESC=w_desc is not None, RED_ROWS=red_rows, A_SORTED=a_div == 0,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(a.dtype), **COMPILE_OPTIONS,
    )


def weight_grad(left: torch.Tensor, l_div: int, right: torch.Tensor, r_div: int, num_experts: int,
                out_dtype: torch.dtype, layout: Layout, tile: KernelTiles, split_m: int = 0) -> torch.Tensor:
    """[E, R, C]: out[e] = sum over e's rows a of left[a // l_div]^T right[a // r_div] (left [.., R],
    right [.., C], both contiguous). Split ``split_m`` ways, else ``tile.split``; 0 = ``choose_split``.
    ``tile.contiguous``: both operands in the layout's rows (a div of 0: already so, padding rows 0; else
    ``permute_rows`` first), so each expert's rows are one range (TMA loads with ``tile.desc``); else the
    kernel gathers rows by index."""
    rows, cols, num_assignments = left.shape[1], right.shape[1], layout.num_assignments
    tiles_per_expert = cdiv(rows, tile.rows) * cdiv(cols, tile.cols)
    split = split_m or tile.split or choose_split(num_experts * tiles_per_expert, num_assignments, num_experts,
                                                  rows * cols, tile.red)
    device = left.device
    if split == 1:
        out = torch.empty(num_experts, rows, cols, dtype=out_dtype, device=device)
    else:
        out = torch.empty(split, num_experts, rows, cols, dtype=torch.float32, device=device)
    grid = (num_experts * tiles_per_expert, split)
    common = dict(BLOCK_R=tile.rows, BLOCK_C=tile.cols, BLOCK_K=tile.red, E_PAD=next_pow2(num_experts),
                  num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(left.dtype))
    strides = (out.stride(0) if split > 1 else 0, rows * cols, cols)
    if tile.contiguous:
        if layout.block_m % tile.red:
            raise ValueError(f"a contiguous weight grad's step (red={tile.red}) must divide the layout's block "
                             f"({layout.block_m}): a step would cross into the next expert's rows")
        left = permute_rows(left, l_div, layout) if l_div else left
        right = permute_rows(right, r_div, layout) if r_div else right
        pair = ((descriptor(left[None], [tile.red, tile.rows]), descriptor(right[None], [tile.red, tile.cols]))
                if tile.desc else (None, None))
        use_desc = None not in pair
        if use_desc and tile.persistent and split == 1:
            return weight_grad_persistent(*pair, rows, cols, layout.counts, layout.block_m, out, tile)
        kernels("gemm_backward").weight_grad_contiguous_kernel[grid](
            *(pair if use_desc else (left, right)), out, layout.counts,
            rows, cols, num_experts, split, layout.block_m, left.stride(0), right.stride(0), *strides,
            GROUP_R=tile.group, DESC=use_desc, **common, **COMPILE_OPTIONS)
    else:
        if not l_div or not r_div:
            raise ValueError("the gathering weight grad takes operands by assignment (div >= 1); operands in the "
                             "layout's rows (div 0) need tile.contiguous")
        kernels("gemm_backward").weight_grad_kernel[grid](
            left, right, out, layout.sorted_ids, layout.counts,
            rows, cols, num_assignments, num_experts, l_div, r_div, split, layout.block_m,
            left.stride(0), right.stride(0), *strides, **common, **COMPILE_OPTIONS)
    return out if split == 1 else out.sum(0).to(out_dtype)  # a fixed-order sum: deterministic


def permute_rows(src: torch.Tensor, div: int, layout: Layout) -> torch.Tensor:
    """[P, C], P the layout's rows: row p = src[sorted_ids[p] // div] (src [S, C] contiguous), zeros on
    padding rows; rows past the ones in use are left unwritten (nothing reads them)."""
    cols = src.shape[1]
    num_rows, block_m = layout.sorted_ids.numel(), 32
    out = torch.empty(num_rows, cols, dtype=src.dtype, device=src.device)
    block_c = min(256, next_pow2(cols))
    kernels("gemm_backward").permute_rows_kernel[(cdiv(num_rows, block_m), cdiv(cols, block_c))](
        src, out, layout.sorted_ids, layout.num_padded, cols, layout.num_assignments, div, src.stride(0),
        out.stride(0), BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4, **COMPILE_OPTIONS)
    return out


def choose_split(num_programs: int, num_assignments: int, num_experts: int, weight_elems: int, step: int) -> int:
    """How many ways a weight grad splits each expert's rows: enough programs to fill the GPU
    (TARGET_PROGRAMS), at most half the ``step``-row steps an expert has on average (a part should loop
    over at least two), the fp32 partials under MAX_SPLIT_BYTES. 1 = no split (written in the weight's dtype)."""
    want = cdiv(TARGET_PROGRAMS, max(num_programs, 1))
    steps = num_assignments // max(num_experts * step, 1)
    fits = MAX_SPLIT_BYTES // max(num_experts * weight_elems * 4, 1)
    return max(1, min(want, steps // 2, fits))


def grad_gate_up(dout, x, w13, w2, weights, layout: Layout, tile: KernelTiles, activation: str,
                 sorted_out: bool = False):
    """(dh [A, 2N], w*g [A, N], d weight partials [A, N tiles] fp32) over the layout's rows; gate and up recomputed.
    dout, x [M, K], weights [A] contiguous. ``tile.desc``: both weights through TMA descriptors where ``descriptor``
    allows it for both. ``sorted_out``: dh, w*g rows are the layout's ([P, ..], padding rows 0, the rest unwritten)."""
    (_, two_n, hidden), n = w13.shape, w13.shape[1] // 2
    num_assignments, work = layout.num_assignments, _work_dtype(x)
    out_rows = layout.sorted_ids.numel() if sorted_out else num_assignments
    dh = torch.empty(out_rows, two_n, dtype=work, device=x.device)
    gw = torch.empty(out_rows, n, dtype=work, device=x.device)
    num_pid_n = cdiv(n, tile.cols)
    parts = torch.zeros(num_assignments, num_pid_n, dtype=torch.float32, device=x.device)  # unrouted rows stay 0
    w13_arg, w2_arg = w13, w2
    if tile.desc:
        pair = (descriptor(w13, [tile.cols, tile.red]), descriptor(w2, [tile.red, tile.cols], tile.red))
        if None not in pair:
            w13_arg, w2_arg = pair
    kernels("gemm_backward").grad_gate_up_kernel[(layout.num_pid_m * num_pid_n,)](
        dout, x, w13_arg, w2_arg, weights, dh, gw, parts,
        layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, hidden, num_assignments, num_assignments // dout.shape[0], layout.num_pid_m,
        dout.stride(0), x.stride(0), *w13.stride(), *w2.stride(), two_n,
        BLOCK_M=layout.block_m, BLOCK_N=tile.cols, BLOCK_K=tile.red, GROUP_M=8,
        ACT=get_activation(activation).kernel_id, W_DESC=w13_arg is not w13,
        OUT_SORTED=sorted_out,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_precision(x.dtype), **COMPILE_OPTIONS,
    )
    return dh, gw, parts


def sum_slots(per_slot: torch.Tensor, ids: torch.Tensor, expert_map, num_experts: int, out_dtype) -> torch.Tensor:
    """[M, K]: the forward's k-sum kernel over per_slot [A, K] (rows of unrouted slots never read)."""
    num_tokens, top_k = ids.shape
    out = torch.empty(num_tokens, per_slot.shape[1], dtype=out_dtype, device=per_slot.device)
    launch = sum_launch(num_tokens, per_slot.shape[1], top_k, num_experts, expert_map, _options(ids.device))
    launch(per_slot, ids, expert_map if expert_map is not None else ids, out)
    return out


@dataclass
class ExpertsGrads:
    """The gradients of one backward call; None where not asked for."""

    x: torch.Tensor | None  # [M, K] x.dtype
    w13: torch.Tensor | None  # [E, 2N, K] w13.dtype, contiguous
    w2: torch.Tensor | None  # [E, K, N] w2.dtype, contiguous
    topk_weights: torch.Tensor | None  # [M, k] topk_weights.dtype; 0 on slots not routed here


def experts_backward(dout, x, w13, w2, ids, weights, expert_map, h_pre, activation: str, needs: tuple,
                     split_m: int = 0, tiles: BackwardTiles | None = None, x_p=None) -> ExpertsGrads:
    """The grads (``needs``: x, w13, w2, topk_weights) of ``sum(out * dout)``; ``tiles`` None =
    ``backward_tiles``; ``x_p`` x already permuted into the layout's rows (``triton_train_forward.
    sorted_forward``) or None; ``h_pre`` the gate-up product h_p [P, 2N] that forward kept (with x_p, and
    the tiles made ``kept_tiles``) or None (recompute). Arguments checked by the caller; A > 0."""
    need_x, need_w13, need_w2, need_weights = needs
    num_experts, top_k = w13.shape[0], ids.shape[1]
    ids, dout, x = ids.contiguous(), dout.to(x.dtype).contiguous(), x.contiguous()  # the GEMMs' operands share a dtype
    expert_map = expert_map.contiguous() if expert_map is not None else None
    tiles = tiles or backward_tiles(ids.numel(), num_experts, w2.shape[2], x.dtype, x.device)
    from moekit.experts.triton_backward_sorted import grad_gate_up_sorted, kept_tiles  # it imports this module
    tiles = kept_tiles(tiles) if h_pre is not None else tiles
    layout = align(ids, expert_map, num_experts, tiles.block_m)
    sorted_out = tiles.dw13.contiguous and tiles.dw2.contiguous  # dh, w*g [P, ..] in the layout's rows (div 0)
    x_div = top_k  # x and dout: by token, or (0) permuted into the layout's rows for grad_gate_up and the dW
    if sorted_out and tiles.grad.contiguous:
        x = x_p if x_p is not None else permute_rows(x, top_k, layout)
        dout, x_div = permute_rows(dout, top_k, layout), 0
        dh, gw, parts = grad_gate_up_sorted(dout, x, w13, w2, weights.contiguous(), layout, tiles.grad, activation,
                                            h_pre)
    else:
        dh, gw, parts = grad_gate_up(dout, x, w13, w2, weights.contiguous(), layout, tiles.grad, activation,
                                     sorted_out)
    div = 0 if sorted_out else 1
    dx = dw13 = dw2 = dweights = None
    if need_x:
        per_slot = torch.empty(ids.numel(), x.shape[1], dtype=dh.dtype, device=x.device)  # [A, K]
        if sorted_out and tiles.dx.contiguous:  # dh [P, 2N] @ w13[e] [2N, K], dh through TMA
            from moekit.experts.triton_backward_sorted import dx_sorted

            dx_sorted(dh, w13, per_slot, layout, tiles.dx)
        else:
            gather_gemm(dh, div, w13, 2, 1, per_slot, layout, tiles.dx)  # dh [A, 2N] @ w13[e] [2N, K]
        dx = sum_slots(per_slot, ids, expert_map, num_experts, x.dtype)
    if need_w13:
        dw13 = weight_grad(dh, div, x, x_div, num_experts, w13.dtype, layout, tiles.dw13, split_m)
    del dh, x  # not read again: the weight grads of w2 run without them
    if need_w2:
        dw2 = weight_grad(dout, x_div, gw, div, num_experts, w2.dtype, layout, tiles.dw2, split_m)
    if need_weights:
        dweights = parts.sum(1).view(ids.shape).to(weights.dtype)
    return ExpertsGrads(dx, dw13, dw2, dweights)
