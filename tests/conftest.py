import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

torch.manual_seed(0)
# Tiny-model tests gain nothing from a second thread and lose a lot on a shared machine;
# real-model tests (tests/slow) set their own thread count.
torch.set_num_threads(int(os.environ.get("VERISPEC_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("VERISPEC_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="VERISPEC_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
