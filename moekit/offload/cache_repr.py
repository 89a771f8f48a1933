"""``ExpertCache``'s repr: what a user printing an offloaded model's cache (``print(offload_experts(...))``) looks for
first: its slots, device and policy, the layers sharing it, how many slots hold an expert, and what the forwards so
far did (hits of the experts touched, fetches, prefetches, bytes copied: ``ExpertCache.stats``).

    ExpertCache(8 slots x 0.29 MB on cuda:0, policy='lfu', 2 layers; 5 of 8 slots in use; hits 120 of 160 touched
    (75.0%), fetched 40, prefetched 0, 11.6 MB copied)
"""

from __future__ import annotations


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.3g} MB"


class ReadableCache:
    """The repr of ``ExpertCache`` (the module docstring)."""

    def __repr__(self) -> str:
        s, slots = self.stats, self._slots
        in_use = 0 if slots is None else self.cache_experts - len(slots.free)
        rate = f" ({s.hit_rate:.1%})" if s.touched else ""
        return (f"ExpertCache({self.cache_experts} slots x {_megabytes(self.expert_bytes)} on {self.device}, "
                f"policy={self.policy.name!r}, {len(self._layers)} layers; {in_use} of {self.cache_experts} slots in "
                f"use; hits {s.hits} of {s.touched} touched{rate}, fetched {s.fetched}, prefetched {s.prefetched}, "
                f"{_megabytes(s.bytes_transferred)} copied)")
