"""Without a CUDA device the Triton kernels run under Triton's interpreter, on CPU tensors.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels (at import of dsv4kv.kernels),
so it is set here, before any test module is imported. On a GPU the kernels compile as usual.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
