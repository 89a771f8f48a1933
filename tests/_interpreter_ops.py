"""Triton's interpreter, minus per-op work whose result is already known or never read.

Under ``TRITON_INTERPRET=1`` every ``tl`` op of every program goes through ``semantic.py`` as in a compile, with
NumPy arrays for handles. Our tests' arrays are tiny, so NumPy is ~1% of a kernel test and Python's type
bookkeeping is most of it. A profiled word-decode GEMV case (``test_triton_wo_gemv``, 43 s in its launches, 35M
calls): every integer ``+``, ``-``, ``*`` checked for overflow (9962 checks, 18 s: two casts to int64, the op
again, two comparisons and an ``and``, whose result only ``device_assert`` reads, and it returns at once unless the
interpreter's ``options.debug`` is set, which it never is); 149k ``block_type`` and 185k ``tensor``
constructions, each building a ``tl.tuple`` of its shape (524k tuples in all) and formatting the type's name; 67k
``_get_np_dtype`` calls, each building a 19-entry dict; 1M ``_unwrap_if_constexpr`` calls.

``install()`` replaces, on this Triton's interpreter only:

- the interpreter's semantic object's ``binary_op_sanitize_overflow_impl``: returns at once where the original's
  only effect would be a ``device_assert`` that does nothing (``options.debug`` unset, both operands one integer
  type); anything else goes through the original. A compile's checks are untouched (another semantic object).
- its ``broadcast_impl_value``: two blocks of one shape are returned as they are (the original's answer for
  them); a block and a scalar: the original's splat, minus its ``to_ir`` of the new type (the interpreter's
  ``get_block_ty`` builds a block type of the same shape again, and its ``create_splat`` reads only the shape; 24k
  of the GEMV case's 35k calls); two scalars are returned as they are (the original's answer); two blocks of one
  rank and different shapes are broadcast as the original does, with their shapes compared as lists of ints, not
  through ``tl.tuple.__eq__`` (which builds a ``tl.tuple`` of the other side: 2.9 of the GEMV file's 88.7 s in
  launches under cProfile); anything else (other ranks, incompatible shapes) goes through the original.
- ``block_type.__init__``: for a shape of ints (or ``constexpr`` ints), the ``tl.tuple``, ``numel`` and text of the
  shape are built once per shape and shared (the name still names this call's element type), with the shape a
  tensor of it gets (a ``tl.tuple`` of ``constexpr``) beside them.
- ``tensor.__init__``: takes that tensor shape from its block type (or the one empty shape of a scalar).
- ``interpreter._get_np_dtype``: one lookup per (type class, type name), which determines its result.
- ``core._unwrap_if_constexpr``: a plain ``constexpr`` or a value of an exact type that is never wrapped (int,
  float, bool, None, str, ``tl.tensor``, a dtype) is answered at once; lists, tuples and the rest go through it.

The shared shapes are read, never written, by the interpreter, so every op sees equal values: results are
bit-identical (every launch's tensor storages hashed with and without it, Triton 3.9 and 3.6). Each replacement is
installed only where the original's source is one this module was checked against (``_CHECKED``: Triton 3.6 and
3.9); another release keeps its own. The same case after it: 12M calls, 20 s in its launches under cProfile.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import math
from dataclasses import dataclass

# The originals each replacement was checked against: the first 16 hex digits of the sha1 of their source
# (``inspect.getsource``) in Triton 3.6 and 3.9 (one value where the two are the same text).
_CHECKED = {
    "block_type.__init__": {"5e48a558c76a6c66"},
    "tensor.__init__": {"918c80e8ee879fd3"},
    "_get_np_dtype": {"74e2c0b884e314f2"},
    "_unwrap_if_constexpr": {"e9e3cb05494211e9", "31368a0b466eb7fd"},
    "binary_op_sanitize_overflow_impl": {"e9781b8791098822", "d70661025baaca42"},
    "device_assert": {"5fe1d491f4615e44", "9b0bbe964143a506"},
    "broadcast_impl_value": {"9c5582987488fc51", "4baf056e1c757973"},
    "create_splat": {"16333a39d7513ec9"},  # the interpreter builder's: reads only its type's shape
    "get_block_ty": {"466afcbecb171a0c"},  # the interpreter builder's: a block_type of the same shape
    "create_broadcast": {"61effa2c91dd3d28"},  # the interpreter builder's: np.broadcast_to to the shape
}


def source_hash_in(fn, hashes: set[str]) -> bool:
    """The first 16 hex digits of the sha1 of ``fn``'s source are one of ``hashes`` (False without a source)."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    return hashlib.sha1(source.encode()).hexdigest()[:16] in hashes


def _checked(name: str, fn) -> bool:
    """``fn`` is the original of ``name`` this module was checked against."""
    return source_hash_in(fn, _CHECKED[name])


@dataclass(frozen=True)
class _Shape:
    """What a ``block_type`` and a tensor of it build from one shape of ints (shared; the interpreter reads them)."""

    shape: object  # tl.tuple of ints: block_type.shape
    numel: int  # block_type.numel
    text: str  # str(shape): the shape's part of block_type.name
    tensor_shape: object  # tl.tuple of constexpr: tensor.shape
    tensor_numel: object  # constexpr: tensor.numel


def _int_shape(core, shape) -> builtins.tuple | None:
    """``shape`` (a list, tuple or tl.tuple of ints or constexpr ints) as a tuple of ints; None for anything else."""
    values = shape.values if type(shape) is core.tuple else shape
    if type(values) is not list and type(values) is not builtins.tuple:
        return None
    ints = []
    for s in values:
        if type(s) is core.constexpr:
            s = s.value
        if type(s) is not int:
            return None
        ints.append(s)
    return builtins.tuple(ints)


def _block_type_init(core, original):
    by_ints: dict[builtins.tuple, _Shape] = {}
    by_tuple: dict[int, _Shape] = {}  # id(a _Shape's shape) -> it: a type's shape passed on (with_element_ty)

    def init(self, element_ty, shape):
        known = by_tuple.get(id(shape))
        if known is None or known.shape is not shape:
            ints = _int_shape(core, shape)
            known = None if ints is None else by_ints.get(ints)
            if known is None:
                original(self, element_ty, shape)
                if ints is not None:
                    known = by_ints[ints] = _Shape(self.shape, self.numel, str(self.shape),
                                                   core.tuple([core.constexpr(s) for s in self.shape]),
                                                   core.constexpr(math.prod(self.shape)))
                    by_tuple[id(self.shape)] = known
                    self._moekit_shape = known
                return
        self.element_ty = element_ty
        self.shape, self.numel = known.shape, known.numel
        self.name = f"<{known.text}, {element_ty}>"
        self._moekit_shape = known

    return init


def _tensor_init(core, original):
    scalar = _Shape(core.tuple([]), 1, "", core.tuple([]), core.constexpr(1))

    def init(self, handle, type):
        if builtins.type(type) is core.block_type:
            known = type.__dict__.get("_moekit_shape")
            if known is None:
                return original(self, handle, type)
        elif isinstance(type, core.dtype) and not type.is_block():
            known = scalar
        else:
            return original(self, handle, type)
        self.handle = handle
        self.numel = known.tensor_numel
        self.type = type
        self.dtype = type.scalar
        self.shape = known.tensor_shape

    return init


def _np_dtype(original):
    found: dict = {}

    def np_dtype(tt_dtype):
        key = (type(tt_dtype), tt_dtype.name)
        np_type = found.get(key)
        if np_type is None:
            np_type = found[key] = original(tt_dtype)
        return np_type

    return np_dtype


def _unwrap(core, original):
    constexpr = core.constexpr
    plain = {int, float, bool, type(None), str, core.tensor, core.dtype, core.pointer_type, core.block_type}

    def unwrap(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t in plain:
            return o
        return original(o)

    return unwrap


def _sanitize(semantic, original):
    builder = semantic.builder

    def sanitize(lhs, rhs, binary_op):
        scalar = lhs.type.scalar
        if not builder.options.debug and scalar == rhs.type.scalar and scalar.is_int():
            return None
        return original(lhs, rhs, binary_op)

    return sanitize


def _broadcast(core, sem, original, builder_checked: bool):
    block_type = core.block_type

    def splat(block_ty, scalar):
        """The original's splat of ``scalar`` to ``block_ty``'s shape, given the block type itself where it passes
        ``block_ty.to_ir(builder)``: a new block type of the same shared shape, and the builder reads only its shape."""
        ty = block_ty.with_element_ty(scalar.type.scalar)
        return sem.make_tensor(sem.builder.create_splat(ty, scalar.handle), ty)

    def expanded(value, value_ty, shape: list[int]):
        """The original's broadcast of a block of equal rank to ``shape``, which it compares as a list of ints."""
        if value_ty.shape.values == shape:
            return value
        return sem.make_tensor(sem.builder.create_broadcast(value.handle, shape), block_type(value_ty.scalar, shape))

    def broadcast(lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        lhs_block, rhs_block = type(lhs_ty) is block_type, type(rhs_ty) is block_type
        if lhs_block and rhs_block:
            lhs_shape, rhs_shape = lhs_ty.shape.values, rhs_ty.shape.values
            if lhs_ty.shape is rhs_ty.shape or lhs_shape == rhs_shape:
                return lhs, rhs  # the original's answer for two blocks of one shape
            if builder_checked and len(lhs_shape) == len(rhs_shape):
                shape = []
                for left, right in zip(lhs_shape, rhs_shape):
                    if left == 1:
                        shape.append(right)
                    elif right == 1 or right == left:
                        shape.append(left)
                    else:
                        return original(lhs, rhs)  # raises the original's error
                return expanded(lhs, lhs_ty, shape), expanded(rhs, rhs_ty, shape)
        elif isinstance(lhs_ty, core.dtype) and isinstance(rhs_ty, core.dtype):
            lhs_scalar, rhs_scalar = not lhs_ty.is_block(), not rhs_ty.is_block()
            if lhs_scalar and rhs_scalar:
                return lhs, rhs  # the original's answer for two scalars
            if builder_checked and lhs_block and rhs_scalar:
                return lhs, splat(lhs_ty, rhs)
            if builder_checked and rhs_block and lhs_scalar:
                return splat(rhs_ty, lhs), rhs
        return original(lhs, rhs)

    return broadcast


def install() -> bool:
    """Replace each checked original (once); False where none of them is this Triton's."""
    try:
        import triton.language.core as core
        from triton.language import semantic
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(core.block_type.__init__, "_moekit_ops", False):
        return True
    patched = False
    for name, owner, attr, make in (
        ("block_type.__init__", core.block_type, "__init__", lambda f: _block_type_init(core, f)),
        ("tensor.__init__", core.tensor, "__init__", lambda f: _tensor_init(core, f)),
        ("_get_np_dtype", interpreter, "_get_np_dtype", _np_dtype),
        ("_unwrap_if_constexpr", core, "_unwrap_if_constexpr", lambda f: _unwrap(core, f)),
    ):
        original = getattr(owner, attr, None)
        if original is not None and _checked(name, original):
            replacement = make(original)
            replacement._moekit_ops = True
            setattr(owner, attr, replacement)
            patched = True
    # the interpreter's own semantic object only: a compile's overflow checks stay in its IR
    ours = getattr(interpreter, "interpreter_semantic", None)
    cls = getattr(semantic, "TritonSemantic", None)
    if (ours is not None and cls is not None and type(ours) is cls
            and _checked("binary_op_sanitize_overflow_impl", cls.binary_op_sanitize_overflow_impl)
            and _checked("device_assert", cls.device_assert)):
        ours.binary_op_sanitize_overflow_impl = _sanitize(ours, ours.binary_op_sanitize_overflow_impl)
        patched = True
    if ours is not None and cls is not None and type(ours) is cls and _checked("broadcast_impl_value",
                                                                           cls.broadcast_impl_value):
        builder = getattr(interpreter, "InterpreterBuilder", None)
        builder_checked = builder is not None and type(ours.builder) is builder and all(
            _checked(name, getattr(builder, name, None))
            for name in ("create_splat", "get_block_ty", "create_broadcast"))
        ours.broadcast_impl_value = _broadcast(core, ours, ours.broadcast_impl_value, builder_checked)
        patched = True
    return patched
