"""A recorded sequence of raw Triton launches (``triton_lean.LaunchSequence``) issued in one call into C.

Each raw launch of a sequence goes through Triton 3.6's generated C launch: a Python call with ~30 arguments,
its ``PyArg_ParseTuple``, a context check, then ``cuLaunchKernelEx``. Per call of an experts path that is 4-6
such calls, each building its argument list in Python first. Here the launches' kernel parameters are laid out
once, as the bytes ``cuLaunchKernelEx`` reads, in one ``bytearray`` (the ``Batch``'s blob); a call hands the C
function ``launch_all`` the stream and the call's values (x, ids, ... as addresses), which it writes into their
recorded parameter slots before issuing every launch, the GIL released once around them.

    blob (u64 words unless said):
      n_launches, n_patches, storage offset
      n_patches x (value index, storage byte offset)       -- where a call's values go
      per launch: function, then u32 grid x, y, z, block x, shared bytes, flags (1: PDL, 2: cooperative),
                  number of parameters, 0; then each parameter's storage byte offset
      storage (128-byte aligned in memory): every parameter's bytes, as Triton's launcher passes them

What reaches the driver is what Triton's launch passes: the same function, grid, block (32 x num_warps), shared
memory, PDL and cooperative attributes, and parameters (pointers as 8 bytes, integers at their width, floats packed
as Triton packs them, a TMA descriptor's 128 bytes, then the global and profile scratch pointers, both null since a
raw launch has no scratch). Only for Triton 3.6's launcher layout (``triton_bind.RawLaunch``), and only where the C
module builds (a C compiler, as Triton's own launchers need); ``Batch.of`` returns None otherwise and the sequence
launches step by step.
"""

from __future__ import annotations

import ctypes
import os
import re
import struct

KINDS: dict[int, tuple] = {}  # a compiled kernel's CUfunction handle -> (its name, expanded signature) (``register``)
_MODULE = [None, False]  # the built C module, whether a build was tried
_DRIVER = [None]  # whether libcuda's entries are set in it (None: not tried)
_HEADER, _LAUNCH = 3, 5  # u64 words: the blob's header, a launch's fixed part (function + 8 u32)
_FLOAT = {"fp16": "e", "bf16": None, "fp32": "f", "f32": "f", "fp64": "d"}
_INT = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I", "i64": "q",
        "u64": "Q"}

_SOURCE = r"""
#include "cuda.h"
#include <stdint.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef CUresult (*launch_ex_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*ctx_current_t)(CUcontext *);
typedef CUresult (*error_string_t)(CUresult, const char **);
static PyObject *data_ptr_name = NULL;
static launch_ex_t launch_ex = NULL;
static ctx_current_t ctx_current = NULL;
static error_string_t error_string = NULL;
typedef struct { PyObject_HEAD; _Alignas(128) CUtensorMap tensorMap; } TensorMapObject;  /* Triton's PyCUtensorMap */

static PyObject *set_driver(PyObject *self, PyObject *args) {
  unsigned long long a, b, c;
  if (!PyArg_ParseTuple(args, "KKK", &a, &b, &c)) return NULL;
  launch_ex = (launch_ex_t)a; ctx_current = (ctx_current_t)b; error_string = (error_string_t)c;
  Py_RETURN_NONE;
}

static PyObject *tensor_map_bytes(PyObject *self, PyObject *obj) {
  /* Triton's type ("triton.backends.nvidia.PyCUtensorMap" in 3.6), whose layout is the struct above */
  const char *name = Py_TYPE(obj)->tp_name;
  size_t length = strlen(name);
  if (length < 13 || strcmp(name + length - 13, "PyCUtensorMap") != 0
      || Py_TYPE(obj)->tp_basicsize < (Py_ssize_t)sizeof(TensorMapObject)) {
    PyErr_Format(PyExc_TypeError, "expected a PyCUtensorMap, got %s", Py_TYPE(obj)->tp_name);
    return NULL;
  }
  return PyBytes_FromStringAndSize((const char *)&((TensorMapObject *)obj)->tensorMap, sizeof(CUtensorMap));
}

/* launch_all(blob, stream, *values): values are addresses (ints), tensors (their data_ptr()) or None (0) */
static PyObject *launch_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 2 || !PyByteArray_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "launch_all(blob: bytearray, stream: int, *values)");
    return NULL;
  }
  if (launch_ex == NULL) { PyErr_SetString(PyExc_RuntimeError, "batch_launch: no driver set"); return NULL; }
  char *base = PyByteArray_AS_STRING(args[0]);
  uint64_t *head = (uint64_t *)base;
  uint64_t n_launches = head[0], n_patches = head[1];
  char *storage = base + head[2];
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  uint64_t *patch = head + 3;
  for (uint64_t p = 0; p < n_patches; ++p, patch += 2) {
    if ((Py_ssize_t)patch[0] + 2 >= nargs) {
      PyErr_SetString(PyExc_IndexError, "launch_all: too few values");
      return NULL;
    }
    PyObject *value = args[2 + patch[0]];
    unsigned long long address = 0;
    if (PyLong_CheckExact(value)) {
      address = PyLong_AsUnsignedLongLong(value);
    } else if (value != Py_None) {  /* a tensor: its data_ptr(), its device address */
      PyObject *got = PyObject_CallMethodNoArgs(value, data_ptr_name);
      if (got == NULL) return NULL;
      address = PyLong_AsUnsignedLongLong(got);
      Py_DECREF(got);
    }
    if (PyErr_Occurred()) return NULL;
    memcpy(storage + patch[1], &address, 8);
  }
  CUcontext context = NULL;
  if (ctx_current != NULL && (ctx_current(&context) != CUDA_SUCCESS || context == NULL)) {
    PyErr_SetString(PyExc_RuntimeError, "batch_launch: no current CUDA context");
    return NULL;
  }
  char *cursor = (char *)patch;
  void *params[256];
  CUresult status = CUDA_SUCCESS;
  uint64_t failed = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (uint64_t l = 0; l < n_launches; ++l) {
    uint64_t function;
    uint32_t d[8];
    memcpy(&function, cursor, 8);
    memcpy(d, cursor + 8, 32);
    uint64_t *offsets = (uint64_t *)(cursor + 40);
    for (uint32_t i = 0; i < d[6] && i < 256; ++i) params[i] = storage + offsets[i];
    cursor += 40 + 8 * (uint64_t)d[6];
    if ((uint64_t)d[0] * d[1] * d[2] == 0) continue;
    CUlaunchAttribute attrs[2];
    unsigned num_attrs = 0;
    if (d[5] & 1) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
      ++num_attrs;
    }
    if (d[5] & 2) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[num_attrs].value.cooperative = 1;
      ++num_attrs;
    }
    CUlaunchConfig config;
    config.gridDimX = d[0]; config.gridDimY = d[1]; config.gridDimZ = d[2];
    config.blockDimX = d[3]; config.blockDimY = 1; config.blockDimZ = 1;
    config.sharedMemBytes = d[4];
    config.hStream = (CUstream)stream;
    config.attrs = attrs;
    config.numAttrs = num_attrs;
    status = launch_ex(&config, (CUfunction)function, params, NULL);
    if (status != CUDA_SUCCESS) { failed = l; break; }
  }
  Py_END_ALLOW_THREADS;
  if (status != CUDA_SUCCESS) {
    const char *text = "unknown";
    if (error_string != NULL) error_string(status, &text);
    PyErr_Format(PyExc_RuntimeError, "batch_launch: launch %llu failed: %s", (unsigned long long)failed, text);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"set_driver", set_driver, METH_VARARGS, NULL},
  {"tensor_map_bytes", tensor_map_bytes, METH_O, NULL},
  {"launch_all", (PyCFunction)(void (*)(void))launch_all, METH_FASTCALL, NULL},
  {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "moekit_batch_launch", NULL, -1, methods};
PyMODINIT_FUNC PyInit_moekit_batch_launch(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  return data_ptr_name == NULL ? NULL : PyModule_Create(&module);
}
"""


def build():
    """The C module, built once per process (cached on disk by Triton), or None where it cannot be built."""
    if not _MODULE[1]:
        _MODULE[1] = True
        try:
            import triton
            from triton.runtime.build import compile_module_from_src

            include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
            _MODULE[0] = compile_module_from_src(src=_SOURCE, name="moekit_batch_launch", include_dirs=[include])
        except Exception:  # noqa: BLE001 (no compiler, no headers: the step-by-step launches stay)
            _MODULE[0] = None
    return _MODULE[0]


def module():
    """The C module pointed at libcuda's entries (once), or None where either is missing."""
    mod = build()
    if mod is not None and _DRIVER[0] is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _DRIVER[0] = False
            return None
        address = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
        mod.set_driver(address("cuLaunchKernelEx"), address("cuCtxGetCurrent"), address("cuGetErrorString"))
        _DRIVER[0] = True
    return mod if _DRIVER[0] else None


def expand_signature(signature: list, tensordesc_meta) -> list | None:
    """The kernel's parameter types as Triton 3.6's launcher lays them out (``make_launcher``'s expansion of
    tensor descriptors), or None for a signature it cannot lay out (tuples, a descriptor type it cannot read)."""
    metas = list(tensordesc_meta or [])
    out = []
    for ty in signature:
        if not isinstance(ty, str):
            return None
        if not ty.startswith("tensordesc"):
            out.append(ty)
            continue
        match = re.match(r"tensordesc<([^[>]*)\[([^]]*)\]", ty)
        if match is None:
            return None
        ndim = match.group(2).count(",") + 1
        meta = metas.pop(0) if metas else None
        out += ["*" + match.group(1), *["i64"] * (2 * ndim), "i1"] if meta is None else ["nvTmaDesc"]
        out += ["i32"] * ndim + ["i64"] * ndim
    return out


def register(function: int, name: str, signature: list, tensordesc_meta) -> None:
    """Keep the name and expanded signature of a raw launch's kernel (``triton_bind.RawLaunch.of``)."""
    kinds = expand_signature(signature, tensordesc_meta)
    if kinds is not None:
        KINDS[function] = (name, tuple(kinds))


def _encode(ty: str, value, mod) -> bytes | None:
    """One parameter's bytes as Triton's launcher passes it, or None where this layout does not know the type."""
    if ty[0] == "*":
        return struct.pack("<Q", 0 if value is None else int(value))
    if ty in _INT:
        return struct.pack("<" + _INT[ty], int(value))
    if ty == "bf16":
        return struct.pack("<f", float(value))[2:]  # the float32's upper half (Triton's pack_bf16 truncates)
    if ty in _FLOAT:
        return struct.pack("<" + _FLOAT[ty], float(value))
    if ty == "nvTmaDesc":
        try:
            return mod.tensor_map_bytes(value)
        except TypeError:  # not Triton's PyCUtensorMap: this layout does not know it
            return None
    return None


class Batch:
    """The launches of one ``LaunchSequence`` as one C call: ``launch_all(blob, stream, *values)``."""

    __slots__ = ("blob", "launch_all", "names")

    def __init__(self, blob: bytearray, launch_all, names: tuple):
        self.blob, self.launch_all, self.names = blob, launch_all, names

    @classmethod
    def of(cls, steps: list, mod=None) -> "Batch | None":
        """``steps`` (``triton_lean.record_steps``'s: (entry, template, slots, raw)) as a batch, or None where
        ``refusal`` names a reason."""
        made = _layout(steps, mod)
        return made if isinstance(made, Batch) else None


def refusal(steps: list, mod=None) -> str | None:
    """Why ``steps`` cannot be batched (a step not raw, a kernel whose signature is not known, a parameter this
    layout does not know, no C module), or None where they can."""
    made = _layout(steps, mod)
    return None if isinstance(made, Batch) else made


def _layout(steps: list, mod) -> "Batch | str":
    if not steps or not all(step[3] for step in steps):
        return "a step is not a raw launch"
    mod = mod if mod is not None else module()
    if mod is None:
        return "no C module (or no libcuda)"
    storage, patches, launches, names = bytearray(), [], [], []
    for _, template, slots, _ in steps:
        name, kinds = KINDS.get(template[4], (None, None))
        args = template[13:]
        if kinds is None or len(kinds) != len(args):
            return f"{name}: signature unknown or {0 if kinds is None else len(kinds)} types for {len(args)} arguments"
        names.append(name)
        offsets = []
        slot_of = {position - 13: index for position, index in slots if position >= 13}
        if any(position < 13 and position != 3 for position, _ in slots):
            return f"{name}: a call's value among the launch's own arguments"
        for i, (ty, value) in enumerate(zip(kinds, args)):
            if ty == "constexpr":
                continue
            data = _encode(ty, 0 if i in slot_of else value, mod)
            if data is None or (i in slot_of and ty[0] != "*"):
                return f"{name}: parameter {i} of type {ty} ({type(value).__name__})"
            align = 128 if ty == "nvTmaDesc" else len(data)
            storage += bytes(-len(storage) % align)
            if i in slot_of:
                patches.append((slot_of[i], len(storage)))
            offsets.append(len(storage))
            storage += data
        for _ in range(2):  # global and profile scratch: none on a raw launch
            storage += bytes(-len(storage) % 8)
            offsets.append(len(storage))
            storage += bytes(8)
        num_warps, num_ctas, shared = template[9]
        if num_ctas != 1 or len(offsets) > 256:
            return f"{name}: {num_ctas} CTAs a cluster, {len(offsets)} parameters"
        flags = (1 if template[6] else 0) | (2 if template[5] else 0)
        launches.append((template[4], (*template[:3], 32 * num_warps, shared, flags, len(offsets), 0), offsets))
    return Batch(_blob(storage, patches, launches), mod.launch_all, tuple(names))


def _blob(storage: bytearray, patches: list, launches: list) -> bytearray:
    """The header, patches and launches, then ``storage`` placed at a 128-byte aligned address."""
    head = struct.pack("<3Q", len(launches), len(patches), 0)
    head += b"".join(struct.pack("<2Q", index, offset) for index, offset in patches)
    for function, dims, offsets in launches:
        head += struct.pack("<Q8I", function, *dims) + struct.pack(f"<{len(offsets)}Q", *offsets)
    blob = bytearray(len(head) + 128 + len(storage))
    address = ctypes.addressof(ctypes.c_char.from_buffer(blob))
    start = len(head) + (-(address + len(head)) % 128)
    blob[:len(head)] = head
    blob[16:24] = struct.pack("<Q", start)
    blob[start:start + len(storage)] = storage
    return blob
