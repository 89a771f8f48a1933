"""``RawLaunch``: the C launch of a compiled kernel called past Triton's Python layers (issue 13's host
time). Its CUDA side runs only on the GPU (``benchmarks/host_time.py`` checks bit-equal outputs there);
here it is held, on a stand-in with the shape of Triton 3.6's launcher, to pass the C function exactly
what Triton's own wrappers would, to expand each descriptor once, and to step aside for anything it was
not built for (another launcher layout, scratch memory, installed launch hooks).
"""

from __future__ import annotations

import sys
import types

import pytest

from moekit.triton_bind import BoundLaunch, LaunchHooks, RawLaunch

BASE_FORMAT = "iiiKKppOOOOOO"


class Desc:
    """A host tensor descriptor as Triton's launcher reads it."""

    def __init__(self, name, shape, strides):
        self.name, self.shape, self.strides = name, shape, strides


def _fake_module(name="fake_triton_driver", base=BASE_FORMAT):
    module = types.ModuleType(name)
    module._BASE_ARGS_FORMAT = base
    module.expansions = []

    def make_tensordesc_arg(arg, meta):  # Triton 3.6: [encoded map, *shape, *strides]
        module.expansions.append(arg.name)
        return [f"map({arg.name},{meta['swizzle']})", *arg.shape, *arg.strides]

    module.make_tensordesc_arg = make_tensordesc_arg
    sys.modules[name] = module
    return module


class CLaunch:
    """Stands in for the compiled C ``launch``: records what it is handed."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _compiled(module, signature, metas, scratch=0, nine=False):
    c_launch = CLaunch()

    def wrap(launcher):  # the shape of Triton 3.6's wrap_handle_tensordesc: a closure over ``launcher``
        def inner(*args):
            return launcher(*args)
        return inner

    launcher_cls = type("CudaLauncher", (), {"__module__": module.__name__})
    launcher = launcher_cls()
    launcher.launch = wrap(c_launch) if metas else c_launch
    launcher.global_scratch_size, launcher.profile_scratch_size = scratch, 0
    launcher.launch_cooperative_grid, launcher.launch_pdl, launcher.num_ctas = False, True, 1
    if nine:
        launcher.arg_annotations = ()
    compiled = types.SimpleNamespace(
        _run=launcher, function=1234, packed_metadata=("packed",), src=types.SimpleNamespace(signature=signature),
        metadata=types.SimpleNamespace(tensordesc_meta=metas))
    return compiled, c_launch


SIGNATURE = {"x": "*bf16", "w": "tensordesc<bf16[64, 64]>", "b": "constexpr", "h": "*bf16", "n": "i32",
             "BLOCK": "constexpr"}
METAS = [{"swizzle": 128, "block_size": [64, 64]}]


def test_raw_launch_hands_the_c_launch_what_triton_would():
    module = _fake_module()
    compiled, c_launch = _compiled(module, SIGNATURE, METAS)
    raw = RawLaunch.of(compiled, (7, 2, 1))
    assert raw is not None
    raw.stream = lambda: 99
    w = Desc("w13", (8, 64), (64, 1))
    raw(("x", w, None, "h"), (5, 32))
    # Triton's wrapper: the descriptor at its signature position becomes [map, *shape, *strides]; the
    # base arguments: grid, stream, function, cooperative, pdl, no scratch, packed metadata, no launch
    # metadata and no hooks (none installed).
    want = (7, 2, 1, 99, 1234, False, True, None, None, ("packed",), None, None, None,
            "x", "map(w13,128)", 8, 64, 64, 1, None, "h", 5, 32)
    assert c_launch.calls == [want]


def test_each_descriptor_is_expanded_once():
    module = _fake_module()
    compiled, c_launch = _compiled(module, SIGNATURE, METAS)
    raw = RawLaunch.of(compiled, (1, 1, 1))
    raw.stream = lambda: 0
    w, other = Desc("w", (4, 64), (64, 1)), Desc("other", (2, 64), (64, 1))
    for d in (w, w, other, w):
        raw(("x", d, None, "h"), (1, 32))
    assert module.expansions == ["w", "other"]
    assert [c[14] for c in c_launch.calls] == ["map(w,128)", "map(w,128)", "map(other,128)", "map(w,128)"]


def test_two_descriptors_each_expanded_in_place():
    """The interleaved gate-up kernel's two descriptors (gate rows, up rows): each replaced by its own
    expansion at its own position, the pointers between and after them kept in order."""
    module = _fake_module()
    signature = {"x": "*bf16", "w": "tensordesc<bf16[64, 64]>", "u": "tensordesc<bf16[64, 64]>", "h": "*bf16",
                 "n": "i32", "BLOCK": "constexpr"}
    compiled, c_launch = _compiled(module, signature, METAS * 2)
    raw = RawLaunch.of(compiled, (1, 1, 1))
    raw.stream = lambda: 0
    raw(("x", Desc("g", (4, 64), (64, 1)), Desc("u", (2, 64), (128, 1)), "h"), (3, 32))
    assert c_launch.calls[0][13:] == ("x", "map(g,128)", 4, 64, 64, 1, "map(u,128)", 2, 64, 128, 1, "h", 3, 32)


def test_plain_kernel_passes_pointers_through():
    module = _fake_module()
    signature = {"x": "*fp32", "y": "*fp32", "n": "i32"}
    compiled, c_launch = _compiled(module, signature, None)
    raw = RawLaunch.of(compiled, (3, 1, 1))
    raw.stream = lambda: 5
    raw(("x", "y"), (10,))
    assert c_launch.calls == [(3, 1, 1, 5, 1234, False, True, None, None, ("packed",), None, None, None, "x", "y", 10)]


@pytest.mark.parametrize("case", ["other base format", "scratch", "newer launcher", "unknown wrapper"])
def test_raw_launch_steps_aside(case):
    module = _fake_module(base="iiiKKOO" if case == "other base format" else BASE_FORMAT)
    compiled, _ = _compiled(module, SIGNATURE, METAS, scratch=64 if case == "scratch" else 0,
                            nine=case == "newer launcher")
    if case == "unknown wrapper":
        compiled._run.launch = lambda *args: None  # a Python wrapper with no ``launcher`` inside
    assert RawLaunch.of(compiled, (1, 1, 1)) is None


class Chain:
    def __init__(self, calls):
        self.calls = calls


def test_installed_hooks_send_launches_through_the_runner():
    """A profiler's launch hook must see every launch: with one installed the bound launch uses the
    compiled kernel's runner (which calls the hooks), not the raw launch."""
    runtime = types.SimpleNamespace(launch_enter_hook=Chain([]), launch_exit_hook=None)
    assert LaunchHooks(runtime).idle()
    seen = []

    class Raw:
        hooks = LaunchHooks(runtime)

        def __call__(self, pointers, tail):
            seen.append(("raw", pointers + tail))

    bound = BoundLaunch.__new__(BoundLaunch)
    bound.tail, bound._raw = (1,), Raw()
    bound._launcher = lambda *a: seen.append(("runner", a))
    bound("a")
    runtime.launch_enter_hook.calls.append(print)
    bound("b")
    assert seen == [("raw", ("a", 1)), ("runner", ("b", 1))]


@pytest.mark.parametrize("addresses", [True, False])
def test_tensors_handed_over_as_their_addresses(monkeypatch, addresses):
    """A tensor pointer (a parameter too) reaches the C launch as its data_ptr, what Triton's launcher would
    have read from it; descriptors, None and ints as they are."""
    import torch

    from moekit import triton_bind

    monkeypatch.setattr(triton_bind, "PASS_ADDRESSES", addresses)
    module = _fake_module()
    compiled, c_launch = _compiled(module, SIGNATURE, METAS)
    raw = RawLaunch.of(compiled, (1, 1, 1))
    raw.stream = lambda: 0
    x, h = torch.ones(4), torch.nn.Parameter(torch.zeros(3))
    raw((x, Desc("w", (8, 64), (64, 1)), None, h), (5, 32))
    got = c_launch.calls[0][13:]
    assert got[1:6] == ("map(w,128)", 8, 64, 64, 1) and got[6] is None and got[8:] == (5, 32)
    if addresses:
        assert (got[0], got[7]) == (x.data_ptr(), h.data_ptr())
    else:
        assert got[0] is x and got[7] is h
