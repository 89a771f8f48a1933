"""A ``SimResult`` as readable text: the stats, an ASCII load histogram, touched experts, the EP view."""

from __future__ import annotations

from moekit.sim.run import SimResult

HIST_HEIGHT = 12  # rows of the ASCII histogram
HIST_WIDTH = 128  # columns at most; more experts are shown as the max of adjacent groups


def format_params(n: float) -> str:
    """362390228992 -> '362.4G' (the page uses the same rule)."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def histogram(loads: list[int], capacity: int) -> str:
    """Vertical bars, one column per expert: '#' kept, 'x' over capacity (dropped), '-' the capacity line."""
    group = -(-len(loads) // HIST_WIDTH)
    cols = [max(loads[i:i + group]) for i in range(0, len(loads), group)]
    top = max(max(cols), capacity, 1)
    rows = []
    for level in range(HIST_HEIGHT, 0, -1):
        lo = (level - 1) * top / HIST_HEIGHT  # the cell covers loads in (lo, hi]
        hi = level * top / HIST_HEIGHT
        cap_here = lo < capacity <= hi
        cells = ["x" if c > lo and lo >= capacity else "#" if c > lo else "-" if cap_here else " " for c in cols]
        label = f"{hi:6.1f} |" if level in (HIST_HEIGHT, 1) or cap_here else "       |"
        rows.append(label + "".join(cells) + (f"  capacity {capacity}" if cap_here else ""))
    rows.append("       +" + "-" * len(cols))
    note = f" ({group} experts per column, max shown)" if group > 1 else ""
    rows.append(f"        experts 0..{len(loads) - 1}{note}")
    return "\n".join(rows)


def summary(result: SimResult) -> str:
    """The human-readable report of one run."""
    p = result.params
    lines = [
        f"E={p['experts']} top-{p['top_k']} tokens={p['tokens']} capacity factor={p['capacity_factor']} "
        f"skew={p['skew']} balance={p['balance']} seed={p['seed']}",
        "router            " + ", ".join(f"{k}={v}" for k, v in result.router.items()),
        *([f"note              {result.note}"] if result.note else []),
        "",
        histogram(result.loads, result.capacity),
        "",
        f"capacity          {result.capacity} assignments per expert",
        f"dropped           {result.dropped} of {result.routed_assignments} assignments "
        f"({100 * result.drop_rate:.1f}%)",
        f"imbalance         {result.imbalance:.2f}x (max/mean expert load)",
        f"experts touched   {result.experts_touched} of {p['experts']}",
        f"params in memory  {format_params(result.total_params)}   read per token {format_params(result.active_params)}"
        f"   sparsity {result.sparsity:.1f}x   [{result.param_shape}]",
    ]
    if result.identity_hits:
        lines.append(f"zero-compute      {sum(result.identity_hits)} of {p['tokens'] * p['top_k']} slots on the "
                     f"{len(result.identity_hits)} identity experts ({100 * result.zero_compute_share:.1f}%): "
                     f"{p['top_k'] * (1 - result.zero_compute_share):.2f} experts run a token")
    if result.hash_layers:
        layers = ", ".join(map(str, result.hash_layers))
        lines.append(f"hash layers       {layers}: not simulated (this run is the top-k layers'); a token's experts "
                     f"there are tid2eid[its id], a table in the checkpoint, so their load is that table's over the "
                     f"text's token ids, which neither --skew nor --balance changes")
    if result.balance is not None:
        b = result.balance
        lines.append(f"balancing         {b.method}, {b.steps} steps: imbalance {b.imbalance_before:.2f}x -> "
                     f"{b.imbalance_after:.2f}x, drops {100 * b.drop_rate_before:.1f}% -> "
                     f"{100 * b.drop_rate_after:.1f}%")
    lines += ["", "experts touched per batch (simulated / uniform prediction):"]
    lines += [f"  batch {t.batch:4d}: {t.simulated:6.1f} / {t.predicted:6.1f}" for t in result.touched_by_batch]
    ep = result.ep
    lines += ["", f"expert parallelism on {ep.gpus} GPUs ({ep.spare_slots} spare slots for EPLB): {ep.cost_model}"]
    for r in ep.placements:
        lines.append(f"  {r.name:11s} step {r.step_time_us:8.2f} µs  balanced {r.balanced_time_us:8.2f} µs  "
                     f"imbalance {r.imbalance:5.2f}x  throughput lost {100 * r.throughput_lost:5.1f}%")
    lines.append(f"  replication gain (contiguous / eplb step time): {ep.replication_gain:.2f}x")
    return "\n".join(lines)
