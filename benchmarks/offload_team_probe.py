"""Per-thread view of torch's OpenMP team, for issue #18's CPU-branch tail (``offload_tail_device_check``): which
thread of a branch's team is late after an idle gap, and is it its wake-up or its work?

    TeamProbe().run(threads, weights)  ->  TeamRun: per thread, the host seconds from the call to its entry
                                           into the region (wake), its read of its share of ``weights``'
                                           bytes (work) and the CPU it ran on

A small C function with one ``#pragma omp parallel`` region, compiled here with the system's C compiler and
linked against the libgomp torch itself loaded (read from /proc/self/maps after one torch parallel op), so
the region runs on torch's own thread pool: the team a CPU branch's GEMMs wake. Each thread reads a
contiguous share of the bytes (64-bit words summed): at M = 1 a CPU expert's GEMV is a read of its weights
from host memory, so a thread's work time is its share of a branch's compute. ``available()`` is False where
no compiler or no libgomp is found (the caller prints why and goes on without the per-thread parts).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch

SOURCE = r"""
#define _GNU_SOURCE
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* enter/leave: seconds after the call, per thread; cpu: sched_getcpu per thread; returns the word sum. */
uint64_t team_read(int threads, int buffers, const uint64_t **words, const long *count, double *enter,
                   double *leave, int *cpu) {
    double t0 = now();
    uint64_t total = 0;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        enter[t] = now() - t0;
        cpu[t] = sched_getcpu();
        uint64_t s = 0;
        for (int b = 0; b < buffers; b++) {  /* each thread its contiguous share of every buffer */
            long lo = count[b] * t / n, hi = count[b] * (t + 1) / n;
            for (long i = lo; i < hi; i++) s += words[b][i];
        }
        total += s;
        leave[t] = now() - t0;
    }
    return total;
}
"""


@dataclass(frozen=True)
class TeamRun:
    """One region's per-thread times (seconds from the call) and CPUs, thread 0 the caller."""

    enter_s: list[float]  # [T] the thread's entry into the region (its wake-up, for the workers)
    leave_s: list[float]  # [T] the end of its share of the read
    cpus: list[int]  # [T] the CPU it ran on
    wall_s: float  # the call's host time (the region's end barrier included)

    @property
    def work_s(self) -> list[float]:
        return [b - a for a, b in zip(self.enter_s, self.leave_s)]

    @property
    def late(self) -> int:
        """The thread that left last: the one the region's barrier waited for."""
        return max(range(len(self.leave_s)), key=self.leave_s.__getitem__)

    def summary(self) -> dict:
        w, e = self.work_s, self.enter_s[1:] or [0.0]
        return {"wall_ms": self.wall_s * 1e3, "wake_max_ms": max(e) * 1e3,
                "wake_median_ms": sorted(e)[len(e) // 2] * 1e3,
                "work_max_ms": max(w) * 1e3, "work_median_ms": sorted(w)[len(w) // 2] * 1e3, "late": self.late,
                "late_wake_ms": self.enter_s[self.late] * 1e3, "late_work_ms": w[self.late] * 1e3,
                "threads": len(w), "distinct_cpus": len(set(self.cpus)), "late_cpu": self.cpus[self.late]}


def _torch_libgomp() -> str | None:
    """The path of the libgomp torch loaded (after one parallel op), None where it uses another runtime."""
    torch.ones(1 << 20).add_(1.0)  # a parallel op: the OpenMP runtime is loaded and its pool made
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
    return sorted(paths)[0] if paths else None


class TeamProbe:
    """``team_read`` built once per process (module docstring)."""

    def __init__(self) -> None:
        self.why, self._fn = "", None
        lib = _torch_libgomp()
        if lib is None:
            self.why = "no libgomp in the process (torch's parallel backend is not OpenMP)"
            return
        folder = tempfile.mkdtemp(prefix="team_probe_")
        src, out = os.path.join(folder, "probe.c"), os.path.join(folder, "probe.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        # -fopenmp only to compile: linking names torch's libgomp by path, never the system's (another pool)
        obj = os.path.join(folder, "probe.o")
        for cmd in (["cc", "-O2", "-fPIC", "-fopenmp", "-c", src, "-o", obj],
                    ["cc", "-shared", obj, "-o", out, lib, f"-Wl,-rpath,{os.path.dirname(lib)}"]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                self.why = f"{' '.join(cmd[:2])} failed: {done.stderr.strip()[-300:]}"
                return
        fn = ctypes.CDLL(out).team_read
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_long),
                       ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_int)]
        self._fn, self.lib = fn, lib

    def available(self) -> bool:
        return self._fn is not None

    def run(self, threads: int, weights: list[torch.Tensor]) -> TeamRun:
        """Read ``weights`` (contiguous host tensors, e.g. one expert's w13 and w2 rows; [] reads nothing:
        the wake alone) on a region of ``threads`` threads; one region per call, its times per thread."""
        if self._fn is None:
            raise RuntimeError(f"the team probe is not available: {self.why}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if any(not w.is_contiguous() or w.device.type != "cpu" for w in weights):
            raise ValueError("weights must be contiguous host tensors (read in place: a copy would warm them)")
        enter, leave, cpus = (ctypes.c_double * threads)(), (ctypes.c_double * threads)(), (ctypes.c_int * threads)()
        ptrs = (ctypes.c_void_p * max(1, len(weights)))(*[w.data_ptr() for w in weights])
        counts = (ctypes.c_long * max(1, len(weights)))(*[w.numel() * w.element_size() // 8 for w in weights])
        start = time.perf_counter()
        self._fn(threads, len(weights), ptrs, counts, enter, leave, cpus)
        wall = time.perf_counter() - start
        # a team smaller than asked (the runtime's limit) leaves the last entries unset: cut them
        n = max(1, sum(1 for i in range(threads) if leave[i] > 0.0))
        return TeamRun(list(enter)[:n], list(leave)[:n], list(cpus)[:n], wall)

