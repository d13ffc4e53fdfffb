"""Split-layer tests run torch on one thread.

The models are tiny; with several intra-op threads on a busy 2-core machine, every
op pays for thread hand-offs (measured: a tiny GPT backward 0.01 s on one thread,
up to 0.5 s on two under load). Restored after the directory's tests.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
