"""Run a function on W gloo ranks spawned on loopback, bounded in time, and collect what each returns.

The function runs as ``fn(rank, world_size, *args)`` in a fresh process (a fork of a forkserver) after
``init_process_group("gloo")`` on 127.0.0.1; it must be importable by name (a module-level function).
A rank that raises reports its traceback; a group that outlives ``timeout_s`` is killed and reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, pg_timeout_s, results, args):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever the hostname resolves to
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share CI's 2 cores
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group (the fault test) may not tear down cleanly
                pass


def run_ranks(fn, world_size: int, *args, timeout_s: float = 150, pg_timeout_s: float = 60) -> list:
    """fn's return value on each rank, in rank order. Raises AssertionError with the ranks' tracebacks
    when one raised, and when the group does not finish within ``timeout_s`` (its processes are killed).
    Retried once on a fresh port when the first one was taken between choosing and binding it."""
    try:
        return _run_ranks_once(fn, world_size, args, timeout_s, pg_timeout_s)
    except AssertionError as err:
        if "address already in use" not in str(err).lower():
            raise
    return _run_ranks_once(fn, world_size, args, timeout_s, pg_timeout_s)


def _context():
    """A forkserver that imported torch and moekit once: each rank is a fork of it, not a fresh interpreter that
    imports them again (~3.5 s of CPU a rank on CI's 2 cores; 4 ranks cost 14 s). Safe to fork: the server only
    imports (no thread pool, no CUDA, no process group), and every rank starts its own group and threads. A rank sees
    the environment the server started with (at the first ``run_ranks``, after conftest's settings), not a later
    change of ``os.environ``: no run_ranks test sets one."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "moekit", "moekit.parallel"])
    return ctx


def _run_ranks_once(fn, world_size, args, timeout_s, pg_timeout_s) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, pg_timeout_s, results, args), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict[int, tuple[str, object]] = {}
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish within "
                                     f"{timeout_s} s")
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
                got[rank] = (status, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a result may still be in the pipe
                    if results.empty():
                        raise AssertionError(f"ranks {dead} exited (codes {[procs[r].exitcode for r in dead]}) without "
                                             f"a result")
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [got[r][1] for r in range(world_size)]
