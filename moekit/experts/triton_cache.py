"""What the Triton experts path keeps between calls besides its plans: the weights' TMA descriptors and
the reused workspaces. Neither ever holds a tensor a caller sees.

    WeightDescriptors: id(w13) -> fingerprint, {plan's descriptor key: DescriptorPair (w13's, w2's)}
    WorkspacePool:     (device, stream, thread) -> one byte buffer, carved into a plan's regions, and
                       int32 counters kept at zero between calls (the folded k-sum's)

Shapes: E local experts, K hidden, N intermediate; a region's shape is the plan's (h [A, N], y [A, K], ...).
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded

REGION_ALIGN = 256  # bytes; every region starts on it (Triton specialises pointers on 16-byte alignment)
# A workspace larger than this is not kept whole: its regions outside POOLED_REGIONS are allocated per call
# (at that size the GPU time, over 1 ms at DeepSeek-V3 shapes, dwarfs an allocation, and a kept buffer
# would hold the memory for good). 256 MiB covers every preset up to M = 1024 (DeepSeek-V3 M=1024: h + y = 144 MiB;
# M=512: 75 MiB): there a fresh h and y buffer cost 12 µs to allocate and 1.8 to free of a 45 µs call (H200,
# benchmarks/host_mid_device_check.py, first run: the call's steps back to back). Was 128 MiB.
REUSE_MAX_BYTES = 256 << 20
# The alignment's regions (a few int32 per assignment and per expert): above REUSE_MAX_BYTES these stay in
# the pool and every other region (h, y; fp8's x_q, h_q, ...: the ones that grow with A*N and A*K) is carved
# from one fresh byte buffer per call. H200 (benchmarks/host_breakdown.py, "workspace buffers"): a fresh
# tensor per region cost 34 µs (DeepSeek-V3 M=4096) and 56 µs (Qwen3 M=4096).
POOLED_REGIONS = ("sorted_ids", "expert_ids", "num_padded", "counts", "hist", "chunk_start", "chunk_base", "offsets")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, eq=False)
class WorkspaceSpec:
    """The internal buffers of one plan, as named regions of one byte buffer. Compared and hashed by
    identity: a pool keeps its carved views per spec object, which lives in its plan."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # byte offset of each region in the buffer, a multiple of REGION_ALIGN
    nbytes: int  # the buffer size that holds every region
    # int32 counters the plan needs at 0 on entry and leaves at 0 (the folded k-sum's, [M * K tiles], then the
    # fused hist + scan's arrival slot): only a pool keeps them (its "counters" view); a fresh workspace has
    # none, and the plan then runs unfolded
    counters: int = 0
    # the regions a pool keeps above its max_bytes (``parts``); the others are allocated per call
    kept: tuple[str, ...] = POOLED_REGIONS

    @classmethod
    def of(cls, regions: list[tuple[str, torch.dtype, tuple[int, ...]]], counters: int = 0,
           kept: tuple[str, ...] = POOLED_REGIONS) -> "WorkspaceSpec":
        offsets, end = [], 0
        for _, dtype, shape in regions:
            offsets.append(end)
            end = _round_up(end + math.prod(shape) * dtype.itemsize, REGION_ALIGN)
        names, dtypes, shapes = zip(*regions) if regions else ((), (), ())
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), end, counters, kept)

    def parts(self) -> "WorkspaceParts":
        """The spec split for a pool's ``max_bytes``: ``pooled``, the ``kept`` regions (by default the
        alignment's, POOLED_REGIONS) with the counters, kept by a pool however large the plan; ``fresh``, the
        rest, allocated per call above it. Built once per spec."""
        parts = self.__dict__.get("_parts")
        if parts is None:
            regions = list(zip(self.names, self.dtypes, self.shapes))
            parts = WorkspaceParts(WorkspaceSpec.of([r for r in regions if r[0] in self.kept], self.counters),
                                   WorkspaceSpec.of([r for r in regions if r[0] not in self.kept]))
            object.__setattr__(self, "_parts", parts)
        return parts

    def allocate(self, device: torch.device) -> dict[str, torch.Tensor]:
        """A fresh tensor per region: the path without reuse (and the one a CUDA graph captures); no counters."""
        return {n: torch.empty(s, dtype=d, device=device) for n, d, s in zip(self.names, self.dtypes, self.shapes)}

    def carve(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``buffer`` (uint8, >= nbytes), one per region."""
        views = {}
        for name, dtype, shape, offset in zip(self.names, self.dtypes, self.shapes, self.offsets):
            size = math.prod(shape) * dtype.itemsize
            views[name] = buffer[offset:offset + size].view(dtype).view(shape)
        return views


@dataclass(frozen=True)
class WorkspaceParts:
    """A spec split in two (``WorkspaceSpec.parts``)."""

    pooled: WorkspaceSpec  # the alignment's regions and the counters: kept by a pool at any size
    fresh: WorkspaceSpec  # every other region (h, y; fp8's x_q, h_q, ...): per call above a pool's max_bytes


class _Workspace:
    __slots__ = ("buffer", "views")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer  # [bytes] uint8
        self.views: dict[WorkspaceSpec, dict[str, torch.Tensor]] = {}  # carved once per plan


class WorkspacePool:
    """Reused internal buffers of eager calls: one byte buffer per (device, stream, thread), grown to
    the largest plan seen (a power of two, at most ``max_bytes``), and each plan's views of it carved
    once. Safe because a stream runs its kernels in order: the next call's writes to h and y queue
    behind this call's reads. Keyed by stream, since two streams would race on one buffer, and by
    thread, since two threads launching on one stream would interleave their kernels. Not used while
    the current stream captures a CUDA graph (the graph must own its buffers: fresh tensors); above
    ``max_bytes`` only the spec's ``parts().pooled`` is. Bounded: ``max_entries`` buffers (oldest
    dropped; a dropped buffer is freed in stream order by the caching allocator, like any temporary),
    ``max_views`` plans each.

    A spec with ``counters`` also gets the "counters" view: int32 counters, zeroed once when allocated,
    which every kernel that uses them leaves at zero (the last arrival resets its counter: the folded
    k-sum's, the fused hist + scan's). Kept per (device, stream, thread) for the same reason as the
    buffer: two streams would share counts. Above ``max_bytes`` every region outside POOLED_REGIONS (h
    and y; fp8's x_q, h_q, ...) is carved per call from one fresh byte buffer (``WorkspaceSpec.parts``);
    the alignment's regions and the counters stay pooled."""

    def __init__(self, max_bytes: int = REUSE_MAX_BYTES, max_entries: int = 8, max_views: int = 256,
                 pow2: bool = True):
        self.max_bytes, self.max_entries, self.max_views = max_bytes, max_entries, max_views
        self.pow2 = pow2  # grow to a power of two (at most max_bytes); off: to the size asked (GB-sized workspaces)
        self._workspaces: dict[tuple, _Workspace] = {}
        self._counters: dict[tuple, torch.Tensor] = {}  # int32, all 0 between calls; zeroed once when allocated
        # moves whenever a buffer or counters tensor is replaced or dropped: what was recorded of the pool's
        # addresses before (``triton_fast``) is stale once it moved
        self.generation = 0

    def buffers(self, spec: WorkspaceSpec, device: torch.device) -> dict[str, torch.Tensor]:
        """The regions of ``spec`` on ``device``: views of the reused buffer, or fresh tensors."""
        if spec.nbytes <= self.max_bytes:
            return self.pooled(spec, device)
        # the alignment's regions kept, the rest carved from one fresh buffer
        parts = spec.parts()
        views = dict(self.pooled(parts.pooled, device))
        views.update(parts.fresh.carve(torch.empty(parts.fresh.nbytes, dtype=torch.uint8, device=device)))
        return views

    def pooled(self, spec: WorkspaceSpec, device: torch.device) -> dict[str, torch.Tensor]:
        """The regions of ``spec`` as views of the reused buffer, whatever its size (fresh tensors only
        while a CUDA graph captures). The same dict on every call until the buffer or counters change."""
        stream = 0
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return spec.allocate(device)
            if device.index is None:  # a tensor's device has its index; a caller's "cuda" may not
                device = torch.device("cuda", torch.cuda.current_device())
            stream = torch._C._cuda_getCurrentRawStream(device.index)
        key = (device, stream, threading.get_ident())
        workspace = self._workspaces.get(key)
        if workspace is None or workspace.buffer.numel() < spec.nbytes:
            workspace = self._grow(key, spec.nbytes, device)
        views = workspace.views.get(spec)
        if views is None:
            views = put_bounded(workspace.views, spec, spec.carve(workspace.buffer), self.max_views)
            if spec.counters:
                views["counters"] = self._kept_counters(key, spec.counters, device)
        return views

    def _kept_counters(self, key: tuple, count: int, device: torch.device) -> torch.Tensor:
        """The first ``count`` of the key's kept counters (grown to a power of two, zeroed when allocated;
        growing re-carves the key's views, which held the old ones)."""
        counters = self._counters.get(key)
        if counters is None or counters.numel() < count:
            self._counters.pop(key, None)
            self.generation += 1
            counters = put_bounded(self._counters, key, torch.zeros(1 << max(0, count - 1).bit_length(),
                                                                    dtype=torch.int32, device=device), self.max_entries)
            workspace = self._workspaces.get(key)
            if workspace is not None:
                workspace.views.clear()
        return counters[:count]

    def _grow(self, key: tuple, nbytes: int, device: torch.device) -> _Workspace:
        self.generation += 1
        self._workspaces.pop(key, None)
        size = max(nbytes, min(1 << max(0, nbytes - 1).bit_length(), self.max_bytes)) if self.pow2 else nbytes
        return put_bounded(self._workspaces, key, _Workspace(torch.empty(size, dtype=torch.uint8, device=device)),
                           self.max_entries)

    def held(self) -> dict[tuple, torch.Tensor]:
        """(device, stream, thread) -> the byte buffer kept for it."""
        return {key: workspace.buffer for key, workspace in self._workspaces.items()}

    def clear(self) -> None:
        self.generation += 1
        self._workspaces.clear()
        self._counters.clear()

    def __len__(self) -> int:
        return len(self._workspaces)


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int, pair_row: int | None = None):
    """A TMA tensor descriptor over w [E, rows, cols] as [E*rows, cols], blocks of [block_n, block_k];
    with ``pair_row`` (0 or 1), over row ``2i + pair_row`` of each pair only, as [E*rows/2, cols] with a
    row stride of 2*cols (the gate or the up rows of an interleaved w13). It holds ``w.detach()``'s
    view, an alias of the storage, never ``w`` itself (see ``WeightDescriptors``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    cols = w.shape[2]
    rows = w.detach().view(-1, cols)  # [E*rows, cols]
    if pair_row is not None:
        rows = rows.view(-1, 2 * cols)[:, pair_row * cols:(pair_row + 1) * cols]  # [E*rows/2, cols], stride 2*cols
    return TensorDescriptor.from_tensor(rows, [block_n, block_k])


class _WeightEntry:
    __slots__ = ("ref", "fingerprint", "descriptors")

    def __init__(self, ref: weakref.ref, fingerprint: tuple):
        self.ref, self.fingerprint = ref, fingerprint
        self.descriptors: dict[tuple, DescriptorPair] = {}  # plan's descriptor key -> its descriptors


@dataclass(frozen=True)
class DescriptorPair:
    """The TMA descriptors of one plan's weight tiles."""

    # over w13 [E, 2N or N, K] as [E*2N or E*N, K] (interleaved: its gate rows [E*N, K]), [BLOCK_N, BLOCK_K] blocks
    w13: object
    w13_up: object | None  # interleaved only: over w13's up rows as [E*N, K]; else None
    w2: object  # over w2 [E, K, N] as [E*K, N], blocks of the down tile [BLOCK_N, BLOCK_K]


PAIR_CHUNK = 64  # gate / up rows interleaved in chunks of this many in a PAIR_DOT tile (``gemm_fp8``'s PAIR_DOT)


def pair_chunk(block_n: int) -> int:
    """The chunk C of a PAIR_DOT gate-up tile BLOCK_N wide (it divides BLOCK_N)."""
    return min(block_n, PAIR_CHUNK)


def pair_descriptor(w13: torch.Tensor, block_n: int, block_k: int):
    """A TMA tensor descriptor over w13 [E, 2N, K] viewed as [E, N/C, 2, C, K] (C = ``pair_chunk(block_n)``; chunk j
    of the gate rows, then chunk j of the up rows; N a multiple of C), blocks of [1, block_n/C, 2, C, block_k]: one
    copy brings a gate tile and its up tile, interleaved by chunks (``gemm_fp8``'s PAIR_DOT)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (num_experts, two_n, hidden), chunk = w13.shape, pair_chunk(block_n)
    view = w13.detach().view(num_experts, 2, two_n // 2 // chunk, chunk, hidden).permute(0, 2, 1, 3, 4)
    return TensorDescriptor.from_tensor(view, [1, block_n // chunk, 2, chunk, block_k])


def descriptor_pair(w13: torch.Tensor, w2: torch.Tensor, key: tuple) -> DescriptorPair:
    """The descriptors of a plan's ``descriptor_key`` (interleaved, E, rows, K, up BLOCK_N, BLOCK_K,
    down BLOCK_N, BLOCK_K), built now; interleaved "pair": w13's through ``pair_descriptor``."""
    interleaved, up_n, up_k = key[0], key[-4], key[-3]
    if interleaved == "pair":
        gate, up = pair_descriptor(w13, up_n, up_k), None
    elif interleaved:
        gate, up = weight_descriptor(w13, up_n, up_k, 0), weight_descriptor(w13, up_n, up_k, 1)
    else:
        gate, up = weight_descriptor(w13, up_n, up_k), None
    return DescriptorPair(gate, up, weight_descriptor(w2, key[-2], key[-1]))


class WeightDescriptors:
    """TMA descriptors of expert weights, built once per (weights, storage address, layout, plan's blocks).

    Keyed by ``id(w13)`` and checked on every use against an address fingerprint, ``(id(w2), data_ptr,
    shape, strides, dtype of both)``: a new weight tensor, a move (new storage) or ``.data`` swapped for
    another view of the same memory (another shape, strides or dtype) builds them again. Never the
    ``_version``: a descriptor holds an address and a layout, never data (the kernel reads the weights
    when it runs), so an in-place update (``w.add_``; a copy into an offload cache's slots,
    ``moekit.offload``) keeps them and the launch sequences recorded over them (``triton_lean``).
    Caches of what is derived from the weights' values (the CPU experts' packed weights,
    ``experts.cpu_packed``) are keyed on ``_version``. An entry goes when w13 is freed (a weak reference),
    and it never keeps w13 alive: the descriptors hold ``w.detach()``. They do hold the storage, so its
    address is never reused while the entry lives, and a weight moved elsewhere keeps its old storage
    referenced until it is next used here or freed (``clear`` drops everything)."""

    def __init__(self):
        self._entries: dict[int, _WeightEntry] = {}

    def get(self, w13: torch.Tensor, w2: torch.Tensor, key: tuple, build=None) -> DescriptorPair:
        """The descriptors for the plan's ``key``: (interleaved, ..., up BLOCK_N, BLOCK_K, down BLOCK_N, BLOCK_K),
        built by ``build(w13, w2, key)`` (``descriptor_pair`` by default; the Gluon paths pass their own, with
        keys of their own that name the device and block shapes: ``triton_gluon_lean``)."""
        fingerprint = (id(w2), w13.data_ptr(), w13.shape, w13.stride(), w13.dtype, w2.data_ptr(), w2.shape, w2.stride(),
                       w2.dtype)
        entry = self._entries.get(id(w13))
        if entry is None or entry.fingerprint != fingerprint:
            entry = self._new_entry(w13, fingerprint)
        descriptors = entry.descriptors.get(key)
        if descriptors is None:
            descriptors = entry.descriptors[key] = (build or descriptor_pair)(w13, w2, key)
        return descriptors

    def _new_entry(self, w13: torch.Tensor, fingerprint: tuple) -> _WeightEntry:
        entries, key = self._entries, id(w13)

        def forget(ref: weakref.ref) -> None:
            entry = entries.get(key)
            if entry is not None and entry.ref is ref:
                del entries[key]

        entry = entries[key] = _WeightEntry(weakref.ref(w13, forget), fingerprint)
        return entry

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
