import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # shared test-support modules beside this file (tiny_checkpoints, ...)

try:  # the GPU device has no redis client; everywhere else the fixture must load
    import redis  # noqa: F401

    pytest_plugins = ["redis_server"]
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Triton interpreter tests (test_*_interpret.py): the project's kernel
# modules reloaded under TRITON_INTERPRET=1 for the module, and NaN-poisoned allocations.
@pytest.fixture(scope="module")
def interp():
    from interpret_support import interpreted_kernels

    with interpreted_kernels() as mods:
        yield mods


@pytest.fixture
def poisoned(monkeypatch):
    """Every float tensor the kernels allocate starts as NaN: an unwritten element fails the test."""
    from interpret_support import poison_empty

    poison_empty(monkeypatch)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny random checkpoint (tests/tiny_stack.py) the end-to-end tests serve, one per module."""
    from tiny_stack import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "kev-tiny")
