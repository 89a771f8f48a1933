"""usr50 device check (session 50, a demanding user's fifth hour), on the GPU machine's torch and Triton (2.11 / 3.6
there; the branch was written on 2.13 / 3.9, the CPU):

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/usr50_device_check.py --out $OUT/usr50 --deadline 75

PASS / FAIL:
  router   what ``print(moe)`` says ``router="auto"`` resolved to on CUDA (``resolved_router()``) against what the
           forward launched (a kernel whose name has "route" in torch.profiler's CUDA events: the fused router, the
           one gate + route launch or the hash router's launch), for four bf16 layers: a plain softmax top-2,
           DeepSeek-V3's rule (sigmoid, groups, correction bias, x2.5, eps 1e-20), ERNIE-4.5's clamp (auto takes
           the fused router for it on CUDA since session 50) and a V4 hash layer; each out against its torch twin (the
           same weights, ``router="torch"``), rel-L2 < 2e-2 (bf16 weights; the twin's routing can differ only at a tie)
  cast     ``MoE(cfg).to(device, torch.bfloat16)`` of a DeepSeek-V3-rule layer built in float32 on the CPU: the
           correction bias stays float32 with its bits, and ids and out equal (bit for bit) those of the same weights
           built as ``MoE(cfg, dtype=torch.bfloat16, device=device)`` (the fused router on CUDA reads the bias)
``--smoke``: the CPU, where "auto" resolves to torch for every layer and nothing named "route" may launch. JSON
under ``--out``. (A torch-free ``moekit --help`` was tried on this branch and dropped: ``tests/test_import_light.py``
says why, so nothing here times the help.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BASE = dict(hidden_size=256, moe_intermediate_size=128, num_experts=16, top_k=2)
LAYERS = {  # name -> MoEConfig fields over BASE
    "plain softmax": {},
    "deepseek-v3 rule": dict(scoring="sigmoid", n_group=4, topk_group=2, use_correction_bias=True,
                             routed_scaling_factor=2.5, renorm_eps=1e-20),
    "ernie clamp": dict(renorm_clamp=1e-12, use_correction_bias=True),
    "v4 hash": dict(scoring="sqrtsoftplus", hash_table_size=1000, renorm_eps=1e-20),
}


def _launched_route(moe, x: torch.Tensor, ids: torch.Tensor | None, device: str) -> tuple[torch.Tensor, bool]:
    """(out, whether a kernel named *route* ran) of one forward after a warm-up call."""
    call = (lambda: moe(x, token_ids=ids)) if ids is not None else (lambda: moe(x))
    with torch.no_grad():
        call()
        kinds = [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=kinds) as prof:
            out = call()
            if device == "cuda":
                torch.cuda.synchronize()
    names = [e.key.lower() for e in prof.key_averages()]
    return out, any("route" in n for n in names)


def check_router(device: str, stop_at: float) -> dict:
    from moekit import HashMoE, MoE, MoEConfig

    found, ok = {}, True
    for name, fields in LAYERS.items():
        if time.perf_counter() > stop_at:
            return {"pass": False, **found, "tail": "out of time"}
        torch.manual_seed(0)
        cfg = MoEConfig(**BASE, **fields)
        cls = HashMoE if cfg.hash_table_size else MoE
        options = dict(dtype=torch.bfloat16, device=device, backend="grouped_mm")
        moe, twin = cls(cfg, **options), cls(cfg, router="torch", **options)
        if cfg.use_correction_bias:
            with torch.no_grad():
                moe.e_score_correction_bias.normal_()
        twin.load_state_dict(moe.state_dict())
        x = torch.randn(8, BASE["hidden_size"], device=device, dtype=torch.bfloat16)
        ids = torch.randint(0, 1000, (8,), device=device) if cfg.hash_table_size else None
        out, launched = _launched_route(moe, x, ids, device)
        with torch.no_grad():
            want = twin(x, token_ids=ids) if ids is not None else twin(x)
        rel = ((out.double() - want.double()).norm() / want.double().norm()).item()
        said = moe.resolved_router()
        passed = (said == "fused") == launched and f"router=auto ({said})" in repr(moe) and rel < 2e-2
        found[name] = {"said": said, "launched_route_kernel": launched, "rel_vs_twin": rel, "pass": passed}
        ok = ok and passed
    return {"pass": ok, **found}


def check_cast(device: str) -> dict:
    from moekit import MoE, MoEConfig

    torch.manual_seed(0)
    cfg = MoEConfig(**BASE, **LAYERS["deepseek-v3 rule"])
    built = MoE(cfg)
    with torch.no_grad():
        built.e_score_correction_bias.copy_(torch.randn(BASE["num_experts"]) * 0.5 + 3.0)  # near a common offset
    bias = built.e_score_correction_bias.clone()
    twin = MoE(cfg, dtype=torch.bfloat16, device=device)
    twin.load_state_dict(built.state_dict())
    cast = built.to(device, torch.bfloat16)
    x = torch.randn(64, BASE["hidden_size"], device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = cast(x, return_stats=True), twin(x, return_stats=True)
    kept = cast.e_score_correction_bias.dtype == torch.float32 and torch.equal(cast.e_score_correction_bias.cpu(), bias)
    same = torch.equal(got.stats.counts, want.stats.counts) and torch.equal(got.out, want.out)
    return {"pass": kept and same, "bias_kept": kept, "counts_and_out_equal": same, "router": cast.resolved_router()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("usr50_out"))
    parser.add_argument("--deadline", type=float, default=75.0, help="seconds from the start: the router layers stop")
    parser.add_argument("--smoke", action="store_true", help="the CPU")
    args = parser.parse_args()
    start = time.perf_counter()
    stop_at = start + args.deadline
    device = "cpu" if args.smoke else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for name, check in (("router", lambda: check_router(device, stop_at)), ("cast", lambda: check_cast(device))):
        found = results[name] = check()
        print(f"{'PASS' if found['pass'] else 'FAIL'} {name}: "
              f"{ {k: v for k, v in found.items() if k not in ('pass', 'tail')} }", flush=True)
        if not found["pass"] and "tail" in found:
            print(found["tail"], flush=True)
        (args.out / "usr50_device_check.json").write_text(json.dumps(results, indent=1))
    print(f"{time.perf_counter() - start:.0f} s on {results['device']}, torch {results['torch']} (nothing timed: "
          f"correctness only)", flush=True)
    print(f"{'layer':<18} {'print(moe) says':<16} {'a route kernel ran':<19} rel-L2 vs router='torch'")
    for name, row in results["router"].items():
        if isinstance(row, dict):
            print(f"{name:<18} {row['said']:<16} {str(row['launched_route_kernel']):<19} {row['rel_vs_twin']:.2e}")

if __name__ == "__main__":
    main()
