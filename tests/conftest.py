import pytest
import torch

# Test models are tiny: one intra-op thread is faster than two (no fork/join per op), and it keeps
# single-process tests from competing with the ranks that multi-rank tests spawn.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
