"""``moekit train --ep N``: the three runs with every MoE layer expert-parallel over N processes.

    parent: spawn N ranks (free loopback port) -> rank 0's step reports and result through a queue -> on_step, curves
    rank r: init_process_group (gloo on the CPU, NCCL with GPU r) -> train_side_by_side(share=RankShare)

Each rank builds the same model (the same seed), turns its MoE layers into ``EPMoE`` (contiguous placement: rank r
holds experts [r*E/N, (r+1)*E/N); with ``--spare-slots S --rebalance-every K`` EPLB's placement with S replicas,
rebalanced every K steps: ``moekit.train.ep_balance``), draws the same batch and runs sequences [r*B/N, (r+1)*B/N) of
it; after backward ``moekit.parallel.sync_grads`` averages every gradient over the ranks (one flat all-reduce for the
model's replicated weights), and the step's loss, drops and expert counts are summed over the ranks (one small
all-reduce), so rank 0 reports the whole batch's curves. No torchrun: the processes are ``torch.multiprocessing``
spawns of this module.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.train.data import ByteCorpus
from moekit.train.loop import Share, StepReport, TrainResult, TrainSettings, train_side_by_side
from moekit.train.model import TinyMoELM

POLL_S = 1.0  # the parent checks for dead ranks this often while it waits for a report


@dataclass
class RankShare(Share):
    """This rank's part of an expert-parallel run (``moekit.train.loop.Share``'s methods across the ranks)."""

    rank: int
    world_size: int
    spare_slots: int = 0  # TrainSettings': EPLB's replica slots per layer
    rebalance_every: int = 0  # TrainSettings': steps between rebalances (0: none)

    def parallel(self, model: TinyMoELM) -> TinyMoELM:
        from moekit.parallel import EPMoE
        from moekit.train.ep_balance import initial_placement

        for block in model.blocks:  # the gate and the rest replicated
            placement = initial_placement(block.moe.config.num_experts, self.world_size, self.spare_slots)
            block.moe = EPMoE.from_moe(block.moe, placement=placement)
        return model

    def after_step(self, model: TinyMoELM, optimizer: torch.optim.Optimizer, step: int) -> None:
        if self.rebalance_every and step % self.rebalance_every == 0:
            from moekit.train.ep_balance import rebalance_

            rebalance_(model, optimizer, self.spare_slots)

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        size = batch.shape[0] // self.world_size  # TrainSettings checks that it divides
        return batch[self.rank * size: (self.rank + 1) * size]  # [B/N, T]

    def sync_grads(self, model: TinyMoELM) -> None:
        from moekit.parallel import sync_grads

        sync_grads(model)

    def totals(self, values: torch.Tensor) -> torch.Tensor:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        total = values.to(device, copy=True)
        dist.all_reduce(total)
        total[0] /= self.world_size  # equal shares: the mean of the ranks' mean losses is the batch's
        return total.cpu()


def check_ranks(settings: TrainSettings) -> None:
    """Refuse, naming ``ep``, what the ranks cannot run: on CUDA one GPU per rank, rank r on GPU r."""
    if not settings.device.startswith("cuda"):
        return
    if settings.device != "cuda":
        raise ValueError(f"ep={settings.ep} puts rank r on GPU r: give the device as cuda, got {settings.device}")
    if torch.cuda.device_count() < settings.ep:
        raise ValueError(f"ep={settings.ep} runs one process per GPU: {torch.cuda.device_count()} GPU(s) visible")


def train_expert_parallel(settings: TrainSettings, corpus: ByteCorpus,
                          on_step: Callable[[StepReport], None] | None = None) -> TrainResult:
    """``train_side_by_side`` over ``settings.ep`` spawned ranks; ``on_step`` runs here with rank 0's reports."""
    check_ranks(settings)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    port, threads = _free_port(), max(1, torch.get_num_threads() // settings.ep)
    ranks = [ctx.Process(target=_rank_main, args=(rank, settings, corpus, port, threads, reports), daemon=True)
             for rank in range(settings.ep)]
    for p in ranks:
        p.start()
    try:
        return _follow(ranks, reports, on_step)
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _follow(ranks, reports, on_step) -> TrainResult:
    """Rank 0's step reports to ``on_step`` until its result comes; a rank's error or death raises here."""
    while True:
        try:
            kind, rank, value = reports.get(timeout=POLL_S)
        except queue.Empty:
            dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"moekit train --ep: rank(s) {dead} exited with codes "
                                   f"{[ranks[r].exitcode for r in dead]} without a result") from None
            continue
        if kind == "error":
            raise RuntimeError(f"moekit train --ep: rank {rank} failed:\n{value}")
        if kind == "step" and on_step is not None:
            on_step(value)
        if kind == "done":
            return value


def _rank_main(rank: int, settings: TrainSettings, corpus: ByteCorpus, port: int, threads: int, reports) -> None:
    """One rank: its process group, the three runs on its share, rank 0's reports and result to the parent."""
    torch.set_num_threads(threads)  # the ranks share the machine's cores
    cuda = settings.device.startswith("cuda")
    if not cuda and sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, whatever the hostname resolves to
    try:
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=settings.ep, timeout=timedelta(minutes=10),
                                **({"device_id": torch.device("cuda", rank)} if cuda else {}))
        on_step = (lambda report: reports.put(("step", rank, report))) if rank == 0 else None
        result = train_side_by_side(replace(settings, device=f"cuda:{rank}" if cuda else settings.device), corpus,
                                    on_step, RankShare(rank, settings.ep, settings.spare_slots,
                                                       settings.rebalance_every))
        if rank == 0:
            reports.put(("done", rank, TrainResult(settings, result.curves)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        reports.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
