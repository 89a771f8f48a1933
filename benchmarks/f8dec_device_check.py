"""Issue #15, session 27: fp8_block at 8 <= M <= 1024: the gate-up GEMM with gate and up in one dot a K-step
(``gemm_fp8``'s PAIR_DOT) and M = 8 config variants against the tuned default (``f8dec_variants``), through
``fp8mid_device_check``'s machinery (PASS / FAIL against the recipe's reference, CUDA-graph µs over 5 interleaved
rounds, % of the fp8 byte floor at this run's copy rate, rounds >= 3% faster, the eager kernel breakdown).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/f8dec_device_check.py --out $OUT/f8dec --deadline 54 \
        --worker-deadline 30
    PYTHONPATH=$PWD python3 benchmarks/f8dec_device_check.py --smoke                                   # CPU
"""

import os
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["FP8MID_VARIANTS"] = "f8dec_variants"
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    runpy.run_path(str(here / "fp8mid_device_check.py"), run_name="__main__")
