"""``simulate``: one run of the routing / load-balancing simulator.

    [synthetic router, skew s] -> [balance: none | aux-loss | bias] -> route the batch (moekit.route)
      -> per-expert loads -> capacity (moekit.routing.capacity) -> drops, imbalance
      -> experts touched per batch size -> parameters -> expert-parallel what-if

Shapes: M = ``tokens``, E = ``experts``, k = ``top_k``, Z = identity experts, B = a batch size of the touched sweep.

``simulate(params, config)`` routes with a ``MoEConfig``'s own rule (``moekit.sim.router``): LongCat-Flash's identity
slots are counted apart (``identity_hits``, ``zero_compute_share``), never as expert loads, capacity or EP work.

Hash-routed layers (DeepSeek-V4's first MoE layers, ``mlp_layer_types[i] == "hash_moe"``) are not simulated: a
token's experts there are ``tid2eid[token id]``, a [vocab, k] table that lives in the checkpoint (no config.json
holds it), so their load is that table's over the text's token frequencies: no router logits, skew or balancing
method decides or changes it, and a made-up table's load would be reported as the model's. A config.json with hash
and top-k layers simulates its top-k layers and names the hash ones (``hash_layers``); a hash layer's ``MoEConfig``
(``hash_table_size``), or a model whose every MoE layer hash-routes, is refused (``hash_layers_of``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moekit.analysis import experts_touched
from moekit.analysis.billed import billed_layer
from moekit.config import MoEConfig, hf_layer_fields
from moekit.config_hf_v4 import hash_layers
from moekit.routing import apply_capacity
from moekit.routing.weighting import without_identity
from moekit.sim import streams
from moekit.sim.balance import BalanceOutcome, expert_loads, train_aux_loss, update_bias
from moekit.sim.ep import EPReport, ep_what_if
from moekit.sim.params import SimParams
from moekit.sim.router import SyntheticRouter, draw_tokens, make_router
from moekit.sim.shape import param_counts, stated_model

TOUCH_BATCHES = (1, 8, 64, 512)
TOUCH_TRIALS = 8  # independent batches averaged per batch size


@dataclass
class BalanceReport:
    """Balancing's effect on the evaluation batch (the same tokens before and after)."""

    method: str  # "aux-loss" or "bias"
    steps: int  # optimizer steps (aux-loss) or bias updates (bias) taken
    imbalance_before: float  # max/mean expert load with the unbalanced router
    imbalance_after: float
    drop_rate_before: float  # dropped fraction at the run's capacity factor
    drop_rate_after: float


@dataclass
class TouchPoint:
    """Distinct experts a batch of B tokens routes to: simulated (mean of trials) and uniform prediction."""

    batch: int  # B
    simulated: float  # mean over TOUCH_TRIALS batches drawn from the (balanced) router
    predicted: float  # E·(1 - (1 - k/E)^B), uniform independent routing (k/(E + Z) with identity experts)


@dataclass
class SimResult:
    """Everything one run reports; ``to_dict()`` is the JSON the CLI and the API emit."""

    params: dict  # the SimParams, as a dict
    loads: list[int]  # loads[e] = assignments routed to expert e (before capacity); sums to routed_assignments
    kept: list[int]  # kept[e] = min(loads[e], capacity)
    capacity: int  # C = ceil(cf·M·k/E)
    dropped: int  # assignments over capacity = sum(loads) - sum(kept)
    drop_rate: float  # dropped / routed_assignments
    imbalance: float  # max(loads) / mean(loads)
    experts_touched: int  # experts with loads > 0
    total_params: int  # stated shape (moekit.sim.shape), all E experts
    active_params: int  # read per token: k of the E experts (k·E/(E + Z) with identity experts)
    sparsity: float  # total / active
    param_shape: str
    touched_by_batch: list[TouchPoint]  # B in (1, 8, 64, 512)
    balance: BalanceReport | None  # None when balancing is off
    ep: EPReport
    router: dict  # the routing rule: scoring, renormalize, groups, bias, the changed router options
    routed_assignments: int  # the M·k slots less the identity ones: what the experts run (before capacity)
    identity_hits: list[int]  # [Z] slots routed to identity expert E + j (LongCat-Flash); [] without
    zero_compute_share: float  # sum(identity_hits) / (M·k): slots that ran no expert
    hash_layers: list[int]  # the model's hash-routed MoE layers (DeepSeek-V4's): not simulated, see the module doc
    note: str | None = None  # a config.json of a family moekit cannot serve: why, and the numbers routed instead

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(params: SimParams, config: MoEConfig | dict | None = None) -> SimResult:
    """Run the simulator for ``params`` (deterministic: the same params give the same result), routing with
    ``config``'s rule when given (its num_experts and top_k are ``params``' experts and top_k). A ``MoEConfig`` is a
    layer alone: parameters and the EP cost are priced at Mixtral-8x7B's shapes with E and k replaced; a config.json's
    fields (a dict: ``moekit.hf_config_of_preset(name)``, a file's) route with its layer's rule and price that whole
    model (``moekit.sim.shape``)."""
    if not isinstance(params, SimParams):  # a dict of the settings failed on "'dict' object has no attribute"
        raise TypeError(f"params must be a moekit.sim.SimParams (SimParams(**settings)), got {type(params).__name__}")
    fields = config if isinstance(config, dict) else None
    hashed = hash_layers_of(config)  # refuses what routes by a table only
    note = None
    if fields is not None:  # a family from_hf_config refuses: its numbers, routed as softmax top-k (BilledLayer.note)
        billed = billed_layer(fields)
        config, note = billed.config, billed.note
    model = None if fields is None else stated_model(params.experts, params.top_k, fields)
    router = make_router(params.experts, params.top_k, params.skew, params.seed, config)
    x = draw_tokens(params.tokens, router.width, streams.generator(params.seed, streams.EVAL))  # [M, F]
    outcome = _balance(router, params)
    routing = outcome.router.route(x, outcome.correction_bias)  # routed once: loads and capacity read the same ids
    identity = _identity_hits(routing.topk_ids, router.config)  # [Z]
    if identity.numel():
        routing = without_identity(routing, router.config)  # identity slots run no expert: capacity never sees them
    loads = expert_loads(routing.topk_ids, params.experts)  # [E]
    capped = apply_capacity(routing, params.experts, params.capacity_factor)
    assignments = int(loads.sum())  # M·k less the identity slots
    dropped = int(capped.dropped)
    counts = param_counts(params.experts, params.top_k, router.config.routed_slots_per_token, model)
    return SimResult(
        params=params.to_dict(),
        loads=loads.tolist(),
        kept=capped.kept_counts.tolist(),
        capacity=capped.capacity,
        dropped=dropped,
        drop_rate=dropped / max(assignments, 1),
        imbalance=_imbalance(loads),
        experts_touched=int((loads > 0).sum()),
        total_params=counts.total,
        active_params=counts.active,
        sparsity=counts.sparsity,
        param_shape=counts.shape,
        touched_by_batch=touched_by_batch(outcome, params.seed),
        balance=_balance_report(router, outcome, x, params, loads, capped),
        ep=ep_what_if(loads.tolist(), params.gpus, params.spare_slots, model),
        router=router_summary(router.config),
        routed_assignments=assignments,
        identity_hits=identity.tolist(),
        zero_compute_share=float(identity.sum()) / (params.tokens * params.top_k),
        hash_layers=hashed,
        note=note,
    )


def hash_layers_of(config: MoEConfig | dict | None) -> list[int]:
    """The hash-routed MoE layers of ``config`` (a config.json's fields; [] for a ``MoEConfig`` or None), which
    ``simulate`` does not simulate (the module doc); a ValueError for a hash layer's ``MoEConfig`` and for a model
    whose every MoE layer hash-routes: nothing of it is the simulator's to route."""
    why = ("routes by a token-id table (tid2eid[token id], a [vocab, k] table in the checkpoint, not in a config): "
           "its load is that table's over the text's token ids, which no router logits, skew or balancing decide; the "
           "simulator routes a synthetic router's logits (a top-k layer)")
    if isinstance(config, MoEConfig) and config.hash_table_size is not None:
        raise ValueError(f"config.hash_table_size={config.hash_table_size}: a hash layer {why}")
    if not isinstance(config, dict):
        return []
    d = hf_layer_fields(config)
    hashed = hash_layers(d)
    if hashed and "moe" not in d["mlp_layer_types"]:
        raise ValueError(f"every MoE layer of this {d.get('model_type')} config ({len(hashed)}) {why}")
    return hashed


def router_summary(config: MoEConfig) -> dict:
    """The routing rule of ``config`` in a few JSON fields: what the page and the summary print."""
    return {"scoring": config.scoring, "renormalize": config.renormalize, "n_group": config.n_group,
            "topk_group": config.topk_group, "use_correction_bias": config.use_correction_bias,
            "renorm_eps": config.renorm_eps, **config.changed_router_options()}


def _balance_report(router: SyntheticRouter, outcome: BalanceOutcome, x: torch.Tensor, params: SimParams,
                    loads: torch.Tensor, capped) -> BalanceReport | None:
    """Balancing's effect on the evaluation batch x [M, F]; None when it is off."""
    if params.balance == "none":
        return None
    before = _loads(router, x, None)
    return BalanceReport(
        method=params.balance,
        steps=outcome.steps,
        imbalance_before=_imbalance(before),
        imbalance_after=_imbalance(loads),
        drop_rate_before=_drop_rate(before, capped.capacity),
        drop_rate_after=int(capped.dropped) / max(int(loads.sum()), 1),
    )


def _identity_hits(topk_ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """[Z] int64: the slots of topk_ids [M, k] on identity expert E + j (ids E..E+Z-1); [0] without them."""
    ids = topk_ids.reshape(-1).long() - config.num_experts
    return torch.bincount(ids[(ids >= 0) & (ids < config.num_identity_experts)],
                          minlength=config.num_identity_experts)[:config.num_identity_experts]


def _balance(router: SyntheticRouter, params: SimParams) -> BalanceOutcome:
    if params.balance == "aux-loss":
        return train_aux_loss(router, params.aux_steps, params.seed)
    if params.balance == "bias":
        return update_bias(router, params.bias_batches, params.seed)
    return BalanceOutcome(router, None, 0)


def _loads(router: SyntheticRouter, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return expert_loads(router.route(x, bias).topk_ids, router.config.num_experts)  # [E]


def _imbalance(loads: torch.Tensor) -> float:
    return float(loads.max()) / float(loads.float().mean())


def _drop_rate(loads: torch.Tensor, capacity: int) -> float:
    """Fraction of assignments over capacity; the same count ``apply_capacity`` drops."""
    return float((loads - capacity).clamp(min=0).sum()) / float(loads.sum())


def touched_by_batch(outcome: BalanceOutcome, seed: int, batches=TOUCH_BATCHES) -> list[TouchPoint]:
    """Distinct experts touched by batches of each size, simulated with the run's router and predicted."""
    router, bias = outcome.router, outcome.correction_bias
    num_experts, top_k = router.config.num_experts, router.config.routed_slots_per_token  # k·E/(E + Z): k/(E + Z) each
    gen = streams.generator(seed, streams.TOUCH)
    points = []
    for batch in batches:
        trials = [int((_loads(router, draw_tokens(batch, router.width, gen), bias) > 0).sum())
                  for _ in range(TOUCH_TRIALS)]
        points.append(TouchPoint(batch, sum(trials) / len(trials), experts_touched(batch, num_experts, top_k)))
    return points
