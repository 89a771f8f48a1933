"""``EPMoE``: one rank's part of an expert-parallel MoE layer.

    [Gate+Route, local tokens] -> [Dispatch: counts, payload all_to_all_single] -> [Local experts]
      -> [Combine: all_to_all_single, sum] (+ shared)

Shapes: M local tokens, K hidden, N expert intermediate, E logical routed experts (``num_experts``),
L physical experts on this rank (``num_local_experts``), S fused shared slots, W ranks, U rows received.

Every rank holds the gate (and the correction bias, and the shared expert) in full and only its own
experts' ``w13 [L(+S), 2N, K]`` / ``w2 [L(+S), K, N]``. A fused shared expert's S slots live on every
rank and serve that rank's own tokens, so its work never crosses the network.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from moekit.config import MoEConfig
from moekit.experts import autocast_input, call_backend
from moekit.func_ops import transforming
from moekit.layer import MoE, MoEOutput, RoutedTokens
from moekit.layer_hash import HashMoE
from moekit.layer_repr import routing_changes
from moekit.parallel.dispatch import (Dispatched, ReplicaTables, choose_replicas, combine, dispatch, dispatch_padded,
                                      plan_sends, weights_dtype)
from moekit.parallel.eplb import RebalanceReport, eplb_placement, load_lower_bound
from moekit.parallel.errors import CollectiveErrors, check_same_on_all_ranks, digest, dtype_name
from moekit.parallel.overlap import dispatch_starters, run_chunks
from moekit.parallel.placement import Placement, balancedness, contiguous_placement, rank_loads
from moekit.parallel.rows import tied_to_received
from moekit.parallel.training import EPTraining
from moekit.parallel.weights import move_experts, take_weights
from moekit.routing import Routing


class EPMoE(EPTraining, MoE):
    """An expert-parallel MoE layer over a ``torch.distributed`` process group (NCCL or gloo).

    A ``MoE`` whose experts-and-combine step (``run_routed``) dispatches rows to the ranks holding
    their experts: same forward signature and result. Each rank passes its own tokens and gets their
    outputs; ranks may pass different numbers of tokens, including none, but every rank of the group
    must call ``forward`` the same number of times (the collectives pair up).

    Errors are collective: a rank that fails before the dispatch (x of another dtype, device or hidden size than the
    weights, NaN logits on the CPU, more than C tokens, bad ``rebalance`` loads, ...) raises its own error and every
    other rank raises ``PeerRankError`` naming it, at once, with the group still in step. Cost: each forward checks,
    routes and (exact dispatch) plans and packs its sends locally, then does one small ``all_to_all_single`` (error flag
    and a signature of the payload row's dtype, K and k, which must match; the exact dispatch's row counts ride along)
    and reads it on the host; messages are exchanged only after an error (``moekit.parallel.errors``).

    Host synchronisation per forward: that one read (the agreement and, exact, the split sizes that
    ``all_to_all_single`` takes as Python ints) and the stats when ``return_stats=True``. With ``max_tokens_per_rank``
    set (every rank the same C; each forward passes at most C tokens) the dispatch is padded instead: C rows go to every
    rank whatever the routing and no counts are exchanged, so captured in a CUDA graph the forward makes no host sync;
    it pays W*C rows on the wire against the exact T (about the same when most tokens need most ranks, as DeepSeek-V3's
    top-8 of 256 does on 2 ranks; wasteful when ranks are many and tokens need few of them). Under capture the agreement
    is skipped and errors stay local; the contract: shapes, dtypes, devices and token counts are static in a graph and
    are agreed by the eager warm-up forward of the same shapes that precedes capture; value checks (NaN logits) are
    device asserts on a GPU, eager or captured, that abort the failing rank's CUDA context as in a single-device ``MoE``
    (the others then wait out the group's timeout). Construction and ``rebalance`` also sync; ``rebalance`` keeps the
    weights' storage when each rank keeps its slot count (``apply_placement``). Trains (``moekit.parallel.rows``): every
    rank calls ``backward`` as often as ``forward``, then ``sync_grads`` (every gradient averaged over the ranks, as
    DDP's; ``moekit.parallel.grad_sync``). The aux loss is this rank's part of the group's (``losses.Across``).

    Load for EPLB: with ``track_load`` (default) every forward adds its routed assignments per logical
    expert to ``expert_load`` (device op, no sync); ``rebalance`` sums them over ranks, computes an EPLB
    placement, moves the weights and resets the count.

    ``capacity_factor`` applies over each rank's local tokens (GShard's per-group capacity), so with
    dropping the result differs from a single-device ``MoE`` over all tokens; dropless (None) matches it.
    """

    def __init__(
        self,
        config: MoEConfig,
        placement: Placement | None = None,
        group: dist.ProcessGroup | None = None,
        *,
        timeout: timedelta | None = None,
        track_load: bool = True,
        max_tokens_per_rank: int | None = None,
        overlap: int = 1,
        **moe_kwargs,
    ) -> None:
        """``moe_kwargs`` are ``MoE``'s (backend, fuse_shared, capacity_factor, drop_policy, ...).
        ``overlap``: chunks of the micro-batch overlap (``moekit.parallel.overlap``); 1 = none."""
        if not isinstance(overlap, int) or isinstance(overlap, bool) or overlap < 1:
            raise ValueError(f"overlap must be an int >= 1 (chunks; 1 = no overlap), got {overlap!r}")
        if max_tokens_per_rank is not None and (
            not isinstance(max_tokens_per_rank, int) or isinstance(max_tokens_per_rank, bool) or max_tokens_per_rank < 1
        ):
            raise ValueError(f"max_tokens_per_rank must be a positive int or None, got {max_tokens_per_rank!r}")
        if isinstance(config, MoEConfig) and config.expert_bias:  # its shards and moves carry w13/w2 only
            raise ValueError("config.expert_bias: EPMoE does not shard or move expert biases yet (gpt-oss); use MoE")
        if isinstance(config, MoEConfig) and config.expert_weight_on == "input" and config.top_k > 1:
            raise ValueError(f"config.expert_weight_on='input' with top_k={config.top_k}: the input-weighted experts "
                             "run one dispatch a slot and EPMoE dispatches once a forward; top_k=1 (Llama-4's) or MoE")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("EPMoE needs torch.distributed initialised (init_process_group) before construction")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        placement = placement if placement is not None else contiguous_placement(config.num_experts, world_size)
        if placement.num_experts != config.num_experts or placement.world_size != world_size:
            raise ValueError(
                f"placement must place num_experts={config.num_experts} over world_size={world_size} ranks, got "
                f"num_experts={placement.num_experts}, world_size={placement.world_size}"
            )
        super().__init__(config, num_local_experts=placement.num_local_experts(rank), **moe_kwargs)
        self.group, self.rank, self.world_size = group, rank, world_size
        self.placement, self.timeout, self.track_load = placement, timeout, track_load
        self.max_tokens_per_rank, self.overlap = max_tokens_per_rank, overlap
        # expert_load[e]: routed assignments of this rank's tokens to logical expert e since the last rebalance.
        device = self.w13.device
        self.register_buffer("expert_load", torch.zeros(config.num_experts, dtype=torch.float64, device=device),
                             persistent=False)
        # Tables of width W (the most replicas any placement can have): a rebalance overwrites them in place.
        self._tables = ReplicaTables.build(placement, self.rank, self.num_shared_slots, device, width=world_size)
        self.graph_captured = False  # a forward ran under CUDA-graph capture: see apply_placement
        self._with_aux = False  # this forward returns the aux loss (and its collective): in the agreement
        self._errors = CollectiveErrors(group, timeout=timeout)  # one agreement per collective call
        check_same_on_all_ranks(self._fingerprint(), group)

    # ----- construction helpers -------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        """E: logical routed experts of the whole layer."""
        return self.config.num_experts

    @property
    def num_local_experts(self) -> int:
        """L: physical routed experts on this rank (replicas included, fused shared slots excluded)."""
        return self.placement.num_local_experts(self.rank)

    @property
    def replica_tables(self) -> ReplicaTables:
        """The device tables the dispatch turns logical experts into (rank, local slot) with."""
        return self._tables

    @property
    def _counts_chunks(self) -> int:
        """Chunks of row counts the forward's error agreement carries: the exact dispatch's (0 when padded)."""
        return self.overlap if self.max_tokens_per_rank is None else 0

    @property
    def num_shared_slots(self) -> int:
        return self.config.num_shared_slots if self.fuse_shared else 0

    @classmethod
    def from_moe(
        cls, moe: MoE, placement: Placement | None = None, group: dist.ProcessGroup | None = None, **kwargs
    ) -> "EPMoE":
        """This rank's ``EPMoE`` from a full ``MoE`` (same weights on every rank): the gate, bias and
        shared expert are copied, the routed experts sliced by ``placement`` (contiguous by default). A ``HashMoE``
        gives an ``EPHashMoE`` (its table copied: replicated, checked equal on every rank).
        ``kwargs`` override the settings taken from ``moe`` (backend, timeout, track_load...)."""
        settings = dict(
            backend=moe.backend, backend_options=moe.backend_options, router=moe.router,
            fuse_shared=moe.fuse_shared, capacity_factor=moe.capacity_factor,
            drop_policy=moe.drop_policy, stats_block_size=moe.stats_block_size,
            dtype=moe.w13.dtype, device=moe.w13.device,
        )
        settings.update(kwargs)
        if isinstance(moe, HashMoE) and not issubclass(cls, HashMoE):  # routed by its table on every rank
            from moekit.parallel.layer_hash import EPHashMoE  # a subclass of this one: imported here

            cls = EPHashMoE
        ep = cls(moe.config, placement, group, **settings)
        take_weights(ep, moe)
        ep.verify_replicated()
        return ep.train(moe.training)  # moe's mode (Phi-MoE's router refuses training: moe_from_hf sets it)

    def verify_replicated(self) -> None:
        """Raise a clear ValueError on every rank unless the weights every rank holds in full (gate and its bias,
        correction bias, shared expert and fused shared slots) are bit-identical across the group.
        Collective; copies those weights to the host once to hash them."""
        replicated = {
            "gate": self.gate.weight, "gate_bias": self.gate.bias, "shared_w13": self.shared_w13,
            "e_score_correction_bias": self.e_score_correction_bias, "shared_w2": self.shared_w2,
            "shared_gate": None if self.shared_gate is None else self.shared_gate.weight,
            "fused_shared_w13": self.w13[self.num_local_experts :],
            "fused_shared_w2": self.w2[self.num_local_experts :], "tid2eid": self._buffers.get("tid2eid"),
        }
        digests = {name: digest(t) for name, t in replicated.items() if t is not None}
        check_same_on_all_ranks(digests, self.group, what="replicated weights (sha256)")

    def load_experts(self, expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill this rank's slots from ``expert_weights(e) -> (w13 [2N, K], w2 [K, N])`` (e.g. read from a
        checkpoint), without materialising the other ranks' experts. ``e`` runs over the logical experts
        this rank holds, then E..E+S-1 for the fused shared slots (``MoE.w13``'s numbering)."""
        experts = self.placement.slots[self.rank] + list(range(self.num_experts,
                                                               self.num_experts + self.num_shared_slots))
        with torch.no_grad():
            for local, expert in enumerate(experts):
                w13, w2 = expert_weights(expert)
                self.w13[local].copy_(w13)
                self.w2[local].copy_(w2)

    def _fingerprint(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "placement": self.placement.to_dict(),
                "fuse_shared": self.fuse_shared, "capacity_factor": self.capacity_factor,
                "drop_policy": self.drop_policy, "dtype": str(self.w13.dtype), "world_size": self.world_size,
                "max_tokens_per_rank": self.max_tokens_per_rank, "overlap": self.overlap}

    # ----- forward --------------------------------------------------------------------------------

    def route_tokens(self, x2d: torch.Tensor) -> RoutedTokens:
        """``MoE.route_tokens`` on this rank's tokens, counting the routed load for EPLB."""
        routed = super().route_tokens(x2d)
        if self.track_load:
            self._accumulate_load(routed.routing.topk_ids)  # shared slots (ids >= E) are not counted
        return routed

    def dispatch(self, x2d: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Dispatched:
        """Exact: plan (replica choice, no sync), exchange counts (the one host sync), send the payload.
        Padded (``max_tokens_per_rank`` set): replica choice, then max_tokens_per_rank rows to every rank."""
        if self.max_tokens_per_rank is not None:
            chosen = choose_replicas(topk_ids, self._tables, self.rank)
            return dispatch_padded(x2d, topk_weights, chosen, self.max_tokens_per_rank, self.group)
        return dispatch(x2d, topk_weights, plan_sends(topk_ids, self._tables, self.rank, self.world_size), self.group,
                        self.timeout)

    def run_local_experts(self, sent: Dispatched) -> torch.Tensor:
        """The received rows through this rank's experts: [U, K], each row its slots' weighted sum."""
        return tied_to_received(call_backend(self._experts_fn, sent.x, self.w13, self.w2, sent.local_ids, sent.weights,
                                          activation=self.config.activation), sent.x, sent.weights,
                                (self.w13, self.w2))  # [U, K]

    def combine(self, y: torch.Tensor, sent: Dispatched) -> torch.Tensor:
        return combine(y, sent, self.group)

    def forward_routed(self, x2d: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Experts only, for a routing computed elsewhere: x2d [M, K], topk_ids [M, k] (logical ids; -1 or
        >= E + S means skip), topk_weights [M, k] -> [M, K]. Collective; a per-rank error raises on
        every rank (the agreement is here, after every local check and before the dispatch)."""
        with self._errors.on(self.w13.device, self._counts_chunks) as errors:
            self._check_x(x2d)
            if x2d.dim() != 2 or x2d.shape[1] != self.config.hidden_size:
                raise ValueError(f"x2d must have shape [M, hidden_size={self.config.hidden_size}], got "
                                 f"{tuple(x2d.shape)}")
            if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x2d.shape[0]:
                raise ValueError(
                    f"topk_ids and topk_weights must both have shape [M={x2d.shape[0]}, k], got "
                    f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
                )
            if self.max_tokens_per_rank is not None and x2d.shape[0] > self.max_tokens_per_rank:
                raise ValueError(
                    f"x must have at most max_tokens_per_rank={self.max_tokens_per_rank} tokens on each rank, got "
                    f"{x2d.shape[0]}"
                )
            # The payload row (K values of x's dtype, k ids, k weights) must be the same on every rank.
            row = (f"x {dtype_name(x2d.dtype)}, hidden {x2d.shape[1]}, {topk_ids.shape[1]} slots per token, "
                   f"weights {dtype_name(weights_dtype(topk_weights))}, aux {self._with_aux}")
            agree = lambda counts=None: errors.agree(row, what="the dispatch payload row", counts=counts)  # noqa: E731
            return run_chunks(self, dispatch_starters(self, x2d, topk_ids, topk_weights, agree))

    def run_routed(self, x2d: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.forward_routed(x2d, routing.topk_ids, routing.topk_weights)

    def forward(self, x: torch.Tensor, return_stats: bool = False,
                return_aux_loss: bool = False) -> torch.Tensor | MoEOutput:
        """x [..., K] (this rank's tokens) -> [..., K]; collective, see the class docstring; aux_loss: this rank's."""
        return self._collective(x, return_stats or return_aux_loss,
                                lambda: MoE.forward(self, x, return_stats, return_aux_loss))

    def _collective(self, x: torch.Tensor, with_aux: bool, call: Callable[[], torch.Tensor | MoEOutput]):
        """``call()`` (the layer's forward of this rank's x) with x checked and every error before the dispatch
        agreed over the group; ``with_aux``: the forward's all_reduce of its stats / aux loss follows the combine."""
        if transforming():  # before any collective: the load counts add in place, the collectives need storage
            raise NotImplementedError("EPMoE does not run under torch.func transforms (grad, vjp, jvp, vmap)")
        with self._errors.on(self.w13.device, self._counts_chunks) as errors:  # checks, routing raise: agreed there
            self.graph_captured |= errors.capturing
            self._check_x(x)
            self._with_aux = with_aux
            try:
                return call()
            finally:
                self._with_aux = False

    def _check_x(self, x: torch.Tensor) -> None:
        """Host-side checks of this rank's tokens (no sync): the payload carries x in the experts' dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != self.w13.dtype and not autocast_input(x):
            raise ValueError(f"x must be {dtype_name(self.w13.dtype)} like the layer's weights, got "
                             f"{dtype_name(x.dtype)}")
        if x.device != self.w13.device:
            raise ValueError(f"x must be on {self.w13.device} like the layer's weights, got {x.device}")

    def _accumulate_load(self, topk_ids: torch.Tensor) -> None:
        num_experts = self.config.num_experts
        ids = topk_ids.reshape(-1).long()
        key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # E = not routed
        counts = torch.zeros(num_experts + 1, dtype=torch.float64, device=ids.device)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.float64))
        self.expert_load += counts[:num_experts]

    # ----- EPLB -----------------------------------------------------------------------------------

    def global_expert_load(self) -> torch.Tensor:
        """[E] float64: ``expert_load`` summed over the group (and ``dp_group``: ``batch_total``). Collective."""
        return self.batch_total(self.expert_load)

    def rebalance(self, num_redundant: int = 0, loads=None) -> RebalanceReport:
        """EPLB: sum the tracked load over ranks (or take ``loads`` [E], rank 0's counts), compute a
        placement with ``num_redundant`` replica slots, move the weights and reset ``expert_load``.

        The placement is computed on the group's rank 0 and broadcast, so every rank applies the very
        same one; it replaces the current placement only when it lowers the maximum rank load.
        Collective, and syncs with the host (the loads and the placement travel as Python objects).
        """
        with self._errors.on(self.w13.device) as errors:  # a bad ``loads`` on one rank raises on every rank
            given = None if loads is None else torch.as_tensor(loads, dtype=torch.float64).tolist()
            if given is not None and len(given) != self.num_experts:
                raise ValueError(f"loads must have num_experts={self.num_experts} entries, got {len(given)}")
            errors.agree(f"loads {'passed' if loads is not None else 'tracked'}",
                         what="where rebalance's loads come from")
        values = self.global_expert_load().tolist() if given is None else given
        with self._errors.on(self.w13.device) as errors:  # so does EPLB failing on rank 0 (e.g. a bad num_redundant)
            box = [None, None]
            if self.rank == 0:
                box = [values, eplb_placement(values, self.world_size, num_redundant, current=self.placement)]
            errors.agree()
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group or dist.group.WORLD, 0), group=self.group)
        values, new = box
        before, after = rank_loads(self.placement, values), rank_loads(new, values)
        received = self.apply_placement(new) if new != self.placement else 0
        self.expert_load.zero_()
        return RebalanceReport(
            loads=values,
            balancedness_before=balancedness(before),
            balancedness_after=balancedness(after),
            max_load_before=max(before),
            max_load_after=max(after),
            lower_bound=load_lower_bound(values, self.world_size, new.num_redundant),
            slots_received=received,
            placement=new,
        )

    def apply_placement(self, placement: Placement) -> int:
        """Move expert weights between ranks so this rank holds ``placement.slots[rank]``; returns the
        slots received over the network. Collective; every rank passes the same placement (checked).

        In place when this rank keeps its slot count (always with EPLB when E + R is a multiple of W) and no expert
        has more replicas than the tables hold (W, or the most a placement applied before had: EPLB may double an
        expert on a rank): weights and replica tables are copied into their storage, so a CUDA graph captured before
        replays the new placement. Otherwise they are reallocated, which is refused on every rank once a forward ran
        under capture (``graph_captured``; reset it after dropping the graphs)."""
        with self._errors.on(self.w13.device) as errors:
            if placement.num_experts != self.num_experts or placement.world_size != self.world_size:
                raise ValueError(
                    f"placement must place num_experts={self.num_experts} over world_size={self.world_size}, got "
                    f"{placement.num_experts} over {placement.world_size}"
                )
            num_local = placement.num_local_experts(self.rank)
            tables = ReplicaTables.build(placement, self.rank, self.num_shared_slots, self.w13.device,
                                         width=self._tables.rank_of.shape[1])
            in_place = num_local == self.num_local_experts and tables.rank_of.shape == self._tables.rank_of.shape
            if not in_place and self.graph_captured:
                raise ValueError(
                    f"the placement changes this rank's expert slots from {self.num_local_experts} to {num_local} "
                    f"or an expert's replicas to {tables.rank_of.shape[1]} (> {self._tables.rank_of.shape[1]}), "
                    "which reallocates w13/w2 or the replica tables under a captured CUDA graph (see apply_placement)")
            errors.agree(json.dumps(placement.to_dict()), what="the placement to apply")
        with torch.no_grad():
            w13 = move_experts(self.w13.data, self.placement, placement, self.rank, self.group)
            w2 = move_experts(self.w2.data, self.placement, placement, self.rank, self.group)
        if num_local == self.num_local_experts:  # same shapes: copy into the same storage
            with torch.no_grad():
                self.w13.copy_(w13.weight)
                self.w2.copy_(w2.weight)
        else:
            self.w13 = nn.Parameter(w13.weight, requires_grad=self.w13.requires_grad)
            self.w2 = nn.Parameter(w2.weight, requires_grad=self.w2.requires_grad)
        if in_place:
            for name in ("num_replicas", "rank_of", "local_of", "lookup"):
                getattr(self._tables, name).copy_(getattr(tables, name))
            # A graph captured before keeps the replica choice it captured (or its absence): either way
            # every slot goes to a rank holding its expert (replica 0 always exists), only the spread differs.
            self._tables.replicated = tables.replicated
        else:
            self._tables = tables
        self.placement = placement
        return w13.received

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"rank={self.rank}/{self.world_size}, E={c.num_experts}, local={self.num_local_experts}, k={c.top_k}, "
            f"K={c.hidden_size}, N={c.moe_intermediate_size}, scoring={c.scoring}{routing_changes(c)}, "
            f"shared_slots={self.num_shared_slots}, "
            f"backend={self.backend}"
        )
