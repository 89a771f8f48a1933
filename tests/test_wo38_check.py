"""The mid-batch weight-only device check's logic on the CPU (``benchmarks/wo38_device_check.py``, ``wo38_variants.py``,
``compile_workers.task_status``): the cells' text, which variants a cell runs by the rows an expert receives, the
compile tasks shared between cells, the workers' task states read from their logs, the table's win. Nothing here
compiles or times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import compile_workers  # noqa: E402
import wo38_device_check as check  # noqa: E402
from wo38_variants import CellSpec, variants  # noqa: E402

H200 = "NVIDIA_H200"


def test_a_cell_is_scheme_preset_and_m():
    assert CellSpec.parse("int4:mixtral-8x7b:512") == CellSpec("int4_w4a16", "mixtral-8x7b", 512)
    for bad in ("int3:mixtral-8x7b:512", "int4:mixtral-8x7b", "mxfp4:qwen3-30b-a3b:many"):
        with pytest.raises(ValueError, match="--cells takes SCHEME:PRESET:M"):
            CellSpec.parse(bad)


def test_variants_follow_the_rows_an_expert_receives():
    # Mixtral int4 M = 256: 64 rows an expert. The route runs the Gluon path (session 38), the 128-row tile heuristic
    # where the device has none; 16-row blocks and the register decode up to 64 rows run, 128-row tiles from 48, no
    # 16-row tile decode (32 rows at most)
    mixtral = variants(CellSpec.parse("int4:mixtral-8x7b:256"), H200, gluon_ok=True)
    assert mixtral["pick"] == mixtral["gluonM"] and mixtral["pick"].decode == "gluon"
    assert {"mma16", "mma64", "reg", "tile128", "scratch", "gluon"} <= set(mixtral)
    assert "tile16g8" not in mixtral
    off_hopper = variants(CellSpec.parse("int4:mixtral-8x7b:256"), H200, gluon_ok=False)["pick"]
    assert off_hopper.decode == "tile" and off_hopper.config.BLOCK_M == 128
    # DeepSeek-V3 M = 512: 16 rows an expert, the route's mma decode in 16-row blocks (session 38). No scratch (256
    # experts), no 64-row variant, none of the Gluon path where the device has none
    deepseek = variants(CellSpec.parse("mxfp4:deepseek-v3:512"), H200, gluon_ok=False)
    assert deepseek["pick"] == deepseek["mma16"] and deepseek["pick"].config.BLOCK_M == 16
    assert {"mma32", "tile16g8", "tile32"} <= set(deepseek)
    assert not {"scratch", "gluon", "gluonM", "tile64", "mma64"} & set(deepseek)


def test_a_variant_compiles_once_per_preset():
    specs = [CellSpec.parse(c) for c in ("int4:mixtral-8x7b:256", "int4:mixtral-8x7b:512", "int4:qwen3-30b-a3b:256")]
    tasks, index = check.compile_tasks(specs, H200, gluon_ok=True)
    assert index[(0, "tile128")] == index[(1, "tile128")]  # the same config, preset and scheme: one task
    assert index[(1, "pick")] == index[(0, "gluonM")]  # M = 512's pick: the Gluon path with the shape's options
    assert index[(0, "mma32")] != index[(2, "mma32")]  # another preset: its own task (E = 8 specialises apart)
    assert sorted(set(index.values())) == list(range(len(tasks)))
    assert [t[0] for t in tasks] == sorted(t[0] for t in tasks)  # the first cell's tasks first


def test_task_status_reads_the_workers_logs(tmp_path):
    log = tmp_path / "w.log"
    log.write_text("START 0 0\nOK 0 0\nSTART 1 0\nERR 1 0 ValueError: 'no'\nSTART 2 0\nnoise\n")
    assert compile_workers.task_status([(None, log)]) == {(0, 0): "ok", (1, 0): "error: ValueError: 'no'",
                                                          (2, 0): "crashed"}


def test_the_table_names_a_win_only_in_five_of_five_rounds():
    named = {"pick": "tile m128", "a": "mma m32", "b": "gluon"}
    cell = check.Cell("int4_w4a16", "mixtral-8x7b", 256, 64.0, H200, named)
    cell.rounds = {"pick": [100.0] * 5, "a": [96.0] * 4 + [98.0], "b": [90.0] * 5}
    cell.times = {name: sorted(v)[2] for name, v in cell.rounds.items()}
    lines = check.rows(cell)
    assert "faster 4/5" in next(line for line in lines if line.strip().startswith("a "))
    assert lines[-1].strip() == "best b: x1.111, 5/5 rounds >= 3% faster  <- a win"
    cell.rounds["b"][2] = 97.5  # one round only 2.5% faster
    assert "a win" not in check.rows(cell)[-1]
