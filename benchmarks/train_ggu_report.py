"""The checks and the table of ``train_ggu_device_check.py`` (its rows: one dict per (shape, M) cell)."""

from __future__ import annotations


def weight_ok(r: dict) -> bool:
    return "ms" in r and max(r["rel_current"], r["twin"]) < 1e-2


def ok_row(r: dict) -> bool:
    return "ms" in r and max(r["dh"], r["gw"], r["dweights"], r["twin"]) < 1e-2


def passed(rows: list) -> bool:
    good = True
    for row in rows:
        for r in row["rows"]:
            if "ms" in r and not ok_row(r):
                print(f"FAIL  {row['shape']} {r['name']}: dh {r['dh']:.1e} gw {r['gw']:.1e} "
                      f"dweights {r['dweights']:.1e} twin {r['twin']:.1e}")
                good = False
        for kernel, rs in row["weight_grads"].items():
            for r in rs:
                if "ms" in r and not weight_ok(r):
                    print(f"FAIL  {row['shape']} {kernel} {r['name']}: rel_current {r['rel_current']:.1e} "
                          f"twin {r['twin']:.1e}")
                    good = False
        if row.get("deterministic") is False:
            print(f"FAIL  {row['shape']}: two backward calls with the winners differ")
            good = False
        if "e2e_error" in row or (row["e2e"] and max(row["e2e"]["rel_l2_vs_heuristic"].values()) >= 1e-2):
            print(f"FAIL  {row['shape']}: forward + backward with the winner: {row.get('e2e_error', row['e2e'])}")
            good = False
    return good


def label(row: dict) -> str:
    return f"{row['shape']}@{row['m']}"


def _variant(where: str, name: str, r: dict, rel: str, pct) -> None:
    """One variant's line: its error, or ms, TFLOP/s, % of mm, ``r[rel]`` (against the current kernel), the
    error against the twin and the registers/spills of its kernels."""
    if "error" in r:
        print(f"{where:20} {name:30} {r['error'][:110]}")
        return
    regs = " ".join(f"{n}:{g}/{sp}" for n, g, sp in r["kernels"])
    print(f"{where:20} {name:30} {r['ms']:8.2f} {r['tflops']:8.0f} {pct(r['tflops']):5.0f} "
          f"{r[rel]:8.1e} {r['twin']:8.1e}  {regs}")


def table(rows: list, matmul: float) -> None:
    pct = (lambda tf: 100 * tf / matmul) if matmul else (lambda tf: 0.0)
    print(f"bf16 mm 8192^3: {matmul:.0f} TFLOP/s")
    print(f"{'shape@M':20} {'grad_gate_up variant':30} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5} {'dh':>8} {'twin':>8}  regs/spills")
    for row in rows:
        for r in row["rows"]:
            _variant(label(row), r["name"], r, "dh", pct)
        print(f"{label(row):20} {'(permute x, dout)':30} {row['permute_ms']:8.2f}")
        for kernel, rs in row["weight_grads"].items():
            for r in rs:
                _variant(label(row), f"{kernel} {r['name']}", r, "rel_current", pct)
    print(f"{'shape@M':20} {'winner (grad_gate_up)':30} {'fwd+bwd ms':>10} {'current':>8} {'grouped_mm':>10} {'speedup':>7} {'%mm':>5}")
    for row in filter(lambda r: r["e2e"], rows):
        e = row["e2e"]
        print(f"{label(row):20} {row['winner']:30} {e['tuned_ms']:10.2f} {e['heuristic_ms']:8.2f} "
              f"{e['baseline_ms']:10.2f} {e['baseline_ms'] / e['tuned_ms']:6.2f}x {pct(e['fwd_bwd_tflops_tuned']):5.0f}")
    print(f"{'shape@M':20} {'stage (winner)':16} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5}")
    for row in filter(lambda r: r.get("stages"), rows):
        for name, st in row["stages"].items():
            print(f"{label(row):20} {name:16} {st['ms']:8.2f} {st['tflops']:8.0f} {pct(st['tflops']):5.0f}")
        print(f"{label(row):20} {'sum':16} {sum(st['ms'] for st in row['stages'].values()):8.2f}  "
              f"deterministic: {row.get('deterministic')}  tiles: {row.get('tiles')}")
