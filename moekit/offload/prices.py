"""A memo of the prices "auto"'s proofs and search ask for again and again (``PriceMemo``): one CPU expert's
time by rows (``MissCosts.cpu_time``) and the GPU side by hits and fetches (``cost.gpu_side_s``), for one
``MissCosts`` object and one expert size. Each entry is the call's own answer (the same float), computed on
first use: a forward's search prices a few hundred splits (a, b), each a GPU side and a running CPU sum,
and the layers of a stack share the costs (``online.CpuRate.apply`` builds new ones only when its estimate
moves), so from the second forward on nearly every price is a dict lookup (one H200 run's "auto" spent
0.1-0.27 ms of host time a forward planning at M = 8-32, the price calls much of it).

``memo_for`` keeps the latest memo; costs of another identity (a new estimate, another layer's costs) or
another expert size start a fresh one.
"""

from __future__ import annotations

from moekit.offload.cost import MissCosts, gpu_side_s


class PriceMemo:
    """``cpu(rows)`` and ``gpu(hits, fetched, busy)`` for ``costs`` and ``expert_bytes``, memoized."""

    def __init__(self, costs: MissCosts, expert_bytes: int) -> None:
        self.costs, self.expert_bytes = costs, expert_bytes
        self._cpu: dict[int, float] = {}
        self._gpu: dict[tuple[int, int, bool], float] = {}

    def cpu(self, rows: int) -> float:
        """``costs.cpu_time(rows)``."""
        t = self._cpu.get(rows)
        if t is None:
            t = self._cpu[rows] = self.costs.cpu_time(rows)
        return t

    def gpu(self, hits: int, fetched: int, busy: bool = False) -> float:
        """``gpu_side_s(hits, fetched, expert_bytes, costs, busy)``."""
        key = (hits, fetched, busy)
        t = self._gpu.get(key)
        if t is None:
            t = self._gpu[key] = gpu_side_s(hits, fetched, self.expert_bytes, self.costs, busy)
        return t


_LATEST: list[PriceMemo] = []


def memo_for(costs: MissCosts, expert_bytes: int) -> PriceMemo:
    """The memo of ``costs`` (by identity) and ``expert_bytes``: the latest one where they match, else a new one."""
    if _LATEST and _LATEST[0].costs is costs and _LATEST[0].expert_bytes == expert_bytes:
        return _LATEST[0]
    memo = PriceMemo(costs, expert_bytes)
    _LATEST[:] = [memo]
    return memo
