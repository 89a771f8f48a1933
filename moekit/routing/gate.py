"""The gate GEMM on one bound Triton launch: x [M, K] -> router logits [M, E], what ``F.linear(x, W, b)``
computes (fp32 accumulation, the output in x's dtype or the router dtype), at a fraction of its eager host time.

    [Gate] -> Route -> Capacity (opt-in) -> Group -> Experts -> Combine

Why: eagerly, ``F.linear`` goes through aten::linear, aten::t and cuBLAS(Lt)'s per-call setup; the H200
measured 13-36 µs of host time for Qwen3's and DeepSeek-V3's gates, against ~6 µs for a raw launch
(``moekit.triton_bind.RawLaunch``). Everything but the pointers is fixed per kind of call (M, dtypes,
strides, alignment) in a ``BoundLaunch``; the weight and bias are passed on every call, so replacing
them or updating them in place needs no invalidation. Torch twin: ``F.linear``, which the layer uses
wherever this does not apply (``gate_logits`` returns None): autograd, torch.compile, mixed dtypes, a
last dim that is not contiguous, and more than MAX_TOKENS rows.

A float32 router over bf16 / fp16 tensors (``router_dtype="float32"``, DeepSeek-V3's float32 gate weight): the kernels
read x and the weights as stored and upcast them in registers (``reads_as``), the float32 inputs' products and sums
without a cast copy before the launch (session 51; ``router_inputs`` casts only for the paths that need it). H100
(``benchmarks/rtr51_device_check.py``, every output bit-equal to the copies'): the layer's fast path at M = 1 on
Qwen3-30B-A3B shapes 35.6 -> 21.1 µs of host (bf16 routing: 20.8), the GPU 8-12 µs less at M = 8 / 64.

Only for decode-sized batches: each program loads a W tile once per K step and multiplies each row
into it, which reads W at the copy rate but sums every row across the tile's threads. H200, bf16
(``benchmarks/gate_device_check.py``), GPU µs against cuBLAS at M = 1 / 2 / 4 / 8: Qwen3 1.9 / 2.3 /
3.4 / 5.4 against 5.0-5.2; Mixtral 2.4 / 3.1 / 5.0 / 9.0 against 5.8; DeepSeek-V3 3.7 / 4.9 / 9.0 /
16.7 against 6.3-6.5. A tensor-core tile (rows masked up to 16) measured 5.4-15.6 µs at every M, never
faster than cuBLAS. So up to 4 rows the kernel is as fast as cuBLAS or within 2.7 µs of it on the
GPU and 15-45 µs cheaper on the host (decode steps are host-bound); up to 8 (MAX_TOKENS) within 10 µs on
the GPU, still cheaper in all (see MAX_TOKENS); above, ``F.linear``.

Also here: ``linear_into``, the gate above MAX_TOKENS rows as ``torch.mm`` / ``torch.addmm`` into a kept buffer
(the ops ``F.linear`` runs, without its dispatch and allocation), and ``router_inputs``, the router-dtype casts.
``moekit.routing.gate_route`` runs this kernel's tiles and the fused router in one launch.

Shapes: M tokens, K hidden, E experts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.func_ops import transforming
from moekit.triton_bind import BoundLaunch, next_pow2

# Rows up to which the kernel runs (module docstring: measured against cuBLAS). 8, not 4: at 5-8 rows the kernel costs
# up to 10 µs more GPU time than cuBLAS (DeepSeek-V3 16.7 against 6.5 at M = 8; Qwen3 +0.4, Mixtral +3.2) but saves
# torch.mm's 12-20 µs of host time, and in the layer the gate and router become one launch (``gate_route``), which
# saves the router's launch too; a decode step of 8 rows is host-bound (issue 13: the layer <= 60 µs at M = 8).
# One limit for every path (eager, the one launch, a CUDA graph), so they compute the same logits bit for bit.
MAX_TOKENS = 8
MAX_BOUND = 4096  # kinds of eager call whose launch is kept bound; the oldest goes first
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NARROW = (torch.bfloat16, torch.float16)  # read into float32 logits exactly: upcast in registers
# The router-dtype casts' A/B (``benchmarks/rtr51_device_check.py``): False, x and the gate weights are cast to the
# router dtype before the launch (session 50's copies: fresh tensors in the full forward, ``layer_fast.RouterCasts``'
# kept buffers on the fast path) instead of read in their stored dtypes. Read by ``MoE`` on every call and by
# ``layer_fast`` when it keeps an entry.
READ_STORED = True


@dataclass(frozen=True)
class _Tiles:
    """A launch's tile sizes: a program computes logits [block_m, block_e], stepping K by block_k."""

    block_m: int
    block_e: int
    block_k: int


def _tiles(num_tokens: int, num_experts: int, hidden: int) -> _Tiles:
    # A decode step reads W once: tiles of 2 experts x 2048 columns (16 values a thread at 4 warps) give
    # DeepSeek-V3's 3.7 MB gate 128 programs of 4 steps, Qwen3's 64 programs of one step.
    block_k = min(2048, next_pow2(hidden))
    block_e = min(next_pow2(num_experts), max(2, 4096 // block_k))
    return _Tiles(next_pow2(num_tokens), block_e, block_k)


def kernels():
    """The kernel module, imported on first use (Triton decides at decoration whether it is interpreted)."""
    return importlib.import_module("moekit.routing._kernels.gate_kernel")


class _BoundGate:
    """One kind of call (M, K, E, dtypes, strides, alignment, bias or not, device), decided once."""

    __slots__ = ("launch", "shape", "dtype")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        num_tokens, num_experts = x.shape[0], weight.shape[0]
        self.shape, self.dtype = (num_tokens, num_experts), dtype  # [M, E] logits in dtype
        t = _tiles(num_tokens, num_experts, weight.shape[1])
        grid = (-(-num_tokens // t.block_m), -(-num_experts // t.block_e))
        scalars = (num_tokens, weight.shape[1], x.stride(0), weight.stride(0), num_experts)  # out: [M, E] contiguous
        self.launch = None if num_tokens == 0 else BoundLaunch(
            kernels().gate_kernel, grid, 4, scalars, True, NUM_EXPERTS=num_experts, BLOCK_M=t.block_m,
            BLOCK_E=t.block_e, BLOCK_K=t.block_k, HAS_BIAS=bias is not None, num_warps=4)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out=None) -> torch.Tensor:
        out = x.new_empty(self.shape, dtype=self.dtype) if out is None else out  # [M, E] on x's device
        if self.launch is not None:
            self.launch(x, weight, weight if bias is None else bias, out)
        return out


# (shapes, strides, dtypes, devices, 16-byte alignment of x / W / b, the logits' dtype) -> its bound launch, or _LINEAR
_BOUND: dict[tuple, object] = {}


def clear_launch_caches() -> None:
    """Drop the bound launches (they hold the kernel they were bound to)."""
    _BOUND.clear()


def gate_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``F.linear(x [M, K], weight [E, K], bias [E] | None)`` -> [M, E] in ``dtype`` (default: ``out``'s, else x's)
    on the kernel, or None where the kernel does not apply (see the module docstring) and the caller runs
    ``F.linear``. x, weight and bias are read in their stored dtypes: each ``dtype``, or bf16 / fp16 for float32
    logits (upcast in registers: the float32 inputs' products and sums, ``reads_as``). Shapes, dtypes, devices and
    layouts are checked once per kind of call (everything they read is in its key). ``out``: written instead of a
    fresh tensor; the caller vouches that it is [M, E] contiguous in ``dtype`` on x's device
    (``moekit.routing.workspace``)."""
    dtype = (x.dtype if out is None else out.dtype) if dtype is None else dtype
    bound = bound_gate(x, weight, bias, dtype)
    return None if bound is None else bound(x, weight, bias, out)


def bound_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               dtype: torch.dtype | None = None) -> _BoundGate | None:
    """The bound launch ``gate_logits`` calls for this kind of call, logits in ``dtype`` (default x's; kept by
    ``moekit.layer_hash_fast``: called ``(x, weight, bias, out)`` on tensors of the same kind), or None where the
    kernel does not apply."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))) or transforming():
        return None  # autograd, or a torch.func transform (its tensors have no storage to launch on)
    dtype = x.dtype if dtype is None else dtype  # in the key as given or not: one launch a kind (layer_hash_fast's)
    key = (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() % 16 == 0, weight.shape, weight.stride(),
           weight.dtype, weight.get_device(), weight.data_ptr() % 16 == 0,
           None if bias is None
           else (bias.shape, bias.stride(), bias.dtype, bias.get_device(), bias.data_ptr() % 16 == 0), dtype)
    bound = _BOUND.get(key)
    if bound is None:
        bound = put_bounded(_BOUND, key, _BoundGate(x, weight, bias, dtype)
                            if _applies(x, weight, bias, MAX_TOKENS, dtype) else _LINEAR, MAX_BOUND)
    return None if bound is _LINEAR else bound


_LINEAR = object()  # in _BOUND: a kind of call the kernel does not take


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = MAX_TOKENS,
             dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel (up to ``max_rows`` rows: ``gate_mma``'s for the tensor-core one) computes
    F.linear(x, weight, bias) on these tensors' values into logits of ``dtype`` (default x's) for this kind of
    call: ``reads_as`` for the dtypes."""
    dtype = x.dtype if dtype is None else dtype
    if (x.dim() != 2 or weight.dim() != 2 or not reads_as(x, weight, bias, dtype)
            or x.shape[1] != weight.shape[1] or x.device != weight.device or x.stride(1) != 1 or weight.stride(1) != 1
            or x.shape[0] > max_rows):
        return False
    return bias is None or (bias.shape == weight.shape[:1] and bias.stride(0) == 1 and bias.device == x.device)


def reads_as(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the gate kernels read x, weight and bias as stored for logits in ``dtype`` (one of bf16, fp16,
    float32): each in ``dtype``, or in bf16 / fp16 for float32 logits, an exact upcast in registers, so the kernels
    compute what they compute on the inputs cast to float32 (the same products and sums: ``_kernels/gate_kernel.py``
    gives every float32-logits load float32's layout). A downcast (float32 x under a bf16 router) is not read."""
    if dtype not in _DTYPES:
        return False
    for t in (x, weight, bias):
        if t is not None and t.dtype != dtype and not (dtype == torch.float32 and t.dtype in _NARROW):
            return False
    return True


def takes_stored(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the gate kernels are given x, weight and bias as they are for logits in ``dtype``: each already in it,
    or read as stored (``READ_STORED`` and ``reads_as``); else the callers cast them (``router_inputs``,
    ``layer_fast.RouterCasts``). The one rule of the full forward (``gate_inputs``) and both decode fast paths."""
    if all(t is None or t.dtype == dtype for t in (x, weight, bias)):
        return True
    return READ_STORED and reads_as(x, weight, bias, dtype)


def router_dtype_of(weight: torch.Tensor, router_dtype: str | None) -> torch.dtype:
    """The router dtype (the logits'): ``router_dtype`` when set, else the gate weight's (``router_inputs``)."""
    return weight.dtype if router_dtype is None else getattr(torch, router_dtype)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                out: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x [M, K], weight [E, K], bias)`` written into ``out`` [M, E] (a kept buffer in x's dtype) through
    ``torch.mm`` / ``torch.addmm`` with ``out=``: the ops aten::linear calls for a 2-D input, so the same cuBLAS
    call and the same result, without aten::linear's dispatch or a fresh output. None where it does not apply
    (autograd, torch.compile, mixed dtypes); the caller runs ``F.linear``."""
    if (x.dtype != weight.dtype or x.dim() != 2 or out.dtype != x.dtype or torch.compiler.is_compiling()
            or (bias is not None and bias.dtype != x.dtype)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad))) or transforming()):
        return None  # out= has no forward-mode derivative: under a torch.func transform F.linear
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


def router_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: str | None):
    """(x [M, K], weight [E, K], bias [E] | None) in the router dtype: ``router_dtype`` when set (x and the weights
    cast for the GEMM, as Megatron's moe_router_dtype; a parameter keeps its dtype and gets its gradient through
    the cast), else the weight's dtype (DeepSeek-V3 keeps an fp32 gate in a bf16 model)."""
    dtype = router_dtype_of(weight, router_dtype)
    if weight.dtype != dtype:
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    return (x if x.dtype == dtype else x.to(dtype)), weight, bias


def gate_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: str | None,
                kernels: bool) -> tuple:
    """(x [M, K], weight [E, K], bias [E] | None, the router dtype) for ``MoE``'s gate: as stored where the caller runs
    the gate kernels (``kernels``) and they read them so for logits in the router dtype (``reads_as``: bf16 / fp16
    under a float32 router, upcast in registers: ``takes_stored``), else ``router_inputs``' casts."""
    dtype = router_dtype_of(weight, router_dtype)
    if not kernels or not takes_stored(x, weight, bias, dtype):
        x, weight, bias = router_inputs(x, weight, bias, router_dtype)
    return x, weight, bias, dtype


def torch_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: str | None,
               out: torch.Tensor | None, linear_mm) -> torch.Tensor:
    """The gate where no kernel took it, on ``router_inputs``' casts (the same tensors where already in the router
    dtype): ``linear_mm`` (``linear_into``, or None) into ``out`` where given, else ``gate_linear``."""
    x, weight, bias = router_inputs(x, weight, bias, router_dtype)
    logits = None if out is None or linear_mm is None else linear_mm(x, weight, bias, out)
    return gate_linear(x, weight, bias, router_dtype) if logits is None else logits


def gate_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, router_dtype: str | None):
    """``F.linear(x, weight, bias)`` on ``router_inputs``' tensors; with ``router_dtype`` set, outside autocast: a
    mixed-precision region casts F.linear's inputs to its own dtype (bf16 logits from a float32 router_dtype), the
    rounding router_dtype exists to keep out of the routing (Megatron runs its router GEMM the same way)."""
    if router_dtype is not None and torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
