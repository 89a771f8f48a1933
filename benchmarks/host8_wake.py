"""Issue 13, the bench's first call after a sync (``host_us`` against ``host_rest_us``): does the host pay it for any
work, and does it depend on how the host waited?

After the GPU ran ``D`` ms (``torch.cuda._sleep``) the host waits one way (``WAITS``) and then runs one workload
(``WORKLOADS``), timed op by op: its first op, its second and the median of the others (``rest``); the first op's
excess over the same op right after the workload ran (``hot``); the first op's CPU time
(``time.thread_time``: a first op whose CPU time is far below its wall time was off the CPU, descheduled or in a
page fault served elsewhere) and whether the thread changed cpu over the wait. Each (wait, D, workload) is repeated
``REPS`` times, interleaved; medians.

    workloads: moekit  Qwen3-30B-A3B bf16 M = 64 experts calls (kept, batched: the bench's cell), 16 back to back
               torch   ``torch.empty_like(x)`` then 15 ``t.add_(1)`` on a 64-element CUDA tensor (no moekit; the
                       first op is the bench call's ``empty_like``)
               cpu     the same ops on CPU tensors (torch's dispatcher, no CUDA driver)
               python  16 steps of a fixed pure-Python loop (no torch)
    waits:     sync      torch.cuda.synchronize() (the bench's ``_EagerLoop``)
               event     an event recorded after the work, ``event.synchronize()`` (the bench's timed pass)
               blocking  an event made with ``blocking=True`` (the thread sleeps in the driver)
               poll      ``while not event.query(): pass``
               pollwork  ``while not event.query(): torch.empty_like(x)`` (torch's allocator path kept busy)
               spin      a Python spin past the GPU's end, then ``synchronize`` (no CUDA call while waiting)
               sleepidle GPU idle, ``time.sleep(D)``
               spinidle  GPU idle, a Python spin of D
    hot:       the workload right after itself (no wait)

    PYTHONPATH=$PWD timeout 60 python3 benchmarks/host8_wake.py --out $OUT/host8 [--deadline-s 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

WAITS = ("sync", "event", "blocking", "poll", "pollwork", "spin", "sleepidle", "spinidle")
WORKLOADS = ("moekit", "torch", "cpu", "python")
DURATIONS_MS = (1.0, 10.0)
REPS, OPS = 11, 16
CYCLES_PER_MS = 1_980_000  # torch.cuda._sleep cycles at the H200's 1.98 GHz


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


class Probe:
    """The workloads' ops and the waits, built once."""

    def __init__(self, device: torch.device):
        from host_big3_device_check import QWEN3, _weights
        from moekit.bench.cells import Shape, make_sets
        from moekit.experts import get_backend

        fn, shape = get_backend("triton"), Shape.from_preset(QWEN3)
        w13, w2 = _weights(shape, "bfloat16")
        sets = make_sets(shape, 64, 2, torch.bfloat16, device)
        self.calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
        self.x, self.t = sets[0].x, torch.zeros(64, device=device)
        self.x_cpu, self.t_cpu = self.x.cpu(), torch.zeros(64)
        self.event, self.blocking = torch.cuda.Event(), torch.cuda.Event(blocking=True)
        self.dict = {i: i for i in range(64)}

    def ops(self, workload: str) -> list:
        """OPS zero-argument ops, timed one by one."""
        if workload == "moekit":
            return [self.calls[i % 2] for i in range(OPS)]
        if workload in ("torch", "cpu"):
            x, t = (self.x, self.t) if workload == "torch" else (self.x_cpu, self.t_cpu)
            return [lambda: torch.empty_like(x)] + [lambda: t.add_(1.0)] * (OPS - 1)
        return [self._py_step] * OPS

    def _py_step(self) -> int:
        d, s = self.dict, 0
        for j in range(256):
            s += d[j & 63]
        return s

    def wait(self, how: str, ms: float) -> None:
        if how in ("sleepidle", "spinidle"):
            torch.cuda.synchronize()
            time.sleep(ms / 1e3) if how == "sleepidle" else _spin(ms / 1e3)
            return
        torch.cuda._sleep(int(CYCLES_PER_MS * ms))
        event = self.blocking if how == "blocking" else self.event
        event.record()
        if how == "sync":
            torch.cuda.synchronize()
        elif how in ("event", "blocking"):
            event.synchronize()
        elif how == "poll":
            while not event.query():
                pass
        elif how == "pollwork":
            x = self.x
            while not event.query():
                torch.empty_like(x)
        elif how == "spin":
            _spin(ms / 1e3 * 1.3)
            torch.cuda.synchronize()


def timed(ops: list) -> dict:
    """µs of the first op (wall, CPU), the median of the rest, the cpu before/after (no sync: the caller's)."""
    cpu0 = _cpu()
    stamps, cpu_t0 = [time.perf_counter()], time.thread_time()
    ops[0]()
    stamps.append(time.perf_counter())
    cpu_first = time.thread_time() - cpu_t0
    for op in ops[1:]:
        op()
        stamps.append(time.perf_counter())
    each = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
    return dict(first=each[0], first_cpu=cpu_first * 1e6, second=each[1], rest=statistics.median(each[2:]),
                rest_sum=sum(each[1:]), moved=int(_cpu() != cpu0))


def run_wake(results: dict, deadline_s: float, save) -> None:
    probe, out = Probe(torch.device("cuda")), results.setdefault("wake", {})
    for w in WORKLOADS:
        for _ in range(3):  # warm: compile, keep, batch
            timed(probe.ops(w))
    end = time.perf_counter() + deadline_s
    cases = [("hot", 0.0)] + [(how, ms) for ms in DURATIONS_MS for how in WAITS]
    rows = {(how, ms, w): [] for how, ms in cases for w in WORKLOADS}
    for rep in range(REPS):
        if time.perf_counter() > end:
            print(f"deadline: wake stops after {rep} repetitions", flush=True)
            break
        for how, ms in cases:
            for w in WORKLOADS:
                ops = probe.ops(w)
                if how == "hot":  # right after itself, the GPU still busy with it (the bench's later calls)
                    timed(ops)
                else:
                    probe.wait(how, ms)
                rows[(how, ms, w)].append(timed(ops))
                torch.cuda.synchronize()  # untimed: every wait starts from an idle GPU
    for (how, ms, w), samples in rows.items():
        if not samples:
            continue
        row = {k: round(statistics.median(s[k] for s in samples), 2) for k in samples[0] if k != "moved"}
        row["moved"], row["n"] = sum(s["moved"] for s in samples), len(samples)
        out[f"{how} {ms:g}ms {w}"] = row
    save(results)


def host_facts() -> dict:
    """The host's CPU count, affinity, frequency driver and governor where readable."""
    facts = dict(cpus=os.cpu_count(), affinity=len(os.sched_getaffinity(0)), load=os.getloadavg())
    base = "/sys/devices/system/cpu/cpu0/cpufreq/"
    for name in ("scaling_driver", "scaling_governor", "scaling_cur_freq", "scaling_max_freq"):
        try:
            with open(base + name) as f:
                facts[name] = f.read().strip()
        except OSError:
            facts[name] = None
    try:
        with open("/sys/module/intel_idle/parameters/max_cstate") as f:
            facts["intel_max_cstate"] = f.read().strip()
    except OSError:
        facts["intel_max_cstate"] = None
    return facts


def print_wake(results: dict) -> None:
    print("\n== wake: per workload the first op / second / median of ops 3..16 (µs), the first's CPU µs, and the "
          "first op's excess over 'hot' (+µs); medians ==")
    wake = results.get("wake", {})
    print(f"{'wait':>14} " + " ".join(f"{w:>30}" for w in WORKLOADS))
    for key in dict.fromkeys(k.rsplit(" ", 1)[0] for k in wake):
        cols = []
        for w in WORKLOADS:
            r, hot = wake.get(f"{key} {w}"), wake.get(f"hot 0ms {w}")
            if r is None or hot is None:
                cols.append(" " * 30)
                continue
            cols.append(f"{r['first']:6.1f}/{r['second']:5.1f}/{r['rest']:5.1f} c{r['first_cpu']:6.1f} "
                        f"+{r['first'] - hot['first']:5.1f}")
        print(f"{key:>14} " + " ".join(cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host8_out"))
    parser.add_argument("--deadline-s", type=float, default=50.0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host8_wake.json")

    def save(results: dict) -> None:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, host=host_facts())
    print(json.dumps(results), flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        run_wake(results, args.deadline_s, save)
    print(f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    print_wake(results)


if __name__ == "__main__":
    main()
