import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _real_model_threads():
    """Real models are bandwidth-bound: use every core for them."""
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("VERISPEC_SLOW_THREADS", str(os.cpu_count() or 1))))
    yield
    torch.set_num_threads(before)
