"""Local processes of a Kev stack: a private redis-server, `python -m bank_service`, `python -m scorer_service`.

The one place that knows how to start, wait for and stop them; kev/stack.py (the embedded stack of
`make demo` and `python -m kev.stack`) composes them, and the tests' harness (tests/tiny_stack.py,
tests/redis_server.py) uses them as they are.

    redis = RedisProc(workdir)                       # unix socket only; `port=` adds TCP on localhost
    redis.start()                                    # returns once it answers PING
    bank = bank_proc(checkpoint, redis.url, "unix:/tmp/x/bank.sock", workdir / "bank.log")
    bank.start(); bank.wait_serving(120)             # gRPC health of kev.v1.Bank
    ...
    bank.stop(); redis.stop()                        # SIGTERM, then SIGKILL after a grace period

Each service child gets a clean environment: every inherited KEV_* variable is dropped, its settings
are set, this checkout is put on PYTHONPATH and OMP_NUM_THREADS is its torch thread count. A process
that dies or does not come up while starting raises `StackError` with its log's tail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
REDIS_START_TIMEOUT_S = 10.0
BANK_SERVICE, SCORER_SERVICE = "kev.v1.Bank", "kev.v1.Scorer"  # the names their gRPC health reports


class StackError(RuntimeError):
    """A stack process could not be started (the message holds its log's tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(settings: Mapping[str, str], torch_threads: int | None = None) -> dict[str, str]:
    """This process's environment without KEV_* variables, plus `settings`, the checkout on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEV_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if torch_threads:
        env["OMP_NUM_THREADS"] = str(torch_threads)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(settings)
    return env


class Proc:
    """One child process (`args`, `env`), started in its own session, logging to `log_path`; it can be
    started again after it stopped (same command, same log file, appended)."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], log_path: str | os.PathLike):
        self.name, self.args, self.env, self.log_path = name, list(args), dict(env), Path(log_path)
        self.popen: subprocess.Popen | None = None
        self.pid: int | None = None  # of the last start, kept after it stopped

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, start_new_session=True)
        self.pid = self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]

    def check_starting(self, deadline: float, what: str = "ready") -> None:
        """Raises StackError (with the log's tail) if the process died, or `deadline` (monotonic) passed."""
        if not self.alive:
            code = None if self.popen is None else self.popen.returncode
            raise StackError(f"{self.name} exited ({code}) while starting; log tail:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"{self.name} not {what} in time; log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        code, self.popen = self.popen.returncode, None
        return code

    def kill(self) -> None:
        """A crash: SIGKILL, nothing cleaned up."""
        if self.popen is not None:
            self.popen.kill()
            self.popen.wait()
            self.popen = None


class RedisProc(Proc):
    """A private redis-server in `directory`: on the unix socket `redis.sock` there, and on TCP
    127.0.0.1:`port` if one is given. No persistence: after `restart()` (a crash and a start) it is
    empty, as a real restart without persistence is."""

    def __init__(self, directory: str | os.PathLike, *, port: int = 0, binary: str = "redis-server"):
        path = shutil.which(binary)
        if path is None:
            raise StackError(f"{binary} not found on PATH: install it (the set-up does: `make install`, "
                             "or apt-get install redis-server)")
        self.dir, self.port = Path(directory), port
        self.socket_path = self.dir / "redis.sock"
        args = [path, "--port", str(port), "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"]
        if port:
            args += ["--bind", "127.0.0.1", "--protected-mode", "no"]
        super().__init__("redis", args, child_env({}), self.dir / "redis.log")

    @property
    def unix_url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    @property
    def url(self) -> str:
        """TCP when it has a port, else the unix socket."""
        return f"redis://127.0.0.1:{self.port}/0" if self.port else self.unix_url

    def start(self) -> None:
        """Starts it (empty) and returns once it answers PING."""
        assert not self.alive, "redis already running"
        self.socket_path.unlink(missing_ok=True)
        super().start()
        import redis  # here: a process that only runs services (kev.stack's users) needs no client

        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        probe = redis.Redis(unix_socket_path=str(self.socket_path), socket_connect_timeout=0.2, retry=None)
        try:
            while True:
                self.check_starting(deadline, "answering PING")
                try:
                    if self.socket_path.exists() and probe.ping():
                        return
                except redis.ConnectionError:
                    pass
                time.sleep(0.01)
        finally:
            probe.close()

    def restart(self) -> None:
        """A crash (SIGKILL) and a start: back empty at the same addresses."""
        self.kill()
        self.start()

    def client(self, **kwargs: object):
        """A redis.Redis client that fails fast while the server is down."""
        import redis

        options: dict[str, object] = {"socket_timeout": 2.0, "socket_connect_timeout": 0.5}
        options.update(kwargs)
        return redis.Redis.from_url(self.url, **options)  # type: ignore[arg-type]


class ServiceProc(Proc):
    """A gRPC service process on `addr` whose health reports `health_service`."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], log_path: str | os.PathLike, *,
                 addr: str, health_service: str):
        super().__init__(name, args, env, log_path)
        self.addr, self.health_service = addr, health_service
        self._channel: grpc.Channel | None = None
        self.tls_ca: str | None = None  # set: health checks and `channel` use TLS with this CA (PEM path)

    @property
    def channel(self) -> grpc.Channel:
        """A channel to the service (closed when it stops; a new one after)."""
        if self._channel is None:
            from kev.serving.security import client_channel

            self._channel = client_channel(self.addr, ca=self.tls_ca)
        return self._channel

    def health(self, service: str | None = None, timeout: float = 1.0) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        name = self.health_service if service is None else service
        return stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout).status

    def wait_serving(self, timeout_s: float) -> None:
        """Until its service is SERVING; StackError if it exits or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_starting(deadline, f"SERVING after {timeout_s:.0f} s")
            try:
                if self.health(timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stop(self, grace_s: float = 20.0) -> int | None:
        self._close_channel()
        return super().stop(grace_s)

    def kill(self) -> None:
        self._close_channel()
        super().kill()


def bank_proc(checkpoint: str | os.PathLike, redis_url: str, listen: str, log_path: str | os.PathLike, *,
              memory_bytes: int, lease_seconds: float = 30.0, metrics_port: int = 0, torch_threads: int = 1,
              flags: Sequence[str] = (), env: Mapping[str, str] | None = None, python: str = sys.executable,
              name: str = "bank", cls: type[ServiceProc] = ServiceProc) -> ServiceProc:
    """`python -m bank_service` on CPU listening on `listen` (`env` settings override; `flags` come last),
    not started yet; `cls` a ServiceProc subclass to make."""
    settings = {"KEV_CHECKPOINT": str(checkpoint), "KEV_DEVICE": "cpu", "KEV_BANK_LISTEN": listen,
                "KEV_BANK_MEMORY_BYTES": str(memory_bytes), "KEV_REDIS_URL": redis_url,
                "KEV_METRICS_PORT": str(metrics_port), "KEV_LEASE_SECONDS": str(lease_seconds), **(env or {})}
    args = [python, "-m", "bank_service", "--torch-threads", str(torch_threads), *flags]
    return cls(name, args, child_env(settings, torch_threads), log_path, addr=listen, health_service=BANK_SERVICE)


def scorer_proc(checkpoint: str | os.PathLike, redis_url: str, bank_addr: str, listen: str,
                log_path: str | os.PathLike, *, lease_seconds: float = 30.0, metrics_port: int = 0,
                torch_threads: int = 1, flags: Sequence[str] = (), env: Mapping[str, str] | None = None,
                python: str = sys.executable, name: str = "scorer") -> ServiceProc:
    """`python -m scorer_service` on CPU listening on `listen`, attached to the bank at `bank_addr`; not started yet."""
    settings = {"KEV_CHECKPOINT": str(checkpoint), "KEV_DEVICE": "cpu", "KEV_SCORER_LISTEN": listen,
                "KEV_BANK_ADDR": bank_addr, "KEV_REDIS_URL": redis_url, "KEV_METRICS_PORT": str(metrics_port),
                "KEV_LEASE_SECONDS": str(lease_seconds), **(env or {})}
    args = [python, "-m", "scorer_service", *flags]
    return ServiceProc(name, args, child_env(settings, torch_threads), log_path, addr=listen,
                       health_service=SCORER_SERVICE)
