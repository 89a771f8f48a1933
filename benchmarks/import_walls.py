"""What starting moekit costs: the wall of ``import moekit``, ``import moekit.hf``, ``moekit --help``,
``--version``, a misspelt command (its usage error), every ``moekit COMMAND --help`` and a first eager forward, each a
fresh interpreter, against ``import torch`` (the floor).

    PYTHONPATH=$PWD python3 benchmarks/import_walls.py [--runs 5] [--out DIR] [--tree PATH]

Each round runs every command once, in turn (rounds interleave the commands, so a burst of load on a shared
machine falls on all of them); a command's figure is the median of its ``--runs`` walls (``time.perf_counter``
around ``subprocess.run``), with the median of its CPU seconds (the child's user + sys: less moved by other processes
on a shared machine than the wall). Then one ``python3 -X importtime`` run a command names what it imported beyond
``import torch``: the heavy packages (``HEAVY``) it loaded, and the import time of the modules torch did not import,
summed by package (``torch._dynamo`` and the like counted apart from torch), in ms, largest first. ``--tree``
measures another checkout (its root goes first on ``PYTHONPATH``, as the ``moekit`` entry point of an editable
install would find it). The table is printed last; ``--out`` also writes it as JSON. CPU only, no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORWARD = ("import torch, moekit; torch.manual_seed(0); "
           "moe = moekit.MoE(moekit.MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2)); "
           "moe(torch.randn(4, 32))")
# name -> the python3 arguments that run it
COMMANDS = {
    "import torch": ["-c", "import torch"],
    "import moekit": ["-c", "import moekit"],
    "import moekit.hf": ["-c", "import moekit.hf"],
    "moekit --help": ["-m", "moekit", "--help"],
    "moekit --version": ["-m", "moekit", "--version"],
    "moekit nope (usage error)": ["-m", "moekit", "nope"],
    "moekit analyze --help": ["-m", "moekit", "analyze", "--help"],
    # every other command's help (session 52: which load more than the package and need not)
    **{f"moekit {c} --help": ["-m", "moekit", c, "--help"] for c in ("bench", "demo", "serve", "simulate", "train",
                                                                     "tune")},
    "MoE forward (cpu)": ["-c", FORWARD],
}
# packages worth naming when a command loads them (none of them is needed to start moekit)
HEAVY = ("torch._dynamo", "torch._inductor", "triton", "transformers", "matplotlib", "rich", "sympy", "scipy",
         "pandas", "safetensors", "huggingface_hub")


@dataclass
class CommandFigures:
    name: str
    walls_s: list[float]  # one per round, in round order
    median_s: float
    cpu_median_s: float  # median of the rounds' user + sys seconds
    heavy: list[str] | None  # HEAVY packages in the command's sys.modules at exit; None: not read (out of time)
    # self import time of the modules ``import torch`` does not import, summed by package: [package, ms], largest first
    beyond_torch_ms: list[tuple[str, float]] = field(default_factory=list)


def _python(args: list[str], tree: Path, stop_at: float, **kwargs) -> subprocess.CompletedProcess | None:
    """``python3 ARGS`` on ``tree`` (its root first on ``PYTHONPATH`` and the working directory: ``-c`` and ``-m`` put
    the working directory first on ``sys.path``), killed at ``stop_at`` (a ``time.perf_counter()`` value): None then."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), env["PYTHONPATH"]]) if env.get("PYTHONPATH") else str(tree)
    left = stop_at - time.perf_counter()
    if left <= 0:
        return None
    try:
        run = subprocess.run([sys.executable, *args], env=env, cwd=tree, stdout=subprocess.DEVNULL,
                             timeout=None if left == float("inf") else left, **kwargs)
    except subprocess.TimeoutExpired:  # out of time: the caller stops measuring
        return None
    if run.returncode not in (0, 2):  # 2: a usage error, the answer one command is timed for; a failing run raises
        raise subprocess.CalledProcessError(run.returncode, run.args, stderr=run.stderr)
    return run


def _run(args: list[str], tree: Path, stop_at: float) -> tuple[float, float] | None:
    """(wall s, user + sys CPU s) of one run; None when it would end past ``stop_at``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if _python(args, tree, stop_at, stderr=subprocess.DEVNULL) is None:  # a usage error's line: not the table's
        return None
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def _package(module: str) -> str:
    """``torch._dynamo.utils`` -> ``torch._dynamo``, ``sympy.core`` -> ``sympy``."""
    parts = module.split(".")
    return ".".join(parts[:2] if parts[0] == "torch" and len(parts) > 1 else parts[:1])


def _import_times(args: list[str], tree: Path, stop_at: float) -> dict[str, int] | None:
    """Module -> self import µs, from one ``-X importtime`` run (its stderr); None when out of time."""
    run = _python(["-X", "importtime", *args], tree, stop_at, stderr=subprocess.PIPE, text=True)
    if run is None:
        return None
    times = {}
    for line in run.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            times[parts[2].strip()] = int(parts[0].removeprefix("import time:"))
    return times


def _rounds(tree: Path, runs: int, commands: dict[str, list[str]], stop_at: float) -> dict[str, list]:
    """name -> [(wall, cpu)], a round each, in order; the rounds end at the first run that would pass ``stop_at``."""
    samples = {name: [] for name in commands}
    for _ in range(runs):
        for name, args in commands.items():
            sample = _run(args, tree, stop_at)
            if sample is None:
                return samples
            samples[name].append(sample)
    return samples


def measure(tree: Path, runs: int, commands: dict[str, list[str]] = COMMANDS, stop_at: float = float("inf"),
            top: int = 6) -> list[CommandFigures]:
    """Each command's figures over ``runs`` interleaved rounds. Every interpreter is killed at ``stop_at`` (a
    ``time.perf_counter()`` value): the rounds end there (a command keeps the walls it has; one with none is left
    out), and the import-time pass reads the commands it has time for (``heavy`` None for the others).
    ``commands`` names ``import torch``, the floor the import times are read against."""
    samples = _rounds(tree, runs, commands, stop_at)
    floor = _import_times(commands["import torch"], tree, stop_at)
    figures = []
    for name, args in commands.items():
        if not samples[name]:
            continue
        times = None if floor is None else _import_times(args, tree, stop_at)
        by_package: dict[str, float] = {}
        for module, us in (times or {}).items():
            if module not in floor:
                by_package[_package(module)] = by_package.get(_package(module), 0.0) + us / 1e3
        walls = [wall for wall, _ in samples[name]]
        heavy = None if times is None else [h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in times)]
        figures.append(CommandFigures(name, walls, statistics.median(walls),
                                      statistics.median(cpu for _, cpu in samples[name]), heavy,
                                      sorted(by_package.items(), key=lambda p: -p[1])[:top]))
    return figures


def table(figures: list[CommandFigures]) -> str:
    lines = [f"{'command':<26} {'wall s':>6} {'cpu s':>6}  {'walls s':<30} heavy packages loaded; beyond torch (ms)"]
    for f in figures:
        walls = " ".join(f"{w:.2f}" for w in f.walls_s)
        top = ", ".join(f"{m} {ms:.0f}" for m, ms in f.beyond_torch_ms[:4])
        lines.append(f"{f.name:<26} {f.median_s:>6.2f} {f.cpu_median_s:>6.2f}  {walls:<30} "
                     f"{'(not read)' if f.heavy is None else ' '.join(f.heavy) or '-'}; {top or '-'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="rounds; each command's figure is their median")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    parser.add_argument("--out", type=Path, help="write import_walls.json here")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    figures = measure(args.tree.resolve(), args.runs)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "import_walls.json").write_text(json.dumps([asdict(f) for f in figures], indent=1))
    print(f"tree {args.tree.resolve()}, {args.runs} rounds, load average {os.getloadavg()[0]:.2f}")
    print(table(figures))


if __name__ == "__main__":
    main()
