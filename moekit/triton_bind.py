"""Triton launches at the lowest host cost the installed Triton allows, shared by both kernel packages
(``moekit.experts``, ``moekit.routing``): a launch whose grid, scalars and constexprs are fixed once,
then called with its pointers alone. Triton itself is only touched when a kernel is launched.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import types

import torch

# The compile options every moekit kernel asks for, Triton and Gluon alike: each ``kernel[grid](...)`` launch passes
# ``**COMPILE_OPTIONS`` and a ``BoundLaunch`` adds them to its options itself (a caller's own choice wins). FP fusion
# (FMA contraction): every kernel was tuned and checked with it on, Triton 3.6-3.9's default; Triton 3.9 warns at a
# compile that leaves it unset and 3.10 turns the default off. Asked for per compile, never through
# ``TRITON_DEFAULT_FP_FUSION`` or ``triton.knobs``: those would change the user's other kernels too.
COMPILE_OPTIONS = types.MappingProxyType({"enable_fp_fusion": True})

LEAD_X = object()  # among a joined lead launch's pointers (``triton_fast.JointCall``): the call's x
LEAD_AUX = object()  # among them too: the call's one other per-call tensor (the hash router's token ids: ``aux``)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes are powers of two."""
    return 1 << max(0, (n - 1).bit_length())


# A raw launch hands each tensor among its pointers to the C launch as its address: given a tensor, Triton's
# launcher calls its data_ptr and then cuPointerGetAttribute, a driver call, for each such argument of each
# launch (the gate and router launch has ten). A CUDA tensor's data_ptr is its device address: the kernel gets
# the same arguments. Off: the tensors as before (the A/B switch of ``f6f35e93:benchmarks/host_trim2_device_check.py``).
PASS_ADDRESSES = True
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA with Triton importable, the CPU only interpreted."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


class BoundLaunch:
    """One kernel launch of a plan: its grid, scalar arguments and constexprs fixed when the plan is
    built; a call passes only the leading pointer (tensor, descriptor or None) arguments.

    With ``cached`` the first call goes through ``kernel[grid](...)`` (Triton binds the arguments,
    specialises, compiles if needed) and keeps what it returns, the compiled kernel; later calls hand the
    full argument list straight to its launcher (``CompiledKernel[grid]``), skipping the binder, the
    specialisation key and the cache lookup of every ``kernel[grid]`` call. That is sound because all
    Triton specialises on is fixed for a plan: the scalars here, and the pointers' dtypes and 16-byte
    alignment, which are part of the plan's key. Where the returned object is not such a kernel (another
    Triton, an asynchronous compile) it stays on ``kernel[grid]``. Under the interpreter the "launcher"
    is ``kernel[grid]`` itself, called with the same full argument list, so tests run the bookkeeping.
    """

    __slots__ = ("kernel", "grid", "tail", "options", "cached", "raw", "_launcher", "_raw", "_named")

    def __init__(self, kernel, grid: tuple, num_pointers: int, scalars: tuple, cached: bool, raw: bool = True,
                 **constexprs_and_options):
        defaults = _defaults(kernel.fn)  # {parameter name: its default, or _NO_DEFAULT}, in signature order
        rest = list(defaults)[num_pointers + len(scalars):]
        missing = [n for n in rest if n not in constexprs_and_options and defaults[n] is _NO_DEFAULT]
        if missing:
            raise TypeError(f"{kernel.fn.__name__}: no value for {missing}")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled launcher reads grid[0..2]
        self.tail = (*scalars, *(constexprs_and_options.pop(n, defaults[n]) for n in rest))  # signature order
        # what is left: Triton's num_warps, num_stages, launch_pdl; COMPILE_OPTIONS unless the caller chose otherwise
        self.options = {**COMPILE_OPTIONS, **constexprs_and_options}
        # the trailing parameters by name for the compiling call: Triton takes its compile options from the keyword
        # arguments only, so a parameter that is also an option (a Gluon kernel's ``num_warps: gl.constexpr``)
        # passed by position would compile with the option's default
        self._named = tuple(rest)
        self.cached = cached
        self.raw = raw and cached  # the C launch past Triton's Python wrappers (``RawLaunch``), where it exists
        self._launcher = None
        self._raw = None

    def compile_arguments(self, pointers: tuple) -> tuple[tuple, dict]:
        """(positional, keyword) arguments of the compiling call (and of a warm-up): the pointers and scalars by
        position, the trailing parameters by name, then the options."""
        split = len(self.tail) - len(self._named)  # the scalars, then the named rest
        return (*pointers, *self.tail[:split]), {**dict(zip(self._named, self.tail[split:])), **self.options}

    def __call__(self, *pointers) -> None:
        raw = self._raw
        if raw is not None and raw.hooks.idle():
            raw(pointers, self.tail)
            return
        launcher = self._launcher
        if launcher is not None:
            launcher(*pointers, *self.tail)
            return
        args, kwargs = self.compile_arguments(pointers)
        compiled = self.kernel[self.grid](*args, **kwargs)
        if self.cached:
            self._launcher = _launcher_of(compiled, self.kernel, self.grid, self.options)
            self.cached = self._launcher is not None  # else kernel[grid] for good, without asking again
            if self.raw and self.cached and not interpreting():
                self._raw = RawLaunch.of(compiled, self.grid)


_NO_DEFAULT = inspect.Parameter.empty


@functools.lru_cache(maxsize=None)
def _defaults(fn) -> dict:
    """The parameters of a kernel's Python function, in order, with their defaults (or _NO_DEFAULT)."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def _launcher_of(compiled, kernel, grid: tuple, options: dict):
    """The callable that launches ``compiled`` on ``grid`` from the full argument list, or None."""
    if interpreting():
        return functools.partial(kernel[grid], **options)
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None
    try:
        return compiled[grid]
    except (AttributeError, TypeError):
        return None


class LaunchHooks:
    """Triton's launch hooks (profilers such as proton add theirs). The raw launch skips them, so it
    is only taken while no hook is installed; ``idle`` is read on every call."""

    __slots__ = ("runtime",)

    def __init__(self, runtime):
        self.runtime = runtime  # triton.knobs.runtime

    def idle(self) -> bool:
        enter, leave = self.runtime.launch_enter_hook, self.runtime.launch_exit_hook
        return ((enter is None or not getattr(enter, "calls", True))
                and (leave is None or not getattr(leave, "calls", True)))


class RawLaunch:
    """A compiled kernel launched through the C entry of its launcher module, skipping the Python layers
    a ``CompiledKernel[grid]`` call goes through each time: the runner (current device and stream
    objects, launch metadata), the launcher object (scratch allocation) and, for kernels with TMA
    tensor descriptors, the per-launch loop that expands every descriptor into its encoded CUtensorMap,
    shape and strides. Measured on the H200 (Triton 3.6): those layers cost 8 µs of a plain launch and
    18 µs of a launch with descriptors (``benchmarks/host_breakdown.py``).

    The expansion is computed once per descriptor object and kept on it (a descriptor is built once
    per weight tensor and version by the experts' descriptor cache, and encodes only its base pointer,
    shape and strides). Built only for the launcher layout of Triton 3.6 (``CudaLauncher.launch`` the
    C function ``launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch,
    profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``, possibly
    wrapped by the descriptor expansion), for kernels without global or profile scratch; ``of``
    returns None for anything else, and the runner is used."""

    __slots__ = ("c_launch", "grid", "function", "cooperative", "pdl", "metadata", "desc_positions", "desc_args",
                 "desc_keys", "hooks", "stream")

    @classmethod
    def of(cls, compiled, grid: tuple) -> "RawLaunch | None":
        launcher = getattr(compiled, "_run", None)
        module = sys.modules.get(type(launcher).__module__)
        if (type(launcher).__name__ != "CudaLauncher" or getattr(module, "_BASE_ARGS_FORMAT", None) != _BASE_FORMAT
                or hasattr(launcher, "arg_annotations") or getattr(launcher, "num_ctas", 1) != 1
                or getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)):
            return None
        c_launch = _unwrapped(launcher.launch)
        signature = list(getattr(getattr(compiled, "src", None), "signature", {}).values())
        positions = tuple(i for i, t in enumerate(signature) if isinstance(t, str) and t.startswith("tensordesc"))
        metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(positions)
        desc_args = getattr(module, "make_tensordesc_arg", None)
        if c_launch is None or len(metas) != len(positions) or (positions and desc_args is None):
            return None
        import triton

        raw = cls()
        raw.c_launch, raw.grid, raw.function = c_launch, grid, compiled.function
        raw.cooperative, raw.pdl, raw.metadata = (launcher.launch_cooperative_grid, launcher.launch_pdl,
                                                  compiled.packed_metadata)
        raw.desc_positions, raw.desc_args = positions, desc_args
        # last position first: replacing a descriptor by its expansion leaves the earlier positions in place
        raw.desc_keys = tuple((i, _meta_key(meta), meta) for i, meta in reversed(list(zip(positions, metas))))
        raw.hooks, raw.stream = LaunchHooks(triton.knobs.runtime), current_stream
        from moekit.batch_launch import register

        register(compiled.function, getattr(compiled.metadata, "name", "?"), signature, metas)
        return raw

    def __call__(self, pointers: tuple, tail: tuple) -> None:
        if PASS_ADDRESSES:
            pointers = [p.data_ptr() if p.__class__ in _TENSORS else p for p in pointers]
        args = self._expanded(pointers) if self.desc_positions else pointers
        grid = self.grid
        self.c_launch(grid[0], grid[1], grid[2], self.stream(), self.function, self.cooperative, self.pdl, None, None,
                      self.metadata, None, None, None, *args, *tail)

    def _expanded(self, pointers: tuple) -> list:
        """``pointers`` with each descriptor replaced by its expansion (computed once per descriptor). One
        list per call and nothing else allocated: every object a launch allocates counts towards Python's
        next garbage collection."""
        args = list(pointers)
        for i, key, meta in self.desc_keys:
            desc = args[i]
            kept = desc.__dict__.get("_moekit_launch_args")
            if kept is None:
                kept = desc.__dict__["_moekit_launch_args"] = {}
            expansion = kept.get(key)
            if expansion is None:
                expansion = kept[key] = tuple(self.desc_args(desc, meta))
            args[i:i + 1] = expansion
        return args


_BASE_FORMAT = "iiiKKppOOOOOO"  # Triton 3.6's C launch: grid x3, stream, function, cooperative, pdl, 6 objects


def current_stream() -> int:
    """The current CUDA stream of the current device, as the handle a launch takes (what Triton's runner
    asks torch for, without building a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _unwrapped(launch):
    """The C launch function under Triton 3.6's descriptor-expanding wrapper (its ``launcher``), or
    ``launch`` itself where it is not a Python function; None for anything else."""
    if not isinstance(launch, types.FunctionType):
        return launch if callable(launch) else None
    code, cells = launch.__code__, launch.__closure__
    if not cells or "launcher" not in code.co_freevars:
        return None
    inner = cells[code.co_freevars.index("launcher")].cell_contents
    return inner if callable(inner) and not isinstance(inner, types.FunctionType) else None


def _meta_key(meta) -> tuple | None:
    """What a descriptor's expansion depends on besides the descriptor: the kernel's TMA metadata."""
    if meta is None:
        return None
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(meta.items()))
