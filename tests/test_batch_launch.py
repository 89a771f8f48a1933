"""moekit.batch_launch: a sequence's raw launches in one C call. No GPU here: the C module is built and pointed at a
recording stand-in for cuLaunchKernelEx (a ctypes callback), and what reaches it is compared with what Triton 3.6's
launcher would pass, written out here by hand (struct packing), and with what the launch-by-launch path hands the
C launch of each step."""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch

import moekit.batch_launch as bl
import moekit.experts.triton_lean as lean


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint32), ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.c_void_p)
_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
PDL, COOPERATIVE = 6, 2  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, CU_LAUNCH_ATTRIBUTE_COOPERATIVE


class Driver:
    """A stand-in driver: records each launch's config and parameter bytes (sizes from ``sizes[function]``)."""

    def __init__(self, sizes: dict, status: int = 0, context: int = 1):
        self.sizes, self.status, self.launches = sizes, status, []
        self._launch = _LAUNCH(self.launch)
        self._context = _CONTEXT(lambda out: self.set_context(out, context))

    @staticmethod
    def set_context(out, context: int) -> int:
        out[0] = context
        return 0

    def launch(self, config, function, params, extra) -> int:
        c = config.contents
        data = [ctypes.string_at(params[i], n) for i, n in enumerate(self.sizes[function])]
        attrs = sorted((c.attrs[i].id, c.attrs[i].value) for i in range(c.num_attrs))
        self.launches.append(dict(function=function, grid=tuple(c.grid), block=tuple(c.block), shared=c.shared,
                                  stream=c.stream, attrs=attrs, params=data))
        return self.status

    def install(self, mod) -> None:
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        mod.set_driver(address(self._launch), address(self._context), 0)


@pytest.fixture
def mod():
    built = bl.build()
    if built is None:
        pytest.fail("the C module did not build (a C compiler and Triton's cuda.h are needed)")
    return built


def _template(function: int, grid: tuple, warps: int, shared: int, cooperative: bool, pdl: bool, args: list) -> list:
    """A raw step's template as ``triton_lean.record_steps`` lays it out."""
    return [*grid, 0, function, cooperative, pdl, None, None, (warps, 1, shared), None, None, None, *args]


def test_expand_signature_matches_triton_36_layout():
    sig = ["*bf16", "tensordesc<bf16[64, 128]>", "i32", "constexpr", "tensordesc<fp8e4nv[128, 64]>"]
    assert bl.expand_signature(sig, [{"swizzle": 128}, None]) == [
        "*bf16", "nvTmaDesc", "i32", "i32", "i64", "i64", "i32", "constexpr",
        "*fp8e4nv", "i64", "i64", "i64", "i64", "i1", "i32", "i32", "i64", "i64"]
    assert bl.expand_signature(sig[:1] + [("i32", "i32")], None) is None  # tuples: not laid out


def test_batch_passes_triton_launcher_bytes(mod):
    bl.register(0x1000, "a", ["*bf16", "i32", "constexpr", "fp32", "i1", "i64", "bf16", "fp16", "*i32"], None)
    bl.register(0x2000, "b", ["*fp32", "u8"], None)
    steps = [(None, _template(0x1000, (3, 2, 1), 4, 2048, False, True,
                              [lean._Slot(0), 5, 64, 1.5, True, -7, 2.0, 0.5, lean._Slot(2)]), ((13, 0), (21, 2)),
              True),
             (None, _template(0x2000, (0, 1, 1), 8, 0, True, False, [lean._Slot(1), 200]), ((13, 1),), True),
             (None, _template(0x2000, (7, 1, 1), 8, 100, True, True, [lean._Slot(1), 3]), ((13, 1),), True)]
    batch = bl.Batch.of(steps, mod)
    assert batch is not None and batch.names == ("a", "b", "b")
    ptr, scratch = [8], [8, 8]
    driver = Driver({0x1000: ptr + [4, 4, 1, 8, 2, 2] + ptr + scratch, 0x2000: ptr + [1] + scratch})
    driver.install(mod)
    for values in ((0x10, 0x20, None), (0xABC0, 0xDEF0, 0x30)):
        driver.launches.clear()
        batch.launch_all(batch.blob, 77, *values)
        x, y, z = (0 if v is None else v for v in values)
        assert len(driver.launches) == 2  # the empty grid is not launched (Triton's launcher skips it too)
        first, third = driver.launches
        assert first["function"] == 0x1000 and first["grid"] == (3, 2, 1) and first["block"] == (128, 1, 1)
        assert first["shared"] == 2048 and first["stream"] == 77 and first["attrs"] == [(PDL, 1)]
        assert first["params"] == [struct.pack("<Q", x), struct.pack("<i", 5), struct.pack("<f", 1.5), b"\x01",
                                   struct.pack("<q", -7), struct.pack("<f", 2.0)[2:], struct.pack("<e", 0.5),
                                   struct.pack("<Q", z), bytes(8), bytes(8)]
        assert third["grid"] == (7, 1, 1) and third["block"] == (256, 1, 1) and third["shared"] == 100
        assert third["attrs"] == [(COOPERATIVE, 1), (PDL, 1)]
        assert third["params"] == [struct.pack("<Q", y), b"\x03", bytes(8), bytes(8)]


def test_batch_refuses_what_it_cannot_lay_out(mod):
    bl.register(0x3000, "c", ["*bf16", "i32"], None)
    raw = (None, _template(0x3000, (1, 1, 1), 4, 0, False, False, [lean._Slot(0), 1]), ((13, 0),), True)
    assert bl.Batch.of([raw], mod) is not None
    assert bl.Batch.of([raw, raw[:3] + (False,)], mod) is None  # a step not raw
    unknown = (None, _template(0x3001, (1, 1, 1), 4, 0, False, False, [1, 1]), (), True)
    assert bl.Batch.of([unknown], mod) is None  # a kernel never registered
    on_scalar = (None, _template(0x3000, (1, 1, 1), 4, 0, False, False, [1, lean._Slot(0)]), ((14, 0),), True)
    assert bl.Batch.of([on_scalar], mod) is None  # a call's value on a scalar parameter
    bl.register(0x3002, "d", ["tensordesc<bf16[64, 64]>"], [{"swizzle": 128}])
    PyCUtensorMap = type("PyCUtensorMap", (), {})  # the name alone: too small to hold a CUtensorMap
    for value in (object(), PyCUtensorMap()):
        not_a_map = (None, _template(0x3002, (1, 1, 1), 4, 0, False, False, [value, 64, 64, 64, 1]), (), True)
        assert bl.Batch.of([not_a_map], mod) is None  # not Triton's PyCUtensorMap
        assert bl.refusal([not_a_map], mod).startswith("d: parameter 0 of type nvTmaDesc")
    assert bl.refusal([raw], mod) is None
    assert bl.refusal([unknown], mod).startswith("None: signature unknown")


def test_batch_raises_on_a_failed_launch_or_no_context(mod):
    bl.register(0x4000, "e", ["*bf16"], None)
    steps = [(None, _template(0x4000, (1, 1, 1), 4, 0, False, False, [lean._Slot(0)]), ((13, 0),), True)] * 2
    batch = bl.Batch.of(steps, mod)
    failing = Driver({0x4000: [8, 8, 8]}, status=1)
    failing.install(mod)
    with pytest.raises(RuntimeError, match="launch 0 failed"):
        batch.launch_all(batch.blob, 0, 16)
    assert len(failing.launches) == 1  # stops at the first failure
    no_context = Driver({0x4000: [8, 8, 8]}, context=0)
    no_context.install(mod)
    with pytest.raises(RuntimeError, match="no current CUDA context"):
        batch.launch_all(batch.blob, 0, 16)
    assert no_context.launches == []
    with pytest.raises(AttributeError):  # neither an address nor a tensor
        batch.launch_all(batch.blob, 0, "not an address")
    with pytest.raises(IndexError):  # fewer values than the launches read
        batch.launch_all(batch.blob, 0)


def test_sequence_batched_passes_what_each_c_launch_gets(mod, monkeypatch):
    """A sequence recorded with BATCHED launches the same pointers, stream and scalars as one launched step by step."""
    monkeypatch.setattr(bl, "module", lambda: mod)
    bl.register(0x5000, "f", ["*bf16", "*bf16", "i32", "*fp32"], None)
    calls = []

    def c_launch(*args):  # what the launch-by-launch path hands Triton's C launch
        calls.append(args)

    x, out = torch.arange(8, dtype=torch.bfloat16), torch.empty(8, dtype=torch.bfloat16)
    kept = torch.zeros(4)
    template = _template(0x5000, (2, 1, 1), 4, 0, False, True, [lean._Slot(lean.X), lean._Slot(lean.OUT), 9,
                                                                 kept.data_ptr()])
    slots = ((13, lean.X), (14, lean.OUT))
    monkeypatch.setattr(lean, "BATCHED", False)  # read when a sequence is recorded
    stepwise = lean.LaunchSequence([(c_launch, template, slots, True)], None, None, None, None)
    monkeypatch.setattr(lean, "BATCHED", True)
    batched = lean.LaunchSequence([(c_launch, template, slots, True)], None, None, None, None)
    assert stepwise.batch is None and batched.batch is not None
    values = (x.data_ptr(), None, None, out, None, None, None, None, None, None, None)  # out: its data_ptr is read
    driver = Driver({0x5000: [8, 8, 4, 8, 8, 8]})
    driver.install(mod)
    stepwise.launch(values, stream=55)
    batched.launch(values, stream=55)
    (args,), (got,) = calls, driver.launches
    assert (got["grid"], got["stream"], got["attrs"], got["block"]) == (tuple(args[:3]), args[3], [(PDL, 1)],
                                                                        (128, 1, 1))
    assert got["params"][:4] == [struct.pack("<Q", args[13]), struct.pack("<Q", args[14]), struct.pack("<i", args[15]),
                                 struct.pack("<Q", args[16])]
    assert args[13] == x.data_ptr() and args[14] == out.data_ptr()
