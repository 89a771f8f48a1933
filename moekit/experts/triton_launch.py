"""How the Triton experts path launches: the options a caller chooses, the device facts they are
resolved against, and the launch itself.

    LaunchOptions (asked for) --resolve_launch_options(options, device), cached--> LaunchOptions (what runs)
    BoundLaunch: one kernel launch whose grid, scalars and constexprs are fixed; called with its pointers

Every switch of the path is a field of one frozen dataclass, passed down to each launch; none is a
module global. So two callers in one process (a served model, an A/B benchmark, a test that poisons
the workspaces) each launch with their own options and never see each other's. What the device
decides (programmatic dependent launch exists only on NVIDIA compute capability >= 9.0, compiled) is
resolved once per (options, device) and cached: after the first call it costs one dictionary lookup.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, fields, replace

import torch

from moekit.triton_bind import interpreting, next_pow2  # noqa: F401  (next_pow2: re-exported for the plans)

ALIGN_CHUNK = 128  # assignments per alignment chunk program; the in-chunk rank is a [C, C] compare (16k lanes)
ALIGN_ONE_LAUNCH_LIMIT = 8192  # ids one program of the one-launch alignment holds in registers, at most
SHORTCUT_ANY_TOKENS = 1 << 30  # LaunchOptions.shortcut_max_tokens's "no limit" (use_naive's A*4 <= E bounds M first)


@dataclass(frozen=True)
class LaunchOptions:
    """The choices of one experts launch that do not change its result (``poison_workspace`` aside, which
    only turns a wrong read into NaN). Defaults are what the H200 measurements picked."""

    # 16-bit weights through TMA tensor descriptors where their strides allow it (others keep pointer
    # loads). On: H200 M=16384 Mixtral 23227 -> 20428 µs, Qwen3 3048 -> 2729; decode equal within noise.
    weight_descriptors: bool = True
    # Programmatic dependent launch: each kernel launches while the one before it drains. Asked for by
    # default, kept only where the device has it (``resolve_launch_options``). On: H200 Qwen3 M=1
    # 28.8 -> 27.7 µs, M=8 128.5 -> 124.7; Mixtral M=1 175.4 -> 173.3 (GEMMs signal after their main loop).
    dependent_launch: bool = True
    # Fill the [A, N] and [A, K] workspaces with NaN first, so that a read of a row no kernel wrote shows
    # up as NaN in the output. For tests: off by default, it costs a fill of each buffer.
    poison_workspace: bool = False
    # Up to align_small_max assignments (at most one chunk) and align_small_max_bins histogram bins
    # (next_pow2(E + 1)) the alignment is one single-program launch instead of three. H200 at M=8:
    # Mixtral (E=8, 16 bins) 4.1 µs against 6.6 µs for three launches; Qwen3 (E=128, 256 bins) 11.5 µs
    # against 6.8 µs, because one program then walks [blocks, bins] tiles that three launches spread.
    align_small_max: int = ALIGN_CHUNK
    align_small_max_bins: int = 64
    # The host path (``triton.py``'s module docstring has the picture). Each is an eager-mode saving
    # that leaves the kernels and the result unchanged, switchable so that an A/B names what it toggles
    # (``benchmarks/host_time.py``).
    # Eager calls skip the torch.library dispatcher and run the implementation directly (never while
    # torch.compile traces, under a dispatch mode, or when autograd would need the op).
    direct_eager: bool = True
    # The plan of a (shapes, dtypes, M, options) call and the weights' TMA descriptors are built once
    # and cached (``triton.clear_launch_caches``); off: rebuilt on every call.
    cache_plans: bool = True
    # A launch calls the compiled kernel's own launcher (``BoundLaunch``) instead of ``kernel[grid](...)``.
    cached_launcher: bool = True
    # The internal buffers (h, y, the alignment's) of eager calls are one reused workspace per (device,
    # stream, thread) instead of fresh allocations; never while a CUDA graph captures.
    reuse_workspace: bool = True
    # A bound launch calls the C launch function under Triton's launcher directly (``triton_bind.RawLaunch``:
    # no runner, no per-launch descriptor encoding), where the installed Triton's launcher has the layout
    # it was written for and no launch hook is installed. H200, Triton 3.6: a gate-up launch with TMA
    # weights 18.5 -> see benchmarks/results (host_breakdown).
    raw_launcher: bool = True
    # Past the single-program case, up to align_one_launch_max assignments the alignment is one launch of
    # many programs that each histogram all the ids themselves, and up to align_two_launch_max two (the
    # histogram, then the scan and the scatter together); above, three (hist, scan, scatter). 0 turns one
    # off. Every launch costs 5.5-7 µs of host time on the H200 (issue 13: <= 40 µs per call). One launch up to A =
    # 2048 (was 512): at M = 256 (A = 2048) its graph µs equal the two launches' within 0.3% (H200,
    # benchmarks/host_mid_device_check.py, second run: Qwen3 301.8 -> 302.5, DeepSeek-V3 4956.9 -> 4949.6), bit-equal.
    align_one_launch_max: int = 2048
    align_two_launch_max: int = 4096
    # Up to align_fold_max assignments (and past the naive shortcut) the experts GEMMs run with no
    # alignment launch at all: each gate-up program derives its own block from all the ids in its
    # prologue, and those of the first N tile write the layout for the down GEMM (``_kernels/gemm.py``,
    # FOLD). One launch fewer per call against a longer prologue in every gate-up program. 0 turns it
    # off. The bf16/fp16/fp32 and fp8 gate-up GEMMs fold (``_kernels/gemm_fp8.py``, FOLD); weight-only
    # keeps the launch. H200 (bf16, graph
    # replay, folded minus unfolded GPU µs): A=16 (Mixtral M=8) -2.5, A=64 (Qwen3 M=8) -2.0; A=128
    # (Mixtral M=64) +2.6, A=512 +3.0 (DeepSeek-V3 M=64) and +9.6 (Qwen3 M=64, +3.5%, eager GPU-bound),
    # A=1024 +167, A=4096 +513. Host: -37 µs at Qwen3 M=8, -22 to -42 at M=64. So the fold stays where
    # it costs no GPU time (benchmarks/host_align_device_check.py).
    align_fold_max: int = 64
    # Up to sum_fold_max tokens the k-sum runs in the down GEMM's epilogue (``_kernels/gemm.py``, KSUM):
    # each down program counts its rows' arrivals per (token, K tile) and the last of a token's slots sums
    # them, in the separate k-sum's order (equal bit for bit), so a call is one launch fewer. Eager calls
    # with a reused workspace only: the counters are kept zeroed in it (a CUDA graph capture and the custom
    # op run the separate k-sum). 0 turns it off. H200 (benchmarks/ksum_fold_device_check.py at a96e644, fold against
    # the separate launch): host -3 to -35 µs per call, GPU (graph) +2.6 to +15 µs at M = 1..64 on Qwen3-30B-A3B
    # and DeepSeek-V3 (+21 and +215 at M = 512), -2 to +1 on Mixtral-8x7B. Eager wall = max(host, GPU) drops
    # only where the call is host-bound: Qwen3 M=1 31.8 -> 28.6 µs (DeepSeek M=1 +0.6, Mixtral M=1 -2.0); at
    # M = 8 the GPU-bound cells lost (Qwen3 +4.4, DeepSeek +7.3). Measured again at M = 8 on the kernels of today
    # (benchmarks/host_mid_device_check.py, first run, graph µs separate -> folded): Qwen3 121.7 -> 121.4, DeepSeek-V3
    # 1266.5 -> 1268.8, Mixtral 574.6 -> 574.4, outputs bit-equal; a launch fewer is 6-9 µs of host time on that host.
    # So it folds up to M = 8 (a decode batch; the layer's host target there is 60 µs). The quantized paths fold
    # under the same limit: fp8_block's down GEMM (eager calls, the pool's counters) and the weight-only ones with
    # one split (lean eager calls; split-K keeps the launch).
    sum_fold_max: int = 8
    # Past sum_fold_max, up to sum_tail_max tokens, the k-sum runs in the down GEMM's grid instead: programs after
    # the GEMM's wait until every GEMM program has stored its y tile (one arrival each on a kept counter), then sum
    # as the separate ordered k-sum does (``_kernels/gemm.py``, SUM_AFTER; bit for bit). The GEMM's programs are
    # unchanged but for that one arrival; a call is one launch fewer. The same eager calls as sum_fold_max (the
    # pool's kept counters), bf16 and fp8_block. 0 turns it off. H200 (f6f35e93:benchmarks/host_launch_device_check.py,
    # run 1, raw/NVIDIA_H200-2026-12-03-ea57e59-host_launch.*; separate -> sum programs, all bit-equal): at M = 64 graph
    # µs within -0.12..+0.48% and host_rest µs 53.1 -> 48.9 (Qwen3), 56.1 -> 32.0 (DeepSeek-V3), 37.6 -> 32.9 (Mixtral),
    # fp8 41.2 -> 33.7 / 73.7 -> 65.0 / 50.1 -> 54.8; at M = 256 graph +0.2..+2.6%, at 1024 +0.8..+6.0% (Qwen3 375 ->
    # 398 µs): the sum programs run at the GEMM's occupancy. So up to M = 64.
    sum_tail_max: int = 64
    # Eager calls launch from their plan's recorded launch sequence (``triton_lean``): per (plan, thread, weights)
    # each launch's full argument list is built once (grids, scalars and constexprs, the pooled workspace's
    # regions and counters, the TMA descriptors' expansions); a call fills in only its own tensors (x, ids,
    # weights, out, map, biases, weights without descriptors; h and y above the pool's max_bytes) and calls
    # the C launch entry, the stream asked once per call (Triton 3.6's launcher layout; elsewhere the
    # compiled launcher with the same list). Rebuilt when the pool hands out other buffers or
    # the weights' descriptors are rebuilt, dropped on a retune; skipped (the BoundLaunch calls run) on a
    # plan's first call, while a CUDA graph captures, with a caller's counters or while a Triton launch hook
    # is installed. Outputs bit-equal. Needs cache_plans, cached_launcher and reuse_workspace and no
    # poison_workspace (``lean_ready``; else off). H200 host µs per call (benchmarks/triton-notes.md):
    # Qwen3-30B-A3B 51 -> 45 at M = 1, 204 -> 112 at M = 4096.
    lean_launch: bool = True
    # Past align_two_launch_max the alignment's histogram and scan are one launch (``align_hist_scan_kernel``:
    # the last chunk program to arrive scans), two launches in all instead of three, in eager calls whose
    # workspace keeps the counters (its arrival slot). H200 (benchmarks/host_lean_device_check.py, raw
    # NVIDIA_H200-2026-12-02-8f1dcd1-host_lean.json): bit-equal, host µs 60 -> 51 (Qwen3-30B-A3B M = 4096),
    # 114 -> 110 (Mixtral), graph µs within 1% either way but Qwen3 M = 4096 (767 against 806: 5% faster).
    align_scan_fold: bool = True
    # A repeated eager call (same weight tensors unchanged, same shapes and dtypes, no expert map or biases)
    # launches straight from what its first lean call kept (``triton_fast``): no argument check, plan,
    # workspace, descriptor or sequence lookup. Needs lean_launch (``lean_ready``) and direct_eager.
    fast_path: bool = True
    # From align_one_pass_from assignments (past align_two_launch_max), in the same eager calls as align_scan_fold (the
    # pool's kept counters), the whole alignment (hist, scan and scatter) is one launch of a persistent cooperative
    # grid (<= 2 programs per SM, all resident), its programs meeting at a barrier after the histogram
    # (``_kernels/align_one_pass.py``): one launch instead of two. 0 turns it off. H200, the alignment alone, GPU µs
    # two launches -> one (f6f35e93:benchmarks/host_big3_device_check.py, raw ...-54c56d0-launch3-ck2early):
    # Qwen3-30B-A3B A = 8192 / 16384 / 32768 / 131072: 10.4 -> 12.3, 15.2 -> 16.2, 23.1 -> 20.6, 69.3 -> 39.0
    # (DeepSeek-V3 11.6 -> 13.7, 16.5 -> 17.6, 25.1 -> 22.6, 72.8 -> 47.6; at A = 4096 against hist + place 7.4 ->
    # 11.0), host 4-7 µs less per call: the barrier costs 1-4 µs where the scan is short. So from A = 32768 (M = 4096
    # at top-8).
    align_one_pass_from: int = 32768
    # vLLM's tiny-batch shortcut (A*4 <= E, no map: block a = assignment a, no alignment) up to shortcut_max_tokens
    # tokens, the alignment past them (folded into gate-up where the plan folds): an expert's slots in one block. Past
    # one token the shortcut streams an expert once per slot that picks it (one token's k experts are distinct):
    # expected repeats M*k - E(1 - (1 - k/E)^M), DeepSeek-V3 M = 8 64 slots on ~57 experts (+12% bytes), Qwen3-30B-A3B
    # M = 4 32 on ~29 (+10%). 0: never the shortcut. Default: no limit, vLLM's rule alone. Session 54 (H100, graph
    # µs, raw/NVIDIA_H100-2026-12-08-dbab789-dsv52 / -tiny53): the alignment won at DeepSeek-V3 M = 8 (bf16 x1.15,
    # fp8 x1.14, int8 x1.09, int4 x1.07, 5/5 rounds) and lost or tied at M = 2-4 and Qwen3-30B-A3B M = 4 (x0.87-1.03,
    # its repeats read from L2): no token count serves both, so the default waits for a rule by expected repeats.
    shortcut_max_tokens: int = SHORTCUT_ANY_TOKENS

    def __post_init__(self) -> None:
        if not 0 <= self.align_small_max <= ALIGN_CHUNK:
            raise ValueError(f"align_small_max must be in [0, {ALIGN_CHUNK}] (one chunk), got {self.align_small_max}")
        if not 0 <= self.align_one_launch_max <= ALIGN_ONE_LAUNCH_LIMIT:
            raise ValueError(f"align_one_launch_max must be in [0, {ALIGN_ONE_LAUNCH_LIMIT}] (the ids one program "
                             f"holds), got {self.align_one_launch_max}")
        if not 0 <= self.align_fold_max <= ALIGN_ONE_LAUNCH_LIMIT:
            raise ValueError(f"align_fold_max must be in [0, {ALIGN_ONE_LAUNCH_LIMIT}] (the ids one program "
                             f"holds), got {self.align_fold_max}")
        if self.sum_fold_max < 0:
            raise ValueError(f"sum_fold_max must be >= 0 (tokens), got {self.sum_fold_max}")
        if self.sum_tail_max < 0:
            raise ValueError(f"sum_tail_max must be >= 0 (tokens), got {self.sum_tail_max}")
        if self.align_one_pass_from < 0:
            raise ValueError(f"align_one_pass_from must be >= 0 (assignments), got {self.align_one_pass_from}")
        if self.shortcut_max_tokens < 0:
            raise ValueError(f"shortcut_max_tokens must be >= 0 (tokens), got {self.shortcut_max_tokens}")
        if self.align_two_launch_max < 0:
            raise ValueError(f"align_two_launch_max must be >= 0, got {self.align_two_launch_max}")
        # lean_launch and what it needs (read on every eager call: computed once)
        object.__setattr__(self, "lean_ready", self.lean_launch and self.cache_plans and self.cached_launcher
                           and self.reuse_workspace and not self.poison_workspace)
        object.__setattr__(self, "fast_ready", self.lean_ready and self.fast_path and self.direct_eager)
        object.__setattr__(self, "_args", self.as_op_args())
        object.__setattr__(self, "_hash", hash(self._args))

    def __hash__(self) -> int:
        # Every eager call hashes its options in the plan key: computed once (the fields are frozen),
        # not by the generated __hash__ on each call (~1 µs on a slow CPU).
        return self._hash

    def __eq__(self, other) -> bool:
        # A plan lookup compares the options whenever the call's object is not the one the plan was keyed
        # with (each function's default LaunchOptions() is its own object; the custom op builds one per
        # call): one tuple comparison of the kept fields, not the generated __eq__'s two new tuples.
        if self is other:
            return True
        return other.__class__ is self.__class__ and self._hash == other._hash and self._args == other._args

    def as_op_args(self) -> tuple:
        """The fields in order: how the options cross a custom op's schema (no dataclasses there)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def pdl_kwargs(self) -> dict:
        """Keyword arguments of every kernel launch: the kernels' ``PDL`` constexpr and Triton's
        ``launch_pdl``. Only meaningful on resolved options."""
        return dict(PDL=self.dependent_launch, launch_pdl=self.dependent_launch)


def is_available(device: torch.device | str) -> bool:
    """True on CUDA with Triton importable; on the CPU only under ``TRITON_INTERPRET=1`` (so ``auto``
    never picks the interpreter on its own)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _major_capability_of(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def has_dependent_launch(device: torch.device) -> bool:
    """Programmatic dependent launch exists on NVIDIA devices of compute capability 9.0 and later; never
    under the interpreter, never on ROCm (whose "cuda" devices report capabilities like 9.4 but have no
    griddepcontrol)."""
    return (device.type == "cuda" and torch.version.hip is None and not interpreting()
            and _major_capability_of(_index(device)) >= 9)


@functools.lru_cache(maxsize=None)
def resolve_launch_options(options: LaunchOptions, device: torch.device) -> LaunchOptions:
    """``options`` as they run on ``device``: what the device lacks switched off. Cached."""
    return replace(options, dependent_launch=options.dependent_launch and has_dependent_launch(device))


def default_launch_options(device: torch.device) -> LaunchOptions:
    """The default options, resolved for ``device``."""
    return resolve_launch_options(LaunchOptions(), device)


@functools.lru_cache(maxsize=None)
def _max_shared_memory_of(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device``: the limit Triton's launcher checks."""
    return _max_shared_memory_of(_index(device))


def kernels(name: str):
    """The kernel module ``moekit.experts._kernels.<name>``, imported on first use: Triton decides at
    decoration time whether a kernel is compiled or interpreted."""
    return importlib.import_module(f"moekit.experts._kernels.{name}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
