"""``OffloadedMoE``: a ``MoE`` whose routed experts live in host memory behind a GPU expert cache.

    [Gate+Route] -> [Touched set: one device->host copy] -> [Hits | misses: fetch or CPU] -> [GPU experts
    through expert_map onto cache slots] (+ [CPU experts, added]) -> [Prefetch the next layer's predicted set]

The gate, the router's bias and the shared expert stay on the device; only routed experts are offloaded.
Each forward copies the batch's expert counts to the host once (the one sync; with ``prefetch="router"``
the next layer's predicted counts ride on the same copy), then:

- hits compute from their slots; misses are fetched into free or evicted slots on a side stream
  while the hits compute, then computed in a second experts call (``compute_misses_on="gpu"``), or
  computed on the CPU from the host weights while the GPU computes the rest (``"cpu"``), or split
  between the two by ``split.split_misses`` (``"auto"``: the cheapest split of the forward's whole miss
  set, priced by ``measure_costs``; the misses every split it may take fetches are issued before it
  searches); the partial outputs add in float32 (``plan`` decides, and the
  cache what-if replays the same decision); the CPU branch (``cpu_path``) stages its inputs through
  reused pinned buffers, queues this forward's admissions before it computes (they travel meanwhile),
  runs at the thread count and GEMM the costs were measured at, and records its phases (``last_cpu``);
- when the touched experts exceed the cache, the GPU side runs in rounds of at most C experts;
- afterwards the next layer's predicted experts (``link_layers``) are prefetched: ``"router"`` applies the next
  layer's router to this input, ``"previous"`` takes the set it touched last, ``None`` prefetches nothing.

Quantized experts (``moe.quant_scheme``) stay packed: the cache's slots read as a QuantizedWeight of C
experts, run as the plain quantized ``MoE`` runs them (Triton's fp8 / weight-only kernels through
``expert_map``); CPU misses dequantize only the missed experts. Expert biases travel with their experts.

The result equals the plain ``MoE``'s within the dtype's rounding (partial sums add in float32). Shapes:
M tokens, K hidden, N intermediate, E routed experts, C cache slots.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from moekit.experts import backend_available, backend_fn, bind_options, call_backend
from moekit.experts.grouped_mm import plan_grouped_mm
from moekit.layer import MoE
from moekit.layer_hash import HashMoE
from moekit.offload import calibrate
from moekit.offload.cache import ExpertCache
from moekit.offload.cost import MissCosts, one_call
from moekit.offload.cpu_direct import direct_share
from moekit.offload.cpu_path import CpuOptions, CpuPath, CpuPhases
from moekit.offload.forward_ops import expert_counts, sum_partials
from moekit.offload.layer_state import load_host_experts, save_host_experts
from moekit.offload.no_backward import no_backward
from moekit.offload.online import CpuRate
from moekit.offload.parts import ExpertWeights
from moekit.offload.plan import PLACES, MissPlan, Proofs, plan_forward
from moekit.offload.resident import copy_resident
from moekit.offload.slot_cap import cap_slots
from moekit.offload.stats import OffloadStats
from moekit.routing import Routing, route

MissPlace = Literal["gpu", "cpu", "auto"]
Prediction = Literal["router", "previous"]
_PREDICTIONS = ("router", "previous", None)


class OffloadedMoE(MoE):
    """A ``MoE`` with host-resident routed experts; build one with ``from_moe``. ``last_stats`` holds
    the ``OffloadStats`` of the latest forward, ``cache.stats`` the running total of every layer."""

    @classmethod
    def from_moe(
        cls,
        moe: MoE,
        *,
        cache_experts: int | None = None,
        cache: ExpertCache | None = None,
        policy: str = "lfu",
        prefetch: Prediction | None = "router",
        compute_misses_on: MissPlace = "gpu",
        costs: MissCosts | None = None,
        admit_per_forward: int | None = None,
        device: torch.device | str | None = None,
        cpu_options: CpuOptions | None = None,
        cpu_rate: CpuRate | None = None,
    ) -> "OffloadedMoE":
        """``moe``'s function with its routed experts moved to host memory (a ``HashMoE`` gives an
        ``OffloadedHashMoE``, called with ``token_ids`` as it is). Give ``cache_experts`` (a
        private cache of that many slots on ``device``, default ``moe``'s device, with ``policy``; capped at E with a
        warning) or a shared ``cache`` (then ``policy``/``device`` come from it). ``costs`` feeds ``"auto"``; measured
        on first use when None. Misses computed on the CPU are not fetched for this forward; the
        busiest of them are copied into the cache in the background (so the cache still learns the hot
        set): ``admit_per_forward`` of them, or with None as many as fit in the link's idle time during
        this forward's CPU work (at least one when nothing was fetched; one when no ``costs`` are
        known; ``plan.plan_misses``); 0 keeps the cache as it is. ``cpu_options`` (``cpu_path.CpuOptions``)
        sets how the CPU branch runs (threads, GEMM, staging buffers, when admissions are queued).
        ``cpu_rate`` (``online.CpuRate``, may be shared by layers): updated after each CPU branch, and
        "auto" prices the CPU side by the calibrated model scaled by its estimate (``MissCosts.scaled``)."""
        if (cache is None) == (cache_experts is None):
            raise ValueError("give exactly one of cache_experts (a private cache) and cache (a shared ExpertCache)")
        if compute_misses_on not in PLACES:
            raise ValueError(f"compute_misses_on must be one of {PLACES}, got {compute_misses_on!r}")
        if admit_per_forward is not None and (
            not isinstance(admit_per_forward, int) or isinstance(admit_per_forward, bool) or admit_per_forward < 0
        ):
            raise ValueError(f"admit_per_forward must be an int >= 0 or None, got {admit_per_forward!r}")
        if prefetch not in _PREDICTIONS:
            raise ValueError(f"prefetch must be one of {_PREDICTIONS}, got {prefetch!r}")
        if cpu_options is not None and not isinstance(cpu_options, CpuOptions):
            raise TypeError(f"cpu_options must be a moekit.offload.CpuOptions, got {type(cpu_options).__name__}")
        if cpu_rate is not None and not isinstance(cpu_rate, CpuRate):
            raise TypeError(f"cpu_rate must be a moekit.offload.CpuRate, got {type(cpu_rate).__name__}")
        layer_cls = _layer_class(cls, moe)
        if cache is None:  # capped at E: a private cache never holds another layer's experts
            slots = cap_slots(cache_experts, moe.config.num_experts, f"cache_experts={cache_experts}")
            cache = ExpertCache(slots, device=device or moe.w13.device, policy=policy)
        layer = layer_cls(moe.config, backend=moe.backend, backend_options=moe.backend_options, fuse_shared=False,
                    capacity_factor=moe.capacity_factor, drop_policy=moe.drop_policy, router=moe.router,
                    stats_block_size=moe.stats_block_size, num_local_experts=0, dtype=moe.w13.dtype,
                    device=cache.device)
        copy_resident(layer, moe)
        e = moe.config.num_experts
        routed = [_routed_rows(w, e) for w in (moe.w13, moe.w2, moe.b13, moe.b2)]  # packed when quantized
        layer.cache, layer.layer_id = cache, cache.register(*routed)
        layer.prefetch, layer.compute_misses_on, layer.costs = prefetch, compute_misses_on, costs
        layer.admit_per_forward, layer.cpu_rate = admit_per_forward, cpu_rate
        layer.last_stats, layer._last_touched, layer._next, layer._proofs = OffloadStats(), [], [], Proofs()
        layer._cpu = CpuPath(cpu_options or CpuOptions(), cache.device)
        return layer.train(moe.training)  # moe's mode (Phi-MoE's router refuses training: moe_from_hf sets it)

    def quantize_(self, scheme: str, **options) -> "OffloadedMoE":
        raise ValueError(f"OffloadedMoE.quantize_: its experts are its ExpertCache's as registered; quantize the "
                         f"MoE, then offload it: OffloadedMoE.from_moe(moe.quantize_({scheme!r}), ...)")

    def _apply(self, fn, recurse=True):
        """A cast of float experts is refused: it would not reach the cache's (the forward failed on the dtypes)."""
        host = self.cache.host(self.layer_id) if hasattr(self, "cache") else None
        dtype = host.w13_template.dtype if host is not None and host.scheme is None else None
        if dtype is not None and fn(torch.empty(0, dtype=dtype)).dtype != dtype:
            raise TypeError(f"OffloadedMoE: its experts are {dtype} in its ExpertCache, which a cast of the layer "
                            f"does not reach: offload a MoE of the dtype wanted")
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # the experts: the host store's (layer_state)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        save_host_experts(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        load_host_experts(self, state_dict, prefix, missing, errors)  # into the host store; slots dropped
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    _token_ids = None  # the latest forward's token ids [M]: a hash layer's (OffloadedHashMoE), None for top-k

    def predicted_ids(self, x2d: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor | None:
        """This layer's experts [M*k] predicted for the previous layer's input x2d [M, K]: its router applied to it
        (``token_ids``, that layer's, are for a hash layer's table: ``OffloadedHashMoE``)."""
        logits = self.gate(x2d if x2d.dtype == self.gate.weight.dtype else x2d.to(self.gate.weight.dtype))
        return route(logits, self.config, self.e_score_correction_bias).topk_ids.reshape(-1)

    @property
    def next_layer(self) -> "OffloadedMoE | None":
        return self._next[0] if self._next else None

    def run_routed(self, x2d: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x2d [M, K] and its routing -> [M, K], experts from the cache (and the CPU), under the cache's lock: two
        threads' forwards (a server's requests on one model) would share its slots' protection, one releasing experts
        the other still reads (evicted under it: wrong weights) or pinning them all ("no slot to fetch into", session
        54), and this layer's staging buffers and last stats."""
        with self.cache.lock:
            return self._run_routed(x2d, routing)

    def _run_routed(self, x2d: torch.Tensor, routing: Routing) -> torch.Tensor:
        cache, stats, e = self.cache, OffloadStats(), self.config.num_experts
        cache.begin_forward()
        cache.mark("start", self.layer_id)
        tokens, predicted = self._touched(x2d, routing)  # the one device -> host copy
        cache.mark("touched", self.layer_id)
        stats.touched = len(tokens)
        hits, misses = cache.lookup(self.layer_id, sorted(tokens), stats)
        split = self.costs is None or not one_call(len(hits), cache.expert_bytes, self.costs)
        issued, hits_map = [], []

        def issue(experts: list[int]) -> None:  # "auto"'s sure fetches, before its search; the hits' map first
            hits_map.extend([cache.slot_map(self.layer_id, hits, e)] if split and hits else [])
            issued.extend(cache.ensure_early(self.layer_id, experts, stats))

        plan = self._plan({m: tokens[m] for m in misses}, len(hits), self._place(x2d.shape[0]), issue)
        on_cpu, early = plan.cpu, self._cpu.options.admit_early
        if on_cpu:  # device -> host copies into kept pinned views, started before the GPU work is queued
            staged = self._cpu.stage([x2d, routing.topk_ids, routing.topk_weights])
        partials = self._gpu_experts(x2d, routing, hits, plan.fetch, stats, split, issued, (hits_map or [None])[0])
        if on_cpu:
            stats.cpu_experts, stats.cpu_tokens, stats.cpu_forwards = len(on_cpu), sum(tokens[m] for m in on_cpu), 1
            stats.cpu_rows = tuple(tokens[m] for m in on_cpu)
            if early:  # queued behind the fetches, the admissions travel while the CPU computes
                cache.admit(self.layer_id, plan.admit, stats)
            threads, gemm = self._cpu.setting(self.costs, cache.host(self.layer_id).scheme is not None)
            cache.mark("cpu_start", self.layer_id)
            partials.append(self._cpu.finish(staged, lambda inputs: self._cpu_experts(inputs, on_cpu, gemm),
                                             x2d.device, len(on_cpu), stats.cpu_tokens, threads))  # [M, K], x2d's dtype
            cache.mark("cpu_end", self.layer_id)
            if not early:
                cache.admit(self.layer_id, plan.admit, stats)
            if self.cpu_rate is not None and self.costs is not None:
                self.cpu_rate.update(self._cpu.last, self.costs, list(stats.cpu_rows))
        else:
            self._cpu.last = None
        out = sum_partials(partials, x2d)
        self._last_touched = sorted(tokens)
        self._prefetch_next(predicted, stats)
        self.last_stats = stats
        cache.stats.add(stats)
        cache.mark("end", self.layer_id)
        return no_backward(out)

    def _touched(self, x2d: torch.Tensor, routing: Routing) -> tuple[dict[int, int], list[int]]:
        """({expert: routed assignments} of this batch, the next layer's predicted experts)."""
        e = self.config.num_experts
        nxt = self.next_layer
        ids, bins = routing.topk_ids.reshape(-1), e + 2  # bins 1..E: this layer's experts (0: dropped)
        pred = None
        if nxt is not None and self.prefetch == "router" and x2d.shape[0]:
            pred = nxt.predicted_ids(x2d, self._token_ids)  # [M*k] or None
        if pred is not None:
            ids = torch.cat([ids, pred.to(ids.dtype) + (e + 2)])  # bins E+3..: the next layer's experts
            bins += nxt.config.num_experts + 1
        counts = expert_counts(ids, bins)  # [bins]
        self.cache.mark("counted", self.layer_id)
        host = [int(c) for c in counts.tolist()]  # the one device -> host copy
        tokens = {i: c for i, c in enumerate(host[1: e + 1]) if c}
        if nxt is None or self.prefetch is None:
            return tokens, []
        if self.prefetch == "previous":
            return tokens, list(nxt._last_touched)
        return tokens, [i for i, c in enumerate(host[e + 3: e + 3 + nxt.config.num_experts]) if c]

    def _cpu_experts(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], on_cpu: list[int],
                     gemm: str) -> torch.Tensor:
        """The ``on_cpu`` experts' share of the output, computed on the CPU from their home weights ("direct":
        ``cpu_direct``, no token layout; otherwise grouped_mm):
        float ones read in place through ``expert_map``; quantized ones selected first (their packed
        bytes copied) so the CPU backend dequantizes only those experts, not the whole layer."""
        host, e = self.cache.host(self.layer_id), self.config.num_experts
        if gemm == "direct":
            return direct_share(host, inputs, on_cpu, self.config.activation)
        cpu_map = torch.full((e,), -1, dtype=torch.int32)
        if host.scheme is None:
            cpu_map[on_cpu] = torch.tensor(on_cpu, dtype=torch.int32)
            w13, w2, b13, b2 = host.rebuild(host.parts)
        else:
            cpu_map[on_cpu] = torch.arange(len(on_cpu), dtype=torch.int32)
            w13, w2, b13, b2 = host.select(on_cpu)
        x, ids, weights = inputs
        return call_backend(_cpu_experts_fn(gemm), x, w13, w2, ids, weights, activation=self.config.activation,
                            expert_map=cpu_map, b13=b13, b2=b2)

    def _place(self, m: int) -> str:
        """The mode this forward of ``m`` tokens plans by: "gpu" for "auto" where no forward of m tokens can
        send a miss to the CPU (``cost.cpu_never_wins``, once per costs and m: ``plan.Proofs``), so it takes the gpu
        path itself, no per-forward pricing on the host's path (at M = 1 on the H200 its CPU side's least
        price is ~2x fetching all k experts); else ``compute_misses_on``."""
        if self.compute_misses_on != "auto" or self.costs is None:
            return self.compute_misses_on
        costs = self.costs if self.cpu_rate is None else self.cpu_rate.apply(self.costs)
        touched = min(m * self.config.top_k, self.config.num_experts)
        return "gpu" if self._proofs.never_wins(m, touched, self.cache.expert_bytes, costs.for_plan()) else "auto"

    def _plan(self, tokens: dict[int, int], hits: int, place: str, issue=None) -> MissPlan:
        """Where this forward's misses (``tokens``: expert -> assignments) go under ``place`` (``plan.plan_forward``,
        ``issue``: its early fetches); the costs are measured on first use when "auto" has none."""
        if place == "auto" and self.costs is None and tokens:
            self.costs = self.measure_costs()
        costs = self.costs if self.cpu_rate is None or self.costs is None else self.cpu_rate.apply(self.costs)
        return plan_forward(self.cache, self.layer_id, place, tokens, hits, self.cache.expert_bytes, costs,
                            self.admit_per_forward, issue)

    def measure_costs(self, tokens: int = 16, repeats: int = 3, rows: tuple[int, ...] | None = None,
                      batch: int = 1, warm: int | None = None) -> MissCosts:
        """This layer's miss costs, every term "auto" prices by, measured on its own paths
        (``calibrate.measure_costs``): the link, the GPU's read rate, the whole CPU branch on cold experts
        with the link busy, at ``rows`` rows an expert (the row counts the caller will see; None: 1, 2, 4
        and ``tokens``), and a second experts call and the least a forward with a fetch takes at ``batch``
        tokens a forward (``gpu_terms``, the benchmark's own path; on a probe cache of 2k slots). The CPU
        GEMM is run once at every row count up to ``warm`` first (None: the largest of ``rows``): give the
        most rows a CPU expert may get (M), so no forward pays oneDNN's first call at a new shape."""
        return calibrate.measure_costs(self, tokens, repeats, rows, batch=batch, warm=warm)

    @property
    def cpu_options(self) -> CpuOptions:
        return self._cpu.options

    @property
    def last_cpu(self) -> CpuPhases | None:
        """The latest forward's CPU branch in phases (``cpu_path.CpuPhases``); None when it ran none."""
        return self._cpu.last

    def _gpu_experts(self, x2d, routing, hits: list[int], fetch: list[int], stats: OffloadStats, split: bool,
                     issued: list[int], hits_map: torch.Tensor | None) -> list[torch.Tensor]:
        """The partial outputs [M, K] (x2d's dtype) of each compute group of ``cache.rounds``: the hits
        (computed while the misses' copies travel), the fetched misses, and further rounds when the
        touched experts exceed the cache; or hits and fetched misses in one call once the copies land,
        where the hits' reads cannot win back a second call (``cost.one_call``). The hits' expert_map is
        copied before the misses' copies (host-to-device copies run in issue order: after them it would
        hold the hits' compute); ``issued``: fetches already queued ("auto"'s early ones, after ``hits_map``)."""
        cache, e = self.cache, self.config.num_experts
        w13, w2, b13, b2 = cache.slot_weights
        if hits_map is None and split and hits and fetch:
            hits_map = cache.slot_map(self.layer_id, hits, e)
        partials, rest = [], [f for f in fetch if f not in set(issued)]
        for experts in cache.rounds(self.layer_id, hits, rest, stats, split, issued):
            if experts:
                if hits_map is not None and experts == hits:
                    expert_map, hits_map = hits_map, None
                else:
                    expert_map = cache.slot_map(self.layer_id, experts, e)
                group = "" if cache.trace is None else _group(experts, hits, fetch)
                cache.mark(f"call_start:{group}", self.layer_id)
                partials.append(call_backend(self._experts_fn, x2d, w13, w2, routing.topk_ids, routing.topk_weights,
                                             activation=self.config.activation, expert_map=expert_map, b13=b13, b2=b2))
                cache.mark(f"call_end:{group}", self.layer_id)
        return partials

    def _prefetch_next(self, predicted: list[int], stats: OffloadStats) -> None:
        nxt = self.next_layer
        if nxt is not None and predicted:
            nxt.cache.prefetch(nxt.layer_id, predicted, stats)

    def _layout_used(self, routing: Routing) -> str:
        """The layout of the latest forward (``routing``'s): the backend's own rule over the cache's C
        slots (the weights its GPU calls read, through ``expert_map``), and, when that forward computed
        misses on the CPU, the CPU call's grouping over the host weights."""
        w13, w2, _, _ = self.cache.slot_weights
        text = (f"{self._layout_for(routing, w13, w2)} over the expert cache ({self.cache.cache_experts} slots) via "
                f"expert_map")
        if not self.last_stats.cpu_experts:
            return text
        host = self.cache.host(self.layer_id)
        if host.scheme == "fp8_block" or not backend_available("grouped_mm", "cpu"):
            return f"{text}; CPU misses: per_expert_loop"  # moekit.quant's recipe loop / the reference backend
        w13h, w2h, _, _ = host.rebuild(host.parts)  # logical shapes and dtype, packed or not
        e, k = routing.topk_ids.shape
        plan = plan_grouped_mm(e, k, w13h.shape[0], w13h.shape[2], w2h.shape[2], w13h.dtype, allow_sync=True)
        return f"{text}; CPU misses: {plan.layout}"


def link_layers(layers: list[OffloadedMoE]) -> None:
    """Declare ``layers`` consecutive (each feeds the next), so each prefetches its successor's experts.
    They must share one ``ExpertCache``: the budget is the model's, not a layer's."""
    for layer in layers:
        if not isinstance(layer, OffloadedMoE):
            raise TypeError(f"layers must be OffloadedMoE, got {type(layer).__name__}")
        if layer.cache is not layers[0].cache:
            raise ValueError("layers must share one ExpertCache (pass cache= to from_moe)")
    for layer, nxt in zip(layers, layers[1:]):
        layer._next = [nxt]  # a list, not an attribute, so the successor is not registered as a submodule


def expert_nbytes(moe: MoE) -> int:
    """Bytes of one of ``moe``'s routed experts as an ``ExpertCache`` slot holds it (w13 + w2, + biases):
    packed bytes, scales and zero points included, for a quantized ``moe``. A byte budget // this is
    the cache size in experts."""
    e = moe.config.num_experts
    return ExpertWeights.of(*[_routed_rows(w, e) for w in (moe.w13, moe.w2, moe.b13, moe.b2)]).expert_bytes


@functools.cache
def _cpu_experts_fn(gemm: str):
    """The CPU experts function for misses: grouped_mm with ``cpu_gemm=gemm``: "onednn_fused", its
    per-expert oneDNN loop on the plain weights, or "mm_loop", torch's mm per expert. Its default also
    keeps oneDNN-packed copies of experts that get 4+ rows: a copy of the expert (host memory the
    offload exists to save) made in that first call, for experts that are cold by definition here."""
    if backend_available("grouped_mm", "cpu"):
        return bind_options(backend_fn("grouped_mm", "cpu"), {"cpu_gemm": gemm})
    return backend_fn("auto", "cpu")


def _group(experts: list[int], hits: list[int], fetch: list[int]) -> str:
    """A compute group's name in a trace: "hits" (cached experts only), "fetched" (this forward's
    fetches only) or "mixed" (both in one call, ``cost.one_call``, or a later round of a forward whose
    experts exceed the cache)."""
    if set(experts) <= set(hits):
        return "hits"
    return "fetched" if set(experts) <= set(fetch) else "mixed"


def _layer_class(cls: type, moe: MoE) -> type:
    """The class ``from_moe`` builds for ``moe``: ``cls``, or ``OffloadedHashMoE`` for a ``HashMoE`` (routed by its
    table, its experts offloaded); any other subclass of ``MoE`` is refused."""
    if type(moe) not in (MoE, HashMoE):
        raise TypeError(f"moe must be a plain moekit.MoE or a moekit.HashMoE, got {type(moe).__name__}")
    if isinstance(moe, HashMoE) and not issubclass(cls, HashMoE):
        from moekit.offload.layer_hash import OffloadedHashMoE  # a subclass of OffloadedMoE: imported here

        return OffloadedHashMoE
    return cls


def _routed_rows(w, num_experts: int):
    """The routed experts' rows [E, ...] of a weight, QuantizedWeight or bias (fused shared slots follow
    them); None stays None."""
    if w is None:
        return None
    return w[:num_experts] if isinstance(w, torch.Tensor) else w.select_experts(slice(0, num_experts))
