"""Fixtures of the Triton tests, which run under Triton's interpreter (TRITON_INTERPRET=1): the
interpreted backend module (``interpreter``; ``fp8``: the fp8 one), and a log of the kernel launches. A
test module imports the fixtures it uses: ``from _triton_helpers import interpreter, launch_log  # noqa: F401``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys

import pytest


def purge_kernels(package: str = "moekit.experts", launcher: str = "moekit.experts.triton") -> None:
    """Triton decides compiled vs interpreted when a kernel is decorated: drop ``package``'s kernel
    modules so the next use re-imports them under the current setting, and ``launcher``'s kept launches,
    which hold the kernels of before."""
    kernels = f"{package}._kernels"
    for name in [m for m in sys.modules if m == kernels or m.startswith(kernels + ".")]:
        del sys.modules[name]
    if launcher in sys.modules:
        sys.modules[launcher].clear_launch_caches()


@contextlib.contextmanager
def interpreted(package: str, launcher: str):
    """``launcher`` imported with ``package``'s kernels decorated under the interpreter; on the way out
    the kernels are dropped again, so the next module decorates them under its own setting."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        purge_kernels(package, launcher)
        yield importlib.import_module(launcher)
    purge_kernels(package, launcher)


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """``moekit.experts.triton``, its kernels decorated under the interpreter."""
    with interpreted("moekit.experts", "moekit.experts.triton") as tri:
        yield tri


@pytest.fixture(scope="module", autouse=True)
def router_and_experts_interpreted():
    """The fused router and ``moekit.experts.triton``, their kernels decorated under the interpreter (the fuzz tests:
    import it into the module, as ``interpreter``)."""
    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        yield


@pytest.fixture(scope="module")
def fp8():
    """``moekit.experts.triton_fp8``, its kernels decorated under the interpreter."""
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as module:
        yield module


class LaunchLog:
    """Stands in for ``triton_launch.kernels``: records (kernel name, arguments by name) of each launch;
    a kernel named in ``skip`` is recorded but not run (a kernel that forgot to write its output)."""

    def __init__(self, real):
        self.real, self.launches, self.skip = real, [], set()

    def __call__(self, module: str):
        return _LoggedModule(self.real(module), self)

    def take(self) -> list:
        launches, self.launches[:] = list(self.launches), []
        return launches


class _LoggedModule:
    def __init__(self, module, log: LaunchLog):
        self.module, self.log = module, log

    def __getattr__(self, name: str):
        return _LoggedKernel(getattr(self.module, name), name, self.log)


class _LoggedKernel:
    def __init__(self, kernel, name: str, log: LaunchLog):
        self.kernel, self.name, self.log = kernel, name, log
        self.arg_names, self.fn = kernel.arg_names, kernel.fn  # what BoundLaunch reads of a kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):  # recorded with the signature's defaults filled in: what the kernel gets
            params = inspect.signature(self.fn).parameters
            defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
            self.log.launches.append((self.name, {**defaults, **dict(zip(self.arg_names, args)), **kwargs}))
            if self.name not in self.log.skip:
                return self.kernel[grid](*args, **kwargs)
            return None

        return launch


@pytest.fixture
def launch_log(interpreter, monkeypatch):
    """A ``LaunchLog`` in place of the kernel modules; the plans are cleared before and after, since a
    plan holds the kernels it was built with."""
    from moekit.experts import triton_align, triton_launch, triton_plan

    log = LaunchLog(triton_launch.kernels)
    monkeypatch.setattr(triton_plan, "kernels", log)
    monkeypatch.setattr(triton_align, "kernels", log)
    interpreter.clear_launch_caches()
    yield log
    interpreter.clear_launch_caches()


def spy_launches(monkeypatch, module, record) -> list:
    """Record ``record(kernel name, the launch's keyword arguments)`` for every launch through ``module.kernels`` (a
    module's lazy kernel loader); returns the list the launches append to. The kernels still run."""
    seen, real = [], module.kernels

    class Spy:
        def __init__(self, kernels):
            self.kernels = kernels

        def __getattr__(self, name):
            kernel = getattr(self.kernels, name)
            return type("K", (), {"__getitem__": lambda _, grid: lambda *a, **kw: (seen.append(record(name, kw)),
                                                                                     kernel[grid](*a, **kw))})()

    monkeypatch.setattr(module, "kernels", lambda name: Spy(real(name)))
    return seen


def spy_desc(monkeypatch, module) -> list:
    """(kernel name, its DESC constexpr; None for a kernel without DESC) for every launch through ``module.kernels``
    (``spy_launches``)."""
    return spy_launches(monkeypatch, module, lambda name, kw: (name, kw.get("DESC")))
