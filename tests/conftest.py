"""Session-wide test setup.

On a machine without CUDA, Triton kernels can only run under Triton's interpreter, and Triton reads
TRITON_INTERPRET when it is first imported; set it here, before any test module imports triton, so
every test sees one consistent triton. ``backend="auto"`` never picks triton on the CPU, so only tests
that ask for it by name run the interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
