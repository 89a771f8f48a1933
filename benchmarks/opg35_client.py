"""``opg35_device_check``'s real client: transformers' Qwen3-MoE (the ``moekit bench --hf`` model: 8 layers at
Qwen3-30B-A3B widths, random weights, bf16) decoding through moekit, before and after the inference twin, in one
process so the rounds interleave.

"after" is the shipped ``"moekit"`` experts implementation: traced by torch.compile under ``generate``'s no_grad, it
calls ``moekit::triton_experts_infer`` (``triton_op.traced_triton_experts`` -> ``experts_op``). "before"
(``BEFORE``, registered here) is main's forward and traced entry copied statement for statement (``before_forward``,
``main_traced``: the same Python traced, so the same dynamo guards), calling main's op with the same arguments:
``main_op``, a ``custom_op`` with autograd around main's body (``LaunchOptions`` built per call). Eager, both run
moekit's
eager path, which launches the kernels directly and never meets either op (the eager rows check that nothing
moved). A compiled graph holds one op or the other; dynamo guards on the module's implementation, so each keeps
its own graph.
"""

from __future__ import annotations

import statistics
import time

import torch

from bench_run import run_generate

BEFORE = "moekit_custom_op"  # main's compiled path: the custom op with autograd
IMPLS = ("moekit", BEFORE)  # after, before


def main_op():
    """``opg35::triton_experts_main``: main's ``moekit::triton_experts`` as it was, a ``custom_op`` (its schema, fake
    and ``register_autograd``) around main's body (``opg35_body_cpu.body_before``: the options built per call)."""
    if not hasattr(torch.ops.opg35, "triton_experts_main"):
        from opg35_body_cpu import body_before

        from moekit.experts.triton_backward import backward_experts_op, setup_experts_op
        from moekit.experts.triton_op import _experts_fake

        schema = str(torch.ops.moekit.triton_experts.default._schema).split("(", 1)[1]
        op = torch.library.custom_op("opg35::triton_experts_main", body_before, mutates_args=(), schema="(" + schema)
        op.register_fake(_experts_fake)
        op.register_autograd(backward_experts_op, setup_context=setup_experts_op)
    return torch.ops.opg35.triton_experts_main.default


def main_traced(x, w13, w2, topk_ids, topk_weights, activation, b13=None, b2=None):
    """main's ``traced_triton_experts``, statement for statement, calling main's op."""
    from moekit.activations import spec_fields
    from moekit.experts import check_experts_args
    from moekit.experts.triton_op import _DEFAULT_OP_ARGS

    x_shape, ids_shape = x.shape, topk_ids.shape
    if (len(x_shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != x_shape[0] or topk_weights.shape != ids_shape
            or w13.dim() != 3 or w13.shape[2] != x_shape[1] or w2.dim() != 3 or w2.shape[0] != w13.shape[0]
            or w2.shape[1] != x_shape[1] or w13.dtype != x.dtype or w2.dtype != x.dtype
            or topk_ids.is_floating_point()):
        check_experts_args(x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)
    return torch.ops.opg35.triton_experts_main(x, w13, w2, topk_ids, topk_weights, None, b13, b2,
                                               *spec_fields(activation), *_DEFAULT_OP_ARGS)


def before_forward(self, hidden_states, top_k_index, top_k_weights):
    """main's ``moekit_experts_forward``, statement for statement, its traced entry ``main_traced``: the same Python
    as main's compiled graph traced, so the same guards (the lean forward of H100 runs 1-3 traced ~60 fewer guards on
    a tiny Qwen3, checked every step outside the CUDA graph: the likely cause of the twin reading 1.6-3.1% slower)."""
    import moekit.hf as mh
    from moekit.experts import backend_fn, call_backend, traced_path_of
    from moekit.hf.composed import run_composed
    from moekit.hf.variants import PLAN_ATTR, experts_plan

    plan = getattr(self, PLAN_ATTR, None) or experts_plan(self)
    w13, w2 = getattr(self, plan.up_name), self.down_proj
    if plan.transposed:
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    b13 = getattr(self, plan.up_name + "_bias") if plan.has_bias else None
    b2 = self.down_proj_bias if plan.has_bias else None
    if plan.activation is None:
        return run_composed(self, plan, hidden_states, w13, w2, top_k_index, top_k_weights, b13, b2)
    fn = backend_fn(mh.HF_BACKEND, hidden_states.device)
    if torch.compiler.is_compiling():
        traced = traced_path_of(fn)
        if traced is not None:
            return main_traced(hidden_states, w13, w2, top_k_index, top_k_weights, plan.activation, b13, b2)
    return call_backend(fn, hidden_states, w13, w2, top_k_index, top_k_weights, activation=plan.activation, b13=b13,
                        b2=b2)


def register_before() -> None:
    """``BEFORE`` as a transformers experts implementation (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    main_op()
    ExpertsInterface.register(BEFORE, before_forward)


def build(smoke: bool, dev: torch.device):
    """(model, prompt [1, 16]): the bench's Qwen3 (1 tiny layer, the triton backend interpreted, in the smoke)."""
    import moekit.experts as experts
    import moekit.hf as mh
    from moekit.bench.hf_models import build_model, hf_config

    if smoke:
        mh.HF_BACKEND = "triton"
        experts._RESOLVED.clear()
    config = hf_config("qwen3", 1 if smoke else 8, tiny=smoke)
    model = build_model(config, torch.bfloat16, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=g).to(dev)
    register_before()
    return model, prompt


class StepClock:
    """A ``generate`` logits processor stamping the host clock each step (generate waits for each step's token)."""

    def __init__(self):
        self.stamps: list[int] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter_ns())
        return scores

    def median_ms(self) -> float:
        """The median step after the first (the prefill and the first decode step left out), ms."""
        steps = [(b - a) / 1e6 for a, b in zip(self.stamps[1:], self.stamps[2:])]
        return statistics.median(steps)


def generate(model, impl: str, prompt, tokens: int, config=None, clock=None, logits: bool = False):
    """``model.generate`` with the registered experts implementation ``impl`` (``run_generate``)."""
    import moekit.hf as mh

    model.set_experts_implementation(impl)
    mh.prepare(model)
    return run_generate(model, prompt, tokens, config, clock, logits)


SEEN: list = []  # the smoke's compiled graphs: each one's moekit ops


def _recorder(gm, example_inputs, **kwargs):
    """The smoke's backend: records the graph's moekit ops, runs it as traced."""
    targets = (str(n.target) for n in gm.graph.nodes)
    SEEN.append(sorted({t for t in targets if t.startswith(("moekit.", "opg35."))}))
    return gm.forward


def compile_config(dev: torch.device, mode: str, smoke: bool):
    """transformers' ``CompileConfig``: inductor in ``mode`` ("reduce-overhead": its default, CUDA graphs;
    "default": none, inductor's call runs the ops every step); the smoke traces with ``_recorder``."""
    from transformers import CompileConfig

    config = CompileConfig(backend=_recorder) if smoke else CompileConfig(mode=mode)
    if dev.type != "cuda":
        config._compile_all_devices = True
    return config


def decode_rounds(model, prompt, tokens: int, config, rounds: int, stop, log, label: str) -> dict:
    """impl -> [ms a decode step, each round], ``IMPLS`` alternating (the order swapped every other round);
    ``stop()`` true ends the rounds after the first."""
    per = {n: [] for n in IMPLS}
    for r in range(rounds):
        if r and stop():
            log(f"{label}: deadline, {r} rounds")
            break
        for n in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            clock = StepClock()
            generate(model, n, prompt, tokens, config, clock)
            per[n].append(clock.median_ms())
        log(f"{label} round {r}: " + ", ".join(f"{n} {v[-1]:.3f} ms" for n, v in per.items()))
    return per


def step_logits(model, impl: str, prompt, config, tokens: int) -> torch.Tensor:
    """[T, V] float logits of each step of a ``tokens``-token generate through ``impl`` (compiled when ``config``)."""
    return torch.stack([s[0].float() for s in generate(model, impl, prompt, tokens, config, logits=True).logits])
