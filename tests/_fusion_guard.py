"""Every kernel launch moekit makes asks for FP fusion (``enable_fp_fusion=True``: ``triton_bind.COMPILE_OPTIONS``):
Triton 3.9 warns at a compile that leaves it unset and Triton 3.10 compiles such a kernel without FMA contraction.

``install()`` wraps the interpreter's launch (``InterpretedFunction.run``, which every ``kernel[grid](...)`` and every
``BoundLaunch`` call reaches under ``TRITON_INTERPRET=1``; the interpreter itself drops the compile options) and notes
each launch of a ``moekit`` kernel that moekit's own code makes: the kernel and the ``enable_fp_fusion`` it was given.
The Gluon stand-ins (``_gluon_fakes.FakeKernel``) note theirs through ``note``. A launch a test makes itself (a kernel
called directly from a ``test_*`` module) is not moekit's and is left alone. ``conftest``'s autouse fixture fails
every test during which a moekit launch went without it (``missing``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

_MISSING = object()  # a launch that passed no enable_fp_fusion at all


@dataclass
class FusionLog:
    """The moekit kernel launches noted since the last ``clear``: (``module.kernel``, the enable_fp_fusion given)."""

    launches: list[tuple[str, object]] = field(default_factory=list)

    def missing(self) -> list[str]:
        """The launches that did not ask for FP fusion (each kernel once, in order)."""
        return list(dict.fromkeys(f"{name} (enable_fp_fusion={'unset' if given is _MISSING else repr(given)})"
                                  for name, given in self.launches if given is not True))

    def kernels(self) -> set[str]:
        return {name for name, _ in self.launches}

    def clear(self) -> None:
        self.launches.clear()


LOG = FusionLog()


def _from_moekit() -> bool:
    """Whether the launch being noted was made by moekit's code: walking out from here, past this module, Triton's
    launch wrappers and the tests' logging wrappers (``_triton_helpers``, ``_gluon_fakes``), a ``moekit`` module's
    frame comes before any test module's."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("moekit"):
            return True
        if module.startswith("test_"):
            return False
        frame = frame.f_back  # Triton's kernel[grid] lambda, functools.partial's caller, a test's wrapper
    return False


def note(fn, kwargs: dict) -> None:
    """Note one launch of ``fn`` (a kernel's Python function) with ``kwargs`` (its launch keywords), if moekit made
    it."""
    if getattr(fn, "__module__", "").startswith("moekit.") and _from_moekit():
        LOG.launches.append((f"{fn.__module__}.{fn.__name__}", kwargs.get("enable_fp_fusion", _MISSING)))


def install() -> bool:
    """Wrap the interpreter's launch (once); False where this Triton has no ``InterpretedFunction.run``."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    real = getattr(InterpretedFunction, "run", None)
    if real is None or getattr(real, "_fusion_guard", False):
        return real is not None

    def run(self, *args, grid, warmup, **kwargs):
        note(self.fn, kwargs)
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    run._fusion_guard = True
    InterpretedFunction.run = run
    return True
