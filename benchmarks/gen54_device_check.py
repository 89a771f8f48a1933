"""gen54: a served model's request threads on the GPU: several Python threads calling one model at once (one CUDA
stream, the default, shared by them), against the same calls made one after another.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/gen54_device_check.py --out $OUT/gen54 --deadline 70   # H100/H200
    PYTHONPATH=$PWD python3 benchmarks/gen54_device_check.py --smoke     # CPU (TRITON_INTERPRET=1): tiny shapes

Phases (each skipped past the deadline; <out>/gen54.json rewritten after each):
  kept     A bf16 ``MoE`` (Qwen3-like: K 512, N 256, E 32, top-2) on its decode fast path (``layer_fast``: kept calls by
           M, route workspace): THREADS threads each make CALLS calls at M = 1, 2, 4, 8 in turn; every output bit-equal
           to the sequential call on the same x (kept calls, route buffers and the experts' sequences are keyed by
           thread; nothing else may be shared). Then the same layer's calls under inference_mode, no_grad and
           grad-enabled interleaved at M = 1: the first two bit-equal, grad within bf16's tolerance.
  alternate Two threads calling the layer in strict turn at M = 1 (200 calls each): fast-path calls served (each
           thread's entry kept, by M and thread since session 54; by M alone none was) and host µs a call against one
           thread's calls.
  graphs   The same layer with ``eager_graph_rows=8`` (``eager_graphs``: a graph per stream, shared by the threads;
           copy, replay and clone under its lock since session 54): as ``kept``, outputs bit-equal to sequential.
  capture  One thread captures a new graph (the ``graphs`` layer's first call at M = 3) while another runs eager calls
           of a second layer: does either raise (torch's capture mode "global" forbids some calls in other threads)?
           Reported, not a default change.
  generate A tiny Qwen3-MoE built offline (random weights, bf16) swapped with ``use_moekit_blocks``: greedy
           ``generate`` of 4 prompts from 4 threads at once, each equal to its sequential run (and the sequential
           tokens to transformers' eager experts', logged); then the same model offloaded (``offload_experts``, 6
           slots of 16 experts x 2 layers: the cache's lock since session 54) from 4 threads against its sequential
           runs.
The table is printed last: each phase's calls and mismatches. On the CPU (--smoke) the Triton interpreter is not
thread-safe (its state is global: "x >= grid_dim[0]" from a second thread): the threads run the torch router and the
grouped_mm backend there, and the kept path one thread at a time.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases, smoke_mode  # noqa: E402

SMOKE = smoke_mode()  # before moekit imports its kernels

from moekit import MoE, MoEConfig, layer_fast  # noqa: E402

THREADS, CALLS, ROWS = 4, 6, (1, 2, 4, 8)
PHASES = ("kept", "alternate", "graphs", "capture", "generate")
NEEDS_S = {"generate": 12}
RUN = RunLog("gen54: threads on one model, outputs against the sequential calls", stall_s=40.0)
RESULT: dict = {}


def _device() -> torch.device:
    return torch.device("cpu" if SMOKE else "cuda")


def _layer(threads: bool = True, **kwargs) -> MoE:
    """The Qwen3-like layer (tiny in --smoke), seeded: two calls give the same weights. On the GPU the defaults (the
    fused router, the triton backend); in --smoke the torch router and grouped_mm for ``threads``, else the fused
    router and the triton backend, interpreted (one thread)."""
    k, n, e = (40, 24, 8) if SMOKE else (512, 256, 32)
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=k, moe_intermediate_size=n, num_experts=e, top_k=2)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    options = {} if not SMOKE else {"router": "torch", "backend": "grouped_mm"} if threads else {"router": "fused",
                                                                                                   "backend": "triton"}
    return MoE(cfg, dtype=dtype, device=_device(), **options, **kwargs).eval()


def _inputs(layer: MoE) -> dict:
    """M -> x [M, K] in the layer's dtype, seeded."""
    g = torch.Generator().manual_seed(1)
    w = layer.w13
    return {m: torch.randn(m, w.shape[2], generator=g).to(w.device, w.dtype) for m in ROWS}


def _threads_against_sequential(name: str, layer: MoE, threads: int = THREADS) -> None:
    """Each of ``threads`` threads calls ``layer`` CALLS x len(ROWS) times (rows in turn, offset by thread), no grad;
    every output compared with the sequential call's, bit for bit."""
    xs = _inputs(layer)
    with torch.no_grad():
        want = {m: layer(x).clone() for m, x in xs.items()}
        for m, x in xs.items():  # kept now (the fast path's second call of a kind)
            layer(x)
    bad, errors = [], []
    barrier = threading.Barrier(threads)

    def work(t: int) -> None:
        try:
            with torch.no_grad():
                barrier.wait()
                for c in range(CALLS * len(ROWS)):
                    m = ROWS[(t + c) % len(ROWS)]
                    if not torch.equal(layer(xs[m]), want[m]):
                        bad.append((t, m))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(f"{type(exc).__name__}: {str(exc)[-300:]}")

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if _device().type == "cuda":
        torch.cuda.synchronize()
    calls = threads * CALLS * len(ROWS)
    RUN.check(f"{name}: {threads} threads", not bad and not errors,
              f"{calls} calls, {len(bad)} differ, {len(errors)} raised {errors[:1]}")
    RESULT[name] = {"threads": threads, "calls": calls, "differ": len(bad), "raised": errors[:3]}
    RUN.summary.append(f"{name:10s} {threads} threads x {calls // threads} calls: {len(bad)} differ, "
                       f"{len(errors)} raised")


def phase_kept() -> None:
    layer = _layer()
    _threads_against_sequential("kept", layer)
    serial = _layer(threads=False)  # the fused router and triton backend (interpreted in --smoke): one thread
    x = _inputs(serial)[1]
    with torch.inference_mode():
        first = serial(x).clone()
        serial(x)  # kept under inference_mode
    with torch.no_grad():
        plain = serial(x)
    with torch.enable_grad():
        graded = serial(x)
    with torch.inference_mode():
        again = serial(x)
    tol = 1e-5 if SMOKE else 1e-2
    ok = torch.equal(first, plain) and torch.equal(first, again) and rel_l2(graded.detach(), first) < tol
    RUN.check("kept: inference_mode / no_grad / grad interleaved", ok,
              f"grad rel_l2 {rel_l2(graded.detach(), first):.1e}")


def _alternating(layer: MoE, x: torch.Tensor, calls: int) -> tuple[int, float]:
    """Two threads calling ``layer`` on x in strict turn (``calls`` each): (fast-path hits, host µs a call)."""
    served, real = [0], layer_fast.DecodeFast.__call__

    def counted(self, owner, x2d):
        out = real(self, owner, x2d)
        served[0] += out is not None
        return out

    turns, spent = [threading.Event(), threading.Event()], [0.0, 0.0]

    def work(me: int) -> None:
        with torch.no_grad():
            for _ in range(calls):
                turns[me].wait()
                turns[me].clear()
                t0 = time.perf_counter()
                layer(x)
                spent[me] += time.perf_counter() - t0
                turns[1 - me].set()

    layer_fast.DecodeFast.__call__ = counted
    try:
        pool = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in pool:
            thread.start()
        turns[0].set()
        for thread in pool:
            thread.join()
    finally:
        layer_fast.DecodeFast.__call__ = real
    return served[0], 1e6 * sum(spent) / (2 * calls)


def phase_alternate() -> None:
    """Two threads in turn at M = 1: each thread's entry kept (by M and thread since session 54: by M alone each call
    replaced the other's, 0 served); host µs a call against one thread's."""
    layer = _layer(threads=False)  # one thread at a time: the interpreter too
    x = _inputs(layer)[1]
    calls = 3 if SMOKE else 200
    with torch.no_grad():
        layer(x), layer(x)
        t0 = time.perf_counter()
        for _ in range(2 * calls):
            layer(x)
        alone = 1e6 * (time.perf_counter() - t0) / (2 * calls)
    served, turn_us = _alternating(layer, x, calls)
    RUN.check("alternate: two threads in turn, M = 1", served >= 2 * calls - 2, f"{served} of {2 * calls} served")
    RESULT["alternate"] = {"calls": 2 * calls, "served": served, "host_us_turns": turn_us, "host_us_alone": alone}
    RUN.summary.append(f"alternate  2 threads in turn: {served} of {2 * calls} served, host µs a call {turn_us:.1f} "
                       f"(one thread: {alone:.1f})")


def phase_graphs() -> None:
    if SMOKE:
        RUN.log("graphs: CUDA only (tests/test_eager_graphs.py holds the lock to account with a stand-in)")
        return
    _threads_against_sequential("graphs", _layer(eager_graph_rows=8))


def phase_capture() -> None:
    if SMOKE:
        RUN.log("capture: CUDA only")
        return
    graphs, other = _layer(eager_graph_rows=8), _layer()
    x3 = torch.randn(3, graphs.w13.shape[2], device="cuda", dtype=torch.bfloat16)
    xs = _inputs(other)
    errors, stop = [], threading.Event()

    def eager_loop() -> None:
        try:
            with torch.no_grad():
                while not stop.is_set():
                    for x in xs.values():
                        other(x)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"eager thread: {type(exc).__name__}: {str(exc)[-300:]}")

    thread = threading.Thread(target=eager_loop)
    thread.start()
    try:
        with torch.no_grad():
            out = graphs(x3)  # captures now
    except Exception as exc:  # noqa: BLE001
        errors.append(f"capturing thread: {type(exc).__name__}: {str(exc)[-300:]}")
        out = None
    stop.set()
    thread.join()
    torch.cuda.synchronize()
    with torch.no_grad():
        graphs.eager_graphs = None
        want = graphs(x3)
    ok = not errors and out is not None and rel_l2(out, want) < 1e-2
    RUN.check("capture: a capture beside another thread's eager calls", ok, "; ".join(errors)[:400])
    RESULT["capture"] = {"raised": errors}
    RUN.summary.append(f"capture    {'no error' if not errors else errors[0][:80]}")


def _tiny_qwen3():
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=16, num_experts_per_tok=2)
    torch.manual_seed(0)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()


def _generate_threads(name: str, model, prompts: list, want: list | None) -> None:
    def run(p):
        with torch.no_grad():
            return model.generate(p, max_new_tokens=12, do_sample=False, pad_token_id=0)

    sequential = [run(p) for p in prompts]
    same_as_eager = want is None or all(torch.equal(a, b) for a, b in zip(sequential, want))
    got, errors = [None] * len(prompts), []

    def work(i: int) -> None:
        try:
            got[i] = run(prompts[i])
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {str(exc)[-300:]}")

    pool = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    differ = sum(g is None or not torch.equal(g, s) for g, s in zip(got, sequential))
    RUN.check(f"generate: {name}, {len(prompts)} threads", not differ and not errors,
              f"{differ} differ from sequential, {len(errors)} raised {errors[:1]}")
    RUN.log(f"generate: {name}: sequential tokens == transformers' eager experts': {same_as_eager} (bf16 on the GPU: "
            "a near tie may break apart; not a thread's doing)")
    RESULT[f"generate_{name}"] = {"differ": differ, "raised": errors[:3], "same_as_eager": same_as_eager}
    RUN.summary.append(f"generate   {name}: {differ} of {len(prompts)} differ, {len(errors)} raised, "
                       f"sequential == eager {same_as_eager}")


def phase_generate() -> None:
    from moekit.hf import offload_experts, use_moekit_blocks

    dev = _device()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (b, 6 + i), generator=g).to(dev) for i, b in enumerate((1, 2, 3, 1))]
    eager = _tiny_qwen3().to(dev)
    eager.set_experts_implementation("eager")
    with torch.no_grad():
        want = [eager.generate(p, max_new_tokens=12, do_sample=False, pad_token_id=0) for p in prompts]
    swapped = _tiny_qwen3().to(dev)
    use_moekit_blocks(swapped, **({"backend": "grouped_mm"} if SMOKE else {}))
    _generate_threads("use_moekit_blocks", swapped, prompts, want)
    offloaded = _tiny_qwen3()
    expert_bytes = 3 * 64 * 32 * offloaded.dtype.itemsize
    offload_experts(offloaded, gpu_budget_bytes=6 * expert_bytes, device=dev, progress=False,
                    **({"backend": "grouped_mm"} if SMOKE else {}))
    _generate_threads("offload_experts", offloaded.to(dev), prompts, None)


def main() -> int:
    args = phase_args(__doc__, dict.fromkeys(PHASES), "gen54.json")
    if not SMOKE and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke on the CPU")
        return 2
    RESULT.update(run_info(), smoke=SMOKE)
    RUN.log(f"{run_info()}; threads {THREADS}, rows {ROWS}")
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    phases = {"kept": phase_kept, "alternate": phase_alternate, "graphs": phase_graphs, "capture": phase_capture,
              "generate": phase_generate}
    return run_phases(RUN, phases, args.phases, args.deadline, NEEDS_S, args.path, RESULT)


if __name__ == "__main__":
    sys.exit(main())
