"""What the expert cache did: per forward (``OffloadedMoE.last_stats``) and cumulative (``ExpertCache.stats``)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class OffloadStats:
    """Counts of routed experts (not tokens, except ``cpu_tokens`` and ``cpu_rows``) over one or more forwards."""

    touched: int = 0  # experts the batches routed at least one token to; = hits + fetched + cpu_experts
    hits: int = 0  # touched experts already in a GPU slot when their forward ran
    fetched: int = 0  # touched experts copied host -> GPU on demand (misses served on the GPU)
    cpu_experts: int = 0  # touched experts computed on the CPU where their weights live (misses)
    cpu_tokens: int = 0  # assignments (token, slot) computed on the CPU
    bytes_transferred: int = 0  # host -> GPU expert bytes (expert_bytes each): fetches, prefetches, admissions
    prefetched: int = 0  # experts copied ahead of their layer's forward by a prediction
    prefetch_used: int = 0  # prefetched experts that their layer's next forward did touch
    admitted: int = 0  # misses computed on the CPU and then copied into the cache for later forwards
    cpu_forwards: int = 0  # forwards that computed any miss on the CPU (one CPU branch each)
    # one forward's CPU experts' routed assignments each (a cost model's input; ``add`` keeps its own)
    cpu_rows: tuple[int, ...] = ()

    @property
    def misses(self) -> int:
        return self.fetched + self.cpu_experts

    @property
    def hit_rate(self) -> float:
        """hits / touched (1.0 when nothing was touched)."""
        return self.hits / self.touched if self.touched else 1.0

    @property
    def prefetch_accuracy(self) -> float:
        """prefetch_used / prefetched (0.0 when nothing was prefetched)."""
        return self.prefetch_used / self.prefetched if self.prefetched else 0.0

    def add(self, other: "OffloadStats") -> None:
        """Add ``other``'s counts; ``cpu_rows`` stays this one's (a running list would grow without bound)."""
        for f in fields(self):
            if f.name != "cpu_rows":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**row, "misses": self.misses, "hit_rate": self.hit_rate, "prefetch_accuracy": self.prefetch_accuracy}
