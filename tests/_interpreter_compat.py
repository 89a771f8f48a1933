"""Triton 3.6's interpreter under NumPy >= 2.4: a Python ``range`` over a kernel scalar fails.

The interpreter holds a kernel scalar as a one-element 1-d NumPy array, and Triton 3.6 gives ``tl.tensor`` an
``__index__`` of ``int(data)``; NumPy 2.4 no longer converts an array with ndim > 0 to a Python scalar
("only 0-dimensional arrays can be converted to Python scalars"), so every kernel that loops
``for i in range(start, end, STEP)`` with a runtime bound fails on the CPU (Triton 3.7+ reads
``int(data.squeeze())``). ``install()`` wraps the interpreter's ``_patch_lang_tensor``: where the ``__index__``
it sets refuses such a scalar, it is replaced by the squeezing one of later Tritons; elsewhere nothing changes.
Only the interpreter is touched: compiled kernels never call ``__index__``.
"""

from __future__ import annotations

import types

import numpy as np


def _squeezed_index(self) -> int:
    return int(self.handle.data.squeeze())


def _refuses_a_scalar(index) -> bool:
    scalar = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.zeros(1, dtype=np.int32)))
    try:
        index(scalar)
    except TypeError:
        return True
    return False


def install() -> bool:
    """Wrap ``_patch_lang_tensor`` (once); False where this Triton's interpreter has no such function."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, "_moekit_index_checked", False):
        return True

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        if _refuses_a_scalar(tensor.__index__):
            scope.set_attr(tensor, "__index__", _squeezed_index)

    patch_lang_tensor._moekit_index_checked = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
