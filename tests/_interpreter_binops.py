"""Triton's interpreter, minus the per-op typing whose answer is already known: binary operands, op wrappers.

After ``_interpreter_ops``, a profiled word-decode GEMV case (``test_triton_wo_gemv``) spent 3.5 of its launches'
7.8 s (cProfile, Triton 3.9) in ``binary_op_type_checking_impl``, run for every ``+``, ``*``, ``&``, ``<``...: two
``isinstance(x, numbers.Number)`` (an ABC check each), two pointer checks, ``computation_type_impl`` (a chain of
dtype tests; 31k calls for a handful of distinct dtype pairs), a ``cast`` of each tensor to the type it already
has. Each builtin the interpreter patches is a lambda that copies its kwargs to drop ``_semantic`` (78k calls), and
each ``TensorHandle`` checks its array's item size against its dtype through a module function (102k).

``install()`` replaces, on this Triton's interpreter only (Triton 3.9's sources: ``_CHECKED``):

- the interpreter's semantic object's ``binary_op_type_checking_impl``: where each operand is a ``tl.tensor`` or a
  plain ``int``/``float``/``bool``, neither of a pointer type, and ``arithmetic_check`` is asked, it does what the
  original does in the original's order with three shortcuts: the operand kinds are read with ``type(x) in``
  (the original's ``isinstance(x, numbers.Number)`` is True for exactly these three among them), the pointer checks
  are skipped (they raise only for a pointer operand), and ``computation_type_impl`` is asked once per (operand
  dtype names, which are scalars, ``div_or_mod``) (it reads nothing else; a raise is never remembered). A tensor
  already of the computation type is kept (the original's ``cast`` returns it as it is); the rest go through the
  original's own ``cast`` / ``_cast_to_computation_type`` and ``broadcast_impl_value``. Anything else: the original.
- ``_patch_attr``: the wrapper it installs for each builtin drops a caller's ``_semantic`` from its kwargs dict (a
  fresh one per call) in place, not through a copy; same arguments, same order. It calls the builtin's function
  itself, not ``core.builtin``'s wrapper around it, whose one check (``_semantic`` given, not None) it always meets.
- ``TensorHandle.__post_init__``: the original's size rule (array item bits <= max(dtype bits, 8); pointers pass)
  inline, with the original called for the error (Triton 3.6 and 3.9, one source).

Results are bit-identical: every launch's tensors hashed with and without it (``benchmarks/triton-notes.md``,
"CI, session 47: the interpreter's next per-op costs").
"""

from __future__ import annotations

from _interpreter_ops import source_hash_in

# The originals each replacement was checked against: the first 16 hex digits of the sha1 of their source.
# binary_op_type_checking_impl's shortcut rests on the other three semantic methods too.
_CHECKED = {
    "binary_op_type_checking_impl": {"8b12e3535b389f6b"},
    "computation_type_impl": {"b5487f9e316fb3e4"},
    "check_ptr_type_impl": {"af5586d3a7ad7e64"},
    "cast": {"39a306eeea4aebe8"},
    "_patch_attr": {"c94834c6df3f4fea"},
    "builtin": {"46c4b3e0619aed6f"},
    "TensorHandle.__post_init__": {"b74d04971cf266fd"},
    "_validate_np_data_size": {"7efb15190b1a94e7"},
}


def _checked(name: str, fn) -> bool:
    """``fn`` is the original of ``name`` this module was checked against."""
    return source_hash_in(fn, _CHECKED[name])


def _type_checking(core, sem, original):
    tensor = core.tensor
    numbers = {int, float, bool}  # the plain values of numbers.Number the kernels pass
    promoted: dict = {}  # (lhs dtype name, lhs is a number, rhs dtype name, rhs is a number, div_or_mod) -> dtype

    def checking(lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        lhs_num, rhs_num = type(lhs) in numbers, type(rhs) in numbers
        if not arithmetic_check or not (lhs_num or type(lhs) is tensor) or not (rhs_num or type(rhs) is tensor):
            return original(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        lhs_ty = sem.to_tensor_type(lhs) if lhs_num else lhs.dtype
        rhs_ty = sem.to_tensor_type(rhs) if rhs_num else rhs.dtype
        if lhs_ty.is_ptr() or rhs_ty.is_ptr():
            return original(lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
        key = (lhs_ty.name, lhs_num, rhs_ty.name, rhs_num, div_or_mod)
        ret = promoted.get(key)
        if ret is None:
            ret = promoted[key] = sem.computation_type_impl(lhs_ty, lhs_num, rhs_ty, rhs_num, div_or_mod)
        # dtype's != is a Python call (not ==): `is` first, then ==
        if lhs_num or (lhs_ty is not ret and not lhs_ty == ret):
            lhs = sem._cast_to_computation_type(lhs, ret)
        if rhs_num or (rhs_ty is not ret and not rhs_ty == ret):
            rhs = sem._cast_to_computation_type(rhs, ret)
        return sem.broadcast_impl_value(lhs, rhs)

    return checking


def _patch_attr(core, interpreter):
    # the code of core.builtin's wrapper: it only raises where _semantic is missing or None, and ours never is
    wrapper_code = core.builtin(lambda _semantic=None: None).__code__

    def patch_attr(obj, name, member, builder, scope):
        if getattr(member, "__code__", None) is wrapper_code and callable(getattr(member, "__wrapped__", None)):
            member = member.__wrapped__

        def new_member(*args, member=member, **kwargs):
            kwargs.pop("_semantic", None)
            kwargs["_semantic"] = interpreter.interpreter_semantic
            return member(*args, **kwargs)

        scope.set_attr(obj, name, new_member)

    return patch_attr


def _post_init(tl, original):
    pointer_type = tl.pointer_type

    def post_init(self):
        dtype = self.dtype
        if isinstance(dtype, pointer_type) or self.data.itemsize * 8 <= max(dtype.primitive_bitwidth, 8):
            return
        original(self)  # raises the original's error

    return post_init


def install() -> bool:
    """Replace each checked original (once); False where none of them is this Triton's."""
    try:
        import triton.language as tl
        import triton.language.core as core
        from triton.language import semantic
        from triton.runtime import interpreter
    except ImportError:
        return False
    handle = getattr(interpreter, "TensorHandle", None)
    if handle is not None and getattr(handle.__post_init__, "_moekit_binops", False):
        return True
    patched = False
    validate = getattr(interpreter, "_validate_np_data_size", None)
    if (handle is not None and validate is not None and _checked("TensorHandle.__post_init__", handle.__post_init__)
            and _checked("_validate_np_data_size", validate)):
        handle.__post_init__ = _post_init(tl, handle.__post_init__)
        handle.__post_init__._moekit_binops = True
        patched = True
    original = getattr(interpreter, "_patch_attr", None)
    if (original is not None and _checked("_patch_attr", original) and _checked("builtin", core.builtin)
            and hasattr(interpreter, "interpreter_semantic")):
        interpreter._patch_attr = _patch_attr(core, interpreter)
        patched = True
    ours = getattr(interpreter, "interpreter_semantic", None)
    cls = getattr(semantic, "TritonSemantic", None)
    if ours is not None and cls is not None and type(ours) is cls and all(
            _checked(name, getattr(cls, name, None))
            for name in ("binary_op_type_checking_impl", "computation_type_impl", "check_ptr_type_impl", "cast")):
        ours.binary_op_type_checking_impl = _type_checking(core, ours, ours.binary_op_type_checking_impl)
        patched = True
    return patched
