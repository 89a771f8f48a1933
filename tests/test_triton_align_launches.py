"""The alignment's launch plans under Triton's interpreter: the one-launch ``place`` (its programs
histogram all ids themselves), hist + ``place`` (the scan folded into the scatter) and the three-launch
hist, scan, scatter each equal the torch twin ``align_block`` element for element, and each plan runs
the kernels (and the number of launches) it says."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.triton_align import align_block_triton, plan_align  # noqa: E402
from moekit.experts.triton_launch import ALIGN_CHUNK, LaunchOptions, resolve_launch_options  # noqa: E402
from moekit.layouts.block_aligned import align_block  # noqa: E402
from moekit.layouts.grouping import max_padded_rows  # noqa: E402

ONE = LaunchOptions(align_small_max=0, align_one_launch_max=8192, align_two_launch_max=0, align_fold_max=0)
TWO = LaunchOptions(align_small_max=0, align_one_launch_max=0, align_two_launch_max=1 << 30, align_fold_max=0)
THREE = LaunchOptions(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0, align_fold_max=0,
                      align_scan_fold=False)  # hist and scan as two launches (the fold: test_triton_align_scan_fold.py)
PATHS = {"one": (ONE, {"align_place_kernel"}), "two": (TWO, {"align_hist_kernel", "align_place_kernel"}),
         "three": (THREE, {"align_hist_kernel", "align_scan_kernel", "align_scatter_kernel"})}


def _ids(m: int, k: int, e: int, seed: int, with_map: bool):
    """Random ids [M, k] with skipped ones (-1, >= E); with_map: a map [E+2] with two -1 entries."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, e + 2, (m, k), generator=g, dtype=torch.int64 if seed % 2 else torch.int32)
    expert_map = None
    if with_map:
        expert_map = torch.randperm(e + 2, generator=g).int() - 2  # values -2..E-1
        expert_map[expert_map == -2] = -1
    return ids, expert_map


def _assert_twin(ids, e, block, expert_map, options):
    want = align_block(ids, e, block, expert_map, allow_naive=False)
    got = align_block_triton(ids, e, block, expert_map, allow_naive=False, options=options)
    for field in ("sorted_ids", "expert_ids", "num_padded", "counts"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b), field
    return got


# (M, k, E, B): one chunk, exactly one chunk, several chunks with a partial last one, E not a power of two,
# block sizes 16 / 64 / 128, more experts than assignments
CASES = [(1, 1, 8, 16), (16, 8, 128, 16), (40, 3, 5, 64), (300, 2, 7, 16), (70, 8, 100, 128), (33, 6, 3, 128)]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("m,k,e,block", CASES)
def test_each_path_equals_twin(launch_log, path, with_map, m, k, e, block):
    options, kernels_wanted = PATHS[path]
    ids, expert_map = _ids(m, k, e, seed=m * 31 + e + block, with_map=with_map)
    _assert_twin(ids, e, block, expert_map, options)
    ran = [name for name, _ in launch_log.take()]
    assert set(ran) == kernels_wanted and len(ran) == len(kernels_wanted)


@pytest.mark.parametrize("path", list(PATHS))
def test_empty_batch(path):
    """A = 0: counts 0, num_padded 0, no rows (whatever path the options ask for)."""
    got = _assert_twin(torch.empty(0, 4, dtype=torch.int32), 6, 16, None, PATHS[path][0])
    assert got.sorted_ids.numel() == 0 and int(got.num_padded) == 0


@pytest.mark.parametrize("path", ["one", "two"])
def test_all_on_one_expert_and_all_skipped(path):
    """Every assignment on one expert (a run over many blocks and chunks), then none routed here."""
    options = PATHS[path][0]
    _assert_twin(torch.full((130, 2), 3, dtype=torch.int64), 5, 16, None, options)
    got = _assert_twin(torch.full((50, 2), -1, dtype=torch.int64), 5, 16, None, options)
    assert int(got.num_padded) == 0 and torch.all(got.expert_ids == -1)


def test_default_options_pick_by_size():
    """The defaults: up to align_one_launch_max assignments one launch, up to align_two_launch_max two,
    then three; the single-program kernel for one chunk and few bins stays first."""
    opts = resolve_launch_options(LaunchOptions(), torch.device("cpu"))

    def launches(a, e=128):
        plan = plan_align(a, e, 64, None, max_padded_rows(a, e, 64), opts)
        return plan.launches, plan.small is not None

    assert launches(64, e=8) == (1, True)  # 16 bins <= align_small_max_bins
    assert launches(64) == (1, False) and launches(opts.align_one_launch_max) == (1, False)
    assert launches(opts.align_one_launch_max + 1) == (2, False) and launches(opts.align_two_launch_max) == (2, False)
    assert launches(opts.align_two_launch_max + 1) == (3, False)
    assert -(-opts.align_two_launch_max // ALIGN_CHUNK) <= 32  # each program sums at most 32 histogram rows


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="align_one_launch_max"):
        LaunchOptions(align_one_launch_max=1 << 20)
    with pytest.raises(ValueError, match="align_two_launch_max"):
        LaunchOptions(align_two_launch_max=-1)


def test_fused_experts_on_each_path(interpreter, launch_log):
    """The whole experts call agrees across the three alignment plans and the folded one (same GEMMs,
    same layout)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 40, generator=g)
    w13, w2 = torch.randn(6, 48, 40, generator=g) / 7, torch.randn(6, 40, 24, generator=g) / 5
    ids = torch.randint(0, 6, (70, 2), generator=g)
    weights = torch.rand(70, 2, generator=g)
    outs = {}
    for path, (options, kernels_wanted) in PATHS.items():
        outs[path] = interpreter.experts_triton(x, w13, w2, ids, weights, options=options)
        assert kernels_wanted <= {name for name, _ in launch_log.take()}
    assert torch.equal(outs["one"], outs["three"]) and torch.equal(outs["two"], outs["three"])
    folded = interpreter.experts_triton(x, w13, w2, ids, weights, options=LaunchOptions(align_fold_max=140))
    assert not any(name.startswith("align_") for name, _ in launch_log.take())
    assert torch.equal(folded, outs["three"])


def test_opcheck_align_op_with_each_path():
    ids = torch.randint(0, 8, (70, 2), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    for one, two in ((512, 4096), (0, 4096), (0, 0)):
        torch.library.opcheck(torch.ops.moekit.align_block_triton, (ids, 8, 16, None, False, True, 0, 64, one, two))
