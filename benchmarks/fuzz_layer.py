"""fuzz37: the whole layer on seeded random configs against a float64 loop, for as many seeds as a run allows (the
test file, ``tests/test_fuzz_layer.py``, runs a fixed few). CPU only; the triton backend and the fused router run
under Triton's interpreter (TRITON_INTERPRET=1, set here). Not a timing: run it niced, one process.

    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_layer.py --seeds 0:2000 --out /tmp/fuzz.json --deadline 3000
    PYTHONPATH=$PWD python3 benchmarks/fuzz_layer.py --seeds 17:18 --backends grouped_mm   # one failing seed again
    PYTHONPATH=$PWD python3 benchmarks/fuzz_layer.py --smoke                                # 3 seeds, every backend
    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_layer.py --grad --offload --ep 2 3 --seeds 0:1000  # all of it
    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_layer.py --grad --hash --seeds 0:500   # the hash layers'
    PYTHONPATH=$PWD nice -n 10 python3 benchmarks/fuzz_layer.py --grad --newest --seeds 0:500  # sessions 45-49's

Per seed (``tests/_fuzz_cases.draw_case``): a config over every router option and the layer's options (capacity,
fused / separate shared expert, fused router, grouped_mm's cpu_gemm / layout / memory budget, quantization, dtype,
M, NaN gate rows); per backend (``tests/_fuzz_check.check_case``): output (plain, stats and repeated calls) vs the
float64 loop (``tests/_fuzz_reference``), rel L2 under the dtype's tolerance; ids bit for bit where no near tie;
counts, drops, masked tokens; every refusal names its argument. ``--grad``: also each backend's gradients against
float64 autograd through the loop (``tests/_fuzz_grad``); ``--offload``: also two OffloadedMoE layers on one small
cache, three batches in a row, saved and loaded whole in some (``tests/_fuzz_offload``); ``--ep 2 3``: also EPMoE
over 2 and 3 gloo ranks, with capacity (per rank) and EPLB in some (``tests/_fuzz_ep``; with ``--grad`` its gradients
too, ``tests/_fuzz_ep_grad``), after the seeds (those the deadline let start). A line per failing
seed (PASS/FAIL), the table last:
seeds, comparisons, refusals checked, comparisons left out for a near tie decided a capacity drop, failing seeds.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from _interpreter_speed import install  # noqa: E402
from bench_run import RunLog, run_info, write_json  # noqa: E402

install()
warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy on the branches tl.where discards
warnings.filterwarnings("ignore", category=UserWarning)

from _fuzz_cases import draw_case, draw_hash_case  # noqa: E402
from _fuzz_check import BACKENDS, Outcome, check_case  # noqa: E402
from _fuzz_newest import draws_newest  # noqa: E402
from _fuzz_ep import check_ep, ep_takes, rank_cases  # noqa: E402
from _fuzz_ep_grad import check_ep_grads, ep_grad_seeds, rank_grads  # noqa: E402
from _fuzz_grad import check_grads  # noqa: E402
from _fuzz_offload import check_offload  # noqa: E402
from _parallel_harness import run_ranks  # noqa: E402

RUN = RunLog("fuzz37: the layer against a float64 loop (seeds, comparisons, refusals, left out, failing)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0:200", help="A:B, the seeds A..B-1")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--out", help="JSON: the run's totals and every failing seed's case and failures")
    p.add_argument("--deadline", type=float, default=float("inf"), help="s: no seed starts after it")
    p.add_argument("--smoke", action="store_true", help="3 seeds, every backend")
    p.add_argument("--grad", action="store_true", help="also the gradients against float64 autograd (_fuzz_grad)")
    p.add_argument("--offload", action="store_true", help="also two OffloadedMoE layers on one cache (_fuzz_offload)")
    p.add_argument("--hash", action="store_true",
                   help="the hash layers' seeds instead (HashMoE, DeepSeek-V4: _fuzz_cases.draw_hash_case)")
    p.add_argument("--newest", action="store_true",
                   help="only the seeds that draw one of sessions 45-49's options (_fuzz_newest.NEWEST)")
    p.add_argument("--ep", type=int, nargs="*", default=[], metavar="W",
                   help="also EPMoE over W gloo ranks (_fuzz_ep; e.g. --ep 2 3), every seed in one spawn per W")
    args = p.parse_args()
    start, stop = (int(v) for v in ("0:3" if args.smoke else args.seeds).split(":"))
    if not 0 <= start < stop:
        p.error(f"--seeds must be A:B with 0 <= A < B, got {args.seeds!r}")
    args.range = range(start, stop)
    return args


def main() -> int:
    args = parse_args()
    totals = dict(seeds=0, compared=0, refusals=0, left_out=0)
    failing = []
    ran = args.range  # the seeds the deadline let start; --ep runs these
    for seed in args.range:
        if RUN.elapsed() > args.deadline:
            RUN.log(f"SKIP seeds {seed}..{args.range.stop - 1}: deadline")
            ran = range(args.range.start, seed)
            break
        case = draw_hash_case(seed) if args.hash else draw_case(seed)
        if args.newest and not args.hash and not draws_newest(case.fields):
            continue
        try:
            outcome = check_case(case, tuple(args.backends))
            if args.grad:
                check_grads(case, tuple(args.backends), outcome)
            if args.offload:
                check_offload(case, outcome)
            failures = outcome.failures
        except Exception as exc:  # noqa: BLE001 (a seed that raises is a failing seed; the others still run)
            outcome, failures = None, [f"raised {type(exc).__name__}: {str(exc)[-400:]}"]
        totals["seeds"] += 1
        if outcome is not None:
            totals["compared"] += outcome.compared
            totals["refusals"] += outcome.refusals
            totals["left_out"] += outcome.skipped_ambiguous
        if failures:
            failing.append({"seed": seed, "case": case.describe(), "failures": failures})
            RUN.check(f"seed {seed}", False, f"{case.describe()}\n    " + "\n    ".join(failures))
        if seed % 50 == 0:
            RUN.log(f"seed {seed}: {totals}, {len(failing)} failing")
    for world_size in args.ep:
        _run_ep(ran, world_size, totals, failing)
        if args.grad:
            _run_ep(ran, world_size, totals, failing, grad=True)
    RUN.summary.append(f"seeds {totals['seeds']} ({args.range.start}..), backends {' '.join(args.backends)}: "
                       f"{totals['compared']} comparisons, {totals['refusals']} refusals checked, "
                       f"{totals['left_out']} left out (near tie at a capacity drop), {len(failing)} failing seeds "
                       f"{[f['seed'] for f in failing][:20]}")
    if args.out:
        write_json(args.out, {"run": run_info(), "totals": totals, "failing": failing})
    RUN.check("every seed", not failing, f"{len(failing)} failing")
    RUN.print_table()
    return 1 if failing else 0


def _run_ep(seeds: range, world_size: int, totals: dict, failing: list, grad: bool = False) -> None:
    """Every seed EPMoE takes (``grad``: trains) through ``world_size`` gloo ranks in one spawn, checked; failures by
    seed."""
    if grad:
        taken, fn, check, what = ep_grad_seeds(seeds, world_size), rank_grads, check_ep_grads, "EP gradients"
    else:
        taken, fn, check, what = [s for s in seeds if ep_takes(draw_case(s))], rank_cases, check_ep, "EP"
    ranks = run_ranks(fn, world_size, taken, timeout_s=3600, pg_timeout_s=600)
    for seed in taken:
        outcome = Outcome()
        check([seed], ranks, world_size, outcome)
        totals["compared"] += outcome.compared
        totals["refusals"] += outcome.refusals
        totals["left_out"] += outcome.skipped_ambiguous
        if outcome.failures:
            failing.append({"seed": seed, "case": f"{what} W={world_size}", "failures": outcome.failures})
            RUN.check(f"seed {seed} {what} W={world_size}", False, "\n    ".join(outcome.failures))
    RUN.log(f"{what} W={world_size}: {len(taken)} seeds")


if __name__ == "__main__":
    sys.exit(main())
