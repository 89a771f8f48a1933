"""The ``@triton.jit`` code of the Triton experts backend. Private: only its launchers
(``moekit.experts.triton``, ``triton_align``, ``triton_backward_launch``) import these modules, lazily through
``triton_launch.kernels``, because Triton decides at decoration time whether a kernel is compiled or
interpreted (``TRITON_INTERPRET=1``).

    align.py    topk_ids -> block-aligned layout        (torch twin: moekit.layouts.block_aligned.align_block)
    gemm.py     gate-up + act-and-mul, down + weight    (torch twin: moekit.experts.reference / grouped_mm)
    combine.py  sum over the k slots                    (torch twin: per_slot.view(M, k, K).sum(1))
    gemm_backward.py  the backward's grouped GEMMs       (torch twin: the autograd of reference / grouped_mm)
"""
