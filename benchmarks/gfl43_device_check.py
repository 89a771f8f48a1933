"""Issue #15, session 43 (brief gfl43): gpt-oss's biased fp8 calls on the fp8 Gluon path's eager fast path
(``triton_gluon_fp8.BIASED_FAST``), and a sweep of the fp8 Gluon tiles at gpt-oss-20b's shape.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gfl43_device_check.py --out $OUT/gfl43 --deadline 70   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/gfl43_device_check.py --smoke     # CPU: interpreter, the GEMMs' torch stand-ins

Shape, weights, biases, spec and inputs: ``gpt39_device_check``'s (gpt-oss-20b: E 32, K = N = 2880, top-4; the smoke:
E 8, K 128, N 64, top-2), random weights quantized to fp8_block by ``moekit.quant``. "The route" is
``run_experts(backend="triton")`` with the biases and the spec; where the default choice does not want M (1024, every
smoke M) it runs under a choice that wants every size ("forced"), so that each M below is a Gluon call.
  correct  at M = 1024, 4096 (``--check-ms``; the smoke: 9, 33), the route with BIASED_FAST on: the third call served
           from its entry, bit-equal to the same call with the switch off (the lean launches, nothing kept) and to the
           plain launches (``experts_gluon_fp8(lean=False)``), within TOL of the reference backend's fp8 recipe and
           TWIN_TOL of the twin (``experts_gluon_fp8_twin``); b13 updated in place: the next call not served and
           bit-equal to the plain launches with the new values (then restored)
  eager    at M = 1024 (forced) and 4096, the route with the switch off ("before": the lean launch's plan, descriptor
           and sequence lookups every call; its biases other tensors of the same values, so the "after" entry cannot
           serve it) / on ("after"), host and wall µs a call (``bench_run.host_and_wall_us``), ROUNDS rounds
  sweep    at M = 2048, 4096, 8192 (``--ms``) the route against each candidate of ``CANDIDATES`` (``--cands``, "all"
           for every one): ``experts_gluon_fp8`` with its tiles (each checked against the twin at its first M, and
           whether it is bit-equal to the route logged), CUDA graphs in ROUNDS settled rounds, median µs; none started
           past the deadline
The table last, then "BIASED_FAST by the defaults rule: X" (every check PASS; at each eager M host >= 3% lower in every
round and wall never >= 3% higher) with the switch's value now, and each candidate that wins by the rule (every check
PASS, >= 3% faster than the route in every round at every M of the sweep) with its tiles. The sweep of session 43
(one H100) found none; a winner would want a per-shape place in ``plan_gluon_fp8``'s rules, which has none today.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fpb40_device_check as fpb40  # noqa: E402
import gpt39_device_check as gpt39  # noqa: E402
from bench_rounds import faster_rounds  # noqa: E402
from bench_run import RunLog, host_and_wall_us, rel_l2, run_phases  # noqa: E402
from moekit.experts.triton_gluon_fp8_launch import Fp8GluonTile  # noqa: E402

MS = (9, 33) if SMOKE else (2048, 4096, 8192)
CHECK_MS = (9, 33) if SMOKE else (1024, 4096)
ROUNDS, REPLAYS = (1, 1) if SMOKE else (5, 3)
TOL, TWIN_TOL = 2e-2, 1e-2  # as gfp42's: bf16 out, an e4m3 midpoint flip now and then; the twin rounds as the kernels
EAGER_CALLS = 2 if SMOKE else 20
@dataclasses.dataclass(frozen=True)
class Tiles:
    """A candidate's tiles; each None keeps the plan's pick."""

    up: Fp8GluonTile | None = None
    down: Fp8GluonTile | None = None
    gather_groups: int | None = None


# name -> the tiles a candidate replaces (the rest the plan's: UP_TILE 3 stages, DOWN_TILE 5, GROUP_M 8, gather 1).
# SMEM: gate-up 4 stages 4 x 48 + 16 = 208 KB, down 6 stages 6 x 32 + 32 = 224 KB (of 227).
CANDIDATES = {
    "up s4": Tiles(up=Fp8GluonTile(stages=4)),
    "up gm4": Tiles(up=Fp8GluonTile(stages=3, group_m=4)),
    "down s6": Tiles(down=Fp8GluonTile(stages=6)),
    "down gm4": Tiles(down=Fp8GluonTile(stages=5, group_m=4)),
    "gather 2": Tiles(gather_groups=2),
    "up gm16": Tiles(up=Fp8GluonTile(stages=3, group_m=16)),
    "down gm16": Tiles(down=Fp8GluonTile(stages=5, group_m=16)),
    "down pipe": Tiles(down=Fp8GluonTile(stages=5, pipelined=True)),  # 23 K-steps: an odd last one
    "gather 4": Tiles(gather_groups=4),
}
DEFAULT_CANDS = ("up s4", "up gm4", "down s6", "down gm4", "gather 2")
RUN = RunLog("gfl43: gpt-oss fp8 on the Gluon path, the biased fast path (eager µs a call) and a tile sweep (graph "
             "µs, median of settled rounds)", stall_s=60)
gpt39.RUN = RUN  # gpt39's ``captured`` and ``reached`` log into this run's log and table
RESULT: dict = {"checks": {}, "eager": {}, "sweep": {}, "failed": RUN.failed}
DEFAULT_CHOICE: list = []  # the module's default choice at the start (a forced one is any other)


def choice_for(m: int, top_k: int):
    """The module's default choice where it wants M at gpt-oss's shape, else one that wants every size."""
    import moekit.experts.triton_gluon_fp8 as tgf

    e, k, n, _ = gpt39.shape()
    if tgf.DEFAULT_FP8_CHOICE.wants(m, top_k, n, k, e):
        return tgf.DEFAULT_FP8_CHOICE
    return dataclasses.replace(tgf.DEFAULT_FP8_CHOICE, min_flops=1, min_rows_per_expert=0)


class Route:
    """``run_experts`` on the triton backend at one M with the switch ``fast`` (BIASED_FAST) and the biases given,
    under ``choice_for``'s choice; counts the calls the fp8 Gluon path's entries served."""

    served = [0]

    def __init__(self, w: dict, x, ids, weights, fast: bool, b13, b2):
        self.w, self.x, self.ids, self.weights, self.fast, self.b13, self.b2 = w, x, ids, weights, fast, b13, b2
        self.choice = choice_for(x.shape[0], ids.shape[1])

    def __call__(self) -> torch.Tensor:
        import moekit.experts.triton_gluon_fp8 as tgf
        from moekit.experts import run_experts

        kept = tgf.DEFAULT_FP8_CHOICE, tgf.BIASED_FAST
        tgf.DEFAULT_FP8_CHOICE, tgf.BIASED_FAST = self.choice, self.fast
        try:
            return run_experts(self.x, self.w["q13"], self.w["q2"], self.ids, self.weights, activation=gpt39.SPEC,
                               b13=self.b13, b2=self.b2, backend="triton")
        finally:
            tgf.DEFAULT_FP8_CHOICE, tgf.BIASED_FAST = kept


def count_served() -> None:
    """Wrap ``triton_gluon_fp8.run_fast_fp8`` (the backend looks it up on the module) to count ``Route.served``."""
    import moekit.experts.triton_gluon_fp8 as tgf

    real = tgf.run_fast_fp8

    def counted(*args):
        out = real(*args)
        Route.served[0] += out is not None
        return out

    tgf.run_fast_fp8 = counted


def plain(w: dict, x, ids, weights, b13, b2) -> torch.Tensor:
    """The fp8 Gluon path's plain launches (``lean=False``: built per call, nothing kept)."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    q13, q2 = w["q13"], w["q2"]
    return experts_gluon_fp8(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, activation=gpt39.SPEC, b13=b13,
                             b2=b2, lean=False)


def tiled(w: dict, x, ids, weights, tiles: Tiles) -> torch.Tensor:
    """The fp8 Gluon path's lean launch with a candidate's tiles (each None: the plan's)."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    q13, q2 = w["q13"], w["q2"]
    return experts_gluon_fp8(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, activation=gpt39.SPEC, b13=w["b13"],
                             b2=w["b2"], up=tiles.up, down=tiles.down, gather_groups=tiles.gather_groups)


def twin(w: dict, x, ids, weights) -> torch.Tensor:
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    q13, q2 = w["q13"], w["q2"]
    return experts_gluon_fp8_twin(x, q13.q, q13.scale, q2.q, q2.scale, ids, weights, activation=gpt39.SPEC,
                                  b13=w["b13"], b2=w["b2"])


def check(w: dict, m: int, dev) -> None:
    """The PASS / FAIL lines of one M (the module's docstring, "correct")."""
    from moekit.experts.triton_fast import clear_fast

    x, ids, weights = gpt39.inputs(m, dev)
    b13, b2 = w["b13"], w["b2"]
    label = f"gpt-oss fp8 M={m} ({'route' if choice_for(m, ids.shape[1]) is DEFAULT_CHOICE[0] else 'forced'})"
    with torch.no_grad():
        clear_fast()
        off = Route(w, x, ids, weights, False, b13, b2)()
        on = Route(w, x, ids, weights, True, b13, b2)
        before = Route.served[0]
        outs = [on() for _ in range(3)]
        served = Route.served[0] - before
        base = plain(w, x, ids, weights, b13, b2)
        errs = {"vs reference recipe": rel_l2(outs[2], fpb40.references(w, x, ids, weights)["new"]),
                "vs twin": rel_l2(outs[2], twin(w, x, ids, weights))}
        RUN.check(f"{label} the third biased call served from its entry", served >= 1, f"served {served}/3")
        RUN.check(f"{label} served == switch off == plain launches (bit-equal)",
                  all(torch.equal(out, base) for out in outs) and torch.equal(off, base))
        for name, err in errs.items():
            RUN.check(f"{label} {name}", err < (TWIN_TOL if name == "vs twin" else TOL), f"rel_l2={err:.2e}")
        saved = b13.clone()
        b13.add_(0.25)
        before = Route.served[0]
        updated = on()
        missed = Route.served[0] == before
        fresh = plain(w, x, ids, weights, b13, b2)
        RUN.check(f"{label} b13 updated in place: not served, the new values read (bit-equal to plain)",
                  missed and torch.equal(updated, fresh) and not torch.equal(updated, base))
        b13.copy_(saved)
        clear_fast()
    RESULT["checks"][m] = {"served": served, **errs}


def eager(w: dict, dev) -> None:
    """Host and wall µs a call, switch off / on, at each M of ``CHECK_MS`` (the module's docstring, "eager")."""
    for m in CHECK_MS:
        if RUN.elapsed() > ARGS.deadline:
            RUN.log(f"SKIP eager M={m}: deadline")
            continue
        x, ids, weights = gpt39.inputs(m, dev)
        fns = {"before": Route(w, x, ids, weights, False, w["b13"].clone(), w["b2"].clone()),
               "after": Route(w, x, ids, weights, True, w["b13"], w["b2"])}
        with torch.no_grad():
            for fn in fns.values():  # compiled, plans and sequences recorded, the entry kept
                fn(), fn(), fn()
            got = host_and_wall_us(fns, dev, EAGER_CALLS, ROUNDS)
        RESULT["eager"][m] = {name: {"host_us": h, "wall_us": wall} for name, (h, wall) in got.items()}
        (hb, wb), (ha, wa) = ((statistics.median(h), statistics.median(wl)) for h, wl in got.values())
        host_wins, wall_losses = faster_rounds(got["after"][0], got["before"][0]), faster_rounds(got["before"][1],
                                                                                                 got["after"][1])
        RESULT["eager"][m]["rule"] = host_wins == ROUNDS and wall_losses == 0
        RUN.log(f"eager M={m}: before host {hb:.1f} / wall {wb:.1f} µs, after host {ha:.1f} / wall {wa:.1f} µs")
        RUN.summary.append(f"| eager {m} | host {hb:.1f} -> {ha:.1f} µs (>= 3% lower {host_wins}/{ROUNDS}) | wall "
                           f"{wb:.1f} -> {wa:.1f} µs (>= 3% higher {wall_losses}/{ROUNDS}) |")


def sweep(w: dict, dev) -> None:
    """The route against each candidate's tiles at each M of ``ARGS.ms`` (the module's docstring, "sweep")."""
    cands = list(CANDIDATES) if ARGS.cands == ("all",) else list(ARGS.cands)
    RUN.summary.append("\n| M | route µs | " + " | ".join(f"{c} µs (route / it, rounds >= 3%)" for c in cands) + " |")
    RUN.summary.append("| --- " * (len(cands) + 2) + "|")
    twin_checked: set = set()
    for m in gpt39.reached("sweep", ARGS.ms, ARGS.deadline, len(cands)):
        x, ids, weights = gpt39.inputs(m, dev)
        route = Route(w, x, ids, weights, False, w["b13"], w["b2"])
        RUN.check(f"sweep M={m}: the route's own choice wants the call", route.choice is DEFAULT_CHOICE[0] or SMOKE)
        arms = {"route": route}
        with torch.no_grad():
            base = route()
            for name in cands:
                tiles = CANDIDATES[name]
                arms[name] = lambda t=tiles: tiled(w, x, ids, weights, t)
                out = arms[name]()  # compiled here
                if name not in twin_checked:
                    err = rel_l2(out, twin(w, x, ids, weights))
                    RUN.check(f"sweep {name} M={m} vs twin", err < TWIN_TOL, f"rel_l2={err:.2e}")
                    twin_checked.add(name)
                RUN.log(f"sweep {name} M={m}: bit-equal to the route: {torch.equal(out, base)}")
        us, eager_timed = gpt39.graph_rounds(arms, dev, ARGS.deadline, ROUNDS, REPLAYS)
        RESULT["sweep"][m] = {"us": us, "eager_timed": eager_timed}
        med, mark = gpt39.medians(f"sweep M={m}", us, eager_timed)
        RUN.summary.append(f"| {m} | {med['route']:.1f}{mark['route']} | " + " | ".join(
            f"{med[c]:.1f}{mark[c]} (x{med['route'] / med[c]:.3f}, {faster_rounds(us[c], us['route'])}/"
            f"{len(us[c])})" for c in cands) + " |")
        del arms, route
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def verdicts() -> None:
    """The defaults rule's lines: BIASED_FAST, then each sweep candidate."""
    import moekit.experts.triton_gluon_fp8 as tgf

    eager_ok = len(RESULT["eager"]) == len(CHECK_MS) and all(r["rule"] for r in RESULT["eager"].values())
    RESULT["biased_fast_by_rule"] = not RUN.failed and eager_ok
    RUN.summary.append(f"\nBIASED_FAST by the defaults rule: {RESULT['biased_fast_by_rule']}  (the switch: "
                       f"moekit/experts/triton_gluon_fp8.py, now {tgf.BIASED_FAST}; on since session 43's H100 run)")
    runs = RESULT["sweep"]
    names = [n for n in CANDIDATES if runs and all(n in r["us"] for r in runs.values())]
    won = {n: statistics.geometric_mean([statistics.median(r["us"][n]) / statistics.median(r["us"]["route"])
                                         for r in runs.values()])
           for n in names if not RUN.failed and len(runs) == len(ARGS.ms)
           and all(faster_rounds(r["us"][n], r["us"]["route"]) == len(r["us"][n]) == ROUNDS for r in runs.values())}
    RESULT["sweep_winners"] = won
    if not won:
        RUN.summary.append("Sweep by the defaults rule: no candidate wins at every M; the plan's rules stay")
        return
    e, k, n, _ = gpt39.shape()
    for name, ratio in sorted(won.items(), key=lambda kv: kv[1]):
        RUN.summary.append(f"Sweep: {name} wins (geometric mean of its / the route's medians {ratio:.3f})")
    best = min(won, key=won.get)
    RUN.summary.append(f"The best at ({e}, {k}, {n}): {CANDIDATES[best]!r} (plan_gluon_fp8 has no per-shape entry "
                       f"yet: add one where it picks the tiles)")


def main() -> int:
    global ARGS
    p = gpt39.parser(__doc__.split("\n")[0], 300.0 if SMOKE else 70.0, ("fp8_block",), MS)  # the smoke: all of it
    p.add_argument("--check-ms", type=lambda v: tuple(int(x) for x in v.split(",") if x), default=CHECK_MS)
    p.add_argument("--cands", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()), default=DEFAULT_CANDS)
    ARGS = p.parse_args()
    unknown = [c for c in ARGS.cands if c not in CANDIDATES and ARGS.cands != ("all",)]
    if unknown:
        p.error(f"--cands: unknown {unknown}; expected names of CANDIDATES ({', '.join(CANDIDATES)}) or all")
    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:  # the Gluon GEMMs do not run in the interpreter: the tests' torch stand-ins take their launches
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
        from _gluon_fakes import install_fakes

        install_fakes()
    import moekit.experts.triton_gluon_fp8 as tgf

    DEFAULT_CHOICE.append(tgf.DEFAULT_FP8_CHOICE)
    count_served()
    gpt39.begin(RESULT, ARGS.ms, "| eager M | host before -> after | wall before -> after |")
    w = gpt39.layer("fp8_block", dev)
    RUN.log("gpt-oss: weights quantized to fp8_block")
    phases = {"checks": lambda: [check(w, m, dev) for m in ARGS.check_ms], "eager": lambda: eager(w, dev),
              "sweep": lambda: sweep(w, dev), "verdicts": verdicts}
    return run_phases(RUN, phases, list(phases), ARGS.deadline, {"checks": 0, "eager": 0, "sweep": 0,
                                                                  "verdicts": -math.inf},  # the verdicts always
                      os.path.join(ARGS.out, "gfl43.json") if ARGS.out else "", RESULT)


if __name__ == "__main__":
    sys.exit(main())
