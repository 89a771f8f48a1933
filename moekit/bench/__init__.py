"""Every measurement: the experts backends side by side against the measured ceilings of the device,
the tuner, the expert-parallel layer, and one real layer against the byte model.

    timing.py         the one timing helper: median and spread of >= 5 passes (CUDA-graph replay or
                      events on the GPU, wall clock on CPU); plain eager calls and their host time
    ceilings.py       copy bandwidth, dense and fp8 matmul rates, measured in the same run
    cells.py          the shapes, the routing, and each cell's compulsory bytes, FLOPs and floor
    quant_cells.py    --dtype: the weights quantized once per shape, their packed bytes and matmul rate
    sweep.py          one shape's cells: per M, every weight dtype x backend
    run.py            the run: ceilings, then every shape's cells; the results document
    report.py         results JSON, the PNG, the compact table
    predict.py        the byte model's predicted floor beside the measured quantized cells (the PNG)
    targets.py, targets_peers.py, targets_load.py, targets_judge.py, targets_report.py
                      ``moekit bench --targets``: issues #15 / #16 / #19's targets judged on bench JSONs
    tuning.py         the kernel-config tuner behind ``moekit tune``: the search, its files, ``--install``
    tuning_quant.py   the tuner's quantized formats: fp8_block and the weight-only int8 / int4 / mxfp4
    tuning_switches.py  the fp8 entries' switches as the tuner's candidates; today's entry as its seed
    ep.py             the expert-parallel benchmark (``torchrun ... -m moekit.bench.ep``)
    layer_measure.py  one ``MoE`` layer over a batch sweep beside the byte model (``analyze --measure``)
    hf_models.py, hf_measure.py, hf_run.py, hf_options.py, hf_passes.py, hf_report.py, hf_fp64.py
                      ``moekit bench --hf``: transformers MoE models end to end, per experts implementation
"""
