"""``benchmarks/wgmma_hazards.py`` on hand-written SASS loops: a register an in-flight HGMMA reads written before the
wait that retires its group is found, after that wait it is not; the waits' depths are counted; only innermost MMA
loops are read. Real kernels: ``benchmarks/wo4k_compile_cpu.py`` (sm_90 offline)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from wgmma_hazards import inflight_writes, mma_loops, pipeline_report  # noqa: E402


def _sass(body: list[str], label: str = ".L_x_1") -> list[str]:
    """A loop in nvdisasm's form: the label, the numbered instructions, the backward branch."""
    lines = [f"{label}:"] + [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(body)]
    return lines + [f"        /*{16 * len(body):04x}*/                   @P0 BRA `({label}) ;"]


def _step(a: int, next_a: int, depth: int, early: bool = False) -> list[str]:
    """One step: the HGMMAs on A at R{a}.., a wait of ``depth``, and the next step's A written at R{next_a}.. after
    it (``early``: before it)."""
    mmas = [f"HGMMA.64x128x16.F32.BF16 R24, R{a + 4 * k}, gdesc[UR8], R24" for k in range(3)]
    mmas.append(f"HGMMA.64x128x16.F32.BF16 R24, R{a + 12}, gdesc[UR8], R24, gsb0")
    writes = [f"LDS.U16 R{next_a + r}, [R2+0x100]" for r in range(16)]
    wait = [f"WARPGROUP.DEPBAR.LE gsb0, 0x{depth:x}", "SYNCS.ARRIVE RZ, [UR4]"]
    return ["WARPGROUP.ARRIVE", *mmas, *(writes + wait if early else wait + writes)]


WRITES = sorted({f"LDS.U16 R{88 + r}, [R2+0x100]" for r in range(16)})


def test_one_register_set_with_a_step_in_flight_is_written_in_flight():
    assert inflight_writes(_sass(_step(88, 88, 1))) == WRITES  # wait(1) leaves the step that reads R88.. in flight


def test_wait_zero_or_two_register_sets_write_nothing_in_flight():
    assert inflight_writes(_sass(_step(88, 88, 0))) == []  # the step retired before its registers are written
    assert inflight_writes(_sass(_step(88, 104, 1) + _step(104, 88, 1))) == []  # ping-pong: the other set's retired
    early = _step(88, 104, 1, early=True) + _step(104, 88, 1, early=True)  # written before the wait retired it
    assert inflight_writes(_sass(early)) == sorted(WRITES + [f"LDS.U16 R{104 + r}, [R2+0x100]" for r in range(16)])


def test_accumulator_writes_and_predicated_writes_count():
    body = _step(88, 104, 1) + ["@!P1 IMAD.MOV.U32 R30, RZ, RZ, R5"] + _step(104, 88, 1)
    assert inflight_writes(_sass(body)) == ["@!P1 IMAD.MOV.U32 R30, RZ, RZ, R5"]  # R30: the accumulator R24..R87


def test_the_report_reads_innermost_mma_loops_and_counts_waits():
    inner = _sass(_step(88, 88, 1), ".L_x_2")
    outer = ["HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR8], R24, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    lines = [".L_x_1:"] + inner + [f"        /*9000*/                   {t} ;" for t in outer]
    lines += ["        /*9010*/                   BRA `(.L_x_1) ;"]
    assert [len(body) for body in mma_loops(lines)] == [len(inner)]
    report = pipeline_report("\n".join(lines))
    assert report.waits == {"0x0": 1, "0x1": 1} and report.loops == 1 and len(report.writes) == 16
    assert report.line() == "waits 0x0:1 0x1:1, in-flight writes 16 in 1 MMA loops"
