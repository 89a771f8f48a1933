"""Install the winners of ``fp8_small_device_check.py`` in the H200 fp8 tuned files (prints; --write writes).

    python benchmarks/fp8_small_install.py RESULTS.json [--write] [--margin 0.02]

Per cell: the fastest Triton variant that passed and loads ahead (AHEAD is the plan's argument, not an
entry's; run 1's PREWARM rows, a plan argument since removed, are left out too), against the default; where
it is faster by more than ``margin`` the cell's entry (key M) becomes its tiles, "weight_tma" and
"x_in_gate_up" (a "default x-in" winner keeps the entry's tiles and adds the switch). Rows the entries cannot
express are reported only: AHEAD off faster, the Gluon path or the backend's choice faster than the best
Triton variant (``Fp8GluonChoice`` decides that). The eager-only "x_in_gate_up" of the "backend entry x-in"
rows is decided by hand from their eager wall µs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "moekit" / "experts" / "configs"
FILES = {"qwen3-30b-a3b": "E128_N768_K2048", "deepseek-v3": "E256_N2048_K7168", "mixtral-8x7b": "E8_N14336_K4096"}


def entry_of(spec: dict, current: dict) -> dict:
    """The tuned entry of a winning variant's spec (``Variant`` as a dict); ``current``: the file's entry now."""
    if spec["tiles"] is None:
        entry = {k: v for k, v in current.items() if k != "x_in_gate_up"}
    else:
        block_m, group_m, up, down = spec["tiles"]
        tile = lambda t: {"BLOCK_N": t[0], "BLOCK_K": 128, "GROUP_M": group_m, "num_warps": t[1],  # noqa: E731
                          "num_stages": t[2]}
        entry = {"BLOCK_M": block_m, "up": tile(up), "down": tile(down)}
        if spec["tma"] is not None:
            entry["weight_tma"] = spec["tma"]
    if spec["x_in"]:
        entry["x_in_gate_up"] = True
    return entry


def nearest_key(configs: dict, m: int) -> str:
    """The key of the entry a call of M tokens uses (``configs.nearest``: log2 distance, ties the smaller)."""
    return min(configs, key=lambda k: (abs(math.log2(int(k)) - math.log2(max(m, 1))), int(k)))


def main() -> int:
    results = json.loads(Path(sys.argv[1]).read_text())
    write, margin = "--write" in sys.argv, 0.02
    if "--margin" in sys.argv:
        margin = float(sys.argv[sys.argv.index("--margin") + 1])
    docs = {}
    for cell in results["cells"]:
        preset, m = cell["preset"], cell["M"]
        rows = [r for r in cell["rows"] if r["us"] is not None and r["status"] == "ok"]
        default = next((r for r in rows if r["variant"] == "default"), None)
        triton = [r for r in rows if r["spec"]["route"] == "triton"]
        if default is None or not triton:
            print(f"{preset} M={m}: no default or no Triton variant timed")
            continue
        best = min((r for r in triton if r["spec"]["ahead"] and not r["spec"].get("prewarm")), key=lambda r: r["us"])
        fastest = min(rows, key=lambda r: r["us"])
        if fastest is not best:
            print(f"{preset} M={m}: fastest {fastest['variant']} {fastest['us']:.1f} us (not an entry's choice); "
                  f"best entry-able {best['variant']} {best['us']:.1f}")
        if best["us"] >= default["us"] * (1 - margin):
            print(f"{preset} M={m}: keep the default ({default['us']:.1f} us; best {best['variant']} {best['us']:.1f})")
            continue
        path = CONFIGS / f"{FILES[preset]}_fp8_block_NVIDIA_H200.json"
        doc = docs.setdefault(path, json.loads(path.read_text()))
        current = doc["configs"].get(str(m)) or doc["configs"][nearest_key(doc["configs"], m)]
        doc["configs"][str(m)] = entry_of(best["spec"], current)
        doc["configs"] = dict(sorted(doc["configs"].items(), key=lambda kv: int(kv[0])))
        print(f"{preset} M={m}: {default['us']:.1f} -> {best['us']:.1f} us ({best['variant']}): "
              f"{json.dumps(doc['configs'][str(m)])}")
    for path, doc in docs.items():
        if write:
            path.write_text(json.dumps(doc, indent=1) + "\n")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
