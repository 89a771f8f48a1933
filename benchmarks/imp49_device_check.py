"""imp49 device check (session 49, import time), on the GPU machine's torch and Triton (2.11 / 3.6 there; the
branch was written on 2.13 / 3.9, the CPU):

    PYTHONPATH=$PWD timeout 90 python3 benchmarks/imp49_device_check.py --out $OUT/imp49 --deadline 75

PASS / FAIL first, each in fresh interpreters:
  tests    ``pytest -q tests/test_import_light.py``: ``import moekit``, an eager CPU forward, the help of moekit and of
           its analyze command load no heavy package; ``torch.compile`` of a layer with ``return_stats=True`` in a
           process that loaded dynamo after moekit breaks once at the stats and ``fullgraph=True`` refuses them with
           the layer's reason, whichever is traced first: this torch's dynamo running the lazily taken
           ``torch.compiler.disable``
  device   ``import moekit`` loads no heavy package; a bf16 layer (E 8, K 256, N 128, top-2, its default backend) on
           the device, ``return_stats=True``: out against the float64 loop of ``tests/_helpers.py`` on the layer's own
           routing (rel-L2 < 2e-2), counts summing to M*k; the heavy packages the forward loaded are reported (triton
           once its kernels are built: where the import moved to)
Every interpreter, checks included, is killed at ``--deadline`` (seconds from the start) and each line is printed
as it comes. Then the walls (and CPU seconds) of fresh interpreters, median of interleaved rounds
(``import_walls.measure``, the rounds ending at the deadline): ``import torch``, ``import moekit``, main's import of
moekit (stand-in: ``import torch._dynamo`` first, what main's decorator imported), a first forward on the device
(import, build, one call, sync) and main's (the same after ``import torch._dynamo``): the first Triton forward loads
dynamo anyway (torch's ``custom_op`` wraps a device kernel in ``torch._disable_dynamo``, which imports it on the first
call), so this says what a GPU user's first forward keeps of the import's saving. The help is the CPU's figure
(``import_walls.py``). The table is printed last; JSON under ``--out``. ``--walls-only``: the timing alone (ck1 ran
the checks: PASS on torch 2.11). ``--smoke``: the CPU (no CUDA), 2 rounds.

ck2 (``--walls-only --deadline 55`` under ``timeout 75``, at e36dbabc) was killed by the timeout with nothing printed:
the deadline was then checked only between rounds and the output was not flushed; both fixed after it, not rerun.
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

ROOT = Path(__file__).resolve().parents[1]

FORWARD = """
import json, sys
import torch
heavy = {heavy!r}
loaded = lambda: [h for h in heavy if any(m == h or m.startswith(h + ".") for m in sys.modules)]
import moekit
after_import = loaded()
from _helpers import experts_loop
torch.manual_seed(0)
moe = moekit.MoE(moekit.MoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2),
                 device={device!r}, dtype=torch.bfloat16)
x = torch.randn(32, 256, device={device!r}, dtype=torch.bfloat16)
res = moe(x, return_stats=True)
weights, ids = torch.topk(torch.softmax(res.router_logits.float().double(), -1), 2)
want = experts_loop(x.cpu(), moe.w13.detach().cpu(), moe.w2.detach().cpu(), ids.cpu(),
                    (weights / weights.sum(-1, keepdim=True)).cpu())
rel = ((res.out.cpu().double() - want).norm() / want.norm()).item()
print(json.dumps({{"after_import": after_import, "after_forward": loaded(), "rel": rel,
                  "backend": moe.resolved_backend(), "counts_sum": int(res.stats.counts.sum()),
                  "torch": torch.__version__}}))
"""

FIRST_FORWARD = ("import torch, moekit; moe = moekit.MoE(moekit.MoEConfig(hidden_size=256, moe_intermediate_size=128, "
                 "num_experts=8, top_k=2), device={device!r}, dtype=torch.bfloat16); "
                 "moe(torch.randn(32, 256, device={device!r}, dtype=torch.bfloat16)); "
                 "torch.cuda.synchronize() if torch.cuda.is_available() else None")


def _python(args: list[str], stop_at: float) -> subprocess.CompletedProcess | None:
    """A fresh interpreter on this tree (and ``tests/``), killed at ``stop_at`` (``time.perf_counter()``): None then."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=max(1.0, stop_at - time.perf_counter()))
    except subprocess.TimeoutExpired:
        return None


def check_tests(stop_at: float) -> dict:
    done = _python(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_import_light.py"], stop_at)
    if done is None:
        return {"pass": False, "summary": "killed at the deadline"}
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    return {"pass": done.returncode == 0, "summary": summary, "tail": (done.stdout + done.stderr)[-2000:]}


def check_device(device: str, stop_at: float) -> dict:
    done = _python(["-c", FORWARD.format(heavy=import_walls.HEAVY, device=device)], stop_at)
    if done is None or done.returncode:
        return {"pass": False, "tail": "killed at the deadline" if done is None else done.stderr[-2000:]}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["pass"] = not found["after_import"] and found["rel"] < 2e-2 and found["counts_sum"] == 32 * 2
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("imp49_out"))
    parser.add_argument("--deadline", type=float, default=75.0,
                        help="seconds from the start; every interpreter is killed there")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="the CPU, 2 rounds")
    parser.add_argument("--walls-only", action="store_true", help="the timing alone, no PASS / FAIL checks")
    args = parser.parse_args()
    start = time.perf_counter()
    device = "cpu" if args.smoke else "cuda"
    stop_at = start + args.deadline
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, check in ({} if args.walls_only else {"tests": check_tests, "device": check_device}).items():
        found = results[name] = check(stop_at) if name == "tests" else check(device, stop_at)
        detail = found.get("summary") or {k: v for k, v in found.items() if k not in ("pass", "tail")}
        print(f"{'PASS' if found['pass'] else 'FAIL'} {name}: {detail}", flush=True)
        if not found["pass"]:
            print(found.get("tail", ""), flush=True)
        (args.out / "imp49_device_check.json").write_text(json.dumps(results, indent=1))
    commands = {
        "import torch": ["-c", "import torch"],
        "import moekit": ["-c", "import moekit"],
        "main's import (stand-in)": ["-c", "import torch._dynamo, moekit"],
        f"first forward ({device})": ["-c", FIRST_FORWARD.format(device=device)],
        "main's first forward": ["-c", "import torch._dynamo; " + FIRST_FORWARD.format(device=device)],
    }
    rounds = 2 if args.smoke else args.rounds
    figures = import_walls.measure(ROOT, rounds, commands, stop_at=stop_at)
    results["walls"] = [asdict(f) for f in figures]
    (args.out / "imp49_device_check.json").write_text(json.dumps(results, indent=1))
    print(f"{time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
    print(import_walls.table(figures), flush=True)


if __name__ == "__main__":
    main()
