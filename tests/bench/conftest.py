"""What the bench tests share: the repository root on sys.path (a bare `pytest` may not put it
there; `python -m pytest` from the root does), and the tiny random checkpoint."""

import sys
from pathlib import Path

import pytest

try:
    import bench  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiny_stack import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "kev-tiny")
