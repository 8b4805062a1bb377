import os

import pytest
import torch

# Tests are deterministic and single-threaded per rank unless they say otherwise.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
