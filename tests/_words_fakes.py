"""Torch stand-ins for the words decode's two Gluon kernels (``gluon_wo_words.gate_up_words_kernel``,
``gluon_wo_words_down.down_words_kernel``; Gluon does not run in the interpreter): each writes exactly what its
kernel writes (h in the stored order or a split's float32 partials; y's split partials times the routed weight),
from weights dequantized here in float64 from the schemes' definitions (int4: (code - zero) * scale; mxfp4: the OCP
e2m1 value times 2^(e8m0 - 127)), for the whole-call tests (``test_triton_wo_words_call``, ``_lean``, ``_mx``)."""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import FakeKernel
from moekit.experts._kernels.gluon_wo_words import stored_column
from moekit.quant.base import unpack_nibbles

E, N, K, GROUP = 8, 512, 512, 128
# OCP MX: e2m1 code bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa; exponent 0 subnormal
E2M1 = [(-1.0) ** (c >> 3) * ((c & 1) * 0.5 if (c >> 1) & 3 == 0 else 2.0 ** (((c >> 1) & 3) - 1) * (1 + (c & 1) / 2))
        for c in range(16)]


def routing(m: int, seed: int) -> tuple:
    """(x [m, K] bf16, ids [m, 2] int32: two distinct experts of E a token, weights [m, 2] float32 summing to 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(m)]).int()
    weights = torch.rand(m, 2, generator=g)
    return x, ids, weights / weights.sum(1, keepdim=True)


def rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def dequant(q, s, z, e: int, cols: int) -> torch.Tensor:
    """Expert e's weight [R, cols] in float64: int4 (float scales of GROUP with zero points) or mxfp4 (uint8 e8m0
    scales of 32)."""
    codes = unpack_nibbles(q[e], cols).long()
    if s.dtype == torch.uint8:
        return torch.tensor(E2M1, dtype=torch.float64)[codes] * torch.exp2(s[e].double() - 127).repeat_interleave(
            32, -1)[:, :cols]
    per = lambda t: t[e].double().repeat_interleave(GROUP, -1)[:, :cols]  # noqa: E731
    return (codes.double() - per(z)) * per(s)


def _blocks(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments, BM, NAIVE):
    """(expert, assignments) of each block the kernels run (``gluon_wo_words.block_rows``)."""
    if NAIVE:
        return [(int(e), [a]) for a, e in enumerate(ids_ptr.reshape(-1).tolist())]
    used = int(num_padded_ptr[0]) // BM
    return [(int(expert_ids_ptr[b]), [a for a in sorted_ids_ptr[b * BM:(b + 1) * BM].tolist() if a < num_assignments])
            for b in range(used)]


def _glu(v: torch.Tensor, bias, n: int, INTERLEAVED, LIMIT, ALPHA, UP_SHIFT, LIMIT_AFTER=False, **_) -> torch.Tensor:
    """One assignment's gate-up sums v [2N] (w13's row order) -> h [N]: ``ActivationSpec``'s definition (LIMIT_AFTER:
    the gate's clamp on gate sigmoid(ALPHA gate), Step-3.7's)."""
    if bias is not None:
        v = v + bias.double()
    gate, up = (v[0::2], v[1::2]) if INTERLEAVED else (v[:n], v[n:])
    if LIMIT > 0:
        gate, up = gate if LIMIT_AFTER else gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
    act = gate * torch.sigmoid(ALPHA * gate)
    return (act.clamp(max=LIMIT) if LIMIT > 0 and LIMIT_AFTER else act) * (up + UP_SHIFT)


def _gate_up(x_ptr, xsum_ptr, q_ptr, s_ptr, z_ptr, h_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
             b13_ptr, N, K, num_assignments, top_k, BM, NAIVE, H_ORDER, SPLIT, BIASED=False, **spec):
    order = stored_column.fn(torch.arange(K))
    x = x_ptr[:, order].double()  # the stored activations back in column order
    for expert, rows in _blocks(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments, BM, NAIVE):
        w = dequant(q_ptr, s_ptr, z_ptr, expert, K)  # [2N, K]
        for a in rows:
            parts = [w[:, s * K // SPLIT:(s + 1) * K // SPLIT] @ x[a // top_k, s * K // SPLIT:(s + 1) * K // SPLIT]
                     for s in range(SPLIT)]
            if SPLIT > 1:
                for s, p in enumerate(parts):
                    h_ptr[s * num_assignments + a] = p.float()
            else:
                h = _glu(parts[0], b13_ptr[expert] if BIASED else None, N, **spec)
                h_ptr[a, stored_column.fn(torch.arange(N)) if H_ORDER else torch.arange(N)] = h.to(h_ptr.dtype)


def _down(h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
          b2_ptr, K, N, num_assignments, split_steps, BM, NAIVE, SPLIT, BIASED=False, **_):
    h = h_ptr[:, stored_column.fn(torch.arange(N))].double()  # the gate-up's stored order back in column order
    cols = split_steps * 256
    for expert, rows in _blocks(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments, BM, NAIVE):
        w = dequant(q_ptr, s_ptr, z_ptr, expert, N)  # [K, N]
        for a in rows:
            for s in range(SPLIT):
                part = w[:, s * cols:(s + 1) * cols] @ h[a, s * cols:(s + 1) * cols]
                if BIASED and s == 0:
                    part = part + b2_ptr[expert].double()
                y_ptr[s * num_assignments + a] = (part * float(weights_ptr.reshape(-1)[a])).to(y_ptr.dtype)


@pytest.fixture
def stand_ins(monkeypatch):
    import moekit.experts._kernels.gluon_wo_words as up
    import moekit.experts._kernels.gluon_wo_words_down as down
    import moekit.experts.triton_wo_words as tw
    from moekit.experts.triton_wo_words_lean import clear_words_plans

    fakes = {"gate_up": FakeKernel(up.gate_up_words_kernel, _gate_up),
             "down": FakeKernel(down.down_words_kernel, _down)}
    monkeypatch.setattr(up, "gate_up_words_kernel", fakes["gate_up"])
    monkeypatch.setattr(down, "down_words_kernel", fakes["down"])
    caches = (tw._gate_up_bound, tw._down_bound)
    for clear in (*(cache.cache_clear for cache in caches), clear_words_plans):
        clear()
    yield fakes
    for clear in (*(cache.cache_clear for cache in caches), clear_words_plans):  # the stand-ins' launches go
        clear()
