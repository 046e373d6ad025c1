"""Shared test set-up: the tests marked ``cuda`` (tests/test_device.py and a few others) run on the device
``--device`` names (default cuda, skipped cleanly where none is present; ``--device cpu`` runs their code
paths on the CPU)."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests on a shared 2-core machine: a draw or an example that is slow because the machine is busy is
# not a failure (hypothesis' deadline and too_slow check time the machine, not the code under test).
settings.register_profile("comera", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("comera")


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs 2 workers) each worker takes its share of the cores for torch's
    intra-op threads: two workers of all the cores each stall each other's OpenMP threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_addoption(parser):
    parser.addoption("--device", default="cuda", choices=("cuda", "cpu"),
                     help="device for the tests marked cuda: cuda (default; skipped when none is present) or "
                          "cpu (their code paths on the CPU, where they exist there)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") != "cuda" or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present (pytest --device cpu runs the tier's "
                                   "code paths on the CPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device(request) -> torch.device:
    """The device of the tests marked cuda: ``--device`` (cuda means the current CUDA device)."""
    name = request.config.getoption("--device")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)


@pytest.fixture(scope="module")
def single_thread():
    """The tensors of some test modules are small: one intra-op thread is as fast, and it avoids OpenMP
    threads stalling each other (runs of 10x the usual time) when the 2-core machine is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def quiet_transformers():
    """transformers' logging at errors only while the test runs (its loaders' reports are long)."""
    transformers = pytest.importorskip("transformers")
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


@pytest.fixture(autouse=True)
def _recompile_limit_as_it_was():
    """A model compiled whole raises dynamo's recompile limit for the process by its TT layers' plan segments
    (compiled_region.allow_segment_graphs): each test leaves the limit, and the segments seen, as it found them,
    so no test's limit depends on the tests before it."""
    from comera_compile import compiled_region

    config = torch._dynamo.config
    limit, segments, limit_set = config.recompile_limit, set(compiled_region._SEGMENTS), list(
        compiled_region._LIMIT_SET)
    yield
    config.recompile_limit = limit
    compiled_region._SEGMENTS.clear()
    compiled_region._SEGMENTS.update(segments)
    compiled_region._LIMIT_SET[:] = limit_set


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches and counters empty before and after the test: its graphs counted alone, and no test's
    graphs adding up to another's recompile limit."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()
