"""Side-by-side benchmarks of the experts backends against the measured ceilings of the device.

    timing.py    the one timing helper (CUDA-graph replay or events on the GPU, wall clock on the CPU)
    ceilings.py  copy bandwidth and dense matmul rate, measured in the same run
    cells.py     the shapes, the routing, and each cell's compulsory bytes, FLOPs and floor
    run.py       the sweep: ceilings, then every (shape, M, backend) cell
    report.py    results JSON, the PNG, the compact table
    tuning.py    the kernel-config tuner behind ``moekit tune``
    hf_models.py, hf_measure.py, hf_run.py, hf_report.py
                 ``moekit bench --hf``: transformers MoE models end to end, per experts implementation
"""
