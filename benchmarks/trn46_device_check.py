"""trn46's device check: ``EPMoE.sync_grads`` over NCCL (one GPU per rank) and ``moekit train --ep`` on CUDA.

    PYTHONPATH=$PWD python3 benchmarks/trn46_device_check.py --out DIR [--deadline 80]

Needs 2 GPUs for the two-rank checks (NCCL refuses two ranks on one GPU); on 1 GPU it runs one NCCL rank and says so;
without CUDA it runs the same code on 2 gloo CPU ranks (a smoke test). Correctness first (PASS / FAIL lines):

1. train: 3 AdamW steps of an ``EPMoE`` (float32, the device's default backend: Triton on CUDA) with EPLB replicas, a
   fused shared expert, the aux losses and the bias update, ``sync_grads`` after backward, against one ``MoE`` trained
   on the concatenated batches on the same GPU (every weight within 1e-4 relative L2: float32 Triton GEMMs, 3 steps);
2. curves: ``moekit train --ep W --device cuda`` against ``--ep 1`` (4 steps, tiny model): counts-based curves equal,
   loss within 1e-4.

Then times ``sync_grads`` (one flat all-reduce) against one all-reduce per replicated gradient (the loop
docs/parallel.md had) on 4 layers with DeepSeek-V3's replicated parts (gate [256, 7168], one fused shared slot, bf16
gradients), CUDA events, interleaved rounds, medians; a table last; JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _train_check(rank: int, world: int, device: torch.device) -> dict:
    """3 AdamW steps of EPMoE + sync_grads against one MoE on all the batches; max relative L2 over the weights."""
    from moekit import MoE, MoEConfig
    from moekit.balance import update_correction_bias_
    from moekit.parallel import EPMoE, Placement

    cfg = MoEConfig(hidden_size=256, moe_intermediate_size=128, num_experts=8, top_k=2, scoring="softmax",
                    renormalize=True, shared_expert_intermediate_size=128, use_correction_bias=True,
                    aux_loss_coef=1e-2, z_loss_coef=1e-3)
    slots = [[0, 1, 2, 3, 0], [4, 5, 6, 7, 0]] if world == 2 else [list(range(8)) + [0]]
    torch.manual_seed(0)
    single = MoE(cfg, device=device)
    ep = EPMoE.from_moe(single, placement=Placement(8, world, slots))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (single, ep)]
    g = torch.Generator(device="cpu").manual_seed(1)
    per = 64
    for _ in range(3):
        x = torch.randn(world * per, 256, generator=g).to(device)
        res = single(x, return_stats=True)
        task = sum((res.out[r * per:(r + 1) * per] ** 2).mean() for r in range(world)) / world
        (task + res.aux_loss).backward()
        opts[0].step()
        opts[0].zero_grad()
        update_correction_bias_(single, res.stats.choice_counts, rate=1e-3)
        mine = ep(x[rank * per:(rank + 1) * per], return_stats=True)
        ((mine.out ** 2).mean() + mine.aux_loss).backward()
        ep.sync_grads()
        opts[1].step()
        opts[1].zero_grad()
        update_correction_bias_(ep, mine.stats.choice_counts, rate=1e-3)
    local = ep.num_local_experts
    errors = [_rel(ep.w13[s], single.w13[e]) for s, e in enumerate(slots[rank])]
    errors += [_rel(ep.w2[s], single.w2[e]) for s, e in enumerate(slots[rank])]
    errors += [_rel(ep.w13[local:], single.w13[8:]), _rel(ep.gate.weight, single.gate.weight),
               _rel(ep.e_score_correction_bias, single.e_score_correction_bias)]
    return {"max_rel_l2": max(errors), "backend": ep.resolved_backend()}


def _time_sync(rank: int, device: torch.device, deadline: float) -> dict:
    """Median µs of sync_grads against one all_reduce per replicated gradient, 4 layers of DeepSeek-V3's parts."""
    from moekit.parallel.grad_sync import sync_grads

    k = 7168 if device.type == "cuda" else 448  # the CPU smoke: 1/16 of the widths
    layers = [(torch.zeros(256, k, dtype=torch.bfloat16, device=device),  # gate
               torch.zeros(1, 4096, k, dtype=torch.bfloat16, device=device),  # fused shared slot of w13
               torch.zeros(1, k, 2048, dtype=torch.bfloat16, device=device)) for _ in range(4)]
    params = [nn.Parameter(t) for layer in layers for t in layer]
    for p in params:
        p.grad = torch.randn_like(p)
    model = nn.Module()
    model.params = nn.ParameterList(params)
    fake = _FakeEP(model)

    def flat():
        sync_grads(fake)

    def per_tensor():
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())

    def flat_bf16():  # one flat all-reduce in the gradients' own dtype: is it the count or the bytes?
        buf = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(buf)
        buf.div_(dist.get_world_size())
        offset = 0
        for p in params:
            p.grad.copy_(buf[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    variants = (("flat", flat), ("per_tensor", per_tensor), ("flat_bf16", flat_bf16))
    times = {name: [] for name, _ in variants}
    for _, fn in variants:
        fn()  # warm-up
    while time.time() < deadline and len(times["flat"]) < 30:
        for name, fn in variants:  # interleaved rounds
            times[name].append(_timed(fn, device))
    return {name: statistics.median(v) for name, v in times.items() if v} | {"rounds": len(times["flat"])}


def _timed(fn, device: torch.device) -> float:
    """µs of one call: CUDA events on a GPU, the host clock on the CPU smoke."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


class _FakeEP(nn.Module):
    """A model whose one EPMoE has no routed slots of its own here: sync_grads's flat path on given gradients."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        from moekit import MoEConfig
        from moekit.parallel import EPMoE

        self.inner = inner
        self.ep = EPMoE(MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=dist.get_world_size(),
                                  top_k=1), device=inner.params[0].device)
        for p in self.ep.parameters():
            p.requires_grad_(False)


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60),
                            **({"device_id": device} if cuda else {}))
    try:
        out = {"train": _train_check(rank, world, device)}
        out["sync_us"] = _time_sync(rank, device, args.start + args.deadline - 10)
        queue.put((rank, out))
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        queue.put((rank, {"error": repr(err)}))
    finally:
        dist.destroy_process_group()


def _curves(world: int, out: Path, until: float) -> dict:
    """moekit train --ep world against --ep 1 on this device (4 steps, tiny)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["--steps", "4", "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--layers", "2", "--experts",
            "4", "--expert-size", "32", "--no-plot", "--device", device]
    docs = {}
    for ep in (1, world):
        subprocess.run([sys.executable, "-m", "moekit", "train", *argv, "--ep", str(ep), "--out", str(out / f"ep{ep}")],
                       check=True, timeout=max(5.0, until - time.time()), env=os.environ | {"PYTHONPATH": os.getcwd()})
        docs[ep] = json.loads((out / f"ep{ep}" / "train-curves.json").read_text())
    result = {}
    for m, run in docs[1]["runs"].items():
        other = docs[world]["runs"][m]
        result[m] = {"counts_equal": run["imbalance"] == other["imbalance"],
                     "loss_rel": max(abs(a - b) / abs(a) for a, b in zip(run["loss"], other["loss"]))}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--deadline", type=float, default=80.0)
    args = p.parse_args()
    args.start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    world = 2 if gpus >= 2 or not torch.cuda.is_available() else 1
    print(f"device: {torch.cuda.get_device_name(0) if gpus else 'cpu (gloo smoke)'}, {gpus} GPU(s), {world} rank(s), "
          f"torch {torch.__version__}")
    if world == 1:
        print("NOTE: one GPU: the train check runs one NCCL rank; the two-rank checks need 2 GPUs")
    doc = {"world": world, "gpus": gpus}
    if world > 1:  # correctness first: the command's curves (its own processes), then the ranks' checks and timing
        try:
            doc["curves"] = _curves(world, args.out, args.start + args.deadline - 25)
        except subprocess.SubprocessError as err:
            print(f"FAIL curves: {err}")
        for m, c in doc.get("curves", {}).items():
            ok = c["counts_equal"] and c["loss_rel"] < 1e-4
            print(f"{'PASS' if ok else 'FAIL'} curves {m}: counts equal {c['counts_equal']}, "
                  f"loss rel {c['loss_rel']:.1e}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=max(5.0, args.start + args.deadline - time.time())) for _ in procs)
    for proc in procs:
        proc.join(timeout=10)
    doc["ranks"] = results
    for r, res in sorted(results.items()):
        if "error" in res:
            print(f"FAIL rank {r}: {res['error']}")
            continue
        t = res["train"]
        print(f"{'PASS' if t['max_rel_l2'] < 1e-4 else 'FAIL'} train rank {r} ({t['backend']}): max rel L2 "
              f"{t['max_rel_l2']:.2e} after 3 AdamW steps (bound 1e-4)")
    (args.out / "trn46_device_check.json").write_text(json.dumps(doc, indent=1))
    print("| rank | sync_grads (flat, float32) µs | per-tensor all_reduce (bf16) µs | flat bf16 µs | rounds |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r, res in sorted(results.items()):
        s = res.get("sync_us")
        if s:
            print(f"| {r} | {s['flat']:.0f} | {s['per_tensor']:.0f} | {s['flat_bf16']:.0f} | {s['rounds']} |")


if __name__ == "__main__":
    main()
