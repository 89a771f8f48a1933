"""Three runs side by side on the same batches from the same initial weights: no balancing, the
auxiliary load-balancing loss, and DeepSeek's bias update.

    for each step: one batch -> each run: forward, loss (+ aux), backward, AdamW step (bias run: bias update)

Expert-parallel (``ep`` > 1, ``moekit.train.ep``): every rank builds the same model with its MoE layers as ``EPMoE``,
draws the same batch and runs its share of the sequences; ``sync_grads`` averages the gradients after backward, the
bias update sums the counts over the ranks, and the curves are the whole batch's (loss averaged, counts summed): the
single process's run on the same seed, up to float32 summation order (``Share``).

One router for all three runs, so the comparison isolates the balancing method: softmax scoring, top-k,
renormalised (Mixtral's), with the correction bias buffer in every run (``use_correction_bias``);
it stays at zero unless the bias run moves it. The bias moves selection only, as in DeepSeek-V3; it
needs no particular scoring function (``moekit.balance``).

Load imbalance of a step: max / mean of the routed assignments per expert, averaged over the MoE layers
(1 = perfectly even; E/k = every token on the same k experts).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from moekit.balance import update_correction_bias_
from moekit.config import MoEConfig
from moekit.train.data import ByteCorpus
from moekit.train.model import TinyMoELM

METHODS = ("none", "aux", "bias")


@dataclass(frozen=True)
class TrainSettings:
    """Everything a run depends on (saved with the curves)."""

    steps: int = 500  # 1 min 45 s for the three runs on this repo's shared 2-core CPU (0.17 s per step when quiet)
    batch_size: int = 16  # B sequences per step
    seq_len: int = 128  # T bytes per sequence
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 128  # N, each expert's intermediate width
    lr: float = 3e-3
    aux_loss_coef: float = 1e-2  # the aux run's coefficient (Switch Transformer: 1e-2)
    # The bias run's update speed: DeepSeek-V3's gamma. Measured at these defaults, seed 0, max/mean load over
    # the last 20% of steps: 500 steps: 1.96 unbalanced, 1.41 aux loss, 1.32 bias (loss 1.91, 1.95, 1.89);
    # 100 steps: 2.16, 1.55, 1.57 (1.58 with a rate of 1e-2: the faster rate buys nothing here).
    bias_rate: float = 1e-3
    capacity_factor: float | None = None  # None: dropless
    seed: int = 0
    device: str = "cpu"
    backend: str = "auto"
    ep: int = 1  # processes the MoE layers' experts are spread over (1: one process, no torch.distributed)
    spare_slots: int = 0  # ep only: replica slots per MoE layer that EPLB fills (``moekit.train.ep_balance``)
    rebalance_every: int = 0  # ep only: steps between EPLB rebalances of every MoE layer (0: the placement stays)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "d_model", "num_layers", "num_heads", "num_experts", "top_k",
                     "expert_size", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("lr", "aux_loss_coef", "bias_rate"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.batch_size % self.ep:
            nearest = self.ep * -(-self.batch_size // self.ep)  # the next multiple up
            raise ValueError(f"ep={self.ep} processes each take batch_size / ep sequences: batch_size "
                             f"({self.batch_size}) must be a multiple of it (e.g. {nearest})")
        if self.num_experts < self.ep:
            raise ValueError(f"ep={self.ep} processes each hold at least one expert: num_experts ({self.num_experts}) "
                             f"must be >= it")
        _check_balancer(self)
        if self.capacity_factor is not None and not 0 < self.capacity_factor < float("inf"):
            raise ValueError(f"capacity_factor must be a positive number or None, got {self.capacity_factor!r}")

    def moe_config(self, method: str) -> MoEConfig:
        return MoEConfig(hidden_size=self.d_model, moe_intermediate_size=self.expert_size, num_experts=self.num_experts,
                         top_k=self.top_k, use_correction_bias=True,
                         aux_loss_coef=self.aux_loss_coef if method == "aux" else 0.0)


def _check_balancer(s: TrainSettings) -> None:
    """EPLB's settings: non-negative ints, with ``ep`` > 1, replicas only when rebalanced, at most ``ep`` - 1 replicas
    of an expert. E + S need not be a multiple of ``ep``: the ranks then hold P // ep or one more slots, and a rank
    whose count a rebalance changes gets new w13 / w2 Parameters, swapped into the optimizer (``ep_balance``)."""
    for name in ("spare_slots", "rebalance_every"):
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if (s.spare_slots or s.rebalance_every) and s.ep == 1:
        raise ValueError("spare_slots / rebalance_every balance the experts over ranks: they need ep > 1")
    if s.spare_slots and not s.rebalance_every:
        raise ValueError(f"spare_slots={s.spare_slots} are filled by EPLB's rebalances: set rebalance_every > 0")
    if s.spare_slots > s.num_experts * (s.ep - 1):
        raise ValueError(f"spare_slots={s.spare_slots} would put some expert on more than ep={s.ep} ranks: at most "
                         f"num_experts * (ep - 1) = {s.num_experts * (s.ep - 1)}")


@dataclass
class Curve:
    """One run's per-step values."""

    loss: list[float] = field(default_factory=list)  # next-byte cross-entropy (nats), without the aux loss
    imbalance: list[float] = field(default_factory=list)  # max/mean assignments per expert, mean over layers
    dropped: list[float] = field(default_factory=list)  # fraction of assignments the capacity factor dropped
    seconds: float = 0.0  # wall time of this run's steps


@dataclass
class StepReport:
    """What ``on_step`` receives after every step of all three runs."""

    step: int  # 1-based
    steps: int
    latest: dict[str, tuple[float, float, float]]  # method -> (loss, imbalance, dropped fraction)


@dataclass
class TrainResult:
    settings: TrainSettings
    curves: dict[str, Curve]  # method -> its curve, METHODS order

    def to_dict(self) -> dict:
        return {"settings": asdict(self.settings), "runs": {m: asdict(c) for m, c in self.curves.items()}}


class Share:
    """One process trains on the whole batch: what ``moekit.train.ep.RankShare`` does across ranks, done locally."""

    def parallel(self, model: TinyMoELM) -> TinyMoELM:
        """The model this process trains (its MoE layers as they are)."""
        return model

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's sequences of a batch [B, T] (all of them)."""
        return batch

    def sync_grads(self, model: TinyMoELM) -> None:
        """The gradients after backward as the whole batch's (nothing to do)."""

    def totals(self, values: torch.Tensor) -> torch.Tensor:
        """A step's [loss, dropped, counts...] over the whole batch (the loss a mean, the rest sums): these."""
        return values

    def after_step(self, model: TinyMoELM, optimizer: torch.optim.Optimizer, step: int) -> None:
        """After step ``step``'s optimizer step (EPLB's rebalance across ranks): nothing."""


@dataclass
class _Run:
    model: TinyMoELM
    optimizer: torch.optim.Optimizer
    curve: Curve


def _build(settings: TrainSettings, method: str, share: Share) -> _Run:
    torch.manual_seed(settings.seed)  # the same initial weights in every run (and on every rank)
    model = share.parallel(TinyMoELM(settings.moe_config(method), settings.num_layers, settings.num_heads,
                                     settings.seq_len, backend=settings.backend,
                                     capacity_factor=settings.capacity_factor).to(settings.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    return _Run(model, optimizer, Curve())


def _step(run: _Run, method: str, settings: TrainSettings, inputs: torch.Tensor, targets: torch.Tensor,
          share: Share) -> None:
    """One step of one run on the batch inputs, targets [B, T] (this process's share of it)."""
    t0 = time.perf_counter()
    out = run.model(share.rows(inputs), share.rows(targets))
    total = out.loss if out.aux_loss is None else out.loss + out.aux_loss
    run.optimizer.zero_grad(set_to_none=True)
    total.backward()
    share.sync_grads(run.model)
    run.optimizer.step()
    if method == "bias":  # an EPMoE sums the counts over its ranks itself
        for moe, stats in zip(run.model.moe_layers, out.stats):
            update_correction_bias_(moe, stats.choice_counts, rate=settings.bias_rate)
    mine = [out.loss.detach().double().reshape(1), torch.tensor([float(sum(s.dropped for s in out.stats))]),
            *(s.counts.double().cpu() for s in out.stats)]
    values = share.totals(torch.cat([v.cpu() for v in mine]))  # [2 + layers * E]: the whole batch's
    counts = values[2:].view(len(out.stats), -1)  # [layers, E]
    assignments = inputs.numel() * settings.top_k * len(counts)
    run.curve.loss.append(float(values[0]))
    run.curve.imbalance.append(sum(float(c.max() / c.mean()) for c in counts) / len(counts))
    run.curve.dropped.append(float(values[1]) / assignments)
    run.curve.seconds += time.perf_counter() - t0


def train_side_by_side(settings: TrainSettings, corpus: ByteCorpus,
                       on_step: Callable[[StepReport], None] | None = None, share: Share | None = None) -> TrainResult:
    """Train the three runs for ``settings.steps`` steps on the same seeded batches; ``share``: this rank's part of
    an expert-parallel run (``moekit.train.ep``), None: one process, all of it."""
    share = Share() if share is None else share
    runs = {method: _build(settings, method, share) for method in METHODS}
    batches = torch.Generator().manual_seed(settings.seed)
    for step in range(1, settings.steps + 1):
        inputs, targets = corpus.batch(settings.batch_size, settings.seq_len, batches)  # [B, T] each
        inputs, targets = inputs.to(settings.device), targets.to(settings.device)
        for method, run in runs.items():
            _step(run, method, settings, inputs, targets, share)
            share.after_step(run.model, run.optimizer, step)
        if on_step is not None:
            latest = {m: (r.curve.loss[-1], r.curve.imbalance[-1], r.curve.dropped[-1]) for m, r in runs.items()}
            on_step(StepReport(step, settings.steps, latest))
    return TrainResult(settings, {m: r.curve for m, r in runs.items()})
