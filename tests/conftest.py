"""Shared test set-up: CUDA-only tests skip cleanly on machines without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_thread():
    """The tensors of some test modules are small: one intra-op thread is as fast, and it avoids OpenMP
    threads stalling each other (runs of 10x the usual time) when the 2-core machine is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
