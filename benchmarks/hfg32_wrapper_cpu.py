"""The Python of transformers' path into moekit at decode (M = 1), on the CPU: a tiny Qwen3-MoE model on the
"moekit" experts implementation with the triton backend under Triton's interpreter, its calls kept by the fast path
(``triton_fast``) and the launches stubbed (``launch_lean`` returns its fresh ``out`` without launching), so what is
timed is every per-call Python step from transformers' experts ``forward`` down to the launch, layer by layer:

    module(x, ids, w)          transformers' wrapper: ``get_interface`` by the config's name, then ours
    moekit_experts_forward     the plan, the weights' attributes, ``backend_fn``, the compile test, ``call_backend``
                               ("with a cache": the module's own ``ExpertsCallCache``, the check once per weight set)
    call_backend               ``check_experts_args``, ``call_checked_backend``, the backend function
    experts_triton_unchecked   ``_run_kept``: the Gluon choice's size test, ``run_fast``
    run_fast                   the kept entry's lookup, ``empty_like``, the (stubbed) launch

    flock /work/wt/cpubench.lock env PYTHONPATH=$PWD python3 benchmarks/hfg32_wrapper_cpu.py [--calls 3000]

Interleaved rounds (5, the order turned each round), µs a call (medians), the load average, then a cProfile of the
wrapper's calls. The shapes do not matter to the Python (tiny widths); the CPU is this machine's.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402

import moekit.experts as experts  # noqa: E402
import moekit.hf as mh  # noqa: E402


def tiny_model():
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=16, num_experts_per_tok=4)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16)
    model.set_experts_implementation("moekit")
    return model


def captured_call(model):
    """(experts module, x [1, K], ids [1, k], weights [1, k]) as transformers passes them at decode."""
    module, seen = model.model.layers[0].mlp.experts, []
    handle = module.register_forward_pre_hook(lambda m, args: seen.append(args))
    with torch.no_grad():
        model.generate(torch.randint(0, 97, (1, 8)), max_new_tokens=4, do_sample=False, pad_token_id=0,
                       disable_compile=True)
    handle.remove()
    return (module, *seen[-1])


def cached_forward(module, x, ids, w):
    """``moekit_experts_forward`` (an untransposed, bias-free fused plan) with the module's own ``ExpertsCallCache``
    in place of ``call_backend``: the fast path first, the check once per weight set."""
    plan = getattr(module, mh.PLAN_ATTR, None)
    calls = module.__dict__.get("_hfg32_calls")
    if calls is None:
        calls = module.__dict__["_hfg32_calls"] = experts.ExpertsCallCache()
    fn = experts.backend_fn(mh.HF_BACKEND, x.device)
    torch.compiler.is_compiling()
    return calls(fn, x, getattr(module, plan.up_name), module.down_proj, ids, w, activation=plan.activation)


def variants(module, x, ids, w) -> dict:
    import moekit.experts.triton as tri

    fn = experts.backend_fn(mh.HF_BACKEND, x.device)
    act = module.__dict__[mh.PLAN_ATTR].activation
    w13, w2 = module.gate_up_proj, module.down_proj
    fast = experts.fast_path_of(fn)
    return {
        "module(x, ids, w)": lambda: module(x, ids, w),
        "moekit_experts_forward": lambda: mh.moekit_experts_forward(module, x, ids, w),
        "  with a cache": lambda: cached_forward(module, x, ids, w),
        "call_backend": lambda: experts.call_backend(fn, x, w13, w2, ids, w, activation=act),
        "experts_triton_unchecked": lambda: tri.experts_triton_unchecked(x, w13, w2, ids, w, activation=act),
        "run_fast (the fast path)": lambda: fast(x, w13, w2, ids, w, act),
        "check_experts_args": lambda: experts.check_experts_args(x, w13, w2, ids, w, activation=act),
    }


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    mh.HF_BACKEND = "triton"  # the CUDA default's backend, interpreted
    experts._RESOLVED.clear()
    model = tiny_model()
    module, x, ids, w = captured_call(model)
    import moekit.experts.triton_fast as tf

    stubbed = []
    tf.launch_lean = lambda sequence, x, *rest, **kw: stubbed.append(1) or torch.empty_like(x)
    tf.READ_ONCE = False  # the stub takes the tensors (the addressed launch is the device's)
    fns = variants(module, x, ids, w)
    with torch.no_grad():
        for fn in fns.values():
            fn()
        assert stubbed, "the fast path did not serve the call"
        names, rounds = list(fns), {n: [] for n in fns}
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                rounds[n].append(per_call_us(fns[n], args.calls))
        print(f"load average {os.getloadavg()}; torch {torch.__version__}, transformers {transformers.__version__}")
        print(f"{'call':<28} {'µs a call (median of ' + str(args.rounds) + ')':>26}  rounds")
        for n in names:
            print(f"{n:<28} {statistics.median(rounds[n]):>26.2f}  " + " ".join(f"{v:.2f}" for v in rounds[n]))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            fns["module(x, ids, w)"]()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
