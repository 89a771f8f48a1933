"""hfz46: the real client on seeded random configs of every MoE family the installed transformers ships, against
transformers' own eager experts, for as many seeds as a run allows (the test file, ``tests/test_hf_fuzz.py``, runs a
fixed few). CPU only; ``--triton`` adds the triton backend under Triton's interpreter (TRITON_INTERPRET=1, set here)
at the tiniest shapes. Not a timing: run it niced, one process.

    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_hf.py --seeds 0:2000 --out /tmp/fuzz_hf.json --deadline 3000
    PYTHONPATH=$PWD python3 benchmarks/fuzz_hf.py --seeds 17:18               # one failing seed again
    PYTHONPATH=$PWD python3 benchmarks/fuzz_hf.py --families                  # the families fuzzed and skipped, why
    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_hf.py --seeds 0:300 --triton --spread

Per seed (``tests/_hf_fuzz_cases.draw_case``): a family, its MoE config fields, the batch (padding or not), the dtype;
(``tests/_hf_fuzz_check.check_case``) logits on "moekit" per backend against eager, gradients for some, moe_from_hf on
a block for some, quantized blocks against their float64 twin (--quant-rate), torch.compile (--compile-rate).
``--spread``: also transformers' batched_mm against its eager (the reduction-order error the tolerances sit above).
A line per failing seed (PASS/FAIL), the table last: seeds, comparisons, left out (near ties; eager not finite),
refusals, failing seeds.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from bench_run import RunLog, run_info, write_json  # noqa: E402

RUN = RunLog("hfz46: the real client against transformers' eager (seeds, comparisons, left out, refusals, failing)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0:200", help="A:B, the seeds A..B-1")
    p.add_argument("--out", help="JSON: the run's totals, every failing seed's case and failures, the skipped families")
    p.add_argument("--deadline", type=float, default=float("inf"), help="s: no seed starts after it")
    p.add_argument("--triton", action="store_true", help="also the triton backend, interpreted, at the tiniest shapes")
    p.add_argument("--compile-rate", type=float, default=0.05, help="the share of seeds that torch.compile the model")
    p.add_argument("--quant-rate", type=float, default=0.1, help="the share of seeds with quantized blocks")
    p.add_argument("--spread", action="store_true", help="also transformers' batched_mm against its eager")
    p.add_argument("--families", action="store_true", help="list the families fuzzed and skipped (why), then stop")
    args = p.parse_args()
    start, stop = (int(v) for v in args.seeds.split(":"))
    if not 0 <= start < stop:
        p.error(f"--seeds must be A:B with 0 <= A < B, got {args.seeds!r}")
    for name in ("compile_rate", "quant_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be within [0, 1], got {getattr(args, name)}")
    args.range = range(start, stop)
    return args


def main() -> int:
    args = parse_args()
    if args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from _interpreter_speed import install

        install()
    warnings.filterwarnings("ignore")
    from _hf_fuzz_cases import draw_case
    from _hf_fuzz_check import check_case
    from _hf_fuzz_models import fuzz_families

    fuzzed, skipped = fuzz_families()
    RUN.log(f"{len(fuzzed)} families fuzzed, {len(skipped)} skipped")
    for s in skipped:
        RUN.log(f"  skipped {s.key}: {s.reason}")
    if args.families:
        RUN.log("fuzzed: " + " ".join(f.key for f in fuzzed))
        return 0
    totals = collections.Counter()
    failing, spreads, per_family = [], [], collections.Counter()
    for seed in args.range:
        if RUN.elapsed() > args.deadline:
            RUN.log(f"SKIP seeds {seed}..{args.range.stop - 1}: deadline")
            break
        case = draw_case(seed, triton=args.triton, compile_rate=args.compile_rate, quant_rate=args.quant_rate)
        try:
            outcome = check_case(case, spread=args.spread)
            failures = outcome.failures
        except Exception as exc:  # noqa: BLE001 (a seed that raises is a failing seed; the others still run)
            outcome, failures = None, [f"raised {type(exc).__name__}: {str(exc)[-400:]}"]
        totals["seeds"] += 1
        per_family[case.fam.key] += 1
        totals["rejected draws"] += len(case.rejected)
        if outcome is not None:
            totals["compared"] += outcome.compared
            totals["left out"] += len(outcome.left_out)
            totals["refusals"] += len(outcome.refusals)
            if outcome.spread is not None:
                spreads.append((str(case.dtype), outcome.spread))
        if failures:
            failing.append({"seed": seed, "case": case.describe(), "failures": failures})
            RUN.check(f"seed {seed}", False, f"{case.describe()}\n    " + "\n    ".join(failures))
        if seed % 25 == 0:
            RUN.log(f"seed {seed}: {dict(totals)}, {len(failing)} failing")
    _summary(args, totals, failing, spreads, per_family)
    if args.out:
        write_json(args.out, {"run": run_info(), "totals": dict(totals), "failing": failing,
                              "skipped": {s.key: s.reason for s in skipped}, "per_family": dict(per_family),
                              "spread": spreads})
    RUN.check("every seed", not failing, f"{len(failing)} failing")
    RUN.print_table()
    return 1 if failing else 0


def _summary(args, totals, failing, spreads, per_family) -> None:
    RUN.summary.append(f"seeds {totals['seeds']} ({args.range.start}..), {len(per_family)} families: "
                       f"{totals['compared']} comparisons, {totals['left out']} left out (near tie; eager not finite), "
                       f"{totals['refusals']} refusals, {totals['rejected draws']} draws the family refused, "
                       f"{len(failing)} failing seeds {[f['seed'] for f in failing][:20]}")
    for dtype in sorted({d for d, _ in spreads}):
        values = sorted(v for d, v in spreads if d == dtype)
        RUN.summary.append(f"spread {dtype}: transformers' batched_mm vs eager rel L2, median "
                           f"{values[len(values) // 2]:.1e}, max {values[-1]:.1e} ({len(values)} seeds)")


if __name__ == "__main__":
    sys.exit(main())
