"""Gradients of expert-parallel layers (``EPMoE``) on the fuzzer's cases against float64 autograd through the loop
(``_fuzz_grad.reference_grads``): what ``test_fuzz_ep`` asserts for training.

    each rank: loss = sum(out * R) over its rows -> backward (the all-to-alls' transposes) -> ``ep.sync_grads()``
    (every gradient averaged over the ranks: times W, the gradient of the sum of the ranks' losses) -> x's gradient
    rows, the layer's gradients -> the parent assembles the whole layer's gradients and compares them with the loop's

The cases ``_fuzz_ep`` runs, float experts only, without aux losses (``test_parallel_train_steps`` trains them),
dropless (a rank's capacity is over its own tokens); EPLB's replicas of an expert summed by ``sync_grads``: each
must then hold the expert's gradient, bit-equal.
Shapes: M tokens of the batch, K hidden, E routed experts, L local, S shared slots.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import numpy as np
import torch

from _fuzz_cases import build, draw_case
from _fuzz_check import Outcome
from _fuzz_ep import ep_case, ep_layer, ep_takes, refused_for, rows_of
from _fuzz_grad import Grads, compare, grad_case, projection, reference_grads, trainable

NO_AUX = dict(aux_loss_coef=0.0, seq_aux_loss_coef=0.0, z_loss_coef=0.0)


@dataclass
class RankGrads:
    """One rank's share of one case, float64 NumPy arrays (see ``_fuzz_ep.RankResult``)."""

    start: int
    stop: int
    slots: list[int]  # the logical experts of its local rows, in order
    logits: np.ndarray  # [rows, W_router]
    grads: dict[str, np.ndarray]  # "x" [rows, K]; w13 / w2 [L(+S), ...]; replicated ones summed over the ranks


def ep_grad_seeds(seeds, world_size: int) -> list[int]:
    """The seeds whose case EPMoE takes on ``world_size`` ranks and trains."""
    cases = {s: ep_case(draw_case(s)) for s in seeds}
    return [s for s, c in cases.items()  # dropless: a rank's capacity is over its own tokens, not the loop's batch
            if ep_takes(c) and c.capacity_factor is None and trainable(c) and not refused_for(c, world_size)]


def _trained(seed: int):
    """(the seed's EP case made a training one without aux losses, its -inf-masked gate-bias entries)."""
    trained = grad_case(ep_case(draw_case(seed)))
    return dataclasses.replace(trained.case, fields={**trained.case.fields, **NO_AUX}), trained.masked_rows


def _moe(case, masked_rows: list[int], backend: str):
    moe, x = build(case, backend)
    if masked_rows:
        with torch.no_grad():
            moe.gate.bias[masked_rows] = float("-inf")
    return moe, x


def rank_grads(rank: int, world_size: int, seeds: list[int]) -> dict[int, RankGrads]:
    """Run on each rank (spawned): every seed's case trained through EPMoE."""
    results = {}
    for seed in seeds:
        case, masked = _trained(seed)
        moe, x = _moe(case, masked, random.Random(f"epb{seed}").choice(["grouped_mm", "reference"]))
        ep = ep_layer(moe, case, world_size)
        start, stop = rows_of(case.m, rank, world_size, seed)
        leaf = x[start:stop].clone().requires_grad_(True)
        call = ep(leaf, return_aux_loss=True)
        (call.out.double() * projection(case)[start:stop]).sum().backward()
        ep.sync_grads()  # averaged over the ranks; EPLB's replicas: each slot holds the expert's whole gradient
        grads = {"x": leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)}
        for name, p in ep.named_parameters():  # times W: the gradient of the sum of the ranks' losses, the loop's
            grads[name] = (p.grad if p.grad is not None else torch.zeros_like(p)).double() * world_size
        logits = call.router_logits.detach().double().numpy()
        results[seed] = RankGrads(start, stop, list(ep.placement.slots[rank]), logits,
                                  {k: v.detach().double().numpy() for k, v in grads.items()})
    return results


def check_ep_grads(seeds: list[int], ranks: list[dict[int, RankGrads]], world_size: int, result: Outcome) -> None:
    """The whole layer's gradients, assembled from the ranks, against the loop's."""
    for seed in seeds:
        case, masked = _trained(seed)
        moe, x = _moe(case, masked, "reference")
        shares = [r[seed] for r in ranks]
        logits = torch.cat([torch.from_numpy(s.logits) for s in shares])  # [M, W_router]
        want = reference_grads(moe, case, x, logits, projection(case))
        if want is None:
            result.skipped_ambiguous += 1
            continue
        got = {"x": torch.cat([torch.from_numpy(s.grads["x"]) for s in shares])}
        e = case.config.num_experts
        for name in ("w13", "w2"):
            full = torch.zeros_like(want.grads[name])  # [E(+S), ...]
            held: dict[int, torch.Tensor] = {}
            for s in shares:  # after sync_grads every replica (EPLB) holds its expert's whole gradient
                local = torch.from_numpy(s.grads[name])
                for slot, expert in enumerate(s.slots):
                    if expert in held and not torch.equal(held[expert], local[slot]):
                        result.fail(f"ep W={world_size} seed {seed}: the replicas of expert {expert} hold different "
                                    f"{name} gradients after sync_grads")
                    held.setdefault(expert, local[slot])
                shared = local[len(s.slots):]  # [S, ...] the fused shared slots: every rank holds them whole
                if s is not shares[0] and not torch.equal(shared, full[e:]):
                    result.fail(f"ep W={world_size} seed {seed}: the ranks' shared slots hold different {name} "
                                f"gradients after sync_grads")
                full[e:] = shared
            for expert, g in held.items():
                full[expert] = g
            got[name] = full
        for name, g in shares[0].grads.items():
            got.setdefault(name, torch.from_numpy(g))
        compare(Grads(None, got), want, case, f"ep W={world_size} seed {seed}", result)
