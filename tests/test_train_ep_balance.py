"""``moekit train --ep N --spare-slots S --rebalance-every K``: EPLB replicas in the training loop.

On 2 gloo ranks in float64 (``torch.set_default_dtype`` in each rank, ``train_side_by_side`` with ``RankShare``), the
three runs with 4 experts and 1 spare slot (5 slots: 3 on one rank, 2 on the other) rebalanced after every step give
one float64 process's run on the whole batch: the same loss within 1e-10 relative (float64 summation order), the
same imbalance and drops exactly, and after the last step (and its rebalance) every slot's weights and AdamW moments
equal that expert's in the one process, every other parameter and the correction bias too. The test checks that
experts moved and that a rank's slot count changed (new w13 / w2 Parameters swapped into the optimizer). Run without
moving the optimizer's state, the curves leave the one-process ones (checked: the test can fail). Then the
refusals, by flag.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from _helpers import cli_error
from _parallel_harness import run_ranks
from moekit.parallel import EPMoE
from moekit.train import ep_balance
from moekit.train.data import ByteCorpus
from moekit.train.ep import RankShare
from moekit.train.loop import METHODS, Share, TrainSettings, train_side_by_side

SETTINGS = TrainSettings(steps=3, batch_size=4, seq_len=8, d_model=16, num_layers=1, num_heads=2, num_experts=4,
                         top_k=2, expert_size=8, aux_loss_coef=0.1, bias_rate=0.01, lr=1e-2, ep=2, spare_slots=1,
                         rebalance_every=1)
EXPERT_ROWS = ("w13", "w2")  # an EPMoE holds these by slot; the one process by logical expert
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-row state


def _corpus() -> ByteCorpus:
    return ByteCorpus(torch.arange(4096, dtype=torch.int64).mul(37).remainder(251).to(torch.uint8), "test", 1)


def _final(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """name -> values (nested lists: a rank's tensors would go through the result queue as shared memory of a process
    that has exited): every parameter, its AdamW moments (``name:exp_avg``) and the correction bias; an EPMoE's
    expert rows as ``name[e]@slot`` (logical expert e in local slot ``slot``)."""
    out = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}"
            tensors = {full: param.detach(), **{f"{full}:{m}": optimizer.state[param][m] for m in MOMENTS}}
            for key, value in tensors.items():
                if isinstance(module, EPMoE) and name in EXPERT_ROWS:
                    out.update({f"{key}[{e}]@{slot}": value[slot].tolist()
                                for slot, e in enumerate(module.placement.slots[module.rank])})
                else:
                    out[key] = value.tolist()
        if getattr(module, "e_score_correction_bias", None) is not None:
            out[f"{module_name}.e_score_correction_bias"] = module.e_score_correction_bias.tolist()
    return out


def _recording(base: type):
    @dataclass
    class Recorder(base):
        """``base`` (the one process's ``Share`` or a ``RankShare``) that keeps each run's tensors after its last
        step's ``after_step`` (the last rebalance included)."""

        finals: list = None

        def after_step(self, model, optimizer, step):
            super().after_step(model, optimizer, step)
            if step == SETTINGS.steps:
                self.finals.append(_final(model, optimizer))

    return Recorder


def _run(settings: TrainSettings, share) -> dict:
    result = train_side_by_side(settings, _corpus(), None, share)
    return {"curves": {m: (c.loss, c.imbalance, c.dropped) for m, c in result.curves.items()},
            "finals": dict(zip(METHODS, share.finals))}


def _single() -> dict:
    """The one float64 process on the whole batch (the same seed)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _run(replace(SETTINGS, ep=1, spare_slots=0, rebalance_every=0), _recording(Share)(finals=[]))
    finally:
        torch.set_default_dtype(dtype)


@dataclass(frozen=True)
class _Unmoved:
    weight: torch.Tensor  # the state left in its rows (zeros where the slot count changed): move_experts skipped


def _rank(rank: int, world_size: int) -> dict:
    """The balanced run, with EPLB's moves and reallocations counted; then the same without moving the state."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    summaries, real_rebalance, real_move = [], ep_balance.rebalance_, ep_balance.move_experts

    def counted(*args):
        summaries.append(real_rebalance(*args))
        return summaries[-1]

    def unmoved(value, old, new, rank, group):
        rows = new.num_local_experts(rank)
        return _Unmoved(value if rows == value.shape[0] else value.new_zeros((rows, *value.shape[1:])))

    share = _recording(RankShare)(rank, world_size, SETTINGS.spare_slots, SETTINGS.rebalance_every, finals=[])
    ep_balance.rebalance_ = counted
    try:
        balanced = _run(SETTINGS, share)
        ep_balance.rebalance_, ep_balance.move_experts = real_rebalance, unmoved
        stale = _run(SETTINGS, _recording(RankShare)(rank, world_size, SETTINGS.spare_slots, SETTINGS.rebalance_every,
                                                     finals=[]))
    finally:
        ep_balance.rebalance_, ep_balance.move_experts = real_rebalance, real_move
    return {"balanced": balanced, "stale": stale, "changed": sum(s.changed for s in summaries),
            "reallocated": sum(s.reallocated for s in summaries)}


def _rel(got: list, want: list) -> float:
    a, b = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_rebalanced_runs_with_unequal_slots_follow_one_process():
    want = _single()
    ranks = run_ranks(_rank, 2, timeout_s=200)
    assert sum(r["changed"] for r in ranks) > 0  # experts moved
    assert sum(r["reallocated"] for r in ranks) > 0  # and a rank's slot count changed: new Parameters
    for method in METHODS:
        (loss_a, imb_a, drop_a) = want["curves"][method]
        (loss_b, imb_b, drop_b) = ranks[0]["balanced"]["curves"][method]
        assert imb_a == imb_b and drop_a == drop_b, method
        assert max(abs(x - y) / abs(x) for x, y in zip(loss_a, loss_b)) < 1e-10, (method, loss_a, loss_b)
        single = want["finals"][method]
        for rank, got in enumerate(ranks):
            compared = set()
            for key, value in got["balanced"]["finals"][method].items():
                name, _, slot = key.partition("@")  # "blocks.0.moe.w13:exp_avg[2]@1" -> its logical row
                base, _, expert = name.partition("[")
                ref = single[base][int(expert[:-1])] if expert else single[base]
                assert _rel(value, ref) < 1e-10, (method, rank, key, _rel(value, ref))
                compared.add(base)
            assert compared == set(single), (method, rank, set(single) ^ compared)
    worst = max(abs(x - y) / abs(x) for m in METHODS
                for x, y in zip(want["curves"][m][0], ranks[0]["stale"]["curves"][m][0]))
    assert worst > 1e-6, worst  # without the state move the runs differ: the test can fail


@pytest.mark.parametrize("argv, message", [
    (["--spare-slots", "2", "--rebalance-every", "2"], "need ep > 1"),
    (["--ep", "2", "--spare-slots", "2"], "set rebalance_every > 0"),
    (["--ep", "2", "--spare-slots", "9", "--rebalance-every", "2"], "at most num_experts * (ep - 1) = 8"),
    (["--ep", "2", "--spare-slots", "-1", "--rebalance-every", "2"], "spare_slots must be an int >= 0, got -1"),
    (["--ep", "2", "--rebalance-every", "-1"], "rebalance_every must be an int >= 0"),
])
def test_balancer_settings_are_refused_by_flag(tmp_path, capsys, argv, message):
    line = cli_error(capsys, ["train", "--steps", "1", "--experts", "8", "--out", str(tmp_path), *argv])
    assert message in line and "--spare-slots/--rebalance-every" in line, line
