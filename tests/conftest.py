"""Without a CUDA device the Triton kernels run under Triton's interpreter, on CPU tensors.

TRITON_INTERPRET must be set before `triton.jit` decorates the kernels (at import of dsv4kv.kernels),
so it is set here, before any test module is imported. On a GPU the kernels compile as usual.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small engine steps: their ops are too small to gain from a second thread,
    and on a shared CPU spinning threads slow them several times over. A module asks for it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
