"""The EP benchmark entry runs end to end on 2 gloo ranks with tiny fp32 shapes (a smoke test: the
numbers on CI's CPU mean nothing; the GPU run is ``torchrun --nproc-per-node 2 -m moekit.bench.ep``)."""

from __future__ import annotations

import argparse

import torch

from _parallel_harness import run_ranks


def _bench(rank: int, world_size: int) -> dict:
    from moekit.bench import ep

    args = argparse.Namespace(tiny=True, check=True, tokens=[0, 8], backend="auto", reps=2, out=None, dispatch="both",
                              profile=False, overlap=[1, 2])
    return ep.run(torch.device("cpu"), rank, world_size, args)


def test_bench_entry_runs_on_two_ranks():
    doc = run_ranks(_bench, 2, timeout_s=120)[0]
    assert doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert max(doc["check_rel_err"].values()) < 1e-5
    assert [(row["dispatch"], row["M"], row["overlap"]) for row in doc["rows"]] == [
        (d, m, c) for d in ("exact", "padded") for m in (0, 8) for c in (1, 2)]
    for row in doc["rows"]:
        for key in ("dispatch_us", "experts_us", "combine_us", "layer_us", "raw_dispatch_us", "single_gpu_us"):
            assert row[key] >= 0, key
        if row["overlap"] > 1:
            assert row["overlap_goal_us"] == 1.05 * max(row["experts_us"], row["raw_dispatch_us"] + row["raw_combine_us"])
