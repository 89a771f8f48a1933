"""``moekit bench --hf --hf-quant <scheme> --hf-quant-options name=value,...``: the scheme's quantizer options reach
the quantized blocks (their bytes and zero points against closed forms), the JSON records them, and every bad value
is one line naming the flag. The options' own effect on a block: tests/test_hf_swap_quant_options.py.

Shapes: E experts, K hidden width, N expert width, g the int4 group size."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config, use_impl  # noqa: E402
from moekit.bench.hf_wo import BLOCK_QUANTS, QUANT_BLOCKS_IMPL  # noqa: E402
from moekit.cli import main  # noqa: E402
from moekit.cli._quant_options import parse_quant_options  # noqa: E402

from _helpers import cli_error  # noqa: E402

SMALL = ["--layers", "1", "--decode-tokens", "2", "--repeats", "1", "--prefill-len", "8", "--no-compile"]


def _int4_bytes(e: int, rows: int, cols: int, g: int) -> int:
    """An int4_w4a16 weight [E, R, C]: packed codes ceil(C/2) bytes a row, a float32 scale and a uint8 zero a group."""
    groups = math.ceil(cols / g)
    return e * rows * (math.ceil(cols / 2) + 4 * groups + groups)


def test_the_options_reach_the_blocks_and_the_json(tmp_path, capsys):
    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", "--hf-quant", "int4_w4a16",
            "--hf-quant-options", "group_size=32, symmetric=true", "--hf-impls", "moekit_blocks", *SMALL,
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-int4_w4a16-*.json")
    assert path.name.startswith("cpu-hf-int4_w4a16-group_size32-symmetrictrue-20")  # the options, then the date
    doc = json.loads(path.read_text())
    assert doc["quant"]["options"] == {"group_size": 32, "symmetric": True}
    assert doc["settings"]["quant_options"] == [["group_size", 32], ["symmetric", True]]
    assert "quant='int4_w4a16', quant_options={'group_size': 32, 'symmetric': True})" in doc["method"]
    cfg = hf_config("qwen3", 1, tiny=True)
    e, k, n = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    quant_bytes = doc["quant"]["memory"]["experts_quant_bytes"]  # the blocks freed with the same options
    assert quant_bytes == _int4_bytes(e, 2 * n, k, 32) + _int4_bytes(e, k, n, 32)
    assert quant_bytes != _int4_bytes(e, 2 * n, k, 128) + _int4_bytes(e, k, n, 128)  # the default: another size
    title = " ".join(capsys.readouterr().out.split())  # the table's title, wrapped at the console's width
    assert "its blocks' experts int4_w4a16 (group_size=32, symmetric=True)" in title


def test_use_impl_quantizes_with_the_options():
    """The bench's quantized row through ``use_impl``: symmetric int4 stores every zero point at 8, group 64 gives
    ceil(K / 64) groups a row of w13 [E, 2N, K]."""
    model = build_model(hf_config("qwen3", 1, tiny=True), torch.float32, torch.device("cpu"))
    options = parse_quant_options("symmetric=true,group_size=32", "int4_w4a16", BLOCK_QUANTS)
    use_impl(model, QUANT_BLOCKS_IMPL, "int4_w4a16", options)
    (swap,) = [m.__dict__["_moekit_swap"] for m in model.modules() if "_moekit_swap" in m.__dict__]
    w13 = swap.moe.w13
    assert w13.group_size == 32 and w13.scale.shape[-1] == math.ceil(w13.shape[-1] / 32)
    assert torch.all(w13.zero == 8) and torch.all(swap.moe.w2.zero == 8)


@pytest.mark.parametrize(("text", "quant", "want"), [
    ("group_size=64", "int4_w4a16", (("group_size", 64),)),
    ("symmetric=false,group_size=128", "int4_w4a16", ()),  # the defaults: the same swap as no options
    ("block_shape=64x128", "fp8_block", (("block_shape", (64, 128)),)),
    (None, "mxfp4", ()),
])
def test_values_take_the_defaults_types(text, quant, want):
    assert parse_quant_options(text, quant, BLOCK_QUANTS) == want


@pytest.mark.parametrize(("argv", "said"), [
    (["--hf-quant-options", "group_size=64"], "need --hf-quant one of .*got --hf-quant None"),
    (["--hf-quant", "fp8", "--hf-quant-options", "block_shape=64x64"], "got --hf-quant fp8"),
    (["--hf-quant", "mxfp4", "--hf-quant-options", "group_size=64"], "'group_size' is not an option of --hf-quant "
                                                                      "mxfp4; it takes none"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_sise=64"], r"takes \['group_size', 'symmetric'\]"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_size=48"], r"group_size must be one of \(32, 64, "),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_size=6.4"], "group_size must be an integer"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "symmetric=yes"], "symmetric must be true or false"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_size"], "must be name=value pairs"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_size=64,"], "must be name=value pairs"),
    (["--hf-quant", "int4_w4a16", "--hf-quant-options", "group_size=64,group_size=32"], "given twice"),
    (["--hf-quant", "fp8_block", "--hf-quant-options", "block_shape=64"], "block_shape must be 2 integers as NxN"),
    (["--hf-quant", "fp8_block", "--hf-quant-options", "block_shape=0x64"], "block_shape"),
])
def test_bad_options_are_one_line_naming_the_flag(argv, said, capsys):
    line = cli_error(capsys, ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3", *argv])
    assert line.startswith("moekit bench: error: --hf-quant-options") and re.search(said, line), line


def test_the_flag_outside_hf_is_refused(capsys):
    line = cli_error(capsys, ["bench", "--hf-quant-options", "group_size=64"])
    assert line == "moekit bench: error: --hf-quant-options applies to --hf, which this run is not"
