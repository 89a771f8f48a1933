"""The ``@triton.jit`` code of the fused router and the gate. Private: only ``moekit.routing.fused`` and
``moekit.routing.gate`` import these modules, and lazily, because Triton decides at decoration time
whether a kernel is compiled or interpreted (``TRITON_INTERPRET=1``).

    route_kernel.py   router logits -> (topk_ids, topk_weights [, shared slots])   (torch twin: moekit.routing.route)
    gate_kernel.py    x, gate weight (, bias) -> router logits                     (torch twin: F.linear)
"""
