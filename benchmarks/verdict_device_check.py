"""Issues #19 / #15 / #16, session 20: every library option no default takes, timed once against the shipped default
at the cells where it could win. A win (>= 3%, consistent over the interleaved rounds) makes it a default for those
cells; otherwise it is removed.

    PYTHONPATH=$PWD python3 benchmarks/verdict_device_check.py --out $OUT/verdict            # H200, <= 175 s
    PYTHONPATH=$PWD python3 benchmarks/verdict_device_check.py --smoke --out /tmp/v         # CPU, interpreter

Three parts, each a subprocess given its share of the deadline (``--deadline-s``; a part that runs over is killed
and the rest still run), each a harness of an earlier check with its cells and calls replaced:
  swap  (``decode_q3_device_check``): ``KernelConfig.swap_ab`` against the tuned entry: fp8 DeepSeek-V3 M = 1 / 8,
        Mixtral M = 1 (run 1: bf16 at Qwen3 / DeepSeek-V3 / Mixtral M = 1, 2 too) (``decode_q3_variants``:
        the tuned tiles swapped, and >= 64-row weight tiles where the tuned ones are narrower). Every output against
        ``experts_reference`` / the fp8 recipe; CUDA-graph replay, 5 interleaved rounds, median.
  fold  (``wo_fold_device_check``): the folded split gate-up on the gemv decode (``WordConfig.glu_fold``, rewritten
        to one contiguous h tile a step, untimed since): Qwen3 / DeepSeek-V3 int4 and mxfp4 at M = 1 / 8, "fold"
        against "pick" wherever the pick splits its gate-up; against the torch twin and bit-equal to unfolded.
  ridge (``ridge_device_check``, calls ``verdict_variants``): the halves Gluon kernel and its padding skip, the 64-row /
        one-warpgroup Gluon tiles, the fp8 SKIP_PADDING, at Mixtral M = 512 / 1024 against the route, on the
        route's lean launch; against the Gluon twins at the real shape; 5 interleaved graph rounds.
Each part prints PASS/FAIL lines and its own table, and writes its JSON under --out/<part>/. Last: the verdict table
(option, cell, the default's µs, the option's, default / option: > 1.03 is a win to check round by round).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
PARTS = ("swap", "fold", "ridge")
SHARE = {"swap": 0.36, "fold": 0.30, "ridge": 0.34}  # of the deadline, in order; time a part leaves goes to the next
DEADLINE_S = 160.0
# (dtype, preset, M): fp8 SWAP_AB where decode-q3's run 1 did not reach or only read once. (Run 1, dd8bed6, also
# had bf16 at Qwen3 / DeepSeek-V3 / Mixtral M = 1, 2: 0.999-1.019x, and the bf16 kernels no longer take SWAP_AB.)
SWAP_CELLS = (("fp8", "deepseek-v3", 1), ("fp8", "mixtral-8x7b", 1), ("fp8", "deepseek-v3", 8))
RIDGE_CELLS = (("mixtral-8x7b", 512), ("mixtral-8x7b", 1024))


def log(msg: str) -> None:
    print(f"[verdict {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def part_swap(deadline_s: float, smoke: bool, worker: str | None) -> int:
    import decode_q3_device_check as dq

    dq.CELLS = SWAP_CELLS
    dq.WORKER_CMD = [__file__, "--part", "swap"]
    dq.WORKER_DEADLINE_S = 0.45 * deadline_s  # compiles (12 workers) while the weights are built
    dq.DEADLINE_S = 0.85 * deadline_s  # timing stops here; eager and the kernel breakdown after
    if worker is not None:
        dq.worker_main([tuple(t) for t in json.loads(worker)])
        return 0
    return dq.main()


def part_fold(deadline_s: float, smoke: bool) -> int:
    import wo_fold_device_check as wf

    wf.PRESET_ORDER = ("qwen3-30b-a3b", "deepseek-v3")
    wf.SCHEMES = ("int4_w4a16", "mxfp4")
    wf.BATCHES = (1, 8)
    wf.EXTRA = {}  # "fold" / "unfold" only: the pick's own twin
    wf.LIMIT_S = deadline_s - 5.0
    return wf.main(["--smoke"] if smoke else [])


def part_ridge(deadline_s: float, smoke: bool) -> int:
    import ridge_device_check as rd

    class VerdictCell(rd.Cell):
        def variants(self, dtype: str):
            from verdict_variants import ridge_calls

            return ridge_calls(self.w13, self.w2, self.q, dtype, gluon=not self.smoke)

    rd.Cell = VerdictCell  # main_rows builds its cells by this name
    rd.BF16_SHARE, rd.TIMING_RESERVE_S = 0.6, 5.0  # 7 bf16 / 5 fp8 calls x 5 rounds at ~1 ms: ~4 s of timing
    rd.BREAKDOWN_RESERVE_S = float("inf")  # no per-GEMM breakdown: run 2 has it, and the time goes to the rounds
    cells = rd.SMOKE_CELLS if smoke else RIDGE_CELLS
    rows, floors, ceil = rd.main_rows(cells, smoke, 1 if smoke else rd.ROUNDS, 1e9 if smoke else deadline_s - 3.0,
                                      1e9 if smoke else (deadline_s - 6.0) / 2.2, ["bf16", "fp8"])
    rd.write_json(rows, floors, ceil, smoke)
    print(rd.table(rows, floors), flush=True)
    return 1 if any(r.status == "FAIL" for r in rows) else 0


def run_part(part: str, budget_s: float, out: Path, smoke: bool) -> int:
    """The part in a subprocess (its own CUDA context, module state and memory), killed past budget_s + 10 s."""
    folder = out / part
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OUT=str(folder))
    args = [sys.executable, __file__, "--part", part, "--deadline-s", f"{budget_s:.1f}"] + (["--smoke"] if smoke else [])
    log(f"part {part}: {budget_s:.0f} s")
    try:
        return subprocess.run(args, env=env, timeout=budget_s + 10.0).returncode
    except subprocess.TimeoutExpired:
        log(f"part {part}: killed past {budget_s + 10:.0f} s")
        return 124


def swap_lines(data: dict) -> list[tuple]:
    lines = []
    for c in data.get("cells", []):
        base = next((r for r in c["rows"] if r["variant"] == "default"), None)
        for r in c["rows"]:
            if r["variant"] != "default":
                lines.append(("swap_ab", f"{c['dtype']} {c['preset']} M={c['M']}", "tuned", base and base["us"],
                              r["variant"], r["us"], r["status"], base and base["samples"], r["samples"]))
    return lines


def fold_lines(data: dict) -> list[tuple]:
    lines = []
    for c in data.get("cells", []):
        t = c["times"]
        for other in ("fold", "unfold"):
            if other in t:
                ok = "PASS" if all(e < 1e-2 for e in c["errors"].values()) and all(c["same"].values()) else "FAIL"
                lines.append(("glu_fold", f"{c['scheme']} {c['preset']} M={c['m']}", "pick", t.get("pick"), other,
                              t[other], ok, None, None))
    return lines


def ridge_lines(data: dict) -> list[tuple]:
    lines, groups = [], {}
    for r in data.get("rows", []):
        groups.setdefault((r["cell"], r["dtype"]), []).append(r)
    for (cell, dtype), rows in groups.items():
        route = next((r for r in rows if r["variant"] == "route"), None)
        for r in rows:
            if r["variant"] != "route":
                lines.append(("gluon", f"{dtype} {cell}", "route", route and route["us"], r["variant"], r["us"],
                              r["status"], route and route["rounds_us"], r["rounds_us"]))
    return lines


def summary(out: Path) -> str:
    """The verdict table from the parts' JSON: default / option > 1 means the option is faster; "rounds won": in
    how many interleaved rounds the option read below the default's same round."""
    found = []
    for part, name, reader in (("swap", "decode_q3.json", swap_lines), ("fold", "wo_fold.json", fold_lines),
                               ("ridge", "ridge.json", ridge_lines)):
        path = out / part / name
        if path.exists():
            found += reader(json.loads(path.read_text()))
        else:
            found.append((part, "-", "-", None, "no JSON", None, "missing", None, None))
    lines = ["| option | cell | default | µs | variant | µs | default/variant | rounds won | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for option, cell, base, base_us, variant, us, status, base_rounds, rounds in found:
        ratio = f"{base_us / us:.3f}" if base_us and us else "-"
        won = (f"{sum(b > v for b, v in zip(base_rounds, rounds))}/{min(len(base_rounds), len(rounds))}"
               if base_rounds and rounds else "-")
        fmt = (lambda v: f"{v:.1f}" if v else "-")
        lines.append(f"| {option} | {cell} | {base} | {fmt(base_us)} | {variant} | {fmt(us)} | {ratio} | {won} | "
                     f"{status} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/verdict"))
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes, no Gluon")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a subprocess: run this part
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # decode_q3's compile worker (part swap)
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(Path(__file__).parent))
    if args.part == "swap":
        return part_swap(args.deadline_s, args.smoke, args.worker)
    if args.part == "fold":
        return part_fold(args.deadline_s, args.smoke)
    if args.part == "ridge":
        return part_ridge(args.deadline_s, args.smoke)
    out = Path(args.out)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    codes = {}
    for j, part in enumerate(parts):
        left = args.deadline_s - (time.perf_counter() - T0)
        share = sum(SHARE[p] for p in parts[j:])
        budget = 1e6 if args.smoke else left * SHARE[part] / share
        if budget < 15.0:
            log(f"part {part}: skipped ({left:.0f} s left)")
            codes[part] = "skipped"
            continue
        codes[part] = run_part(part, budget, out, args.smoke)
    table = summary(out)
    (out / "verdict.md").write_text(table + "\n")
    log(f"done; exit codes {codes} (0: every check PASS)")
    print(table, flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
