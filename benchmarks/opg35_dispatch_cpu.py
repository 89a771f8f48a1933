"""Per-call host cost of ``moekit::triton_experts``' registration against its inference twin's, on the CPU
(session 35, ``moekit.experts.triton_op``). The real kernel is a Triton launch (interpreted here, so not timed):
the op's 33-argument schema with a body that only allocates the output, registered the two ways the shipped ops
are: ``torch.library.custom_op`` + ``register_autograd`` (``triton_experts``, before for calls without a gradient)
and ``op_library.define_inference_op`` (``triton_experts_infer``, the twin); each called directly, from a
``torch.compile``d function (inductor's generated call in front), and the body alone; plus ``experts_op``, the
choice between them each eager call makes. Under ``no_grad`` (as ``generate`` runs); tiny CPU tensors; per
round each variant runs ``--calls`` calls after 200 warm-up calls, the order reversed every other round; prints µs
a call (medians, each round), twin / custom_op per round and the load average.

    flock /work/wt/cpubench.lock python3 benchmarks/opg35_dispatch_cpu.py --rounds 7 --calls 2000
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, Optional

import torch

from moekit.activations import ActivationSpec, spec_fields
from moekit.experts.op_library import define_inference_op
from moekit.experts.triton_op import _DEFAULT_OP_ARGS, _experts_fake, experts_op
from op_dispatch import per_call_us, timing_args


def empty_kernel(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float], up_shift: float,
    weight_descriptors: bool, dependent_launch: bool, poison_workspace: bool, align_small_max: int,
    align_small_max_bins: int, direct_eager: bool, cache_plans: bool, cached_launcher: bool, reuse_workspace: bool,
    raw_launcher: bool, align_one_launch_max: int, align_two_launch_max: int, align_fold_max: int, sum_fold_max: int,
    sum_tail_max: int, lean_launch: bool, align_scan_fold: bool, fast_path: bool, align_one_pass_from: int,
) -> torch.Tensor:
    """triton_experts' schema, no work: x [M, K] -> a fresh [M, K]."""
    return torch.empty_like(x)


def _backward(ctx, grad):
    return (grad,) + (None,) * 32


def _no_context(ctx, inputs, output):
    pass


def variants() -> dict[str, Callable]:
    custom = torch.library.custom_op("opg35_bench::empty_custom", empty_kernel, mutates_args=())
    custom.register_fake(_experts_fake)
    custom.register_autograd(_backward, setup_context=_no_context)
    before, twin = torch.ops.opg35_bench.empty_custom.default, define_inference_op("opg35_empty", empty_kernel,
                                                                                    _experts_fake)
    return {"body": empty_kernel, "twin": twin, "custom_op": before,
            "compiled twin": torch.compile(lambda *a: twin(*a), fullgraph=True),
            "compiled custom_op": torch.compile(lambda *a: before(*a), fullgraph=True),
            "experts_op (the choice)": lambda x, w13, w2, ids, weights, *rest: experts_op(x, w13, w2, weights, None,
                                                                                          None)}


def op_args() -> tuple:
    """The 33 arguments: x [1, 64] bf16, experts E = 8 of [64, 32], k = 2, silu, the default options."""
    x = torch.randn(1, 64).bfloat16()
    w13, w2 = torch.randn(8, 64, 64).bfloat16(), torch.randn(8, 64, 32).bfloat16()
    ids, weights = torch.tensor([[1, 5]]), torch.tensor([[0.6, 0.4]])
    return (x, w13, w2, ids, weights, None, None, None, *spec_fields(ActivationSpec()), *_DEFAULT_OP_ARGS)


def main() -> None:
    a = timing_args(__doc__)
    args = op_args()
    with torch.no_grad():
        found = variants()
        us = {name: [] for name in found}
        for r in range(a.rounds):
            for name in (list(found) if r % 2 == 0 else list(found)[::-1]):
                us[name].append(per_call_us(found[name], args, a.calls))
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, {a.rounds} rounds x {a.calls} calls, no_grad")
    print("| variant | µs a call (median) | rounds |\n|---|---|---|")
    for name, values in us.items():
        print(f"| {name} | {statistics.median(values):.2f} | {' '.join(f'{v:.1f}' for v in values)} |")
    for new, old in (("twin", "custom_op"), ("compiled twin", "compiled custom_op")):
        print(f"{new} / {old} per round:", " ".join(f"{n / o:.2f}" for n, o in zip(us[new], us[old])))


if __name__ == "__main__":
    main()
