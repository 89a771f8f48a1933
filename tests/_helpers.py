"""Helpers shared by the tests: one random experts problem, one tolerance table, one float64 experts loop (the
reference most tests hold a backend to), the error measures.

Shapes: M tokens, k slots, E experts, K hidden, N expert intermediate.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from moekit.activations import ActivationSpec

# Relative L2 error against a float64 reference that a dtype must stay under (design.md's contract).
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


class Problem(NamedTuple):
    """Inputs of one ``run_experts`` call, in its argument order (so ``run_experts(*problem)`` works)."""

    x: torch.Tensor  # [M, K]
    w13: torch.Tensor  # [E, 2N, K], scaled by K^-1/2
    w2: torch.Tensor  # [E, K, N], scaled by N^-1/2
    ids: torch.Tensor  # [M, k] int32, k distinct experts per token; -1 (skipped) where ``skips``
    weights: torch.Tensor  # [M, k] float32 in [0, 1)


def make_problem(m, k, e, hidden, inter, dtype=torch.float32, seed=0, *, skips=False) -> Problem:
    """A seeded problem, drawn in float32 and then cast to ``dtype``; ``skips`` marks about 20% of the
    slots -1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).int() if m else torch.zeros(0, k).int()
    if skips and m:
        ids[torch.rand(m, k, generator=g) < 0.2] = -1
    weights = torch.rand(m, k, generator=g)
    return Problem(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)


def bf16_quantized_pair(scheme: str, e: int, n: int, k: int, options: dict | None = None, seed: int = 0) -> tuple:
    """(q13, q2): random bf16 experts w13 [E, 2N, K] and w2 [E, K, N] (scaled by K^-1/2, N^-1/2) from one generator
    seeded ``seed``, quantized to ``scheme`` with ``options``."""
    from moekit.quant import quantize

    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * n, k, generator=g) * k**-0.5).bfloat16()
    w2 = (torch.randn(e, k, n, generator=g) * n**-0.5).bfloat16()
    return quantize(w13, scheme, **(options or {})), quantize(w2, scheme, **(options or {}))


def bf16_routing(m: int, k: int, e: int, top_k: int, seed: int) -> tuple:
    """(x [M, K] bf16, ids [M, top_k] int32: top_k distinct experts of E a token, weights [M, top_k] float32 softmax),
    drawn in that order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    ids = torch.rand(m, e, generator=g).argsort(dim=1)[:, :top_k].int()
    return x, ids, torch.softmax(torch.rand(m, top_k, generator=g), dim=1)


def routed_slots(ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | list | None = None):
    """(t, j, e) for every (token, slot) of ids [M, k] that routes to local expert e: an id outside the
    map (a tensor or a list) or mapped to -1, or a local id outside [0, E), adds nothing (the experts contract)."""
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < len(expert_map) else -1
            if 0 <= e < num_experts:
                yield t, j, e


# The activations in float64, written out from their definitions (not moekit's table): g, alpha -> act(g).
FORMULAS64 = {
    "silu": lambda g, alpha: g / (1.0 + torch.exp(-alpha * g)),
    "gelu": lambda g, alpha: 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))),
    "gelu_tanh": lambda g, alpha: 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))),
    "relu": lambda g, alpha: torch.where(g > 0, g, torch.zeros_like(g)),
    "relu2": lambda g, alpha: torch.where(g > 0, g * g, torch.zeros_like(g)),
}


def glu64(h: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """h [R] float64 -> [N]: the contract's glu of one token, written from the ``ActivationSpec``'s fields (gated:
    gate / up halves or alternating rows, up clamped both sides at ``limit`` and the gate above, before the
    activation or with ``limit_after_act`` act(gate) after it, alpha, up_shift)."""
    act = FORMULAS64[spec.name]
    if not spec.gated:
        return act(h, spec.alpha)
    n = h.shape[0] // 2
    gate, up = (h[0::2], h[1::2]) if spec.interleaved else (h[:n], h[n:])
    if spec.limit is not None:
        up = up.clamp(-spec.limit, spec.limit)
        if not spec.limit_after_act:
            gate = gate.clamp(max=spec.limit)
    a = act(gate, spec.alpha)
    if spec.limit_after_act:
        a = a.clamp(max=spec.limit)
    return a * (up + spec.up_shift)


def experts_loop(x, w13, w2, ids, weights, expert_map=None, *, b13=None, b2=None, spec=None) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * (w2[e] @ glu(w13[e] @ x[t] + b13[e]) + b2[e]) in float64, one (token, slot) of
    ``routed_slots`` at a time; w13 [E, R, K], w2 [E, K, N], b13 [E, R] and b2 [E, K] or None. glu: silu(gate) * up
    (torch's silu, gate rows first) for ``spec`` None or "silu", else ``glu64``'s written-out formulas of the spec
    (a name: its plain gated spec). Differentiable in every float input (autograd gives the reference gradients)."""
    if isinstance(spec, str):
        spec = None if spec == "silu" else ActivationSpec(spec)
    x, w13, w2 = x.double(), w13.double(), w2.double()
    n = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j, e in routed_slots(ids, w13.shape[0], expert_map):
        h = w13[e] @ x[t]  # [R]
        if b13 is not None:
            h = h + b13[e].double()
        glu = torch.nn.functional.silu(h[:n]) * h[n:] if spec is None else glu64(h, spec)  # [N]
        y = w2[e] @ glu  # [K]
        if b2 is not None:
            y = y + b2[e].double()
        out[t] += weights[t, j].double() * y
    return out


def quantized_experts_loop(x, q13, q2, ids, weights, expert_map=None) -> torch.Tensor:
    """``experts_loop`` on the dequantized weights of quantized q13 [E, 2N, K] / q2 [E, K, N]."""
    return experts_loop(x, q13.dequantize(), q2.dequantize(), ids, weights, expert_map)


def partial_expert_map(e_global: int, e_local: int, seed: int) -> torch.Tensor:
    """A map [e_global] onto e_local experts in a seeded random order, the rest -1 (not on this rank)."""
    g = torch.Generator().manual_seed(seed)
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[torch.randperm(e_global, generator=g)[:e_local]] = torch.arange(e_local, dtype=torch.int32)
    return expert_map


def count_served(monkeypatch, owner, name: str) -> list[int]:
    """Wrap ``owner.<name>`` (a function or method returning an output, or None where it did not serve); returns
    [how many calls returned an output]."""
    served = [0]
    real = getattr(owner, name)

    def counted(*args):
        out = real(*args)
        served[0] += out is not None
        return out

    monkeypatch.setattr(owner, name, counted)
    return served


def count_calls(monkeypatch, seen: dict, targets: list[tuple]) -> dict:
    """Wrap each (module, function name, key) of ``targets`` so every call adds 1 to ``seen[key]``; returns seen."""
    for module, name, key in targets:
        real = getattr(module, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            seen[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return seen


class CountedOp:
    """A torch op that appends ``name`` to ``calls`` at each call; anything else (``.default``, which the autograd
    reads) is the op's."""

    def __init__(self, op, calls: list, name: str):
        self.op, self.calls, self.name = op, calls, name

    def __call__(self, *args):
        self.calls.append(self.name)
        return self.op(*args)

    def __getattr__(self, attr: str):
        return getattr(self.op, attr)


def count_op_calls(monkeypatch, names) -> list:
    """Each ``torch.ops.moekit.<name>`` of ``names`` replaced by a ``CountedOp``; returns the list of the names
    called, in call order."""
    calls: list[str] = []
    for name in names:
        monkeypatch.setattr(torch.ops.moekit, name, CountedOp(getattr(torch.ops.moekit, name), calls, name))
    return calls


def run_compile_script(script: str, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``benchmarks/<script> <args>`` in a process of its own with TRITON_INTERPRET unset (the kernels compile; this
    process's interpreted kernels patch Triton's frontend): the finished process and its OK / FAIL lines."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(root / "benchmarks" / script), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    return done, [line for line in done.stdout.splitlines() if line.startswith(("OK", "FAIL"))]


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64; a NaN in ``got`` (an unwritten row was read) fails at once."""
    assert not got.isnan().any(), "NaN in the output: an unwritten row was read"
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def rel_max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float64 (the EP tests' measure: one bad row is not averaged away);
    0 for two equally shaped empty tensors, inf for an empty ``ref`` and a differently shaped ``out``."""
    if ref.numel() == 0:
        return 0.0 if out.shape == ref.shape else float("inf")
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def cli_error(capsys, argv: list[str]) -> str:
    """Run ``moekit ARGV`` in-process and check that it failed as a usage error: exit code 2, no
    traceback, stderr one line ``moekit <subcommand>: error: ...`` (after argparse's usage lines, for
    the errors argparse reports itself). Returns that line."""
    from moekit.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits by itself
        code = exc.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines and lines[-1].startswith(f"moekit {argv[0]}") and ": error: " in lines[-1], err
    assert len(lines) == 1 or lines[0].startswith("usage: "), err
    return lines[-1]


class RacingDict(dict):
    """A dict whose oldest entry goes the moment it is iterated: what a weakref callback (a weight freed) or
    a clear on another thread does between an eviction's look at the oldest key and its pop."""

    def __iter__(self):
        keys = list(dict.__iter__(self))
        if keys:
            dict.pop(self, keys[0])
        return iter(keys)


def value_error_of(call) -> str:
    """The message of the ValueError ``call()`` raises, or "no error" (for a spawned rank, which returns values)."""
    try:
        call()
    except ValueError as err:
        return str(err)
    return "no error"
