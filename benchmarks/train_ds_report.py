"""The checks and the table of ``train_ds_device_check.py`` (its rows: one dict per shape at 16384 tokens)."""

from __future__ import annotations

from moekit.experts.triton_backward_launch import KernelTiles

FLOPS = {"dw13": 4, "dw2": 2, "dx": 4, "fwd13": 4, "fwd2": 2}  # a GEMM's FLOPs / (A N K)
STAGE_FLOPS = {"forward": 6, "grad_gate_up": 6, "dx": 4, "dw13": 4, "dw2": 2}  # the rest: 0 (memory-bound)
TOL = 1e-2
TRANSFORMERS = "transformers grouped_mm"


def stage_rows(ms: dict, ank: int, mm: float) -> dict:
    """{stage: {ms, pct_mm}}: a stage's FLOPs (STAGE_FLOPS x A N K) over its time, against the mm rate."""
    return {name: dict(ms=t, pct_mm=100 * STAGE_FLOPS.get(name, 0) * ank / t / 1e9 / mm if mm else 0.0)
            for name, t in ms.items()}


def verdict(rows: list) -> bool:
    """True when every variant that ran agrees with the current kernels and the winners' step is deterministic."""
    good = True
    for row in rows:
        bad = [f"{row['shape']}: {row['error']}"] if "error" in row else []
        for kernel, rs in row.get("weight_grads", {}).items():
            bad += [f"{row['shape']} {kernel} {r['name']}: rel {r['rel_current']:.1e} twin {r['twin']:.1e}"
                    for r in rs if "ms" in r and max(r["rel_current"], r["twin"]) >= TOL]
        bad += [f"{row['shape']} dx {r['name']}: rel {r['rel_current']:.1e}" for r in row.get("dx", [])
                if "ms" in r and r["rel_current"] >= TOL]
        if row.get("forward", {}).get("sorted_rel", 0.0) >= TOL:
            bad.append(f"{row['shape']} permuted forward: rel {row['forward']['sorted_rel']:.1e}")
        for name, r in (row.get("e2e") or {}).items():
            if name == TRANSFORMERS:
                continue
            if "error" in r or r["rel_vs_default"] >= TOL or r.get("deterministic") is False:
                bad.append(f"{row['shape']} e2e {name}: {r}")
        for line in bad:
            print(f"FAIL  {line}")
        good = good and not bad
    return good


def _variant_lines(row: dict) -> list[str]:
    lines = []
    groups = [(k, rs) for k, rs in row.get("weight_grads", {}).items()] + [("dx", row.get("dx", []))]
    groups += [(k, row["forward"][k]) for k in ("fwd13", "fwd2") if k in row.get("forward", {})]
    for kernel, rs in groups:
        for r in rs:
            got = f"{r['ms']:8.2f} {r['pct_mm']:5.0f}" if "ms" in r else f"  {r.get('error', '')[:60]}"
            lines.append(f"{row['shape'][:12]:12s} {kernel:5s} {r['name']:34s}{got}")
    f = row.get("forward", {})
    if "fused_ms" in f:
        lines.append(f"{row['shape'][:12]:12s} fwd   inference (fused_experts)       {f['fused_ms']:8.2f}")
    if "sorted_ms" in f:
        lines.append(f"{row['shape'][:12]:12s} fwd   permuted, best pair             {f['sorted_ms']:8.2f}"
                     f"        rel {f['sorted_rel']:.1e}")
    return lines


def table(rows: list, mm: float) -> None:
    print(f"\nbf16 mm 8192^3: {mm:.0f} TFLOP/s.  variants (ms, % of mm):")
    for row in rows:
        print("\n".join(_variant_lines(row)))
    for row in rows:
        print(f"\n{row['shape']} @ {row['m']}  stages with the winners (ms, % of mm):")
        for name, r in (row.get("stages") or {}).items():
            print(f"  {name:20s} {r['ms']:8.2f} {r['pct_mm']:5.0f}")
        e2e = row.get("e2e") or {}
        base = e2e.get(TRANSFORMERS, {}).get("ms")
        print(f"{row['shape']} @ {row['m']}  forward + backward (ms, x vs grouped_mm, % of mm, peak GiB, grads vs default):")
        for name, r in e2e.items():
            if "ms" not in r:
                print(f"  {name:28s} {r.get('error', '')[:80]}")
                continue
            speed = f"{base / r['ms']:5.2f}x" if base else "   - "
            pct = 100 * 18 * row["ank"] / r["ms"] / 1e9 / mm if mm else 0.0  # 3 x the forward's 6 A N K
            det = "" if "deterministic" not in r else f"  deterministic {r['deterministic']}"
            print(f"  {name:28s} {r['ms']:8.2f} {speed} {pct:4.0f}% {r['peak_gib']:7.2f} {r['rel_vs_default']:.1e}{det}")
        print(f"  winners: {row.get('winners')}")


def snapshot(grad):
    """A copy of a grad to compare: the first 8 experts' of a weight grad (DeepSeek-V3's are 22 GB in all:
    a whole copy next to transformers' 58 GB step would not fit), all of the others."""
    if grad is None:
        return None
    return (grad[:8] if grad.dim() == 3 else grad).clone()


def winners_of(weights: dict, dx: list) -> dict:
    """{dw13, dw2, dx: KernelTiles} of the fastest correct variant of each (TUNED's included)."""
    ok = [r for r in dx if "ms" in r and r["rel_current"] < 1e-2]
    out = {"dx": KernelTiles(**min(ok, key=lambda r: r["ms"])["tile"])} if ok else {}
    for kernel, rows in weights.items():
        ok = [r for r in rows if "ms" in r and max(r["rel_current"], r["twin"]) < 1e-2]
        if ok:
            out[kernel] = KernelTiles(**min(ok, key=lambda r: r["ms"])["tile"])
    return out


def forward_pair(forward: dict) -> dict:
    """{fwd13, fwd2: KernelTiles} of the permuted forward's best pair, when it ran and agreed; else {}."""
    if forward.get("sorted_rel", 1.0) >= 1e-2:
        return {}
    return {k: KernelTiles(**next(r for r in forward[k] if r["name"] == forward["winners"][k])["tile"])
            for k in ("fwd13", "fwd2")}
