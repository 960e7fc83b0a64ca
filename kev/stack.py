"""The embedded stack: a private Redis, the bank service and one scorer, as local processes.

    from kev.stack import Stack

    with Stack(checkpoint_dir) as stack:          # starts everything, waits until all are healthy
        channel = grpc.insecure_channel(stack.scorer_addr)
        ...                                       # the real gRPC API
    # everything stopped (SIGTERM, then SIGKILL after a grace period), the temp dir removed

or, to keep one running until Ctrl-C (the README's "Run a stack and call it"):

    python -m kev.stack CHECKPOINT [--device cpu|cuda[:N]] [--bank-memory 256M] [--scorer-port 50051]

`device`: where the bank and the scorer run (`KEV_DEVICE` of both; on CUDA the bank's pool is
shared with the scorer by CUDA IPC, and start-up tunes kernel classes and captures CUDA graphs,
minutes for a large model). Start-up progress: every service logs `start-up: ...` lines (loading
weights, warm-up classes k/n, graphs captured k/n, ready in N s); `Stack(progress=...)` follows
the logs and hands each such line to a callback while `start()` waits, and the command line
prints them on its console (`ProgressPrinter`: a progress bar on a terminal, plain lines otherwise).

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
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kev.serving.processes import RedisProc, ServiceProc, StackError, bank_proc, free_port, scorer_proc

__all__ = ["LogFollower", "ProgressPrinter", "Stack", "main", "parse_size"]

START_TIMEOUT_S = 120.0
CUDA_START_TIMEOUT_S = 900.0  # the command line's default on CUDA: weights, class warm-up, graph captures
PROGRESS_MARK = "start-up: "  # the services' progress log lines carry it
_STEP = re.compile(r"(\d+)/(\d+)")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `256M`, `8G`, `1.5GiB`, `65536` (binary units)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 256M, 8G or a number of bytes)")
    return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2).lower() or " "))))


class LogFollower(threading.Thread):
    """Follows the `*.log` files of `directory` (Redis's aside) and calls `on_line(process, message)`
    for each complete line holding `start-up: ` (the message is what follows it)."""

    def __init__(self, directory: Path, on_line: Callable[[str, str], None], every_s: float = 0.1):
        super().__init__(name="kev-stack-progress", daemon=True)
        self.directory, self.on_line, self.every_s = Path(directory), on_line, every_s
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            self.poll()
        self.poll()

    def poll(self) -> None:
        for path in sorted(self.directory.glob("*.log")):
            if path.name == "redis.log":
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            *lines, rest = (self._partial.pop(path, b"") + data).split(b"\n")
            self._partial[path] = rest
            for line in lines:
                text = line.decode(errors="replace")
                at = text.find(PROGRESS_MARK)
                if at >= 0:
                    self.on_line(path.stem, text[at + len(PROGRESS_MARK):].strip())

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(5.0)


class ProgressPrinter:
    """Prints start-up progress lines (`LogFollower`'s callback): on a terminal a progress bar for
    steps `k/n` (redrawn in place, kept once done), otherwise one plain line each."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, width: int = 24):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.width, self.start = width, time.monotonic()
        self._open = False  # a bar line is being redrawn

    def __call__(self, process: str, message: str) -> None:
        elapsed = time.monotonic() - self.start
        step = _STEP.search(message)
        if not self.tty:
            print(f"[{elapsed:6.1f} s] {process}: {message}", file=self.stream, flush=True)
            return
        if step is None:
            self._write(f"[{elapsed:6.1f} s] {process}: {message}", done=True)
            return
        k, n = int(step.group(1)), int(step.group(2))
        filled = self.width * k // max(n, 1)
        label = message[: step.start()].strip()
        self._write(f"[{elapsed:6.1f} s] {process}: {label} [{'#' * filled}{'.' * (self.width - filled)}] {k}/{n}",
                    done=k >= n)

    def _write(self, text: str, done: bool) -> None:
        self.stream.write("\r\x1b[K" + text + ("\n" if done else ""))
        self.stream.flush()
        self._open = not done

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


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
    device: str = "cpu"  # KEV_DEVICE of the bank and the scorers: cpu | cuda | cuda:N
    progress: Callable[[str, str], None] | None = None  # (process, message) of each start-up line while starting

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
        follower = LogFollower(self.dir, self.progress) if self.progress is not None else None
        if follower is not None:
            follower.start()
        try:
            self.redis = RedisProc(self.dir)  # StackError when redis-server is missing
            self.redis.start()
            # The first scorer starts while the bank loads; it attaches (mapping the bank's weights,
            # and only then warming up on the GPU) once the bank is ready, so no two warm-ups share
            # the device.
            self._start_bank(wait=False)
            self.add_scorer(self.scorer_port, wait=False)
            self.bank.wait_serving(self.start_timeout_s)
            self.scorers[0].wait_serving(self.start_timeout_s)
        except BaseException as e:
            if follower is not None:
                follower.stop()
            if not isinstance(e, StackError):  # interrupted (a signal, a time limit): where each service was
                for proc in (self.bank, *self.scorers):
                    if proc is not None:
                        print(f"--- {proc.name} log tail (start-up interrupted) ---\n{proc.log_tail()}",
                              file=sys.stderr, flush=True)
            self.stop()
            raise
        if follower is not None:
            follower.stop()

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
                              torch_threads=self.torch_threads, env={"KEV_DEVICE": self.device, **self.bank_env},
                              python=self.python,
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
                           env={"KEV_DEVICE": self.device, **self.scorer_env, **(env or {})}, python=self.python,
                           name=name,
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
    """`python -m kev.stack CHECKPOINT [--device cpu|cuda] [--bank-memory 256M] [--scorer-port 50051]`:
    starts a stack, prints its start-up progress and addresses, serves until Ctrl-C / SIGTERM."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kev.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint directory (the demo model: kev/demo_model)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N: where the bank and the "
                                                        "scorer run")
    parser.add_argument("--bank-memory", type=parse_size, default=256 << 20,
                        help="the bank's memory for document states, e.g. 256M (default) or 8G")
    parser.add_argument("--bank-memory-bytes", type=int, dest="bank_memory", help=argparse.SUPPRESS)
    parser.add_argument("--scorer-port", type=int, default=50051, help="the scorer's localhost port (default 50051)")
    parser.add_argument("--max-document-tokens", type=int, default=65536, help="document limit (default 65536)")
    parser.add_argument("--start-timeout", type=float, default=None,
                        help=f"seconds per process (default {START_TIMEOUT_S:g} on CPU, {CUDA_START_TIMEOUT_S:g} on CUDA)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    timeout = args.start_timeout or (START_TIMEOUT_S if args.device == "cpu" else CUDA_START_TIMEOUT_S)
    printer = ProgressPrinter()
    print(f"starting a stack on {args.device}: {args.checkpoint} (bank memory {args.bank_memory >> 20} MiB)",
          flush=True)
    start = time.monotonic()
    stack = Stack(args.checkpoint, bank_memory_bytes=args.bank_memory, scorer_port=args.scorer_port,
                  device=args.device, max_document_tokens=args.max_document_tokens, start_timeout_s=timeout,
                  progress=printer)
    try:
        stack.start()
    except StackError as e:
        printer.close()
        print(f"the stack did not start: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        printer.close()
        return 130
    with stack:
        printer.close()
        print(f"stack ready in {time.monotonic() - start:.1f} s", flush=True)
        print(f"scorer {stack.scorer_addr}  bank {stack.bank_addr}  redis {stack.redis_url}", flush=True)
        print(f"logs in {stack.dir}", flush=True)
        print(f"try: kev models --addr {stack.scorer_addr}   (Ctrl-C stops everything)", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
