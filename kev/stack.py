"""The embedded stack: a private Redis, the bank service and one scorer, as local processes.

    from kev.stack import Stack

    with Stack(checkpoint_dir) as stack:          # starts everything, waits until all are healthy
        channel = grpc.insecure_channel(stack.scorer_addr)
        ...                                       # the real gRPC API
    # everything stopped (SIGTERM, then SIGKILL after a grace period), the temp dir removed

or `python -m kev.stack CHECKPOINT` to keep one running until Ctrl-C.

Everything private lives in one temp dir under /tmp (unix socket paths are limited to ~107
bytes): Redis listens only on `redis.sock` (no TCP port, no persistence), the bank on
`bank.sock`; the scorer on a free localhost TCP port (or `scorer_port`). Processes log to files
in the temp dir; a process that dies while starting raises `StackError` with its log's tail.
Each child gets a clean environment: every inherited KEV_* variable is dropped, the settings
below are set, and this checkout is put on PYTHONPATH. `redis-server` must be on PATH (the
set-up installs it); when it is missing `StackError` says so.

Test helpers: `add_scorer()` starts another scorer on the same bank, `kill_scorer()` crashes one;
`stop_bank(kill=)` / `start_bank()` and `kill_redis()` / `start_redis()` (and `restart_*`) take
those down and bring them back in place (same addresses; Redis comes back empty).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 120.0


class StackError(RuntimeError):
    """A stack process could not be started (the message holds its log's tail)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

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


@dataclass
class Stack:
    checkpoint: str | os.PathLike
    bank_memory_bytes: int = 64 << 20
    lease_seconds: float = 30.0
    max_document_tokens: int = 65536  # the same limit for the bank and the scorers
    scorer_port: int = 0  # 0: a free port
    scorer_env: dict[str, str] = field(default_factory=dict)  # extra KEV_* settings for scorers
    bank_env: dict[str, str] = field(default_factory=dict)
    scorer_flags: list[str] = field(default_factory=list)
    bank_flags: list[str] = field(default_factory=list)
    torch_threads: int = 1  # per process: the bank and the scorers share the machine's cores
    start_timeout_s: float = START_TIMEOUT_S  # per process; GPU start-ups (8 GB of weights, warm-up) take longer
    python: str = sys.executable

    def __post_init__(self) -> None:
        self.dir: Path | None = None
        self.redis: Proc | None = None
        self.bank: Proc | None = None
        self.scorers: list[Proc] = []
        self.scorer_addrs: list[str] = []

    # ------------------------------------------------------------------------------ addresses

    @property
    def redis_url(self) -> str:
        return f"unix://{self._path('redis.sock')}?db=0"

    @property
    def bank_addr(self) -> str:
        return f"unix:{self._path('bank.sock')}"

    @property
    def scorer_addr(self) -> str:
        return self.scorer_addrs[0]

    def _path(self, name: str) -> Path:
        assert self.dir is not None, "stack not started"
        return self.dir / name

    # ------------------------------------------------------------------------------ life cycle

    def __enter__(self) -> "Stack":
        if self.dir is None:  # `with` on a stack already started only adds the clean-up
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.dir is not None:
            raise StackError("stack already started")
        binary = shutil.which("redis-server")
        if binary is None:
            raise StackError("redis-server not found on PATH: install it (the set-up does: `make install`, "
                             "or apt-get install redis-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="kev-stack-", dir="/tmp"))
        try:
            self._start_redis(binary)
            # The first scorer loads its weights while the bank starts; it attaches (and only then
            # warms up on the GPU) once the bank is ready, so no two warm-ups share the device.
            self._start_bank(wait=False)
            self.add_scorer(self.scorer_port, wait=False)
            self.wait_healthy(self.bank, self.bank_addr, "kev.v1.Bank")
            self.wait_healthy(self.scorers[0], self.scorer_addrs[0], "kev.v1.Scorer")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Scorers first (they release their pins), then the bank (it owns the memory), then Redis."""
        for proc in self.scorers:
            proc.stop()
        self.scorers, self.scorer_addrs = [], []
        if self.bank is not None:
            self.bank.stop()
        if self.redis is not None:
            self.redis.stop(5.0)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _env(self, settings: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KEV_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["OMP_NUM_THREADS"] = str(self.torch_threads)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(settings)
        return env

    def _start_redis(self, binary: str) -> None:
        args = [binary, "--port", "0", "--unixsocket", str(self._path("redis.sock")), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no"]
        self.redis = Proc("redis", args, self._env({}), self._path("redis.log"))
        self.start_redis()

    def start_redis(self) -> None:
        """Starts Redis on the stack's socket, empty (no persistence)."""
        assert self.redis is not None and not self.redis.alive
        self._path("redis.sock").unlink(missing_ok=True)
        self.redis.start()
        deadline = time.monotonic() + 10
        while not self._path("redis.sock").exists():
            self._check_alive(self.redis, deadline)
            time.sleep(0.01)

    def kill_redis(self) -> None:
        """A Redis crash (SIGKILL): its data is gone."""
        assert self.redis is not None
        self.redis.kill()

    def restart_redis(self) -> None:
        """A crash and a restart without persistence: Redis comes back empty on the same socket."""
        self.kill_redis()
        self.start_redis()

    def _start_bank(self, wait: bool = True) -> None:
        settings = {"KEV_CHECKPOINT": str(self.checkpoint), "KEV_DEVICE": "cpu",
                    "KEV_BANK_LISTEN": self.bank_addr, "KEV_BANK_MEMORY_BYTES": str(self.bank_memory_bytes),
                    "KEV_REDIS_URL": self.redis_url, "KEV_METRICS_PORT": "0",
                    "KEV_LEASE_SECONDS": str(self.lease_seconds), **self.bank_env}
        args = [self.python, "-m", "bank_service", "--node", "stack", "--shm-dir", str(self.dir),
                "--max-document-tokens", str(self.max_document_tokens), "--torch-threads", str(self.torch_threads),
                *self.bank_flags]
        self.bank = Proc("bank", args, self._env(settings), self._path("bank.log"))
        self.bank.start()
        if wait:
            self.wait_healthy(self.bank, self.bank_addr, "kev.v1.Bank")

    def stop_bank(self, kill: bool = False) -> None:
        """Stops the bank (SIGTERM), or crashes it (`kill`: SIGKILL)."""
        assert self.bank is not None
        self.bank.kill() if kill else self.bank.stop()

    def start_bank(self) -> None:
        """Starts a new bank instance on the same address (after `stop_bank`)."""
        assert self.bank is not None and not self.bank.alive
        self._path("bank.sock").unlink(missing_ok=True)
        self.bank.start()
        self.wait_healthy(self.bank, self.bank_addr, "kev.v1.Bank")

    def restart_bank(self, kill: bool = False) -> None:
        self.stop_bank(kill)
        self.start_bank()

    def add_scorer(self, port: int = 0, env: dict[str, str] | None = None, wait: bool = True) -> str:
        """Starts a scorer on the bank; returns its address once it is SERVING (`wait`), or at once."""
        addr = f"127.0.0.1:{port or free_port()}"
        settings = {"KEV_CHECKPOINT": str(self.checkpoint), "KEV_DEVICE": "cpu", "KEV_SCORER_LISTEN": addr,
                    "KEV_BANK_ADDR": self.bank_addr, "KEV_REDIS_URL": self.redis_url, "KEV_METRICS_PORT": "0",
                    "KEV_LEASE_SECONDS": str(self.lease_seconds), **self.scorer_env, **(env or {})}
        args = [self.python, "-m", "scorer_service", "--max-document-tokens", str(self.max_document_tokens),
                *self.scorer_flags]
        proc = Proc(f"scorer{len(self.scorers)}", args,
                    self._env(settings), self._path(f"scorer{len(self.scorers)}.log"))
        self.scorers.append(proc)
        self.scorer_addrs.append(addr)
        proc.start()
        if wait:
            self.wait_healthy(proc, addr, "kev.v1.Scorer")
        return addr

    def kill_scorer(self, index: int = 0) -> None:
        self.scorers[index].kill()

    # ------------------------------------------------------------------------------ health

    def _check_alive(self, proc: Proc, deadline: float) -> None:
        if not proc.alive:
            code = None if proc.popen is None else proc.popen.returncode
            raise StackError(f"{proc.name} exited ({code}) while starting; log tail:\n{proc.log_tail()}")
        if time.monotonic() > deadline:
            raise StackError(f"{proc.name} not ready after {self.start_timeout_s:.0f} s; log tail:\n{proc.log_tail()}")

    def wait_healthy(self, proc: Proc, addr: str, service: str) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        with grpc.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive(proc, deadline)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kev.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--scorer-port", type=int, default=50051)
    parser.add_argument("--bank-memory-bytes", type=int, default=256 << 20)
    args = parser.parse_args(argv)
    with Stack(args.checkpoint, bank_memory_bytes=args.bank_memory_bytes, scorer_port=args.scorer_port) as stack:
        print(f"scorer {stack.scorer_addr}  bank {stack.bank_addr}  redis {stack.redis_url}", flush=True)
        print(f"try: kev models --addr {stack.scorer_addr}   (Ctrl-C stops everything)", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
