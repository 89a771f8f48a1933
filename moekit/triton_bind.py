"""Triton launches at the lowest host cost the installed Triton allows, shared by both kernel packages
(``moekit.experts``, ``moekit.routing``): a launch whose grid, scalars and constexprs are fixed once,
then called with its pointers alone. Triton itself is only touched when a kernel is launched.
"""

from __future__ import annotations

import functools
import inspect
import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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

    __slots__ = ("kernel", "grid", "tail", "options", "cached", "_launcher")

    def __init__(self, kernel, grid: tuple, num_pointers: int, scalars: tuple, cached: bool, **constexprs_and_options):
        defaults = _defaults(kernel.fn)  # {parameter name: its default, or _NO_DEFAULT}, in signature order
        rest = list(defaults)[num_pointers + len(scalars):]
        missing = [n for n in rest if n not in constexprs_and_options and defaults[n] is _NO_DEFAULT]
        if missing:
            raise TypeError(f"{kernel.fn.__name__}: no value for {missing}")
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled launcher reads grid[0..2]
        self.tail = (*scalars, *(constexprs_and_options.pop(n, defaults[n]) for n in rest))  # signature order
        self.options = constexprs_and_options  # what is left: Triton's num_warps, num_stages, launch_pdl
        self.cached = cached
        self._launcher = None

    def __call__(self, *pointers) -> None:
        launcher = self._launcher
        if launcher is not None:
            launcher(*pointers, *self.tail)
            return
        compiled = self.kernel[self.grid](*pointers, *self.tail, **self.options)
        if self.cached:
            self._launcher = _launcher_of(compiled, self.kernel, self.grid, self.options)
            self.cached = self._launcher is not None  # else kernel[grid] for good, without asking again


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
