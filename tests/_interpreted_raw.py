"""Raw launches that run under Triton's interpreter: the CPU stand-in for a GPU's ``triton_bind.RawLaunch`` and the
driver's ``cuLaunchKernelEx``, so that the real one-C-call paths (``batch_launch.Batch``, ``triton_fast.JointCall``)
run their kernels here and their outputs can be held to a reference.

    BoundLaunch's first interpreted call -> an ``InterpretedRaw`` on it (a handle of its own, the signature read
      from that call's arguments, registered with ``batch_launch``) -> sequences recorded after it are raw, so
      batched -> ``launch_all`` -> ``ExecutingDriver.launch`` (the ctypes callback the C module takes as the driver):
      the parameter bytes decoded by the registered signature, pointers as tensors at those addresses, constexprs from
      the bound launch, and the interpreted kernel run on them.

The interpreter reads and writes memory through a tensor's address (a CPU tensor's storage is its own host copy), so
a one-element tensor over the address stands in for the tensor the launch was recorded with. Not covered: a weight's
TMA descriptor (on a GPU the C module copies its CUtensorMap's 128 bytes) travels here as a constexpr, the object the
bound launch's first call passed (the kept weights' own: the sequence holds it on a GPU too).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import struct

import pytest
import torch

import moekit.batch_launch as bl
import moekit.experts.triton_fast as triton_fast
import moekit.experts.triton_lean as lean
import moekit.triton_bind as triton_bind
from test_batch_launch import _CONTEXT, _LAUNCH

_TORCH = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1"}
_DTYPE = {name: dtype for dtype, name in _TORCH.items()}
_SCALAR = {"i1": "<?", "i64": "<q", "fp32": "<f"}


def _constexpr_names(fn) -> set:
    return {name for name, a in inspect.get_annotations(fn).items() if "constexpr" in str(a)}


def _type_of(value, constexpr: bool) -> str:
    """The signature entry of one argument as the first call passed it (None and constexprs: not a parameter)."""
    if constexpr or value is None or value.__class__.__name__ == "TensorDescriptor":
        return "constexpr"
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no signature entry for {type(value).__name__}")


def tensor_at(address: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A one-element tensor over ``address`` (0: None, what a null pointer stands for)."""
    if address == 0:
        return None
    size = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * size).from_address(address), dtype=dtype)


class InterpretedRaw:
    """A ``RawLaunch``'s fields for ``record_steps`` and ``Batch.of``, over a bound launch's interpreted launcher."""

    _next = [0x10000]

    def __init__(self, launch: triton_bind.BoundLaunch, pointers: tuple) -> None:
        names = list(inspect.signature(launch.kernel.fn).parameters)
        constexprs = _constexpr_names(launch.kernel.fn)
        values = (*pointers, *launch.tail)
        self.signature = [_type_of(v, n in constexprs) for n, v in zip(names, values)]
        self.first = values  # what a "constexpr" entry takes: the constexprs, None, a weight's TMA descriptor
        self.launch, self.grid, self.function = launch, launch.grid, InterpretedRaw._next[0]
        InterpretedRaw._next[0] += 1
        self.cooperative, self.pdl, self.desc_positions, self.c_launch = False, False, (), self.step
        self.metadata = (launch.options.get("num_warps", 4), 1, 0)
        import triton

        self.hooks = triton_bind.LaunchHooks(triton.knobs.runtime)
        bl.register(self.function, launch.kernel.fn.__name__, self.signature, None)

    def __call__(self, pointers: tuple, tail: tuple) -> None:  # BoundLaunch's raw call
        self.launch._launcher(*pointers, *tail)

    def step(self, *args) -> None:
        """A raw step launched on its own (Triton's C launch layout: 13 launch fields, then the arguments)."""
        self.run([tensor_at(a, _DTYPE[t[1:]]) if t.startswith("*") and isinstance(a, int) else a
                  for a, t in zip(args[13:], self.signature)])

    def run(self, values: list) -> None:
        self.launch._launcher(*values)


class ExecutingDriver:
    """``cuLaunchKernelEx`` for the C module: each launch's parameters decoded and its interpreted kernel run."""

    def __init__(self) -> None:
        self.kernels: dict[int, InterpretedRaw] = {}
        self.launches: list[str] = []
        self.error: BaseException | None = None
        self._launch = _LAUNCH(self.launch_ex)
        self._context = _CONTEXT(self.context)

    @staticmethod
    def context(out) -> int:
        out[0] = 1
        return 0

    def launch_ex(self, config, function, params, extra) -> int:
        try:
            raw = self.kernels[function]
            c = config.contents
            assert tuple(c.grid) == raw.grid, (tuple(c.grid), raw.grid)
            values, index = [], 0
            for entry, kept in zip(raw.signature, raw.first):
                if entry == "constexpr":
                    values.append(kept)
                    continue
                address = params[index]
                index += 1
                if entry.startswith("*"):
                    values.append(tensor_at(ctypes.c_uint64.from_address(address).value, _DTYPE[entry[1:]]))
                else:
                    fmt = _SCALAR[entry]
                    values.append(struct.unpack(fmt, ctypes.string_at(address, struct.calcsize(fmt)))[0])
            raw.run(values)
            self.launches.append(raw.launch.kernel.fn.__name__)
            return 0
        except BaseException as e:  # a ctypes callback cannot raise: kept, and the C call fails on the status
            self.error = e
            return 1

    def install(self, mod) -> None:
        address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        mod.set_driver(address(self._launch), address(self._context), 0)


@contextlib.contextmanager
def interpreted_raw(mod):
    """Every bound launch raw after its first interpreted call, sequences batched, the C module driven by an
    ``ExecutingDriver`` (yielded); a CPU call's stream is 0 (the C call's stream argument: a GPU's handle). The kept
    launches and sequences are dropped on the way in and out."""
    driver = ExecutingDriver()
    driver.install(mod)
    real_call = triton_bind.BoundLaunch.__call__

    def call(self, *pointers):
        real_call(self, *pointers)
        if self._raw is None and self._launcher is not None:
            self._raw = InterpretedRaw(self, pointers)
            driver.kernels[self._raw.function] = self._raw

    _drop_launches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bl, "module", lambda: mod)
        mp.setattr(lean, "BATCHED", True)
        mp.setattr(triton_bind.BoundLaunch, "__call__", call)
        mp.setattr(lean, "current_stream", lambda: 0)
        mp.setattr(triton_fast, "_stream", lambda device: 0)
        mp.setattr(triton_fast, "current_stream", lambda: 0)
        mp.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
        try:
            yield driver
        finally:
            _drop_launches()  # no raw launch or batched sequence outlives the driver


def _drop_launches() -> None:
    """Every bound launch and recorded sequence the layers' paths keep (made again, raw or not, on the next call)."""
    from moekit.experts.triton import clear_launch_caches
    from moekit.routing import gate, gate_route, hash_fused

    for clear in (clear_launch_caches, gate.clear_launch_caches, gate_route.clear_launch_caches,
                  hash_fused.clear_launch_caches):
        clear()
