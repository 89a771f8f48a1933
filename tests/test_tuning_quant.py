"""``moekit tune --dtype fp8_block|int8_w8a16|int4_w4a16|mxfp4`` on the CPU: every candidate config is
one the scheme's own plan builds (its config checks called, not restated here); a tune with a fake
timer writes the file the plan's lookup then returns, for the tuned M and the nearest M; each scheme's
timed call computes the experts (under Triton's interpreter, against ``experts_reference`` on the
same quantized weights); ``--install``; the compile-only pass of the precompile; the CLI's errors.
The timing itself needs the GPU (``moekit tune`` there)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import cli_error, rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit.bench import tuning, tuning_quant  # noqa: E402
from moekit.bench.cells import PRESETS, Shape, make_sets  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.triton_bind import BoundLaunch  # noqa: E402

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)
CPU = torch.device("cpu")
BATCHES = (1, 8, 64, 512, 4096, 16384)


@pytest.fixture(scope="module")
def paths():
    """The fp8 and weight-only launchers, their kernels decorated under the interpreter."""
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as fp8, \
            interpreted("moekit.experts", "moekit.experts.triton_wo") as wo:
        yield fp8, wo


def searched(scheme: tuning.TuneScheme, shape: Shape, m: int) -> list[KernelConfig]:
    """Every config ``tune_one`` times for one M (its timer replaced by one that records them)."""
    seen: list[KernelConfig] = []

    def fake_timer(shape, num_tokens, scheme, device, weights):
        def measure(configs: list[KernelConfig]) -> list[float]:
            seen.extend(configs)
            return [1.0] * len(configs)
        return measure

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tuning, "_timer", fake_timer)
        tuning.tune_one(shape, m, scheme, CPU, None)
    return seen


def fp8_plan_builder(fp8):
    """Builds the fp8 plan of a small call with an explicit config (no kernel runs): ``build_plan``
    calls the plan's config check."""
    from moekit.experts.triton_fp8_plan import build_plan

    x = torch.randn(8, 160)
    w13, w2 = torch.zeros(4, 192, 160).to(torch.float8_e4m3fn), torch.zeros(4, 160, 96).to(torch.float8_e4m3fn)
    s13, s2 = torch.ones(4, 2, 2), torch.ones(4, 2, 1)
    ids = torch.randint(0, 4, (8, 2), dtype=torch.int32)
    return lambda config: build_plan(x, w13, s13, w2, s2, ids, None, (128, 128), config, LaunchOptions())


def wo_plan_builder(wo, scheme: str, decode: str):
    """Builds the weight-only plan of a small call with an explicit config and decode (no kernel runs)."""
    from moekit.experts.triton_wo_plan import build_wo_plan

    e, n, hidden, group = 4, 96, 160, {"int4_w4a16": 128, "mxfp4": 32}.get(scheme, 0)

    def args(r: int, c: int):
        if scheme == "int8_w8a16":
            return wo.weight_args(torch.zeros(e, r, c, dtype=torch.int8), torch.ones(e, r), None, 0)
        groups, packed = -(-c // group), torch.zeros(e, r, -(-c // 2), dtype=torch.uint8)
        zero = torch.zeros(e, r, groups, dtype=torch.uint8) if scheme == "int4_w4a16" else None
        scale = torch.ones(e, r, groups) if scheme == "int4_w4a16" else torch.zeros(e, r, groups, dtype=torch.uint8)
        return wo.weight_args(packed, scale, zero, group)

    x, ids = torch.randn(8, hidden, dtype=torch.bfloat16), torch.randint(0, e, (8, 2), dtype=torch.int32)
    a13, a2 = args(2 * n, hidden), args(hidden, n)
    return lambda config: build_wo_plan(x, a13, a2, ids, None, scheme, "silu", config, LaunchOptions(), decode=decode)


@pytest.mark.parametrize("name", tuning_quant.QUANT_SCHEMES)
def test_every_candidate_is_built_by_the_schemes_plan(paths, name):
    fp8, wo = paths
    scheme = tuning.scheme_for(name)
    build = fp8_plan_builder(fp8) if name == "fp8_block" else wo_plan_builder(wo, *tuning_quant.WO_TUNE_NAMES[name])
    for preset in PRESETS:
        shape = Shape.from_preset(preset)
        for m in BATCHES:
            configs = set(searched(scheme, shape, m))
            # a few dozen per M at most; fp8 adds a stage of switches per height (up to 11 combinations each,
            # tests/test_tuning_switches.py checks them against the plan at their own M)
            assert 1 < len(configs) <= (96 if name == "fp8_block" else 48), (preset, m, len(configs))
            for config in configs:
                build(tuning.tiles_of(config))  # raises where the plan refuses the config's tiles
                scheme.validate(config)


def test_fp8_candidates_keep_the_block_rules():
    """BLOCK_K of both GEMMs is the scale block 128 (checked by the plan's own ``check_config`` above);
    here: the narrow gate-up tiles that hand h over in float32 are among the decode candidates."""
    from moekit.experts.triton_fp8_plan import check_config

    scheme = tuning.scheme_for("fp8_block")
    decode = searched(scheme, Shape.from_preset("deepseek-v3"), 1)
    assert {c.up.BLOCK_N for c in decode} >= {16, 32, 64, 128}
    with pytest.raises(ValueError, match="BLOCK_K"):
        check_config(replace(decode[0], up=GemmTile(64, 64)), 128)  # the check the candidates pass bites
    with pytest.raises(ValueError, match="BLOCK_K"):
        scheme.validate(replace(decode[0], down=GemmTile(64, 256)))


def _fake_timer(shape, num_tokens, scheme, device, weights):
    """Deterministic, fastest (100 µs) at a gate-up tile 128 wide with 3 stages and a down tile 64 wide
    (candidates of every scheme and height; no heuristic picks all three at the shapes tested)."""
    def cost(c: KernelConfig) -> float:
        return 100.0 + abs(c.up.BLOCK_N - 128) + 10 * abs(c.up.num_stages - 3) + abs(c.down.BLOCK_N - 64)
    return lambda configs: [cost(c) for c in configs]


def _lookup(name: str, m: int, shape: Shape) -> KernelConfig:
    """What the scheme's plan picks for M with no explicit config (tuned file, else heuristic)."""
    from moekit.experts.triton_fp8_plan import fp8_config
    from moekit.experts.triton_wo_configs import wo_config

    if name == "fp8_block":
        return fp8_config(m, shape.num_experts, shape.n, shape.k, shape.top_k, 128, "cpu")
    return wo_config(m, shape.num_experts, shape.n, shape.k, shape.top_k, *_wo_scheme_decode(name, "cpu"))


def _wo_scheme_decode(name: str, device: str) -> tuple[str, str, str]:
    """(scheme, device, decode) of a weight-only tune name: wo_config's last three arguments."""
    scheme, decode = tuning_quant.WO_TUNE_NAMES[name]
    return scheme, device, decode


@pytest.mark.parametrize("name", tuning_quant.QUANT_SCHEMES)
def test_tuned_file_is_what_the_plan_looks_up(user_config_dir, monkeypatch, name):
    monkeypatch.setattr(tuning, "_timer", _fake_timer)
    heuristic = tuning.scheme_for(name).heuristic
    assert _lookup(name, 1, TINY) == heuristic(1, TINY)  # no file yet
    path = tuning.tune(TINY, [1, 64], name, device="cpu")
    assert path.parent == user_config_dir and not path.with_suffix(".partial.json").exists()
    data = json.loads(path.read_text())
    assert data["dtype"] == name and (data["E"], data["N"], data["K"]) == (8, 24, 40)
    for tuned_m, other_m in ((1, 2), (64, 50)):
        entry = KernelConfig.from_dict(data["configs"][str(tuned_m)])
        assert (entry.up.BLOCK_N, entry.up.num_stages, entry.down.BLOCK_N) == (128, 3, 64)  # the fake's winner
        assert entry != heuristic(tuned_m, TINY)  # so the lookups below read the file
        assert _lookup(name, tuned_m, TINY) == entry
        assert _lookup(name, other_m, TINY) == entry  # the nearest tuned M
        assert data["measured"][str(tuned_m)]["us"] < data["measured"][str(tuned_m)]["heuristic_us"]


@pytest.mark.parametrize("name", tuning_quant.QUANT_SCHEMES)
def test_timed_call_computes_the_experts(paths, name):
    """The call the tuner times, on the weights it makes, against the reference on the same quantized
    weights (fp8: the recipe's activation quantization included; bf16 output)."""
    scheme = tuning.scheme_for(name)
    scheme_name = tuning_quant.WO_TUNE_NAMES.get(name, (name,))[0]  # the weight-only names' quantization scheme
    q13, q2 = tuning_quant._quantized(scheme_name, TINY, CPU)  # what ``make_weights`` quantizes, seed for seed
    weights = scheme.make_weights(TINY, CPU)
    for m in (1, 9):  # the naive shortcut and the aligned path
        s = make_sets(TINY, m, 1, scheme.x_dtype, CPU, seed=m)[0]
        out = scheme.call(weights, s, scheme.heuristic(m, TINY))
        ref = experts_reference(s.x, q13, q2, s.topk_ids, s.topk_weights)
        assert out.dtype == torch.bfloat16 and rel_l2(out, ref) < 2e-2, (m, rel_l2(out, ref))


def test_install_checks_then_copies(user_config_dir, monkeypatch, tmp_path_factory):
    monkeypatch.setattr(tuning, "_timer", _fake_timer)
    packaged = tmp_path_factory.mktemp("packaged")
    path = tuning.tune(TINY, [1], "fp8_block", device="cpu")
    assert tuning.install(path, packaged).read_text() == path.read_text()
    renamed = path.with_name("E8_N24_K41_fp8_block_cpu.json")
    renamed.write_text(path.read_text())
    with pytest.raises(ValueError, match="must be named E8_N24_K40_fp8_block_cpu.json"):
        tuning.install(renamed, packaged)
    data = json.loads(path.read_text())
    data["configs"]["1"]["up"]["BLOCK_K"] = 64
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="M=1: .*BLOCK_K"):
        tuning.install(path, packaged)
    partial = path.with_suffix(".partial.json")
    partial.write_text(json.dumps({"configs": {}, "measured": {}}))
    with pytest.raises(ValueError, match="not a tuned config file"):
        tuning.install(partial, packaged)
    assert [p.name for p in packaged.iterdir()] == [path.name]


def test_install_cli(user_config_dir, monkeypatch, tmp_path_factory, capsys):
    monkeypatch.setattr(tuning, "_timer", _fake_timer)
    monkeypatch.setattr(tuning, "PACKAGED_DIR", tmp_path_factory.mktemp("packaged"))
    good = tuning.tune(TINY, [1], "int4_w4a16", device="cpu")
    partial = good.with_name("E1_N2_K3_mxfp4_cpu.partial.json")
    partial.write_text("{}")
    bad = good.with_name("E8_N24_K40_mxfp4_cpu.json")
    bad.write_text(good.read_text())  # an int4 file under an mxfp4 name
    assert "--install" in cli_error(capsys, ["tune", "--install", str(good), str(bad)])
    assert not list(tuning.PACKAGED_DIR.iterdir())  # nothing copied: every file is checked first
    from moekit.cli import main

    assert main(["tune", "--install", str(good), str(partial)]) == 0
    out = capsys.readouterr().out
    assert f"skipped {partial}" in out and "installed" in out
    assert [p.name for p in tuning.PACKAGED_DIR.iterdir()] == [good.name]
    assert "--install" in cli_error(capsys, ["tune", "--install", str(good), "--preset", "qwen3-30b-a3b"])


def test_cli_takes_every_tune_name():
    # ``moekit tune --dtype`` offers each format the tuner has, the register decode's names included
    from moekit.cli.tune import DTYPES

    assert set(DTYPES) == {*tuning.FLOAT_DTYPES, *tuning_quant.QUANT_SCHEMES}


@pytest.mark.parametrize("argv, flag", [
    (["tune", "--preset", "qwen3-30b-a3b", "--dtype", "int3_w3a16"], "--dtype"),
    (["tune", "--preset", "qwen3-30b-a3b", "--dtype", "fp8"], "--dtype"),
    (["tune", "--install", "no/such/file.json"], "--install"),
])
def test_cli_refuses_naming_the_flag(argv, flag, capsys):
    assert flag in cli_error(capsys, argv)


def test_cli_refuses_a_shape_the_scheme_cannot_take(capsys, monkeypatch):
    """What the path's own argument check raises for the shape, before any weights are made, naming
    --dtype (no shape is refused by today's paths: a stand-in check refuses this one)."""
    def refuse(scheme, shape, device):
        raise ValueError(f"{scheme} needs an even K, got {shape.k}")

    monkeypatch.setattr(tuning_quant, "_check_shape", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check
    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("tuned a refused shape"))
    line = cli_error(capsys, ["tune", "--shape", "8,24,41,2", "--dtype", "mxfp4"])
    assert "--dtype mxfp4 cannot take E8_N24_K41_k2" in line and "needs an even K, got 41" in line


@pytest.mark.parametrize("name", tuning_quant.QUANT_SCHEMES)
def test_shape_check_passes_shapes_with_tails(name):
    for shape in (TINY, Shape("odd", 3, 25, 41, 2), Shape("wide", 2, 200, 136, 1)):  # the paths take tails
        tuning.scheme_for(name).check_shape(shape, CPU)


class _Kernel:
    """Stands in for a Triton kernel: records launches (``kernel[grid](...)``) and warmups."""

    def __init__(self):
        self.log = []

    @staticmethod
    def fn(a, b, n, BLOCK):  # the kernel's signature, which BoundLaunch binds to
        pass

    def warmup(self, *args, grid, **options):
        self.log.append(("warmup", args, grid, options))

    def __getitem__(self, grid):
        return lambda *args, **options: self.log.append(("launch", args, grid, options))


def test_compile_only_warms_the_same_arguments_and_restores_the_launch():
    kernel = _Kernel()
    launch = BoundLaunch(kernel, (3,), 2, (5,), False, BLOCK=16, num_warps=4)
    with tuning._compile_only():
        launch("a", "b")
    launch("a", "b")
    # the trailing parameter by name in both, as Triton reads compile options (a Gluon kernel's num_warps) by name;
    # FP fusion asked for by the warm-up as by the launch (moekit.triton_bind.COMPILE_OPTIONS)
    named = {"BLOCK": 16, "enable_fp_fusion": True, "num_warps": 4}
    assert kernel.log == [("warmup", ("a", "b", 5), (3, 1, 1), named), ("launch", ("a", "b", 5), (3, 1, 1), named)]
    with pytest.raises(RuntimeError), tuning._compile_only():
        raise RuntimeError("a failed pass")
    launch("c", "d")
    assert kernel.log[-1][0] == "launch"  # restored after an exception too


def test_precompile_warms_every_call_inside_async_compile(monkeypatch):
    """The orchestration (Triton's AsyncCompileMode itself is exercised on the GPU): every call's
    launches become warmups inside one async-compile scope, and a call that raises skips only itself."""
    scopes = []

    class FakeAsyncCompileMode:
        def __init__(self, pool, ignore_errors=False):
            scopes.append(("enter", ignore_errors))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            scopes.append(("exit", None))

    monkeypatch.setattr(triton, "AsyncCompileMode", FakeAsyncCompileMode, raising=False)
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    kernel = _Kernel()
    launch = BoundLaunch(kernel, (2,), 2, (5,), False, BLOCK=16)

    def broken():
        raise RuntimeError("a config whose plan cannot be built")

    tuning.precompile([lambda: launch("a", "b"), broken, lambda: launch("c", "d")], torch.device("cuda"))
    assert scopes == [("enter", True), ("exit", None)]
    named = {"BLOCK": 16, "enable_fp_fusion": True}
    assert [(kind, args, kw) for kind, args, _, kw in kernel.log] == [("warmup", ("a", "b", 5), named),
                                                                      ("warmup", ("c", "d", 5), named)]
    tuning.precompile([lambda: launch("e", "f")], CPU)  # nothing to compile off the GPU
    assert len(kernel.log) == 2 and len(scopes) == 2
