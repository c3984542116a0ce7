"""Session settings every test relies on.

Bitwise comparisons (loss and every gradient equal to running without checkpointing) need
deterministic algorithms: on CUDA, ``index_add_``, ``scatter_add_`` and
``index_put_(accumulate=True)`` (the MoE layers combine experts with them) accumulate with
atomics, in an order that differs from run to run. The session turns deterministic mode on and
every test checks, before and after it runs, that it is still on.
"""

import os

# cuBLAS is deterministic only with a fixed workspace; it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from support import require_deterministic  # noqa: E402

torch.use_deterministic_algorithms(True)


@pytest.fixture(autouse=True)
def deterministic_algorithms():
    """Bitwise tests run, and leave the session, in deterministic mode (one flag read each)."""
    require_deterministic()
    yield
    require_deterministic()
