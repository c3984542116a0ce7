"""Session settings every test relies on.

Bitwise comparisons (loss and every gradient equal to running without checkpointing) need
deterministic algorithms: on CUDA, ``index_add_``, ``scatter_add_`` and
``index_put_(accumulate=True)`` (the MoE layers combine experts with them) accumulate with
atomics, in an order that differs from run to run. The session turns deterministic mode on and
every test checks, before and after it runs, that it is still on.

Tests run torch on one CPU thread (unless OMP_NUM_THREADS says otherwise), as the example jobs
and the 2-process launches do: with two threads per process on a shared host, OpenMP's waiting
threads slow a loaded machine's tests several times over.
"""

import os

# cuBLAS is deterministic only with a fixed workspace; it must be set before CUDA starts.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Read by torch at its start, and by every subprocess a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from support import require_deterministic  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def deterministic_algorithms():
    """Bitwise tests run, and leave the session, in deterministic mode (one flag read each)."""
    require_deterministic()
    yield
    require_deterministic()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps its state in process-wide singletons: reset them around the test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
