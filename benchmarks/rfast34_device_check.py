"""Session 34 (branch `rfast34`): the fused router computes the router options (soft-cap, the bias on the logits, the
group rule and fill, the averaged shared expert), on the GPU. Each case is ``fam34_device_check``'s family layer with
its option on (bf16, random weights, the CUDA defaults), once through the fused path (``router="fused"``: the fused
router, the one gate + router launch and the decode fast path) and once through the ``route`` fallback
(``router="torch"``, what "auto" took before this check let it take the option), the same weights.

    PYTHONPATH=$PWD timeout 60 python3 benchmarks/rfast34_device_check.py --out $OUT/rfast34 --deadline 45   # GPU
    PYTHONPATH=$PWD python3 benchmarks/rfast34_device_check.py --smoke    # CPU: tiny shapes, interpreted kernels

Per case (skipped past the deadline; <out>/rfast34.json rewritten after each):
  checks   the fused layer holds the fused router and the one launch, the fallback none; at M = 64 the fused
           router's ids equal ``route``'s on the same logits (rows that differ: near-ties in fp32, reported) and
           its weights within 1e-5; the fused layer's output against a float64 loop over ``route``'s routing
           (``fam34_device_check.reference``): rel-L2 PASS < 2e-2; a decode fast-path entry kept at M = 1.
  timing   eager forward µs a call to completion (no grad), fused and fallback interleaved, --rounds rounds, at
           M = 1 and 64 (a win: >= 3% faster in every round).
The table is printed last: median µs fused / fallback and x (fallback median / fused median; rounds >= 3% faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import versus  # noqa: E402
from bench_run import RunLog, case_args, rel_l2, run_cases  # noqa: E402
from fam34_device_check import CASES as FAMILIES, TINY, reference, timed  # noqa: E402
import fam34_device_check  # noqa: E402

RUN = RunLog("rfast34: the router options on the fused router (eager forward µs a call, median of rounds)",
             stall_s=60.0)
RESULT: dict = {"run": {}, "cases": {}, "failed": RUN.failed}
CASES = ("laguna_softcap", "kolibri_bias_on_logits", "axk2_groups_zero_fill", "mistral4_groups_top2",
         "cohere2_average")
ARGS = argparse.Namespace()


def build(name: str, dev):
    """(the option's layer on the fused path, the same on ``route``): bf16 on ``dev``, bias random (std 0.05)."""
    from moekit import MoE, MoEConfig

    on = FAMILIES[name][0]
    if SMOKE:
        on = dict(on, **TINY, num_experts=min(on["num_experts"], 16))
        on.update(shared_expert_intermediate_size=16 if on.get("shared_expert_intermediate_size") else 0)
    cfg = MoEConfig(**on)
    torch.manual_seed(0)
    kw = dict(backend="triton") if SMOKE else {}  # the CUDA default, interpreted
    fused = MoE(cfg, dtype=torch.bfloat16, device=dev, router="fused", **kw)
    if fused.e_score_correction_bias is not None:
        fused.e_score_correction_bias.normal_(std=0.05)
    torch_ = MoE(cfg, dtype=torch.bfloat16, device=dev, num_local_experts=0, fuse_shared=fused.fuse_shared,
                 router="torch", **kw)
    torch_.w13, torch_.w2, torch_.gate.weight = fused.w13, fused.w2, fused.gate.weight
    if fused.shared_w13 is not None:
        torch_.shared_w13, torch_.shared_w2 = fused.shared_w13, fused.shared_w2
    if fused.e_score_correction_bias is not None:
        torch_.e_score_correction_bias.copy_(fused.e_score_correction_bias)
    return fused, torch_


def check(name: str, fused, torch_, dev) -> dict:
    from moekit import route

    m = 8 if SMOKE else 64
    x = torch.randn(m, fused.config.hidden_size, device=dev, dtype=torch.bfloat16)
    RUN.check(f"{name} fused router and one launch, fallback route", fused._fused_router is not None
              and (SMOKE or fused._gate_route is not None) and torch_._fused_router is None)
    with torch.no_grad():
        logits = fused._router_logits(x)  # [M, E] in the router dtype
        bias = fused.e_score_correction_bias
        got, want = fused._fused_router(logits, bias), route(logits, fused.config, bias)
        rows = int((got.topk_ids != want.topk_ids).any(dim=1).sum())
        same = got.topk_ids == want.topk_ids
        werr = float((got.topk_weights - want.topk_weights).abs()[same].max()) if same.any() else float("nan")
        err = rel_l2(fused(x), reference(fused, x))
        err_torch = rel_l2(torch_(x), reference(fused, x))
    RUN.check(f"{name} M={m} ids equal route's", rows == 0, f"{rows} rows differ")
    RUN.check(f"{name} M={m} weights within 1e-5 of route's (equal ids)", werr < 1e-5, f"max abs {werr:.1e}")
    RUN.check(f"{name} M={m} fused vs float64", err < 2e-2, f"rel_l2={err:.2e} (fallback {err_torch:.2e})")
    return {"rel_l2_vs_fp64": err, "fallback_rel_l2_vs_fp64": err_torch, "id_rows_differ": rows, "weight_err": werr}


def run_case(name: str, dev) -> None:
    fused, torch_ = build(name, dev)
    res = RESULT["cases"][name] = check(name, fused, torch_, dev)
    for m in (1, 64) if not SMOKE else (1,):
        per = timed({"fused": fused, "route": torch_}, m, dev)
        res[f"M{m}_us"] = per
        line = (f"{name:24s} M={m:3d}  fused {statistics.median(per['fused']):8.1f}  route "
                f"{statistics.median(per['route']):8.1f}  route/fused {versus(per['fused'], per['route'])}")
        RUN.summary.append(line)
        RUN.log(line)
        if m == 1:
            kept = 1 in fused._decode._entries
            res["decode_fast_path_m1"] = kept
            RUN.check(f"{name} M=1 decode fast-path entry kept", kept or SMOKE, f"kept={kept}")
    del fused, torch_
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    case_args(__doc__, 45.0, CASES, ARGS)
    fam34_device_check.ARGS.rounds = ARGS.rounds  # its ``timed`` reads them
    dev = torch.device("cpu" if SMOKE else "cuda")
    run_cases(RUN, RESULT, ARGS, "rfast34", lambda name: run_case(name, dev))


if __name__ == "__main__":
    main()
