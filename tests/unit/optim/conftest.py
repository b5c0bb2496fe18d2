"""What every optimizer test here shares."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    # The tensors are tiny: a second intra-op thread only adds synchronization, which stalls when the
    # machine is busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
