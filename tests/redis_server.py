"""A private, throwaway `redis-server` per test: never the system one on 6379.

Reuse from any test module (pytest puts tests/ on sys.path):

    from redis_server import RedisServer, redis_server  # noqa: F401  (the import registers the fixture)

    def test_x(redis_server: RedisServer) -> None:
        client = redis_server.client()
        ...

`redis_server.url` (TCP on a free localhost port) and `redis_server.unix_url` (a socket in a
short temp dir) can be handed to services in other processes. `kill()` is a crash (SIGKILL),
`restart()` brings it back empty on the same port and socket, as a real restart without
persistence does.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, binary: str = "redis-server") -> None:
        path = shutil.which(binary)
        if path is None:
            pytest.skip(f"{binary} not found on PATH")
        self.binary = path
        # mkdtemp under /tmp, not pytest's tmp_path: unix socket paths are limited to ~107 bytes.
        self.dir = Path(tempfile.mkdtemp(prefix="kev-redis-"))
        self.socket_path = self.dir / "redis.sock"
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def start(self) -> None:
        assert self.proc is None, "already running"
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
            # No persistence: a restart comes back empty, which is the case the directory must survive.
            "--save", "", "--appendonly", "no",
            "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no", "--protected-mode", "no",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, retry=None)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{log}")
                try:
                    if probe.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} not ready after {START_TIMEOUT_S}s")
                time.sleep(0.01)
        finally:
            probe.close()

    def kill(self) -> None:
        """Crash: SIGKILL, no shutdown handshake."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.socket_path.unlink(missing_ok=True)
        self.start()

    def client(self, **kwargs: object) -> redis.Redis:
        """A client that fails fast while the server is down (tests assert on that)."""
        options: dict[str, object] = {"socket_timeout": 2.0, "socket_connect_timeout": 0.5}
        options.update(kwargs)
        return redis.Redis.from_url(self.url, **options)  # type: ignore[arg-type]

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
