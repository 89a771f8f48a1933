"""The fused router's kernels (``route_kernel``, the one gate + router launch ``gate_route_kernel``, the tensor-core
gate + router ``gate_mma_kernel``) in sm_90 SASS, compiled on a machine without a GPU, for a change that must leave
the default configs' machine code alone (session 34: the router options as constexprs, ``routing/router_math.py``):
``--dump`` the tree before and after it, on each Triton, then ``gluon_sass_diff_cpu.py --compare``.

    PYTHONPATH=/tmp/before-tree python3 benchmarks/route_sass_diff_cpu.py --dump /tmp/route-sass-before   (Triton 3.9)
    PYTHONPATH=$PWD python3 benchmarks/route_sass_diff_cpu.py --dump /tmp/route-sass-after --options
    PYTHONPATH=/tmp/f8pre-site:... (Triton 3.6, the H200's), then
    python3 benchmarks/gluon_sass_diff_cpu.py --compare /tmp/route-sass-before /tmp/route-sass-after

Cases (the launches' constexprs as ``fused._plan`` makes them, the launch options ``_launch_options`` gives a
Hopper GPU: PRECISE, PDL, no ftz; a constexpr a tree's kernel lacks is left out, one it has and the case does not
name takes its default): Qwen3-30B-A3B (128 experts, softmax, renormalised), DeepSeek-V3 (256 experts, 8 groups
keep 4, sigmoid, a bias, top-2 group sums), Mixtral (8 experts, 16 rows a program), Qwen2-MoE's gated shared slots,
masking (nonfinite="mask") and the flag (nonfinite="raise" under torch.compile), the others with the kernel's own
assert (eager nonfinite="raise", debug=True); the one launch at 1 and 4 rows, the tensor-core one at
64; DeepSeek-V4's hash router with its flags and with its own asserts (session 49). ``--options`` adds each
session-34 option on, and ERNIE-4.5's layer with its renorm floor (session 49) in each kernel (the after tree
only: a compile check and their size; a file the before dump lacks is not compared).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# nonfinite="raise" as eager GPU calls launch it: the kernel's own assert, compiled with debug=True
LAUNCH = dict(PRECISE=True, PDL=True, ASSERT_FINITE=True, CHECK_FINITE=False, HAS_GATE=False, NUM_SHARED=0)
QWEN3 = LAUNCH | dict(NUM_EXPERTS=128, PER_GROUP=128, G_PAD=1, P_PAD=128, TOP_K=8, TOPK_GROUP=1, SLOTS_PAD=8,
                      GROUPED=False, TOP2=False, SIGMOID=False, RENORMALIZE=True, HAS_BIAS=False)
DSV3 = LAUNCH | dict(NUM_EXPERTS=256, PER_GROUP=32, G_PAD=8, P_PAD=32, TOP_K=8, TOPK_GROUP=4, SLOTS_PAD=8,
                     GROUPED=True, TOP2=True, SIGMOID=True, RENORMALIZE=True, HAS_BIAS=True)
MIXTRAL = QWEN3 | dict(NUM_EXPERTS=8, PER_GROUP=8, P_PAD=8, TOP_K=2, SLOTS_PAD=2)
QWEN2 = QWEN3 | dict(NUM_EXPERTS=64, PER_GROUP=64, P_PAD=64, TOP_K=4, NUM_SHARED=4, SLOTS_PAD=8, HAS_GATE=True,
                     RENORMALIZE=False)
# DeepSeek-V4's top-k layer (session 48's option): 256 experts, no groups, top-6 + its fused shared slot, the bias
V4 = QWEN3 | dict(NUM_EXPERTS=256, PER_GROUP=256, P_PAD=256, TOP_K=6, NUM_SHARED=1, SLOTS_PAD=8, HAS_BIAS=True,
                  SQRT_SOFTPLUS=True)
# ERNIE-4.5-21B-A3B's layer (session 49's renorm_clamp): 64 experts, softmax, top-6, the bias, the floor at 1e-12
ERNIE = QWEN3 | dict(NUM_EXPERTS=64, PER_GROUP=64, P_PAD=64, TOP_K=6, SLOTS_PAD=8, HAS_BIAS=True,
                     RENORM_LOG_CLAMP=-27.631021499633789)
# DeepSeek-V4's hash layer (``hash_route_kernel``, its plan: E 256, top-6 + the fused shared slot, sqrt(softplus), one
# row a program at 128 elements): its two checks as flags (interpreted, FusedHashRouter(assert_in_kernel=False)) or
# as the kernel's own asserts (session 49's eager default on the GPU)
HASH = dict(NUM_EXPERTS=256, E_PAD=256, TOP_K=6, NUM_SHARED=1, SLOTS_PAD=8, SIGMOID=False, SQRT_SOFTPLUS=True,
            RENORMALIZE=True, SHARED_SCALE=1.0, SOFTCAP=0.0, SOFTCAP_INV=0.0, BLOCK_M=1, PRECISE=True)
POINTERS = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "gate_ptr": "*bf16", "ids_ptr": "*i32", "tid_ptr": "*i64",
            "table_ptr": "*i64",
            "weights_ptr": "*fp32", "ok_ptr": "*i32", "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
            "count_ptr": "*i32", "part_ptr": "*fp32"}
SCALARS = {"scaling": "fp32"}  # every other scalar: i32
ONES = ("stride_le", "stride_b", "stride_gm")  # 1 in every launch: Triton specialises them as constants
ALIGNED = ("logits_ptr", "bias_ptr", "ids_ptr", "weights_ptr", "ok_ptr", "x_ptr", "w_ptr", "b_ptr", "count_ptr",
           "part_ptr", "stride_lm", "stride_xm", "stride_we", "hidden")
# the session-34 options on (``router_math.RouterMath.constexprs``): Laguna's cap 30 (its fp32 reciprocal); session
# 49's renorm_eps at DeepSeek-V3's 1e-20 and renorm_clamp at ERNIE-4.5's 1e-12 (their fp32 logs)
OPTIONS = {"softcap": dict(SOFTCAP=30.0, SOFTCAP_INV=0.03333333507180214), "bias_on_logits": dict(BIAS_ON_LOGITS=True),
           "fill_zero": dict(FILL_ZERO=True), "average": dict(SHARED_SCALE=0.5),
           "renorm_eps": dict(RENORM_LOG_EPS=-46.051700592041016),
           "renorm_clamp": dict(RENORM_LOG_CLAMP=-27.631021499633789)}


def _compile(module: str, kernel: str, const: dict, num_warps: int, num_stages: int = 3):
    """triton.compile for sm_90 of the parameters this tree's ``kernel`` has."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moekit.triton_bind import COMPILE_OPTIONS

    fn = getattr(importlib.import_module(f"moekit.routing._kernels.{module}"), kernel)
    names = fn.arg_names
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty}
    const = defaults | {k: v for k, v in const.items() if k in names} | {n: 1 for n in ONES if n in names}
    sig = {n: "constexpr" if n in const else POINTERS.get(n, SCALARS.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in names}
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in const.items()}, attrs)
    asserts = const.get("ASSERT_FINITE") or const.get("ASSERT_IN_KERNEL")
    debug = dict(debug=True, sanitize_overflow=False) if asserts else {}  # as the eager launch
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(
        num_warps=num_warps, num_stages=num_stages, enable_reflect_ftz=False, launch_pdl=False, **debug,
        **COMPILE_OPTIONS))


def cases(options: bool) -> dict:
    """name -> () -> compiled: the default configs' launches (and with ``options`` each option on)."""
    route = partial(_compile, "route_kernel", "route_kernel", num_warps=1)
    one = partial(_compile, "gate_route_kernel", "gate_route_kernel", num_warps=4)
    mma = partial(_compile, "gate_mma_kernel", "gate_mma_kernel", num_warps=4)
    hashed = partial(_compile, "hash_route_kernel", "hash_route_kernel", num_warps=1)
    gate = dict(BLOCK_M=1, BLOCK_E=2, BLOCK_K=2048, HAS_LINEAR_BIAS=False)  # gate._tiles(1, E, 7168)
    tensor = dict(BLOCK_M=64, BLOCK_E=64, BLOCK_K=64, SPLIT_K=1, IEEE=False, UPCAST=False, HAS_LINEAR_BIAS=False,
                  ROUTE=True)
    out = {
        "route_qwen3": partial(route, QWEN3 | dict(BLOCK_M=1)),
        "route_dsv3": partial(route, DSV3 | dict(BLOCK_M=1)),
        "route_mixtral": partial(route, MIXTRAL | dict(BLOCK_M=16)),
        "route_qwen2_shared": partial(route, QWEN2 | dict(BLOCK_M=1)),
        "route_dsv3_mask": partial(route, DSV3 | dict(BLOCK_M=1, ASSERT_FINITE=False)),
        "route_qwen3_flag": partial(route, QWEN3 | dict(BLOCK_M=1, CHECK_FINITE=True, ASSERT_FINITE=False)),
        "one_qwen3_m4": partial(one, QWEN3 | gate | dict(BLOCK_M=4)),
        "one_dsv3_m1": partial(one, DSV3 | gate),
        "mma_dsv3_m64": partial(mma, DSV3 | tensor | dict(ROUTE_M=8)),
        "mma_qwen3_m64": partial(mma, QWEN3 | tensor | dict(ROUTE_M=16)),
        "hash_v4_flags": partial(hashed, HASH),
        "hash_v4_assert": partial(hashed, HASH | dict(ASSERT_IN_KERNEL=True)),
    }
    if options:
        out |= {f"opt_route_dsv3_{n}": partial(route, DSV3 | dict(BLOCK_M=1) | c) for n, c in OPTIONS.items()}
        out |= {f"opt_one_dsv3_{n}": partial(one, DSV3 | gate | c) for n, c in OPTIONS.items()}
        out["opt_route_qwen2_average"] = partial(route, QWEN2 | dict(BLOCK_M=1, SHARED_SCALE=0.5))
        out["opt_mma_dsv3_all"] = partial(mma, DSV3 | tensor | dict(ROUTE_M=8) | {
            k: v for c in OPTIONS.values() for k, v in c.items()})
        out |= {"opt_route_v4": partial(route, V4 | dict(BLOCK_M=1)), "opt_one_v4_m1": partial(one, V4 | gate),
                "opt_mma_v4_m64": partial(mma, V4 | tensor | dict(ROUTE_M=8)),
                "opt_route_v4_renorm_eps": partial(route, V4 | dict(BLOCK_M=1) | OPTIONS["renorm_eps"])}
        out |= {"opt_route_ernie": partial(route, ERNIE | dict(BLOCK_M=1)),
                "opt_one_ernie_m1": partial(one, ERNIE | gate),
                "opt_mma_ernie_m64": partial(mma, ERNIE | tensor | dict(ROUTE_M=16))}
    return out


def main() -> int:
    import moekit
    from gluon_sass_diff_cpu import write_sass

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, required=True)
    parser.add_argument("--options", action="store_true", help="also each router option on (the after tree)")
    parser.add_argument("--only", nargs="+", help="name prefixes of the kernels to dump (default: all)")
    args = parser.parse_args()
    todo = {n: c for n, c in cases(args.options).items() if not args.only or n.startswith(tuple(args.only))}
    print(f"moekit at {Path(moekit.__file__).parent}: {len(todo)} kernels", flush=True)
    return write_sass(args.dump, todo)


if __name__ == "__main__":
    sys.exit(main())
