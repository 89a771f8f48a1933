"""Every moekit kernel compiles with FP fusion asked for (``enable_fp_fusion=True``, one definition:
``moekit.triton_bind.COMPILE_OPTIONS``). Triton 3.9 warns at a compile that leaves it unset; Triton 3.10 compiles such
a kernel without FMA contraction (other numerics, likely slower), and every kernel was tuned and checked with it on.

- the launch sites: every ``kernel[grid](...)`` in moekit passes ``**COMPILE_OPTIONS`` (read in the source), and a
  ``BoundLaunch`` adds them to its options;
- the launches: calls of every kernel family under the interpreter (bf16 / fp32 / fp8 / weight-only forward, the
  alignment's launch counts, the k-sum, backward, routing; the Gluon GEMMs through their torch stand-ins), each
  launch noted by ``_fusion_guard`` with what it asked for; they and the test modules ``ELSEWHERE`` names reach every
  kernel moekit launches; with the options emptied the guard names the launches that went without;
- the offline compile for sm_90 (no GPU): with the options no FP-fusion warning, without them Triton 3.9's warning.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import _fusion_guard
from _helpers import bf16_quantized_pair, bf16_routing, make_problem

triton = pytest.importorskip("triton")

from _triton_helpers import interpreted  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


def _source_files() -> list[Path]:
    return sorted((ROOT / "moekit").rglob("*.py"))


def _jit_functions() -> list[tuple[str, str]]:
    """Every top-level ``@triton.jit`` / ``@gluon.jit`` function in moekit: (its module, its name)."""
    found = []
    for path in _source_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    re.fullmatch(r"(triton|gluon)\.jit(\(.*\))?", ast.unparse(d), re.S) for d in node.decorator_list):
                found.append((module, node.name))
    return found


def launched_kernels() -> set[str]:
    """The jit functions moekit launches (``module.name``): its ``*_kernel`` ones that its host code (outside the
    ``_kernels`` packages) names, as an attribute (``kernels("gemm").gate_up_kernel``) or in a string (the weight-only
    decodes' tables); the ``_kernel`` helpers only kernels call (``wait_for_previous_kernel``) are not named there."""
    host = "\n".join(p.read_text() for p in _source_files() if "_kernels" not in p.parts)
    return {f"{module}.{name}" for module, name in _jit_functions()
            if name.endswith("_kernel") and re.search(rf"[.\"']{name}\b", host)}


def test_every_launch_site_passes_compile_options():
    """Read in the source: each ``<kernel>[grid](...)`` call in moekit passes ``**COMPILE_OPTIONS``; the one
    exception is ``BoundLaunch``'s own call, whose options hold them (next test)."""
    sites, without = 0, []
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and "kernel" in ast.unparse(node.func.value)):
                continue
            sites += 1
            if path.name == "triton_bind.py" and ast.unparse(node.func) == "self.kernel[self.grid]":
                continue
            if not any(k.arg is None and ast.unparse(k.value) == "COMPILE_OPTIONS" for k in node.keywords):
                without.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert sites >= 20 and not without, without


def test_bound_launch_asks_for_fusion_unless_told_otherwise():
    from moekit.triton_bind import COMPILE_OPTIONS, BoundLaunch

    def kernel_fn(x_ptr, n, BLOCK):
        pass

    kernel = types.SimpleNamespace(fn=kernel_fn)
    launch = BoundLaunch(kernel, (1,), 1, (4,), cached=False, BLOCK=8, num_warps=2)
    assert dict(COMPILE_OPTIONS) == {"enable_fp_fusion": True}
    assert launch.options == {"enable_fp_fusion": True, "num_warps": 2}
    assert launch.compile_arguments(("x",)) == (("x", 4), {"BLOCK": 8, "enable_fp_fusion": True, "num_warps": 2})
    told = BoundLaunch(kernel, (1,), 1, (4,), cached=False, BLOCK=8, enable_fp_fusion=False)
    assert told.options == {"enable_fp_fusion": False}  # a caller's own choice is kept, not overwritten
    with pytest.raises(TypeError):
        COMPILE_OPTIONS["enable_fp_fusion"] = False  # read-only: no caller can change every kernel's


# In a process of its own, without the interpreter (an interpreted kernel leaves Triton's frontend patched in this
# one) and without TRITON_DEFAULT_FP_FUSION (which silences the warning): a Triton kernel (the router's, Qwen3's
# case) and a Gluon one (the bf16 gate-up GEMM) compiled for sm_90 by the SASS tools' compiles, which take
# COMPILE_OPTIONS as the launches do; then the router's case again with the options emptied. Each line: the case,
# the compiled kernel's enable_fp_fusion, how many FP-fusion warnings the compile raised.
_OFFLINE = r"""
import sys
import warnings

sys.path.insert(0, sys.argv[1])
import moekit.triton_bind as bind
from gluon_sass_diff_cpu import bf16_cases
from route_sass_diff_cpu import cases as route_cases


def report(name, compile_):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled = compile_()
    fusion = sum("FP_FUSION" in str(w.message) for w in seen)
    print(name, compiled.metadata.enable_fp_fusion, fusion)


report("route", route_cases(False)["route_qwen3"])
report("gluon", bf16_cases()["gateup_tma"])
bind.COMPILE_OPTIONS = {}  # what a launch without them compiles
report("route_unasked", route_cases(False)["route_qwen3"])
"""


def test_offline_compile_asks_for_fusion_without_a_warning():
    """sm_90 compiles (no GPU) of a Triton and a Gluon kernel with COMPILE_OPTIONS: fusion on, no FP-fusion warning;
    the same Triton kernel without them: on Triton 3.9 the warning (3.10: fusion off), on 3.6-3.8 the old default
    silently (fusion on). So the option is one every Triton from 3.6 takes, Gluon's compile included."""
    pytest.importorskip("triton.experimental.gluon._runtime", reason="no GluonASTSource in this Triton")
    import os

    from triton import knobs

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _OFFLINE, str(ROOT / "benchmarks")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = {name: (fusion, int(warned)) for name, fusion, warned in (ln.split() for ln in done.stdout.splitlines())}
    warns = hasattr(knobs.language, "fp_fusion_enabled")  # Triton 3.9's warning and its 3.10 default
    assert got == {"route": ("True", 0), "gluon": ("True", 0), "route_unasked": ("True", int(warns))}, got


# --- the launches, under the interpreter --------------------------------------------------------------------------

CFG = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, top_k=2)
# the alignment's launch counts (``triton_align.plan_align``), none folded into the GEMM: three launches (the chunked
# histogram, scan, scatter), hist + scan folded (the workspace's arrival counter), one placing launch with its own
# histogram or after one, one pass; and the k-sum as its own launch
ALIGNMENTS = {"three": dict(align_scan_fold=False), "hist_scan": {},
              "place": dict(align_one_launch_max=2048), "hist_place": dict(align_two_launch_max=2048),
              "one_pass": dict(align_one_pass_from=1)}
UNFOLDED = dict(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0, align_fold_max=0, sum_fold_max=0,
                sum_tail_max=0)


def _layer(dtype, m: int, scheme: str | None = None, backward: bool = False) -> None:
    """A ``MoE`` on the triton backend and the fused router: forward (and backward) of m tokens."""
    from moekit import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(**CFG), backend="triton", router="fused", dtype=dtype)
    if scheme is not None:
        moe.quantize_(scheme)
    x = torch.randn(m, CFG["hidden_size"], dtype=dtype, requires_grad=backward)
    with torch.set_grad_enabled(backward):
        out = moe(x)
    assert torch.isfinite(out).all()
    if backward:
        out.float().sum().backward()
        assert torch.isfinite(x.grad).all()


def _float_families() -> dict:
    from moekit import MoEConfig
    from moekit.experts.triton import experts_triton
    from moekit.experts.triton_align import align_block_triton
    from moekit.experts.triton_launch import LaunchOptions
    from moekit.routing.fused import route_fused
    from moekit.routing.gate import gate_logits

    p = make_problem(40, 2, 8, 64, 32)
    sparse = make_problem(1, 1, 64, 64, 32).ids  # 4 A <= E: the alignment op's one-program "naive" layout

    def experts(problem, **options):
        return lambda: experts_triton(*problem, options=LaunchOptions(**options))

    return {  # the keys: FAMILIES
        # M = 1 folds the alignment into the gate-up GEMM, M = 40 one program aligns; backward: dx, dW, the gate-up's
        # gradient; M = 4 the gate and the router in one launch, bf16 M = 40 their tensor-core launch
        "float": lambda: (_layer(torch.float32, 1), _layer(torch.float32, 40, backward=True),
                          _layer(torch.float32, 4), _layer(torch.bfloat16, 40)),
        "routing": lambda: (route_fused(torch.randn(5, 8), MoEConfig(**CFG)), gate_logits(torch.randn(3, 64),
                                                                                         torch.randn(8, 64))),
        **{f"align_{name}": experts(p, **{**UNFOLDED, **o}) for name, o in ALIGNMENTS.items()},
        "align_naive": lambda: align_block_triton(sparse, 64, 16, allow_naive=True),
        "fp8": lambda: (_layer(torch.bfloat16, 1, "fp8_block"), _layer(torch.bfloat16, 40, "fp8_block")),
        **{f"wo_{scheme}": (lambda scheme=scheme: (_layer(torch.bfloat16, 1, scheme),
                                                   _layer(torch.bfloat16, 40, scheme)))
           for scheme in ("int8_w8a16", "int4_w4a16", "mxfp4")},
        **{f"wo_{decode}": (lambda decode=decode: _wo_decode(decode)) for decode in ("mma", "gemv", "scratch")},
    }


def _wo_decode(decode: str) -> None:
    from moekit.experts.triton_quant import _wo
    from moekit.experts.triton_wo import run_experts_wo
    from moekit.experts.triton_wo_plan import weight_args

    q13, q2 = bf16_quantized_pair("int4_w4a16", 4, 64, 128)
    x, ids, weights = bf16_routing(3, 128, 4, 2, 0)
    args = [weight_args(w.q, w.scale, w.zero, w.group_size) for w in map(_wo, (q13, q2))]
    assert torch.isfinite(run_experts_wo(x, *args, ids, weights, None, "int4_w4a16", decode=decode)).all()


def _gluon_families() -> dict:
    """The Gluon paths, their GEMMs the torch stand-ins (``_gluon_fakes``; the Triton kernels around them run)."""
    from moekit.experts.triton_gluon import GluonChoice, experts_triton_gluon
    from moekit.experts.triton_gluon_fp8 import Fp8GluonChoice
    from moekit.experts.triton_gluon_launch import BLK256_UP_TILE, DOWN_TILE, UP_TILE, with_tail
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.experts.triton_gluon_wo import GluonWoOptions, run_experts_wo_gluon
    from moekit.experts.triton_quant import _wo
    from moekit.quant import quantize

    p = make_problem(300, 2, 4, 256, 128, dtype=torch.bfloat16)
    f13, f2 = (quantize(w, "fp8_block") for w in (p.w13, p.w2))
    i13, i2 = (_wo(quantize(w, "int8_w8a16")) for w in (p.w13, p.w2))
    return {
        "gluon_bf16": lambda: experts_triton_gluon(*p, choice=GluonChoice(min_tokens=1, min_tokens_wide=1)),
        "gluon_tiles": lambda: (run_lean(*p, None, UP_TILE, with_tail(DOWN_TILE), in_loader=False),
                                run_lean(*p, None, BLK256_UP_TILE, DOWN_TILE)),
        "gluon_fp8": lambda: experts_triton_gluon(p.x, f13, f2, p.ids, p.weights,
                                                  fp8_choice=Fp8GluonChoice(min_flops=1, min_rows_per_expert=0)),
        "gluon_wo": lambda: (run_experts_wo_gluon(p.x, i13, i2, p.ids, p.weights, None, "int8_w8a16"),
                             run_experts_wo_gluon(p.x, i13, i2, p.ids, p.weights, None, "int8_w8a16",
                                                  options=GluonWoOptions(swap=True))),
    }


@pytest.fixture(scope="module")
def family_launches() -> dict:
    """{family: [(kernel, the enable_fp_fusion it was given)]} of each family's calls, kernels interpreted."""
    from _gluon_fakes import install_fakes

    seen = {}

    def run(families: dict) -> None:
        for name, call in families.items():
            _fusion_guard.LOG.clear()
            call()
            seen[name] = list(_fusion_guard.LOG.launches)

    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        run(_float_families())
        with pytest.MonkeyPatch.context() as mp:
            install_fakes(mp.setattr)
            run(_gluon_families())
        sys.modules["moekit.experts.triton"].clear_launch_caches()  # no plan holding a stand-in
    _fusion_guard.LOG.clear()
    return seen


# Launched kernels these families do not reach, and the test module whose calls do (conftest's ``fp_fusion_asked``
# checks every launch there too): their paths take tiles or layouts a test sets up (the backward's sorted and
# persistent variants, the fp8 persistent GEMMs, the weight-only split gate-up and mma halves, the hash router).
ELSEWHERE = {
    "gemm_backward.permute_rows_kernel": "test_weight_grad_contiguous",
    "gemm_backward.weight_grad_contiguous_kernel": "test_weight_grad_contiguous",
    "gemm_backward_sorted.sorted_gemm_kernel": "test_triton_backward_sorted",
    "gemm_backward_sorted.grad_gate_up_sorted_kernel": "test_triton_backward_sorted",
    "gemm_train_forward.gate_up_train_kernel": "test_triton_backward_train_forward",
    "gemm_train_forward.down_train_kernel": "test_triton_backward_train_forward",
    "wgrad_persistent.weight_grad_persistent_kernel": "test_triton_backward_wgrad_persistent",
    "gemm_fp8_persistent.gate_up_fp8_persistent_kernel": "test_triton_fp8_persistent",
    "gemm_fp8_persistent.down_fp8_persistent_kernel": "test_triton_fp8_persistent",
    "wo_split.split_glu_kernel": "test_triton_wo_split",
    "gemm_wo_mma.gate_up_halves_wo_mma_kernel": "test_triton_wo_mma_halves",
    "hash_route_kernel.hash_route_kernel": "test_hash_fused",  # DeepSeek-V4's hash layers (session 48)
}


FAMILIES = ["float", "routing", "fp8", *(f"align_{n}" for n in (*ALIGNMENTS, "naive")),
            *(f"wo_{n}" for n in ("int8_w8a16", "int4_w4a16", "mxfp4", "mma", "gemv", "scratch")),
            "gluon_bf16", "gluon_tiles", "gluon_fp8", "gluon_wo"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_asks_for_fusion_at_every_launch(family_launches, family):
    launches = family_launches[family]
    assert launches, f"{family}: no moekit kernel launched"
    assert [k for k, given in launches if given is not True] == []


def test_the_families_reach_every_launched_kernel(family_launches):
    """The kernels the families launched, with those ``ELSEWHERE`` names, are every kernel moekit launches (a new
    kernel is reached here or named there); a kernel named there is not reached here, and its test module exists."""
    short = {k.split("_kernels.")[1] for launches in family_launches.values() for k, _ in launches}
    launched = {k.split("_kernels.")[1] for k in launched_kernels()}
    assert len(launched) >= 50
    assert launched - short == set(ELSEWHERE), sorted(launched - short ^ set(ELSEWHERE))
    assert all((ROOT / "tests" / f"{module}.py").exists() for module in ELSEWHERE.values())


def test_the_guard_names_launches_without_fusion(monkeypatch, fp_fusion_asked):
    """The mutation: COMPILE_OPTIONS emptied in every moekit module that reads it. A forward and backward, and a
    forward of 4 tokens (the gate and router's launch), launch ``BoundLaunch``es' kernels (the GEMMs, the router) and
    a plain ``kernel[grid](...)``'s (the backward's dx GEMM) without the option; the guard names them, so a launch
    site that drops it fails every test that reaches it."""
    import importlib

    for name in ("moekit.experts.triton_backward_launch", "moekit.routing.fused"):
        importlib.import_module(name)  # imported before the patch: it reads the emptied options
    for name, module in list(sys.modules.items()):
        if name.startswith("moekit") and isinstance(getattr(module, "COMPILE_OPTIONS", None), types.MappingProxyType):
            monkeypatch.setattr(module, "COMPILE_OPTIONS", types.MappingProxyType({}))
    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        _layer(torch.float32, 40, backward=True)
        _layer(torch.float32, 4)
    missing = fp_fusion_asked.missing()
    fp_fusion_asked.clear()  # this test's own launches went without on purpose
    unset = "(enable_fp_fusion=unset)"
    assert {f"moekit.experts._kernels.gemm.gate_up_kernel {unset}",
            f"moekit.experts._kernels.gemm_backward.gather_gemm_kernel {unset}",
            f"moekit.routing._kernels.gate_route_kernel.gate_route_kernel {unset}"} <= set(missing), missing
