"""A private, throwaway `redis-server` per test: never the system one on 6379.

Reuse from any test module (pytest puts tests/ on sys.path):

    from redis_server import RedisServer, redis_server  # noqa: F401  (the import registers the fixture)

    def test_x(redis_server: RedisServer) -> None:
        client = redis_server.client()
        ...

The server is kev/serving/processes.py's `RedisProc` (what the embedded stack runs) in a short temp
dir, on a free localhost TCP port as well: `redis_server.url` (TCP) and `redis_server.unix_url`
can be handed to services in other processes. `kill()` is a crash (SIGKILL), `restart()` brings it
back empty on the same port and socket, as a real restart without persistence does. Without a
`redis-server` on PATH the test is skipped.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest

from kev.serving.processes import RedisProc, StackError, free_port


class RedisServer(RedisProc):
    def __init__(self, binary: str = "redis-server") -> None:
        # mkdtemp under /tmp, not pytest's tmp_path: unix socket paths are limited to ~107 bytes.
        directory = tempfile.mkdtemp(prefix="kev-redis-")
        try:
            super().__init__(directory, port=free_port(), binary=binary)
        except StackError as e:
            shutil.rmtree(directory, ignore_errors=True)
            pytest.skip(str(e))

    def cleanup(self) -> None:
        # Nothing to flush (no persistence), and SIGTERM's shutdown costs ~100 ms per test.
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh, empty redis-server for one test (starts in a few ms)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
