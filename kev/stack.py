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
The processes themselves (a clean environment each, start-up waits, stop and kill) are
kev/serving/processes.py's, which the tests' harness uses too. `redis-server` must be on PATH (the
set-up installs it); when it is missing `StackError` says so.

Test helpers: `add_scorer()` starts another scorer on the same bank, `kill_scorer()` crashes one;
`stop_bank(kill=)` / `start_bank()` and `kill_redis()` / `start_redis()` (and `restart_*`) take
those down and bring them back in place (same addresses; Redis comes back empty).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kev.serving.processes import (REPO_ROOT, Proc, RedisProc, ServiceProc, StackError, bank_proc, free_port,
                                   scorer_proc)

__all__ = ["REPO_ROOT", "Proc", "Stack", "StackError", "free_port", "main"]

START_TIMEOUT_S = 120.0


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
        self.redis: RedisProc | None = None
        self.bank: ServiceProc | None = None
        self.scorers: list[ServiceProc] = []
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
        self.dir = Path(tempfile.mkdtemp(prefix="kev-stack-", dir="/tmp"))
        try:
            self.redis = RedisProc(self.dir)  # StackError when redis-server is missing
            self.redis.start()
            # The first scorer loads its weights while the bank starts; it attaches (and only then
            # warms up on the GPU) once the bank is ready, so no two warm-ups share the device.
            self._start_bank(wait=False)
            self.add_scorer(self.scorer_port, wait=False)
            self.bank.wait_serving(self.start_timeout_s)
            self.scorers[0].wait_serving(self.start_timeout_s)
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

    def start_redis(self) -> None:
        """Starts Redis on the stack's socket, empty (no persistence)."""
        assert self.redis is not None
        self.redis.start()

    def kill_redis(self) -> None:
        """A Redis crash (SIGKILL): its data is gone."""
        assert self.redis is not None
        self.redis.kill()

    def restart_redis(self) -> None:
        """A crash and a restart without persistence: Redis comes back empty on the same socket."""
        assert self.redis is not None
        self.redis.restart()

    def _start_bank(self, wait: bool = True) -> None:
        self.bank = bank_proc(self.checkpoint, self.redis_url, self.bank_addr, self._path("bank.log"),
                              memory_bytes=self.bank_memory_bytes, lease_seconds=self.lease_seconds,
                              torch_threads=self.torch_threads, env=self.bank_env, python=self.python,
                              flags=["--node", "stack", "--shm-dir", str(self.dir),
                                     "--max-document-tokens", str(self.max_document_tokens), *self.bank_flags])
        self.bank.start()
        if wait:
            self.bank.wait_serving(self.start_timeout_s)

    def stop_bank(self, kill: bool = False) -> None:
        """Stops the bank (SIGTERM), or crashes it (`kill`: SIGKILL)."""
        assert self.bank is not None
        self.bank.kill() if kill else self.bank.stop()

    def start_bank(self) -> None:
        """Starts a new bank instance on the same address (after `stop_bank`)."""
        assert self.bank is not None and not self.bank.alive
        self._path("bank.sock").unlink(missing_ok=True)
        self.bank.start()
        self.bank.wait_serving(self.start_timeout_s)

    def restart_bank(self, kill: bool = False) -> None:
        self.stop_bank(kill)
        self.start_bank()

    def add_scorer(self, port: int = 0, env: dict[str, str] | None = None, wait: bool = True) -> str:
        """Starts a scorer on the bank; returns its address once it is SERVING (`wait`), or at once."""
        addr = f"127.0.0.1:{port or free_port()}"
        name = f"scorer{len(self.scorers)}"
        proc = scorer_proc(self.checkpoint, self.redis_url, self.bank_addr, addr, self._path(f"{name}.log"),
                           lease_seconds=self.lease_seconds, torch_threads=self.torch_threads,
                           env={**self.scorer_env, **(env or {})}, python=self.python, name=name,
                           flags=["--max-document-tokens", str(self.max_document_tokens), *self.scorer_flags])
        self.scorers.append(proc)
        self.scorer_addrs.append(addr)
        proc.start()
        if wait:
            proc.wait_serving(self.start_timeout_s)
        return addr

    def kill_scorer(self, index: int = 0) -> None:
        self.scorers[index].kill()


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
