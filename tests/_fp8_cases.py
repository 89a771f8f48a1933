"""The fp8 Triton path's test problems, shared by ``test_triton_fp8*.py``: quantized weights, routing,
and the kernels-against-twin call (workspaces poisoned with NaN)."""

from __future__ import annotations

import json

import pytest
import torch
from _helpers import glu64, routed_slots

from moekit.experts.configs import clear_config_cache
from moekit.experts.triton_launch import LaunchOptions

POISON = LaunchOptions(poison_workspace=True)
# Kernel, twin and the float64 emulation round the same values onto the e4m3 grid, but their float32
# sums differ in order, so now and then a value within ~1e-7 of a rounding midpoint goes the other way:
# one such flip moves an output by ~1e-4 at these shapes (seen: the twin against float64, seed 13).
# Without flips they agree to ~1e-7; a wrong scale or a skipped quantization costs >= 1e-2.
FLIP_TOL = 1e-3
SHAPES = [((4, 160, 96), (128, 128)), ((5, 150, 70), (64, 32))]  # (E, K, N), block shape: K and N tails


@pytest.fixture
def fp8_tuned_file(user_config_dir):
    """``write(entries)``: the tuned fp8_block file of SHAPES[0]'s experts on the CPU ({M: entry dict}) in an empty
    user config directory searched first, the lookups' cache cleared after each write (and after the test)."""

    def write(entries: dict) -> None:
        body = {"E": 4, "N": 96, "K": 160, "dtype": "fp8_block", "device": "cpu", "configs": entries}
        (user_config_dir / "E4_N96_K160_fp8_block_cpu.json").write_text(json.dumps(body))
        clear_config_cache()

    return write


def e4m3_groups_f64(v: torch.Tensor) -> torch.Tensor:
    """v [R, C] through e4m3 per row per 128 columns (s = amax / 448, 1 for zeros), back in float64."""
    out = torch.empty(v.shape, dtype=torch.float64)
    for c in range(0, v.shape[1], 128):
        block = v[:, c:c + 128].float()
        amax = block.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        out[:, c:c + 128] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn).double() * s.double()
    return out


def fake_quant_f64(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [C] float64 quantized per group of G and dequantized: s = amax/448 (1 for zeros), e4m3(v / s) * s."""
    out = torch.empty_like(v)
    for c0 in range(0, v.numel(), group):
        block = v[c0:c0 + group]
        s = block.abs().max() / 448 if block.abs().max() > 0 else 1.0
        out[c0:c0 + group] = (block / s).to(torch.float8_e4m3fn).double() * s
    return out


def emulation_f64(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape, expert_map=None, *, b13=None, b2=None,
                  spec=None):
    """The recipe per token and slot in float64 (the definition the twin is held to): x quantized per G columns,
    block-dequantized weights (+ b13 [E, 2N]), silu-and-mul (``spec`` not None: ``_helpers.glu64``'s formulas of the
    ActivationSpec), h quantized per G columns (+ b2 [E, K]), the routed weight, the slots summed."""
    (bn, bk), num_experts, inter = block_shape, w13_q.shape[0], w2_q.shape[2]

    def deq(q, s, e):  # q [R, C] * s[r // GN, c // G]
        r, c = torch.arange(q.shape[1])[:, None] // bn, torch.arange(q.shape[2])[None, :] // bk
        return q[e].double() * s[e].double()[r, c]

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j, e in routed_slots(ids, num_experts, expert_map):
        gate_up = deq(w13_q, w13_s, e) @ fake_quant_f64(x[t].double(), bk)  # [2N]
        if b13 is not None:
            gate_up = gate_up + b13[e].double()
        h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:] if spec is None else glu64(gate_up, spec)
        y = deq(w2_q, w2_s, e) @ fake_quant_f64(h, bk)  # [K]
        if b2 is not None:
            y = y + b2[e].double()
        out[t] += float(weights[t, j]) * y
    return out


def quantize_weight(w: torch.Tensor, block_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, R, C] -> (q e4m3, scale [E, ceil(R/GN), ceil(C/G)]): scale = block amax / 448."""
    (num_experts, rows, cols), (bn, bk) = w.shape, block_shape
    scale = torch.empty(num_experts, -(-rows // bn), -(-cols // bk))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            block = w[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = block.abs().amax(dim=(1, 2)) / 448
            scale[:, i, j] = s
            q[:, i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s[:, None, None]).to(torch.float8_e4m3fn)
    return q, scale


def block_experts(g: torch.Generator, num_experts: int, inter: int, hidden: int) -> tuple:
    """(w13 e4m3 [E, 2N, K], its scales, w2 e4m3 [E, K, N], its scales) in 128 x 128 blocks, drawn from ``g`` (w13,
    then w2; each / sqrt(its reduction) for unit-scale outputs): the Gluon fp8 tests' experts."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return (*quantize_weight(w13, (128, 128)), *quantize_weight(w2, (128, 128)))


def problem(m, k, shape, block_shape, dtype=torch.float32, seed=0, num_global=None):
    """x, (w13, w2) unquantized, quantized weights, ids (into num_global experts if given), weights."""
    (num_experts, hidden, inter), g = shape, torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    pool = num_global or num_experts
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(m)]).int() if m else torch.zeros(0, k).int()
    if num_global:
        ids[torch.rand(m, k, generator=g) < 0.2] = -1  # skipped slots
    weights = torch.rand(m, k, generator=g)
    quantized = (*quantize_weight(w13, block_shape), *quantize_weight(w2, block_shape))
    return x, (w13, w2), quantized, ids, weights


def kernel_vs_twin(fp8, x, quantized, ids, weights, block_shape, expert_map=None, config=None, x_in_gate_up=None,
                   options=POISON, weight_tma=None):
    """(the kernels' output, the twin's); through the custom op unless a config, x_in_gate_up or
    weight_tma is given."""
    args = (x, *quantized, ids, weights)
    if config is None and x_in_gate_up is None and weight_tma is None:
        out = fp8.fused_experts_fp8(*args, expert_map=expert_map, block_shape=block_shape, options=options)
    else:
        out = fp8.fused_experts_fp8_launch(*args, expert_map, block_shape, config, options, x_in_gate_up, weight_tma)
    twin = fp8.fused_experts_fp8_torch(*args, expert_map=expert_map, block_shape=block_shape)
    assert out.shape == x.shape and out.dtype == x.dtype and twin.dtype == x.dtype
    return out, twin
