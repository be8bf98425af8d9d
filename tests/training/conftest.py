"""Training tests run tiny models: one torch thread avoids two-thread contention on 2-core machines."""

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def single_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
