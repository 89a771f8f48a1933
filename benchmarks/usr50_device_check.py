"""usr50 device check (session 50, a demanding user's fifth hour), on the GPU machine's torch and Triton (2.11 / 3.6
there; the branch was written on 2.13 / 3.9, the CPU):

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/usr50_device_check.py --out $OUT/usr50 --deadline 75

PASS / FAIL first:
  help     in a fresh interpreter, ``moekit --help``, ``--version`` and a misspelt command answer with torch not
           imported (``moekit/__init__.py``'s names imported on first use), and ``moekit.MoE`` then imports
  router   what ``print(moe)`` says ``router="auto"`` resolved to on CUDA (``resolved_router()``) against what the
           forward launched (a kernel whose name has "route" in torch.profiler's CUDA events: the fused router, the
           one gate + route launch or the hash router's launch), for four bf16 layers: a plain softmax top-2,
           DeepSeek-V3's rule (sigmoid, groups, correction bias, x2.5, eps 1e-20), ERNIE-4.5's clamp (auto keeps
           ``route`` for it on CUDA) and a V4 hash layer; each out against its torch twin (the same weights,
           ``router="torch"``), rel-L2 < 2e-2 (bf16 weights; the twin's routing can differ only at a tie)
  cast     ``MoE(cfg).to(device, torch.bfloat16)`` of a DeepSeek-V3-rule layer built in float32 on the CPU: the
           correction bias stays float32 with its bits, and ids and out equal (bit for bit) those of the same weights
           built as ``MoE(cfg, dtype=torch.bfloat16, device=device)`` (the fused router on CUDA reads the bias)
Then the walls (and CPU seconds) of fresh interpreters, median of interleaved rounds (``import_walls.measure``, killed
at the deadline): ``import torch`` (the floor the help paid before this branch), ``moekit --help``, ``--version``, a
misspelt command and ``moekit analyze --help`` (still torch: its parser reads the library's tables). The table is
printed last; JSON under ``--out``. ``--smoke``: the CPU, where "auto" resolves to torch for every layer and nothing
named "route" may launch, 2 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import import_walls
import torch

ROOT = Path(__file__).resolve().parents[1]

HELP = """
import contextlib, io, json, sys
from moekit.cli import main
codes = []
for argv in (["--help"], ["--version"], ["nope"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as done:
            codes.append(done.code)
torch_before = "torch" in sys.modules
import moekit
print(json.dumps({"codes": codes, "torch_before": torch_before, "moe": moekit.MoE.__module__}))
"""

BASE = dict(hidden_size=256, moe_intermediate_size=128, num_experts=16, top_k=2)
LAYERS = {  # name -> MoEConfig fields over BASE
    "plain softmax": {},
    "deepseek-v3 rule": dict(scoring="sigmoid", n_group=4, topk_group=2, use_correction_bias=True,
                             routed_scaling_factor=2.5, renorm_eps=1e-20),
    "ernie clamp": dict(renorm_clamp=1e-12, use_correction_bias=True),
    "v4 hash": dict(scoring="sqrtsoftplus", hash_table_size=1000, renorm_eps=1e-20),
}


def check_help(stop_at: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-c", HELP], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=max(1.0, stop_at - time.perf_counter()))
    except subprocess.TimeoutExpired:
        return {"pass": False, "tail": "killed at the deadline"}
    if done.returncode:
        return {"pass": False, "tail": done.stderr[-2000:]}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["pass"] = found["codes"] == [0, 0, 2] and not found["torch_before"] and found["moe"] == "moekit.layer"
    return found


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
    parser.add_argument("--deadline", type=float, default=75.0,
                        help="seconds from the start; the checks stop and every interpreter is killed there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the CPU, 2 rounds")
    args = parser.parse_args()
    start = time.perf_counter()
    stop_at = start + args.deadline
    device = "cpu" if args.smoke else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for name, check in (("help", lambda: check_help(stop_at)), ("router", lambda: check_router(device, stop_at)),
                        ("cast", lambda: check_cast(device))):
        found = results[name] = check()
        print(f"{'PASS' if found['pass'] else 'FAIL'} {name}: "
              f"{ {k: v for k, v in found.items() if k not in ('pass', 'tail')} }", flush=True)
        if not found["pass"] and "tail" in found:
            print(found["tail"], flush=True)
        (args.out / "usr50_device_check.json").write_text(json.dumps(results, indent=1))
    commands = {name: import_walls.COMMANDS[name] for name in
                ("import torch", "moekit --help", "moekit --version", "moekit nope (usage error)",
                 "moekit analyze --help")}
    figures = import_walls.measure(ROOT, 2 if args.smoke else args.rounds, commands, stop_at=stop_at)
    results["walls"] = [asdict(f) for f in figures]
    (args.out / "usr50_device_check.json").write_text(json.dumps(results, indent=1))
    print(f"{time.perf_counter() - start:.0f} s on {results['device']}, torch {results['torch']}", flush=True)
    print(import_walls.table(figures), flush=True)


if __name__ == "__main__":
    main()
