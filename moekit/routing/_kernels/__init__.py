"""The ``@triton.jit`` code of the fused router. Private: only ``moekit.routing.fused`` imports these
modules, and it does so lazily, because Triton decides at decoration time whether a kernel is compiled
or interpreted (``TRITON_INTERPRET=1``).

    route_kernel.py   router logits -> (topk_ids, topk_weights [, shared slots])   (torch twin: moekit.routing.route)
"""
