"""Session-wide test setup, and the fixtures more than one test module uses.

On a machine without CUDA, Triton kernels can only run under Triton's interpreter, and Triton reads
TRITON_INTERPRET when it is first imported; set it here, before any test module imports triton, so
every test sees one consistent triton. ``backend="auto"`` never picks triton on the CPU, so only tests
that ask for it by name run the interpreter; ``_interpreter_compat`` mends Triton 3.6's interpreter under
NumPy >= 2.4, and ``_interpreter_speed`` removes the interpreter's repeated re-patching of
``triton.language`` on every helper call inside a kernel and ``_interpreter_ops`` its rebuilding of the same types
(and its overflow checks that nothing reads) on every op, ``_interpreter_binops`` its re-typing of binary operands
whose computation type is already known. ``_fusion_guard`` notes every moekit kernel launch under the
interpreter, and ``fp_fusion_asked`` fails a test during which moekit launched a kernel without FP fusion asked for.

Under pytest-xdist (``-n 2``: CI's two cores, each worker's torch with two OpenMP threads) an idle OpenMP thread
sleeps at once (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning on a core the other worker needs: read by libgomp
when torch loads, so set here before torch is imported; the thread counts, and so every path the tests take, are
unchanged (``tests/test_routing_options.py`` at ``-n 2``: 22.4 -> 9.8 s wall).
"""

import os
import threading

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import _interpreter_binops
    import _interpreter_compat
    import _interpreter_ops
    import _interpreter_speed

    _interpreter_compat.install()
    _interpreter_speed.install()
    _interpreter_ops.install()
    _interpreter_binops.install()

import _fusion_guard  # noqa: E402

_fusion_guard.install()  # on a GPU machine too: tests that interpret a kernel module (``_triton_helpers.interpreted``)


@pytest.fixture(autouse=True)
def fp_fusion_asked():
    """Every kernel launch moekit made during the test asked for FP fusion (``_fusion_guard``; ``COMPILE_OPTIONS``).
    Checked after the test, not at the launch: a path that falls back on an error would hide a raise there."""
    from _fusion_guard import LOG

    LOG.clear()
    yield LOG
    missing = LOG.missing()
    LOG.clear()
    assert not missing, f"launched without enable_fp_fusion=True (moekit.triton_bind.COMPILE_OPTIONS): {missing}"


@pytest.fixture(scope="module")
def base_url():
    """The simulator's server on a free loopback port, for one test module."""
    from moekit.sim.server import make_server

    server = make_server()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host, port = server.server_address[:2]
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def user_config_dir(tmp_path, monkeypatch):
    """An empty user config directory (``$MOEKIT_CONFIG_DIR``, searched first) for the tuned files a test writes, the
    config lookups' cache cleared before and after the test (a test that rewrites a file clears it again)."""
    from moekit.experts.configs import clear_config_cache

    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    clear_config_cache()
    yield tmp_path
    clear_config_cache()


@pytest.fixture
def launched(monkeypatch):
    """Counts the calls that went through a recorded launch sequence (``triton_lean.LaunchSequence``)."""
    from moekit.experts.triton_lean import LaunchSequence

    count, real = [0], LaunchSequence.launch

    def launch(self, values, stream=None):
        count[0] += 1
        return real(self, values, stream)

    monkeypatch.setattr(LaunchSequence, "launch", launch)
    return count
