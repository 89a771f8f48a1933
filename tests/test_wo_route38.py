"""The weight-only route at mid batches takes what sessions 38 and 39 measured faster
(``benchmarks/wo38_device_check.py``, one H100, every call PASS, >= 3% faster than the route before in 5 of 5 rounds;
the figures in the tables' comments): the Gluon path for Mixtral-8x7B from M = 128 (int4, int8) / 256 (mxfp4) and
DeepSeek-V3 from M = 1024 (int4, int8) / 2048 (mxfp4), the mma decode for Mixtral mxfp4 M = 128..255, DeepSeek-V3 int4 /
mxfp4 M = 512, Qwen3 4-bit M = 256 and mxfp4 M = 512, DeepSeek-V3 int8 M = 512 on the 32-row tile and mxfp4 M = 1448 on
the 64-row tile, and the neighbouring M each table row serves. The decision alone: meta tensors, no kernel runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moekit.experts.triton_gluon_wo as tgw
from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_wo import _runs_gluon
from moekit.experts.triton_wo_configs import wo_config
from moekit.experts.triton_wo_plan import choose_decode

MIXTRAL, DEEPSEEK, QWEN3 = (8, 14336, 4096, 2), (256, 2048, 7168, 8), (128, 768, 2048, 8)  # E, N, K, top_k
T128 = GemmTile(32, 128, 1, 1, 3)  # the mma decode's tiles
PACK = {"int8_w8a16": 1, "int4_w4a16": 2, "mxfp4": 2}


def _weight(scheme: str, e: int, rows: int, cols: int) -> SimpleNamespace:
    """A weight's layout on the meta device, as ``gluon_wo_unfit`` reads it (int4: group 128 with zero points)."""
    q = torch.empty(e, rows, cols // PACK[scheme], dtype=torch.int8 if scheme == "int8_w8a16" else torch.uint8,
                    device="meta")
    groups = torch.empty(e, rows, cols // 128, device="meta")
    zero = groups.to(torch.uint8) if scheme == "int4_w4a16" else None
    return SimpleNamespace(q=q, scale=groups, zero=zero, group_size=128 if scheme == "int4_w4a16" else 32)


def _gluon(scheme: str, m: int, shape: tuple, monkeypatch) -> tgw.GluonWoGemms | None:
    """The GEMM options the route's call of M tokens runs on the Gluon path (a Hopper with Gluon), or None where it
    keeps the Triton decodes."""
    monkeypatch.setattr(tgw, "gluon_supported", lambda device: True)
    e, n, k, top_k = shape
    w13, w2 = _weight(scheme, e, 2 * n, k), _weight(scheme, e, k, n)
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    ids = torch.empty(m, top_k, dtype=torch.int32, device="meta")
    if not _runs_gluon(x, w13, w2, ids, scheme, "silu", None, None, None):
        return None
    return tgw.wo_options(w13, w2, scheme, m)


@pytest.mark.parametrize("scheme,lo,on", [
    ("int4_w4a16", 128, {"split", "swap"}),  # M=128 764.4 against 817.3 µs
    ("mxfp4", 256, {"split", "fast"}),  # M=256 883.8 against 1513.8
    ("int8_w8a16", 128, {"split", "fast", "swap"}),  # M=128 648.1 against 783.9 (session 39), M=256 656.9 / 978.9
])
def test_mixtral_takes_the_gluon_path_from_where_it_won(monkeypatch, scheme, lo, on):
    # the GEMM options measured: the shape's (GLUON_WO_OPTIONS'), not the session-27 GEMMs (1.2-1.5x slower there)
    options = tgw.GLUON_WO_OPTIONS[(scheme, *MIXTRAL[:3])].gemms
    assert options.up == options.down and {f for f in ("split", "fast", "swap") if getattr(options.up, f)} == on
    for m in (lo, 256, 384, 512, 1024):
        assert _gluon(scheme, m, MIXTRAL, monkeypatch) == options, m
    assert _gluon(scheme, lo - 1, MIXTRAL, monkeypatch) is None
    assert _gluon(scheme, 512, DEEPSEEK, monkeypatch) is None  # the other shapes keep their cells
    monkeypatch.setattr(tgw, "gluon_supported", lambda device: False)  # off Hopper: the Triton decodes
    assert _runs_gluon(torch.empty(512, 4096, dtype=torch.bfloat16, device="meta"), _weight(scheme, 8, 28672, 4096),
                       _weight(scheme, 8, 4096, 14336), torch.empty(512, 2, device="meta"), scheme, "silu", None, None,
                       None) is False


def test_below_the_gluon_path_mixtral_keeps_the_mma_decode():
    # int4 to M = 127: the M = 64 row's mma in 16-row blocks; mxfp4 M = 128..255 (32 rows an expert): 32-row blocks,
    # two-sided (744.7 against the 64-row tile's 833.9 µs), below it the M = 64 row's halves
    assert choose_decode("int4_w4a16", 127, *MIXTRAL) == "mma"
    for m in (128, 200, 255):
        assert choose_decode("mxfp4", m, *MIXTRAL) == "mma"
        assert wo_config(m, *MIXTRAL, "mxfp4", "nowhere", "mma") == KernelConfig(32, T128, T128)
    assert wo_config(127, *MIXTRAL, "mxfp4", "nowhere", "mma").halves


def test_deepseek_m512_takes_the_16_row_decodes():
    # int4 / mxfp4 M = 512: the mma decode's 16-row blocks (3611.7 / 3376.7 against the 64-row tile's 5974.2 /
    # 6044.4 µs) to M = 724, where the M = 1024 rows are nearer; int8 the 32-row tile (4257.9 against 5755.5)
    for scheme in ("int4_w4a16", "mxfp4"):
        for m in (256, 512, 724):
            assert choose_decode(scheme, m, *DEEPSEEK) == "mma", (scheme, m)
            assert wo_config(m, *DEEPSEEK, scheme, "nowhere", "mma") == KernelConfig(16, T128, T128)
    assert choose_decode("int4_w4a16", 725, *DEEPSEEK) == "tile"  # M = 1024's row, unchanged (see its comment)
    assert wo_config(1024, *DEEPSEEK, "int4_w4a16", "nowhere").BLOCK_M == 64
    assert {m: wo_config(m, *DEEPSEEK, "int8_w8a16", "nowhere").BLOCK_M for m in (256, 511, 512, 724, 725, 1024)} == {
        256: 16, 511: 16, 512: 32, 724: 32, 725: 64, 1024: 64}
    assert {choose_decode("int8_w8a16", m, *DEEPSEEK) for m in (256, 512, 1024)} == {"tile"}


def test_deepseek_mxfp4_m1024_takes_the_32_row_mma_decode_and_m1448_the_64_row_tile():
    # 5100.6 against the 64-row tile's 6209.0 µs (16-row blocks 5452.4): 725..1217 on the mma decode, 1024.. in 32-row
    # blocks; session 39: at 1448 the 64-row tile 6192.0 against that mma decode's 6952.4, 1218..2047
    for m in (725, 1024, 1217):
        assert choose_decode("mxfp4", m, *DEEPSEEK) == "mma"
    assert {m: wo_config(m, *DEEPSEEK, "mxfp4", "nowhere", "mma").BLOCK_M for m in (725, 1023, 1024, 1217)} == {
        725: 16, 1023: 16, 1024: 32, 1217: 32}
    for m in (1218, 1448, 2047, 2048, 2435):  # from 2048 the Gluon path on Hopper; this row where it does not run
        assert choose_decode("mxfp4", m, *DEEPSEEK) == "tile"
        cfg = wo_config(m, *DEEPSEEK, "mxfp4", "nowhere")
        assert (cfg.BLOCK_M, cfg.up, cfg.down, cfg.ahead) == (64, GemmTile(64, 64, 1, 4, 4), GemmTile(64, 64, 1, 4, 4),
                                                               False)


def test_qwen3_4bit_takes_the_mma_decode_to_m511():
    # M = 256 (16 rows an expert): 227.8 / 211.0 against the 32-row tile's 475.7 / 377.5 µs; mxfp4 M = 8..128
    # (96.7-174.9 against the tile / register decodes' 130.5-280.7); int4 M = 512: the 64-row tile stayed the fastest
    assert {m: choose_decode("int4_w4a16", m, *QWEN3) for m in (64, 256, 511, 512)} == {
        64: "mma", 256: "mma", 511: "mma", 512: "tile"}
    assert {m: choose_decode("mxfp4", m, *QWEN3) for m in (64, 256, 511)} == {64: "mma", 256: "mma", 511: "mma"}
    assert {m: choose_decode("mxfp4", m, *QWEN3) for m in (1, 8, 32, 128)} == {1: "gemv", 8: "mma", 32: "mma",
                                                                             128: "mma"}


def test_qwen3_mxfp4_m512_takes_the_32_row_mma_decode():
    # session 39: 328.3 against the M = 1024 row's 64-row tile 371.1 µs, for 512..724 (nearer 512 than 1024); below
    # 512 the 16-row bucket's config as before, from 725 the M = 1024 row's tile
    assert {m: choose_decode("mxfp4", m, *QWEN3) for m in (511, 512, 724, 725, 1023)} == {
        511: "mma", 512: "mma", 724: "mma", 725: "tile", 1023: "tile"}
    assert {m: wo_config(m, *QWEN3, "mxfp4", "nowhere", "mma").BLOCK_M for m in (511, 512, 724)} == {
        511: 16, 512: 32, 724: 32}
    assert wo_config(512, *QWEN3, "mxfp4", "nowhere", "mma") == KernelConfig(32, T128, T128)
    assert wo_config(725, *QWEN3, "mxfp4", "nowhere").BLOCK_M == 64


@pytest.mark.parametrize("scheme", ["int4_w4a16", "int8_w8a16"])
def test_deepseek_takes_the_swapped_gluon_gemms_from_m1024(monkeypatch, scheme):
    # session 39: M = 1448 int4 / int8 5721.0 / 5512.6 against the 64-row tile's 6377.9 / 6156.1 µs, int4 M = 2048
    # 5984.6 against 9347.3 (the session-27 GEMMs 8335.8-8490.2); session 38 at 1024: 5569 against 6036 / 6005
    options = tgw.GLUON_WO_OPTIONS[(scheme, *DEEPSEEK[:3])].gemms
    assert options.up.swap and options.down.swap and options.up.split
    for m in (1024, 1448, 2048, 4096, 8191):
        assert _gluon(scheme, m, DEEPSEEK, monkeypatch) == options, m
    assert _gluon(scheme, 1023, DEEPSEEK, monkeypatch) is None
    assert _gluon(scheme, 8192, DEEPSEEK, monkeypatch) is None
    assert _gluon("mxfp4", 1448, DEEPSEEK, monkeypatch) is None  # lost there (6768.1 against the m64 tile's 6192.0)


def test_deepseek_mxfp4_takes_the_gluon_path_from_m2048(monkeypatch):
    # session 39: M = 2048 7018.8 against the M = 4096 row's m128n256 tile 9858.6 µs (the session-27 GEMMs 8019.1)
    options = tgw.GLUON_WO_OPTIONS[("mxfp4", *DEEPSEEK[:3])].gemms
    assert options.up.fast and options.down.fast and not options.up.swap
    for m in (2048, 2895, 4096, 8191):
        assert _gluon("mxfp4", m, DEEPSEEK, monkeypatch) == options, m
    assert _gluon("mxfp4", 2047, DEEPSEEK, monkeypatch) is None
