"""What starting moekit loads. ``import moekit``, an eager CPU forward (its stats and a backward too), ``moekit --help``
and ``moekit analyze --help`` load none of the heavy packages they do not use (torch._dynamo: 1.3 s of the import
when ``stats_on_host`` was decorated at import; triton, transformers, matplotlib, rich), and the command line imports
the module of the one command it runs. Then the lazily taken ``torch.compiler.disable`` of ``stats_on_host``: in a
process that never loaded dynamo before ``torch.compile``, the compiled layer still breaks its graph once at the stats
(equal to the eager forward's) and ``fullgraph=True`` refuses them with the layer's reason, whichever comes first.

Each check runs in a fresh interpreter (this one has loaded everything); timing is ``benchmarks/import_walls.py``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moekit.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
# packages that starting moekit or an eager CPU forward has no use for
HEAVY = ["torch._dynamo", "torch._inductor", "triton", "transformers", "matplotlib", "rich"]

STAGES = """
import json, sys
HEAVY, COMMANDS = {heavy!r}, {commands!r}
seen = {{}}
def snapshot(stage):
    seen[stage] = {{"heavy": [h for h in HEAVY if h in sys.modules],
                   "commands": [c for c in COMMANDS if "moekit.cli." + c in sys.modules]}}
import moekit
snapshot("import moekit")
import torch
moe = moekit.MoE(moekit.MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2, aux_loss_coef=0.01))
res = moe(torch.randn(5, 16), return_stats=True)
(res.out.square().sum() + res.aux_loss).backward()
assert int(res.stats.counts.sum()) == 10 and moe.w13.grad is not None
snapshot("forward")
from moekit.cli import main
for argv in (["--help"], ["analyze", "--help"]):
    try:
        main(argv)
    except SystemExit:
        pass
    snapshot("moekit " + " ".join(argv))
print(json.dumps(seen))
"""

COMPILED = """
import json, sys
import torch
from moekit import MoE, MoEConfig
torch.manual_seed(4)
moe = MoE(MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, aux_loss_coef=0.01),
          capacity_factor=1.0)
x = torch.randn(2, 6, 16)
eager = moe(x, return_stats=True)  # dynamo not loaded yet: the stats read plainly
fresh = "torch._dynamo" not in sys.modules and "moekit.routing._stats_untraced" not in sys.modules
found = {{"fresh": fresh}}
for first in {order!r}:
    if first == "fullgraph":
        try:
            torch.compile(moe, fullgraph=True, backend="eager")(x, return_stats=True)
            found["refused"] = ""
        except Exception as err:
            found["refused"] = str(err)
    else:
        explained = torch._dynamo.explain(moe)(x, return_stats=True)
        found["breaks"] = explained.graph_break_count
        found["reasons"] = [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
got = torch.compile(moe, backend="eager")(x, return_stats=True)
found["out_equal"] = torch.equal(got.out, eager.out)
found["counts"] = [got.stats.counts.tolist(), eager.stats.counts.tolist()]
found["dropped"] = [got.stats.dropped, eager.stats.dropped]
print(json.dumps(found))
"""


def _python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter on this tree; its last stdout line, read as JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_starting_moekit_loads_no_heavy_package_and_one_command():
    seen = _python(STAGES.format(heavy=HEAVY, commands=list(COMMANDS)))
    assert {stage: s["heavy"] for stage, s in seen.items()} == dict.fromkeys(seen, [])
    assert {stage: s["commands"] for stage, s in seen.items()} == {
        "import moekit": [], "forward": [], "moekit --help": [], "moekit analyze --help": ["analyze"]}


HELPS = """
import io, json, os, sys
from contextlib import redirect_stdout
from moekit.cli import COMMANDS, main
HEAVY = {heavy!r}
found = {{}}
for command in COMMANDS:  # each in a child forked after the package's import: what its own --help adds
    read, write = os.pipe()
    if os.fork() == 0:
        with redirect_stdout(io.StringIO()):
            try:
                main([command, "--help"])
            except SystemExit:
                pass
        os.write(write, json.dumps([h for h in HEAVY if h in sys.modules]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        found[command] = json.loads(pipe.read() or "null")
    os.wait()
print(json.dumps(found))
"""


def test_no_command_help_loads_a_heavy_package():
    """Every ``moekit COMMAND --help`` (session 52's walk of the helps' walls): none loads transformers, triton,
    dynamo or matplotlib; demo's module takes rich, which its run prints with. (torch comes with ``import moekit``:
    the layer's ops are registered on import, ``test_import_moekit_alone_registers_the_ops_a_saved_program_calls``.)"""
    found = _python(HELPS.format(heavy=HEAVY))
    assert found == {command: (["rich"] if command == "demo" else []) for command in COMMANDS}


@pytest.mark.parametrize("order", [["fullgraph", "explain"], ["explain", "fullgraph"]])
def test_compiled_stats_stay_outside_the_graph_when_dynamo_comes_after_moekit(order):
    """The layer's own reason, not dynamo's word on the ``torch.compiler.disable`` call, whichever trace is first."""
    found = _python(COMPILED.format(order=order))
    assert found["fresh"]
    assert "MoE(x, return_stats=True) reads its MoEStats on the host" in found["refused"]
    assert found["breaks"] == 1 and "return_stats" in found["reasons"][0]
    assert found["out_equal"]
    (got_counts, want_counts), (got_dropped, want_dropped) = found["counts"], found["dropped"]
    assert got_counts == want_counts and got_dropped == want_dropped > 0
    assert sum(want_counts) == 2 * 6 * 2 - want_dropped  # M*k - dropped


def test_commands_are_the_cli_modules_and_a_full_build_lists_them_all():
    """``COMMANDS`` names every public module of ``moekit/cli`` (a command left out would vanish from ``moekit``),
    and ``moekit --help`` lists each with its line whether its parser is built or not."""
    modules = {p.stem for p in (ROOT / "moekit" / "cli").glob("*.py") if not p.stem.startswith("_")}
    assert set(COMMANDS) == modules
    full, bare = build_parser().format_help(), build_parser([]).format_help()
    assert full == bare
    assert all(name in bare and summary in " ".join(bare.split()) for name, summary in COMMANDS.items())



SAVED = """
import json, sys, torch
import moekit  # nothing else of moekit: what a process that loads a saved program imports
program = torch.export.load(sys.argv[1])
x, want = torch.load(sys.argv[2]), torch.load(sys.argv[3])
print(json.dumps({"equal": torch.equal(program.module()(x), want)}))
"""


def test_import_moekit_alone_registers_the_ops_a_saved_program_calls(tmp_path):
    """``import moekit`` registers the layer's custom ops (``torch.ops.moekit.*``): a program exported with a layer
    (``torch.export.save``) loads in a process that imported moekit and nothing of it beyond, and computes what the
    layer did. Why ``moekit --help`` keeps importing torch: the names of ``moekit/__init__.py`` imported on first use
    (PEP 562) made the help torch-free and broke this load ("failed to resolve torch.ops.moekit.group_gemm")."""
    import torch

    from moekit import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2))
    x = torch.randn(4, 32)
    program = torch.export.export(moe, (x,))
    assert any("moekit" in str(n.target) for n in program.graph.nodes if n.op == "call_function")
    torch.export.save(program, tmp_path / "moe.pt2")
    torch.save(x, tmp_path / "x.pt")
    torch.save(moe(x).detach(), tmp_path / "y.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SAVED, *(str(tmp_path / f) for f in ("moe.pt2", "x.pt", "y.pt"))],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"equal": True}
