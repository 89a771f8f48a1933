"""The inference-only ops registered through ``moekit.experts.op_library`` (``moekit::cpu_experts``,
``moekit::cpu_quant_experts``): schema, fake and dispatch agree (``torch.library.opcheck``), no Python autograd
layer is registered, and a direct call of the op equals a float64 (token, slot) loop written in the tests."""

import pytest
import torch

from _helpers import experts_loop
from moekit.activations import spec_fields
from moekit.experts.cpu_op import cpu_experts_op
from moekit.experts.cpu_quant_op import cpu_quant_experts_op
from moekit.experts.cpu_quant_op import _meta as quant_meta
from test_cpu_compile import GPT_OSS, problem, rel_err
from test_cpu_quant import SCHEMES, loop64
from test_cpu_quant import problem as quant_problem

OPS = ("moekit::cpu_experts", "moekit::cpu_quant_experts")


def cpu_args(x, w13, w2, ids, weights, spec=GPT_OSS, cpu_gemm="auto"):
    """The op's positional arguments: no map or biases, default budget and layout, weights as stored."""
    return (x, w13, w2, ids, weights, None, None, None, *spec_fields(spec), None, "auto", cpu_gemm, False, False)


def quant_args(x, q13, q2, ids, weights, spec=GPT_OSS):
    return (x, list(q13.tensors().values()), list(q2.tensors().values()), ids, weights, None, None, None, q13.scheme,
            quant_meta(q13), quant_meta(q2), q13.dtype, q2.dtype, *spec_fields(spec), None, "auto")


@pytest.mark.parametrize("name", OPS)
def test_ops_have_a_fake_and_no_python_autograd_kernel(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")  # the fake
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd")
    namespace, op = name.split("::")
    assert torch.Tag.pt2_compliant_tag in getattr(getattr(torch.ops, namespace), op).default.tags


@pytest.mark.parametrize("cpu_gemm", ["auto", "onednn_packed"])
def test_cpu_experts_op_equals_float64_loop_and_passes_opcheck(cpu_gemm):
    x, w13, w2, ids, weights = problem(5, 2, seed=31)
    args = cpu_args(x, w13, w2, ids, weights, cpu_gemm=cpu_gemm)
    with torch.no_grad():
        got = cpu_experts_op(*args)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, experts_loop(x, w13, w2, ids, weights, spec=GPT_OSS)) < 1e-5
    torch.library.opcheck(cpu_experts_op, args)


@pytest.mark.parametrize("scheme, options", SCHEMES)
def test_cpu_quant_experts_op_equals_float64_loop_and_passes_opcheck(scheme, options):
    x, q13, q2, ids, weights = quant_problem(scheme, options, seed=32)
    args = quant_args(x, q13, q2, ids, weights)
    with torch.no_grad():
        got = cpu_quant_experts_op(*args)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, loop64(x, q13, q2, ids, weights, GPT_OSS)) < 1e-5
    torch.library.opcheck(cpu_quant_experts_op, args)


def test_cpu_experts_op_refuses_a_call_that_needs_a_gradient():
    """No backward: a call with an input that needs a gradient raises (``_runs_cpu_op`` sends such calls to the
    traced path); the same inputs under ``no_grad`` run."""
    x, w13, w2, ids, weights = problem(3, 2, seed=33)
    args = cpu_args(x, w13.requires_grad_(), w2, ids, weights)
    with pytest.raises(RuntimeError, match="no backward"):
        cpu_experts_op(*args)
    with torch.no_grad():
        got = cpu_experts_op(*args)
    assert rel_err(got, experts_loop(x, w13.detach(), w2, ids, weights, spec=GPT_OSS)) < 1e-5
