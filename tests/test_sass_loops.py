"""benchmarks/sass_loops.py: spills inside the innermost MMA loops of a SASS listing, against listings written here
whose loops and spills are counted by hand."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sass_loops import spill_places  # noqa: E402

sys.path.pop(0)


def _listing(body: list[str]) -> str:
    """nvdisasm -c's shape: labels on their own lines, each instruction at /*address*/ with a hex comment."""
    out, address = [], 0
    for item in body:
        if item.endswith(":"):
            out.append(item)
        else:
            out.append(f"        /*{address:04x}*/                   {item} ;   /* 0x000 */")
            out.append("                                                    /* 0x000 */")
            address += 16
    return "\n".join(out)


def _kernel(spill_in_k_loop: bool) -> str:
    return _listing([
        "STL [R1], R2",  # prologue spill: once
        ".L_x_0:",  # the tile loop
        "MOV R3, RZ",
        ".L_x_1:",  # the K loop, nested in it
        "QGMMA.64x128x32.F32.E4M3.E4M3 R44, gdesc[UR20], R44",
        *(["LDL R5, [R1+0x4]"] if spill_in_k_loop else []),
        "ISETP.NE.AND P0, PT, R3, RZ, PT",
        "@P0 BRA `(.L_x_1)",
        "STL [R1+0x8], R6",  # epilogue spill: once a tile
        "@P1 BRA `(.L_x_0)",
        "@P2 BRA `(.L_x_2)",  # a forward branch: no loop
        ".L_x_2:",
        "EXIT",
    ])


def test_spills_around_the_k_loop_are_not_in_it():
    places = spill_places(_kernel(spill_in_k_loop=False))
    assert (places.mma_loops, places.spills, places.in_mma_loops) == (1, 2, 0)


def test_a_spill_in_the_k_loop_is_counted():
    places = spill_places(_kernel(spill_in_k_loop=True))
    assert (places.mma_loops, places.spills, places.in_mma_loops) == (1, 3, 1)


def test_loops_without_mma_and_bf16_mmas():
    sass = _listing([".L_x_0:", "LDL R1, [R1]", "@P0 BRA `(.L_x_0)",  # a loop with a spill but no MMA
                     ".L_x_1:", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "@P0 BRA `(.L_x_1)"])
    places = spill_places(sass)
    assert (places.mma_loops, places.spills, places.in_mma_loops) == (1, 1, 0)
