"""Triton's interpreter, minus one repeated cost: re-patching ``triton.language`` on every device-function call.

Under ``TRITON_INTERPRET=1`` a kernel launch patches the language modules its globals name (``tl``,
``tl.core``: every builtin swapped for its interpreted form) and restores them when the grid is done. Every
call of a ``@triton.jit`` helper inside the kernel calls the same patching again, for the same modules, while
they are still patched; it changes nothing, yet it rescans every member of ``tl``, ``tl.core``, ``tl.math`` and
``tl.tensor`` (``inspect.getmembers``). In our kernels, which call helpers in their inner loops, that was half
of the interpreter's time (a word-decode GEMV test: 34 of 68 s in the patching).

``install()`` wraps the interpreter's launch (``GridExecutor.__call__``, which notes the kernel's modules) and
its ``_patch_lang``: the launch's own call patches as before; a call made while that patch is active, for a
function whose language modules are already patched in this launch, returns a scope with nothing to restore;
any other call (a helper naming a module not yet patched: ``tl.zeros`` or ``tl.sum``, jitted in
``triton.language.standard``, which names ``core`` where our kernels name ``tl`` alone) runs the original, and
its modules count as patched from then on until its scope is restored (Triton 3.9's device-function call never
restores it, so they stay patched to the launch's end: before, each of those calls rescanned ``tl`` and
``tl.core`` anew, a third of a word-decode GEMV test's time). The patched state every helper sees is the one it
saw before, so results are unchanged. A function's language modules are read from its globals once and again only
when those globals are another dict or change size (a scan of every global at each of a GEMV case's 38k helper calls
was 4 of 37 s once the per-op costs were gone, ``_interpreter_ops``). A Triton whose interpreter lacks these names
(another release) is left as it is.
"""

from __future__ import annotations

import inspect


class _NothingToRestore:
    def restore(self) -> None:
        pass


class _Tracked:
    """A helper call's patch scope (the original's): restoring it also un-counts the modules it added."""

    def __init__(self, scope, patched: set, added: frozenset) -> None:
        self.scope, self.patched, self.added = scope, patched, added

    def restore(self) -> None:
        self.scope.restore()
        self.patched -= self.added


def _langs_reader(tl):
    """``langs_of(fn)``: the ids of ``tl`` and ``tl.core`` among ``fn``'s globals, read again only when they changed."""
    seen: dict = {}  # function -> (its globals, their size, the language modules among them)

    def langs_of(fn) -> frozenset[int]:
        names = fn.__globals__
        known = seen.get(fn)
        if known is not None and known[0] is names and known[1] == len(names):
            return known[2]
        langs = frozenset(id(v) for v in names.values() if inspect.ismodule(v) and v in (tl, tl.core))
        seen[fn] = (names, len(names), langs)
        return langs

    return langs_of


def install() -> bool:
    """Wrap the interpreter's launch and ``_patch_lang`` (once); False where this Triton's interpreter differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None:
        return False
    if getattr(original, "_moekit_nested_skip", False):
        return True
    try:
        if list(inspect.signature(original).parameters) != ["fn"]:
            return False
    except (TypeError, ValueError):
        return False
    launch = executor.__call__
    state = {"pending": None}  # the launching kernel's modules, until its own _patch_lang call
    active: list[set[int]] = []  # the modules patched (and not restored) in each running launch

    langs_of = _langs_reader(tl)

    def patch_lang(fn):
        if state["pending"] is not None:  # the launch's own call: patch, and remember what
            langs, state["pending"] = state["pending"], None
            scope = original(fn)
            active.append(set(langs))
            return scope
        if not active:
            return original(fn)
        langs = langs_of(fn)
        if langs <= active[-1]:
            return _NothingToRestore()
        added = langs - active[-1]
        scope = original(fn)
        active[-1] |= added
        return _Tracked(scope, active[-1], added)

    def launch_tracked(self, *args, **kwargs):
        depth = len(active)
        state["pending"] = langs_of(self.fn)
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["pending"] = None
            del active[depth:]

    patch_lang._moekit_nested_skip = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch_tracked
    return True
