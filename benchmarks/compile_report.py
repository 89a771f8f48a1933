"""The report loop of the offline compile scripts (``*_compile_cpu.py``, ``wo_*_sass_cpu.py``): each job run in turn,
an ``OK`` line with what it measured or a ``FAIL`` line with the error, so one kernel that does not compile never
hides the others; the exit status says whether any failed.
"""

from __future__ import annotations

from typing import Callable


def report_jobs(jobs: list[tuple[str, Callable[[], str]]], tail: int = 1500) -> int:
    """Run each (label, job) of ``jobs``: print "OK <job()>", or "FAIL <label>: <error type>: <the error's last
    ``tail`` characters>". Returns 1 if any failed, else 0."""
    failed = 0
    for label, job in jobs:
        try:
            print(f"OK {job()}", flush=True)
        except Exception as exc:  # noqa: BLE001 (report each)
            failed += 1
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-tail:]}", flush=True)
    return 1 if failed else 0
