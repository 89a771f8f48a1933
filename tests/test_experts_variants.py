"""The experts signature's variants (biases, ungated, interleaved gate/up, clamped SwiGLU, transposed weights) in every
torch backend, against a float64 per-token loop whose activation formulas are written out (``_helpers.experts_loop``,
``glu64``); the bad inputs that the signature refuses, each naming its argument.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated).
"""

from dataclasses import dataclass, replace

import pytest
import torch
import transformers.activations as hf_act

from _helpers import TOLERANCE, experts_loop, glu64, rel_l2
from moekit.activations import ActivationSpec, activation_from_hf, apply_glu, as_spec
from moekit.experts import backend_fn, bind_options, call_backend, run_experts
from moekit.experts.grouped_mm import CPU_GEMMS, GROUPED_MM_LAYOUTS, experts_grouped_mm

BACKENDS = ["reference", "grouped_mm"]
E, K, N = 5, 16, 12

@dataclass(frozen=True)
class Variant:
    """One experts configuration: the activation spec and which biases the call carries."""

    spec: ActivationSpec
    b13: bool = False
    b2: bool = False
    x_scale: float = 1.0  # gpt-oss's limit of 7 only bites on large pre-activations

    def __str__(self) -> str:
        return f"{self.spec}-b13={self.b13}-b2={self.b2}"


GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
VARIANTS = {
    "plain": Variant(ActivationSpec("silu")),
    "gpt_oss": Variant(GPT_OSS, b13=True, b2=True, x_scale=6.0),
    "relu2_ungated_bias": Variant(ActivationSpec("relu2", gated=False), b13=True, b2=True),
    "gelu_gated_b2": Variant(ActivationSpec("gelu"), b2=True),
    "gelu_tanh_ungated_b13": Variant(ActivationSpec("gelu_tanh", gated=False), b13=True),
    "relu_interleaved": Variant(ActivationSpec("relu", interleaved=True), b13=True),
    "silu_clamped_concat": Variant(ActivationSpec("silu", limit=0.5, up_shift=-0.25), b13=True),
    "silu_alpha_ungated": Variant(ActivationSpec("silu", gated=False, alpha=1.702), b2=True),
}


@dataclass
class Case:
    """One call's tensors; ``w13``/``w2`` are transposed views when built with ``transposed``."""

    x: torch.Tensor  # [M, K]
    w13: torch.Tensor  # [E, R, K]
    w2: torch.Tensor  # [E, K, N]
    ids: torch.Tensor  # [M, k] int32 with -1 and >= E markers
    weights: torch.Tensor  # [M, k]
    b13: torch.Tensor | None  # [E, R]
    b2: torch.Tensor | None  # [E, K]

    def kwargs(self, spec) -> dict:
        return dict(activation=spec, b13=self.b13, b2=self.b2)


def make_case(variant: Variant, m=23, k=3, *, transposed=False, dtype=torch.float32, seed=0, n=N) -> Case:
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if variant.spec.gated else n
    x = torch.randn(m, K, generator=g) * variant.x_scale
    w13 = torch.randn(E, rows, K, generator=g) / K**0.5
    w2 = torch.randn(E, K, n, generator=g) / n**0.5
    if transposed:  # transformers' is_transposed storage [E, K, R] / [E, N, K], read as views
        w13, w2 = w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
        assert not w13.is_contiguous() and not w2.is_contiguous()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(m)]).int() if m else torch.zeros(0, k).int()
    if m:
        ids[1::4, 0] = -1  # moekit's skip marker
        ids[2::5, -1] = E + 1  # transformers' EP sentinel (id >= E)
    weights = torch.rand(m, k, generator=g)
    b13 = torch.randn(E, rows, generator=g) if variant.b13 else None
    b2 = torch.randn(E, K, generator=g) * 0.5 if variant.b2 else None
    cast = (lambda t: None if t is None else t.to(dtype))
    return Case(x.to(dtype), cast(w13), cast(w2), ids, weights, cast(b13), cast(b2))


def _want(case: Case, spec, expert_map=None) -> torch.Tensor:
    return experts_loop(case.x, case.w13, case.w2, case.ids, case.weights, expert_map, b13=case.b13, b2=case.b2,
                        spec=spec)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_matches_float64_loop(backend, name, transposed):
    variant = VARIANTS[name]
    case = make_case(variant, transposed=transposed, seed=len(name))
    got = run_experts(case.x, case.w13, case.w2, case.ids, case.weights, backend=backend, **case.kwargs(variant.spec))
    assert got.dtype == torch.float32 and got.shape == case.x.shape
    assert rel_l2(got, _want(case, variant.spec)) < 1e-5


def test_gpt_oss_case_exercises_clamp_and_shift():
    """The gpt-oss case above is only a test of the clamp and the +1 if dropping them changes the answer."""
    case = make_case(VARIANTS["gpt_oss"])
    want = _want(case, GPT_OSS)
    for weaker in (replace(GPT_OSS, limit=None), replace(GPT_OSS, up_shift=0.0), replace(GPT_OSS, interleaved=False)):
        assert rel_l2(_want(case, weaker), want) > 0.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gpt_oss", "relu2_ungated_bias"])
def test_bfloat16_within_tolerance(backend, name):
    variant = VARIANTS[name]
    case = make_case(variant, dtype=torch.bfloat16, transposed=True, seed=3)
    got = run_experts(case.x, case.w13, case.w2, case.ids, case.weights, backend=backend, **case.kwargs(variant.spec))
    assert got.dtype == torch.bfloat16 and rel_l2(got, _want(case, variant.spec)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gpt_oss", "relu2_ungated_bias"])
def test_expert_map_skips_unmapped_and_out_of_range(backend, name):
    variant = VARIANTS[name]
    case = make_case(variant, m=17, seed=5)
    global_ids = torch.where(case.ids >= 0, case.ids * 2, case.ids).int()  # 2E global experts, even ones local
    expert_map = torch.tensor([i // 2 if i % 2 == 0 else -1 for i in range(2 * E)])
    global_ids[::3, 1] = 1  # an expert another rank holds
    case.ids = global_ids
    got = run_experts(case.x, case.w13, case.w2, case.ids, case.weights, backend=backend, expert_map=expert_map,
                      **case.kwargs(variant.spec))
    want = _want(case, variant.spec, expert_map.tolist())
    assert rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens(backend):
    case = make_case(VARIANTS["gpt_oss"], m=0)
    got = run_experts(case.x, case.w13, case.w2, case.ids, case.weights, backend=backend, **case.kwargs(GPT_OSS))
    assert got.shape == (0, K) and got.dtype == torch.float32


@pytest.mark.parametrize("name", VARIANTS)
def test_apply_glu_is_the_contract(name):
    spec = VARIANTS[name].spec
    h = torch.randn(7, 2 * N if spec.gated else N, dtype=torch.float64) * 3
    want = torch.stack([glu64(row, spec) for row in h])
    assert torch.allclose(apply_glu(h, spec), want, rtol=1e-12, atol=1e-12)


def test_hf_names_map_to_transformers_own_functions():
    t = torch.linspace(-6, 6, 101, dtype=torch.float64)
    for hf_name in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu", "relu2"):
        ours = apply_glu(t, ActivationSpec(activation_from_hf(hf_name), gated=False))
        assert torch.allclose(ours, hf_act.ACT2FN[hf_name](t), rtol=1e-10, atol=1e-10), hf_name


def _bad_call(variant: Variant, **changes):
    """run_experts on a valid reference call with ``changes`` applied to its arguments."""
    case = make_case(variant, m=4, seed=1)
    args = dict(x=case.x, w13=case.w13, w2=case.w2, topk_ids=case.ids, topk_weights=case.weights,
                **case.kwargs(variant.spec))
    args.update(changes)
    return run_experts(**args, backend="reference")


@pytest.mark.parametrize("changes, error, words", [
    (dict(b13=torch.zeros(E, N)), ValueError, ["b13", f"2N={2 * N}"]),  # the ungated shape on a gated spec
    (dict(b13=torch.zeros(E, 2 * N, dtype=torch.float64)), TypeError, ["b13", "float32"]),
    (dict(b13=torch.zeros(E, 2 * N, device="meta")), ValueError, ["b13", "cpu"]),
    (dict(b2=torch.zeros(E, N)), ValueError, ["b2", f"K={K}"]),
    (dict(b2=torch.zeros(E, K, dtype=torch.bfloat16)), TypeError, ["b2", "bfloat16"]),
    (dict(b2=torch.zeros(E, K, device="meta")), ValueError, ["b2", "meta"]),
    (dict(b2=[0.0] * K), TypeError, ["b2", "list"]),
    (dict(w13=torch.zeros(E, 2 * N + 1, K)), ValueError, ["w13", "2N"]),
    (dict(activation="tanh"), ValueError, ["activation", "tanh"]),
    (dict(activation=1), TypeError, ["activation", "int"]),
])
def test_gated_call_refuses_bad_input_naming_it(changes, error, words):
    with pytest.raises(error) as info:
        _bad_call(VARIANTS["gpt_oss"], **changes)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_ungated_call_refuses_gated_shapes():
    variant = VARIANTS["relu2_ungated_bias"]
    with pytest.raises(ValueError, match=r"w2 must have shape \[E=5, K=16, N=24\]"):
        _bad_call(variant, w13=torch.zeros(E, 2 * N, K), b13=None)  # a gated w13 read as ungated: N=2N
    with pytest.raises(ValueError, match=rf"b13 must have shape \[E={E}, N={N}\]"):
        _bad_call(variant, b13=torch.zeros(E, 2 * N))
    with pytest.raises(ValueError, match="w13 must have shape .*ungated"):
        _bad_call(variant, w13=torch.zeros(E, N, K + 1))


@pytest.mark.parametrize("fields, error, words", [
    (dict(name="tanh"), ValueError, ["activation.name", "tanh"]),
    (dict(name="gelu", alpha=1.702), ValueError, ["alpha", "silu"]),
    (dict(limit=0.0), ValueError, ["limit", "> 0"]),
    (dict(limit=-1.0), ValueError, ["limit", "> 0"]),
    (dict(limit=float("inf")), TypeError, ["limit", "finite"]),
    (dict(alpha="1.7"), TypeError, ["alpha"]),
    (dict(gated=False, interleaved=True), ValueError, ["interleaved", "gated"]),
    (dict(gated=False, limit=7.0), ValueError, ["limit", "gated"]),
    (dict(gated=False, up_shift=1.0), ValueError, ["up_shift", "gated"]),
    (dict(gated=1), TypeError, ["gated", "bool"]),
])
def test_spec_refuses_inconsistent_fields(fields, error, words):
    with pytest.raises(error) as info:
        ActivationSpec(**fields)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_as_spec_reads_names_and_keeps_specs():
    assert as_spec("gelu") == ActivationSpec(name="gelu") and as_spec("gelu").plain
    assert as_spec(GPT_OSS) is GPT_OSS and not GPT_OSS.plain
    assert as_spec("relu2").kernel_id != as_spec("relu").kernel_id


PATH_CASES = [("gpt_oss", True), ("relu2_ungated_bias", False), ("gelu_gated_b2", True)]


@pytest.mark.parametrize("layout", ["auto", *GROUPED_MM_LAYOUTS])
@pytest.mark.parametrize("cpu_gemm", CPU_GEMMS)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name, transposed", PATH_CASES)
def test_grouped_mm_every_path(layout, cpu_gemm, grad, name, transposed):
    """Each layout and GEMM strategy (the CPU oneDNN/mm loops without grad, the grouped GEMM with it)."""
    variant = VARIANTS[name]
    case = make_case(variant, m=29, transposed=transposed, seed=7)
    with torch.set_grad_enabled(grad):
        got = experts_grouped_mm(case.x.requires_grad_(grad), case.w13, case.w2, case.ids, case.weights,
                                 layout=layout, cpu_gemm=cpu_gemm, **case.kwargs(variant.spec))
    assert got.dtype == torch.float32 and rel_l2(got.detach(), _want(case, variant.spec)) < 1e-5


@pytest.mark.parametrize("layout", GROUPED_MM_LAYOUTS)
def test_grouped_mm_chunks_keep_biases(layout):
    variant = VARIANTS["gpt_oss"]
    case = make_case(variant, m=40, transposed=True, seed=8)
    got = experts_grouped_mm(case.x, case.w13, case.w2, case.ids, case.weights, layout=layout,
                             memory_budget_bytes=20_000, **case.kwargs(variant.spec))  # a few tokens a chunk
    assert rel_l2(got, _want(case, variant.spec)) < 1e-5


def _leaves(case: Case, transposed: bool) -> dict:
    """Fresh leaf tensors for the differentiable arguments; transposed weights stay views of their storage."""
    store13 = case.w13.transpose(1, 2) if transposed else case.w13
    store2 = case.w2.transpose(1, 2) if transposed else case.w2
    leaves = {"x": case.x, "store13": store13, "store2": store2, "b13": case.b13, "b2": case.b2}
    return {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}


def _grads(fn, case: Case, leaves: dict, transposed: bool, seed: int) -> dict:
    w13 = leaves["store13"].transpose(1, 2) if transposed else leaves["store13"]
    w2 = leaves["store2"].transpose(1, 2) if transposed else leaves["store2"]
    out = fn(leaves["x"], w13, w2, leaves["b13"], leaves["b2"])
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out * probe.to(out.dtype)).sum().backward()
    return {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("backend, layout", [("reference", None), *(("grouped_mm", lay) for lay in GROUPED_MM_LAYOUTS)])
@pytest.mark.parametrize("name, transposed", [("gpt_oss", True), ("relu2_ungated_bias", False)])
@pytest.mark.parametrize("n", [N, 13])  # 13: rows not 16-byte aligned, so the grouped GEMM's fallback loop
def test_gradients_match_float64_autograd(backend, layout, name, transposed, n):
    variant = VARIANTS[name]
    case = make_case(variant, m=19, transposed=transposed, seed=11, n=n)
    layout_option = {} if layout is None else {"backend_options": {"layout": layout}}

    def ours(x, w13, w2, b13, b2):
        fn = bind_options(backend_fn(backend, "cpu"), layout_option.get("backend_options", {}))
        return call_backend(fn, x, w13, w2, case.ids, case.weights, activation=variant.spec, b13=b13, b2=b2)

    def theirs(x, w13, w2, b13, b2):
        return experts_loop(x, w13, w2, case.ids, case.weights, b13=b13, b2=b2, spec=variant.spec)

    got = _grads(ours, case, _leaves(case, transposed), transposed, seed=1)
    leaves64 = {k: v.detach().double().requires_grad_(True) for k, v in _leaves(case, transposed).items()}
    want = _grads(theirs, case, leaves64, transposed, seed=1)
    for key in want:
        assert rel_l2(got[key], want[key]) < 1e-5, key


@pytest.mark.parametrize("grad", [False, True])
def test_grouped_mm_reads_views_with_no_unit_stride(grad):
    """A weight view strided in both matrix dimensions (no BLAS layout) still runs, through the loop."""
    variant = VARIANTS["gpt_oss"]
    case = make_case(variant, m=21, seed=12)
    case.w13 = torch.stack([case.w13, -case.w13], dim=-1).flatten(2)[:, :, ::2]  # [E, R, K], strides (., 2K, 2)
    case.w2 = torch.stack([case.w2, case.w2], dim=-1).flatten(2)[:, :, ::2]  # [E, K, N], strides (., 2N, 2)
    assert case.w13.stride(2) == 2 and case.w2.stride(2) == 2
    with torch.set_grad_enabled(grad):
        got = run_experts(case.x.requires_grad_(grad), case.w13, case.w2, case.ids, case.weights,
                          backend="grouped_mm", **case.kwargs(variant.spec))
    assert rel_l2(got.detach(), _want(case, variant.spec)) < 1e-5


@pytest.mark.parametrize("name", ["gpt_oss", "relu2_ungated_bias"])
def test_compiled_call_traces_whole(name):
    """call_backend with a spec, biases and transposed views traces under torch.compile(fullgraph=True)."""
    variant = VARIANTS[name]
    case = make_case(variant, m=13, transposed=True, seed=13)
    fn = backend_fn("grouped_mm", "cpu")

    def call(x, w13, w2, b13, b2):
        return call_backend(fn, x, w13, w2, case.ids, case.weights, activation=variant.spec, b13=b13, b2=b2)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    assert rel_l2(compiled(case.x, case.w13, case.w2, case.b13, case.b2), _want(case, variant.spec)) < 1e-5


def test_biases_are_contract_arguments_not_backend_options():
    with pytest.raises(ValueError, match=r"backend_options \['b13'\] are not options of experts_grouped_mm"):
        bind_options(backend_fn("grouped_mm", "cpu"), {"b13": None})
