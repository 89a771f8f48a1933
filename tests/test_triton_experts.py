"""The Triton experts backend on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), small shapes.

Chain: triton kernels vs the torch twins (``align_block`` exactly; ``experts_reference`` within the
dtype's tolerance on a float64 reference). Intermediate buffers are filled with NaN before every run
(``LaunchOptions(poison_workspace=True)``), so a read of an unwritten row shows up as NaN in the output.

What the interpreter cannot run and the device run covers instead: bf16 ``tl.dot`` (upcast here),
bf16 rounding of the intermediates (float32 here), timing, CUDA graphs, int64 offsets past 2^31.
"""

from __future__ import annotations

import json

import pytest
import torch


# conftest.py sets TRITON_INTERPRET=1 before anything imports triton (Triton's own tl.zeros, tl.cumsum...
# are decorated at `import triton`, so it must come first).
triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from _helpers import TOLERANCE as TOL, make_problem as _problem, rel_l2 as _rel_err  # noqa: E402
from moekit.experts import available_backends  # noqa: E402
from moekit.experts.configs import (  # noqa: E402
    GemmTile, KernelConfig, config_file_name, get_config, load_configs, nearest, write_configs,
)
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_align import align_block_triton  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options  # noqa: E402
from moekit.experts.triton_plan import descriptors_allowed  # noqa: E402
from moekit.layouts.block_aligned import align_block, use_naive  # noqa: E402

POISON = LaunchOptions(poison_workspace=True)  # every test run fills the workspaces with NaN first


def _check(tri, x, w13, w2, ids, weights, expert_map=None, activation="silu"):
    out = tri.experts_triton(x, w13, w2, ids, weights, expert_map=expert_map, activation=activation, options=POISON)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = experts_reference(x.double(), w13.double(), w2.double(), ids, weights, expert_map=expert_map,
                            activation=activation)
    if x.shape[0]:
        assert _rel_err(out, ref) < TOL[x.dtype]
    return out


# --- alignment: exactly the torch twin --------------------------------------------------------------


@pytest.mark.parametrize("m", [0, 1, 3, 33])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("e,block", [(8, 4), (64, 16), (3, 16)])
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("launch", ["single", "three"])
def test_align_equals_twin(m, k, e, block, with_map, launch):
    # "three" forces the chunked three-launch path even for small batches, "single" the single launch
    # for any expert count.
    three = LaunchOptions(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0)
    options = three if launch == "three" else LaunchOptions(align_small_max_bins=1 << 20)
    g = torch.Generator().manual_seed(m * 100 + k * 10 + e)
    ids = torch.randint(-1, e + 2, (m, k), generator=g, dtype=torch.int32)  # includes skipped ids (-1, >= E)
    expert_map = None
    if with_map:
        expert_map = torch.randperm(e + 2, generator=g).int() - 2  # [E+2]: two entries -1/-2 -> not here
        expert_map[expert_map == -2] = -1
    for allow_naive in (True, False):
        want = align_block(ids, e, block, expert_map, allow_naive)
        got = align_block_triton(ids, e, block, expert_map, allow_naive, options=options)
        assert got.naive == want.naive
        for field in ("sorted_ids", "expert_ids", "num_padded", "counts"):
            a, b = getattr(got, field), getattr(want, field)
            assert a.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b), field


def test_align_many_chunks():
    # More assignments than one chunk (128): the cross-chunk scan must keep each expert's rows in a-order.
    ids = torch.randint(0, 5, (150, 3), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    want, got = align_block(ids, 5, 16), align_block_triton(ids, 5, 16)
    assert torch.equal(got.sorted_ids, want.sorted_ids) and torch.equal(got.expert_ids, want.expert_ids)


# --- the fused experts path vs the reference ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("m", [0, 1, 3, 33])
def test_experts_odd_shapes(interpreter, m, k, dtype):
    # K = 33 and N = 17 are multiples of no block: every tail is masked. E = 8 with k = 1, m <= 1 takes
    # the naive (no-alignment) path; the rest aligns.
    _check(interpreter, *_problem(m, k, 8, 33, 17, dtype, seed=m + k))


def test_naive_path_with_many_experts(interpreter):
    x, w13, w2, ids, weights = _problem(3, 2, 32, 33, 17, torch.bfloat16)  # A*4 = 24 <= 32: naive
    ids[1, 0] = -1  # a skipped slot: its h row is never written, so never read
    assert use_naive(ids.numel(), 32, None)
    _check(interpreter, x, w13, w2, ids, weights)


def test_empty_experts_and_all_on_one(interpreter):
    x, w13, w2, _, weights = _problem(33, 2, 8, 33, 17, torch.float32)
    ids = torch.stack([torch.full((33,), 5), torch.full((33,), 2)], 1).int()  # six experts stay empty
    _check(interpreter, x, w13, w2, ids, weights)
    ids = torch.full((33, 2), 7, dtype=torch.int32)  # every assignment on one expert, rows > one block
    _check(interpreter, x, w13, w2, ids, weights)


@pytest.mark.parametrize("options", [POISON, LaunchOptions(reuse_workspace=False, direct_eager=False)])
def test_no_slots_give_zeros(interpreter, options):
    """k = 0: every token has no expert, so its output is exactly 0 (issue 12: it was uninitialised
    memory), through the direct eager path and through the custom op alike."""
    x, w13, w2, _, _ = _problem(5, 2, 8, 33, 17, torch.float32)
    ids, weights = torch.zeros(5, 0, dtype=torch.int32), torch.zeros(5, 0)
    torch.full_like(x, float("nan"))  # recycles NaN bytes into the allocator's free blocks
    out = interpreter.experts_triton(x, w13, w2, ids, weights, options=options)
    assert torch.equal(out, torch.zeros_like(x))


def test_expert_map_and_skipped_ids(interpreter):
    x, w13, w2, _, weights = _problem(33, 6, 8, 33, 17, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(-1, 14, (33, 6), generator=g, dtype=torch.int32)  # global ids, -1 and >= 12 skipped
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1], dtype=torch.int32)  # [12] global -> local
    _check(interpreter, x, w13, w2, ids, weights, expert_map=expert_map)
    _check(interpreter, x, w13, w2, ids, weights)  # no map: ids >= E are transformers' EP skip marker


def test_non_contiguous_inputs(interpreter):
    x, w13, w2, ids, weights = _problem(33, 2, 8, 33, 17, torch.float32)
    x_nc = torch.cat([x, x], 1)[:, ::2]  # [M, K] with column stride 2
    x_nc.copy_(x)
    w13_nc = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2N, K] with K-stride 2N
    w2_nc = w2.transpose(1, 2).contiguous().transpose(1, 2)
    ids_nc, weights_nc = ids.t().contiguous().t(), weights.t().contiguous().t()
    assert not any(t.is_contiguous() for t in (x_nc, w13_nc, w2_nc, ids_nc, weights_nc))
    _check(interpreter, x_nc, w13_nc, w2_nc, ids_nc, weights_nc)


@pytest.mark.parametrize("descriptors", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_descriptors_with_tails(interpreter, descriptors, dtype):
    """16-bit weights with 16-byte rows (K=40, N=24) take the TMA descriptor path: the last N tile of
    the gate reads the up rows, the last up tile reads the next expert's rows (or past the end), K=40
    leaves a zero-filled tail of the 32-wide K tile. None of it may reach the output."""
    options = LaunchOptions(weight_descriptors=descriptors, poison_workspace=True)
    x, w13, w2, ids, weights = _problem(33, 2, 8, 40, 24, dtype)
    cfg = KernelConfig(16, GemmTile(16, 32, 2, 4, 2), GemmTile(16, 32, 1, 4, 2))
    assert descriptors_allowed(w13, w2, options) == descriptors
    out = interpreter.fused_experts(x, w13, w2, ids, weights, config=cfg, options=options)
    ref = experts_reference(x.double(), w13.double(), w2.double(), ids, weights)
    assert _rel_err(out, ref) < TOL[dtype]
    assert not descriptors_allowed(w13[:, :, :33].contiguous(), w2, POISON)  # 66-byte rows: pointers
    assert not descriptors_allowed(w13.float(), w2.float(), POISON)  # float32 keeps pointer loads


def test_dependent_launch_only_on_hopper_gpus(monkeypatch):
    """Programmatic dependent launch is asked for on NVIDIA devices of compute capability >= 9 only: never
    under the interpreter (it cannot run griddepcontrol), on the CPU, on ROCm, or when switched off."""
    from moekit.experts import triton_launch as tl_

    def resolved(options: LaunchOptions, device: torch.device) -> dict:
        tl_.resolve_launch_options.cache_clear()  # the device facts are patched below
        return tl_.resolve_launch_options(options, device).pdl_kwargs()

    off, on = dict(PDL=False, launch_pdl=False), dict(PDL=True, launch_pdl=True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    try:
        assert resolved(LaunchOptions(), cpu) == off and tl_.default_launch_options(cpu).pdl_kwargs() == off
        monkeypatch.setattr(tl_, "interpreting", lambda: False)
        assert resolved(LaunchOptions(), cpu) == off
        monkeypatch.setattr(tl_, "_major_capability_of", lambda index: 9)
        assert resolved(LaunchOptions(), cuda) == on
        assert resolved(LaunchOptions(dependent_launch=False), cuda) == off  # switched off by the caller
        monkeypatch.setattr(tl_, "_major_capability_of", lambda index: 8)
        assert resolved(LaunchOptions(), cuda) == off
        monkeypatch.setattr(tl_, "_major_capability_of", lambda index: 9)
        monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: MI300 reports capability 9.4, no griddepcontrol
        assert resolved(LaunchOptions(), cuda) == off
    finally:
        tl_.resolve_launch_options.cache_clear()  # no patched fact outlives the test


def test_launch_options_resolve_keeps_other_fields():
    asked = LaunchOptions(weight_descriptors=False, poison_workspace=True, align_small_max=0, align_small_max_bins=8)
    got = resolve_launch_options(asked, torch.device("cpu"))
    assert got == LaunchOptions(False, False, True, 0, 8)
    assert resolve_launch_options(asked, torch.device("cpu")) is got  # cached per (options, device)
    with pytest.raises(ValueError, match="align_small_max"):
        LaunchOptions(align_small_max=129)  # the single-program alignment holds one chunk of 128


def test_two_callers_launch_with_their_own_options(interpreter, launch_log):
    """Options travel with the call: interleaved callers with different options each get theirs, through
    the op (``experts_triton``) and around it (``fused_experts``, ``align_block_triton``)."""
    x, w13, w2, ids, weights = _problem(33, 2, 8, 40, 24, torch.bfloat16)
    ref = experts_reference(x.double(), w13.double(), w2.double(), ids, weights)
    a = LaunchOptions(weight_descriptors=False, align_small_max=0, poison_workspace=True, align_one_launch_max=0,
                      align_two_launch_max=0, align_fold_max=0, align_scan_fold=False)
    b = LaunchOptions(weight_descriptors=True, align_small_max_bins=1 << 20, poison_workspace=True, align_fold_max=0)
    for _ in range(2):
        for options, kernels_wanted, w_desc in ((a, {"align_hist_kernel", "align_scan_kernel"}, False),
                                                (b, {"align_small_kernel"}, True)):
            for run in (interpreter.experts_triton, interpreter.fused_experts):
                out = run(x, w13, w2, ids, weights, options=options)
                assert _rel_err(out, ref) < TOL[torch.bfloat16]
                launches = dict(launch_log.take())
                assert kernels_wanted <= set(launches), launches.keys()
                assert launches["gate_up_kernel"]["W_DESC"] == launches["down_kernel"]["W_DESC"] == w_desc
            align = align_block_triton(ids, 8, 16, options=options)
            assert torch.equal(align.sorted_ids, align_block(ids, 8, 16).sorted_ids)
            assert kernels_wanted <= {name for name, _ in launch_log.take()}


def test_compiled_caller_picks_its_options(interpreter, launch_log):
    """Under torch.compile(fullgraph=True) the options are constants of the graph: two compiled
    functions with different options launch differently and agree."""
    x, w13, w2, ids, weights = _problem(5, 2, 8, 40, 24, torch.bfloat16)
    outs = {}
    for w_desc in (False, True):
        options = LaunchOptions(weight_descriptors=w_desc, poison_workspace=True)
        fn = torch.compile(lambda *t, o=options: interpreter.experts_triton(*t, options=o),
                           fullgraph=True, backend="aot_eager")
        outs[w_desc] = fn(x, w13, w2, ids, weights)
        assert {kw["W_DESC"] for _, kw in launch_log.take() if "W_DESC" in kw} == {w_desc}
    ref = experts_reference(x.double(), w13.double(), w2.double(), ids, weights)
    assert _rel_err(outs[False], ref) < 1e-2 and _rel_err(outs[True], ref) < 1e-2


def test_float16(interpreter):
    _check(interpreter, *_problem(33, 2, 8, 33, 17, torch.float16))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_activations(interpreter, activation):
    _check(interpreter, *_problem(3, 2, 8, 33, 17, torch.float32), activation=activation)


def test_nan_padding_never_leaks(interpreter):
    # Padding rows of x's gather are masked; poisoned (NaN) workspace rows are never read. A token routed
    # nowhere gets exact zeros.
    x, w13, w2, ids, weights = _problem(3, 2, 8, 33, 17, torch.float32)
    ids[1] = -1
    out = _check(interpreter, x, w13, w2, ids, weights)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_explicit_configs_agree(interpreter):
    x, w13, w2, ids, weights = _problem(33, 2, 8, 40, 24, torch.float32)
    ref = experts_reference(x, w13, w2, ids, weights)
    for block_m in (16, 32):
        cfg = KernelConfig(block_m, GemmTile(16, 32, 2, 4, 2), GemmTile(32, 16, 1, 4, 2))
        out = interpreter.fused_experts(x, w13, w2, ids, weights, config=cfg, options=POISON)
        assert _rel_err(out, ref.double()) < 1e-5


def test_bad_arguments(interpreter):
    x, w13, w2, ids, weights = _problem(3, 2, 8, 33, 17, torch.float32)
    with pytest.raises(ValueError, match="activation"):
        interpreter.experts_triton(x, w13, w2, ids, weights, activation="tanh")
    with pytest.raises(TypeError, match="x must be one of"):
        interpreter.experts_triton(x.double(), w13.double(), w2.double(), ids, weights)
    with pytest.raises(ValueError, match="w2"):
        interpreter.experts_triton(x, w13, w2[:, :, :5], ids, weights)


# --- availability, registration, compile -------------------------------------------------------------


def test_availability(interpreter, monkeypatch):
    assert interpreter.is_available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreter.is_available("cpu")
    assert "triton" not in available_backends("cpu")  # auto on the CPU never picks the interpreter


def test_opcheck(interpreter):
    x, w13, w2, ids, weights = _problem(5, 2, 8, 33, 17, torch.float32)
    options = LaunchOptions(poison_workspace=True).as_op_args()
    plain = ("silu", True, False, 1.0, None, 0.0, False)  # activation, gated, interleaved, alpha, limit, up_shift,
    # limit_after_act
    torch.library.opcheck(torch.ops.moekit.triton_experts,
                          (x, w13, w2, ids, weights, None, None, None, *plain, *options))
    torch.library.opcheck(torch.ops.moekit.align_block_triton, (ids, 8, 16, None, False, True, 128, 64))
    torch.library.opcheck(torch.ops.moekit.align_block_triton, (ids, 8, 16, None, False, True, 0, 64))
    torch.library.opcheck(torch.ops.moekit.align_block_triton, (ids[:1, :1], 8, 16, None, True, True, 128, 64))


def test_moe_compiles_fullgraph(interpreter):
    from moekit.config import MoEConfig
    from moekit.layer import MoE

    torch.manual_seed(0)
    # The default nonfinite="raise" becomes a device-side assert under compile: still one graph.
    config = MoEConfig(hidden_size=33, moe_intermediate_size=17, num_experts=8, top_k=2)
    layer = MoE(config, backend="triton")
    x = torch.randn(2, 3, 33)
    with torch.no_grad():  # forward only: the triton ops have no backward
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager)
    layer.backend = "reference"
    with torch.no_grad():
        torch.testing.assert_close(eager, layer(x), rtol=1e-5, atol=1e-5)


# --- tuned config files ------------------------------------------------------------------------------


def test_config_lookup_nearest_and_user_dir(interpreter, tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    small = KernelConfig(16, GemmTile(32, 128), GemmTile(64, 128))
    big = KernelConfig(64, GemmTile(64, 64, 8), GemmTile(128, 64, 8, 8, 3))
    path = tmp_path / config_file_name(8, 17, 33, torch.float32, "cpu")
    write_configs(path, 8, 17, 33, torch.float32, "cpu", {1: small, 256: big})
    assert json.loads(path.read_text())["configs"]["256"]["up"]["BLOCK_N"] == 64
    assert load_configs(8, 17, 33, torch.float32, "cpu") == {1: small, 256: big}
    assert get_config(3, 8, 17, 33, 2, torch.float32, "cpu") == small  # log2 distance: 3 is nearer 1 than 256
    assert get_config(64, 8, 17, 33, 2, torch.float32, "cpu") == big
    assert nearest({1: small, 256: big}, 16) == small  # equal distance: the smaller M
    # The file changes the launch, and the result stays right.
    _check(interpreter, *_problem(33, 2, 8, 33, 17, torch.float32))
