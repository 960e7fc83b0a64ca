"""The bank service's settings: one frozen object, built once at start-up and passed down.

Environment (docs/settings.md): KEV_CHECKPOINT, KEV_ADAPTER, KEV_DEVICE, KEV_BANK_LISTEN,
KEV_BANK_MEMORY_BYTES, KEV_REDIS_URL, KEV_METRICS_PORT (0 = off), KEV_LEASE_SECONDS, and the CUDA
settings KEV_GRAPH_DOCS, KEV_MAX_GRAPHS and KEV_WARM_CLASSES (their flags, --graph-docs, --max-graphs and
--warm-classes, override).
Tuning knobs that deployments rarely change are command-line flags (`python -m bank_service
--help`). Nothing else in the service reads the environment.
"""

from __future__ import annotations

import argparse
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from kev.exec.passes import DEFAULT_DOC_BUCKETS, GraphPlan, parse_doc_buckets, parse_warm_classes


class ConfigError(ValueError):
    """A setting is missing or malformed (the message names the variable or flag)."""


@dataclass(frozen=True)
class BankConfig:
    checkpoint: Path  # KEV_CHECKPOINT
    device: str  # KEV_DEVICE: "cpu" or "cuda" / "cuda:N"
    memory_bytes: int  # KEV_BANK_MEMORY_BYTES: recurrent + conv + paged K/V pools
    redis_url: str  # KEV_REDIS_URL
    adapter: Path | None = None  # KEV_ADAPTER
    listen: str = "0.0.0.0:50052"  # KEV_BANK_LISTEN
    metrics_port: int = 9091  # KEV_METRICS_PORT, 0 = no metrics server
    lease_seconds: float = 30.0  # KEV_LEASE_SECONDS: default pin lease (and the post-restart protective pin)
    # Flags
    node: str = ""  # directory namespace of this bank; default: the host name
    ops: str = ""  # kev.ops backend for state passes ("torch" | "triton"); "": torch on CPU, triton on CUDA
    graph_docs: str = DEFAULT_DOC_BUCKETS  # KEV_GRAPH_DOCS: state buckets (DxL) captured at start-up on CUDA
    max_graphs: int = 24  # KEV_MAX_GRAPHS: CUDA graphs kept (LRU); 0: none
    warm_classes: str = "all"  # KEV_WARM_CLASSES: autotune classes warmed at start-up on CUDA ("all", "none", a list)
    block_size: int = 64  # tokens per paged K/V block
    avg_doc_tokens: int = 1024  # how memory_bytes is split between slots and K/V pages
    max_document_tokens: int = 65536  # longest document Acquire takes (including <state>)
    max_wait_ms: float = 2.0  # longest a new document waits for others to share its state pass
    # longest a new document waits for space while every entry is pinned (their requests finish and
    # release them), counted from its arrival; then RESOURCE_EXHAUSTED. 0: refused at once. The
    # default lease's length: a pin its crashed holder never releases expires within the wait.
    full_wait_ms: float = 30000.0
    max_pass_tokens: int = 16384  # document tokens per state pass at most (one longer document runs alone)
    max_pass_documents: int = 64
    max_lease_seconds: float = 3600.0  # longest lease a caller may ask for
    grpc_workers: int = 64  # concurrent RPCs (Acquire blocks while its state pass runs)
    epoch_check_s: float = 1.0  # how often an idle bank checks that Redis still holds its epoch
    shm_dir: Path = Path("/dev/shm")  # where the CPU bank's shared-memory file lives
    torch_threads: int = 0  # 0 = torch's default
    switch_interval_ms: float = 0.0  # the GIL's (kev/serving/interpreter.py); 0 = CPython's 5 ms
    grace_s: float = 5.0  # drain time for in-flight RPCs at shutdown

    def __post_init__(self) -> None:
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ConfigError(f"KEV_DEVICE must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.memory_bytes <= 0:
            raise ConfigError(f"KEV_BANK_MEMORY_BYTES must be positive, got {self.memory_bytes}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"KEV_METRICS_PORT must be 0..65535, got {self.metrics_port}")
        if not 0 < self.lease_seconds <= self.max_lease_seconds:
            raise ConfigError(f"KEV_LEASE_SECONDS must be in (0, {self.max_lease_seconds}], got {self.lease_seconds}")
        if self.ops not in ("", "torch", "triton"):
            raise ConfigError(f"--ops must be 'torch' or 'triton', got {self.ops!r}")
        if self.max_graphs < 0:
            raise ConfigError(f"KEV_MAX_GRAPHS must be >= 0, got {self.max_graphs}")
        try:
            docs = parse_doc_buckets(self.graph_docs)
        except ValueError as e:
            raise ConfigError(f"KEV_GRAPH_DOCS: {e}") from None
        if self.max_graphs and len(docs) > self.max_graphs:
            raise ConfigError(f"KEV_GRAPH_DOCS names {len(docs)} buckets, "
                              f"more than KEV_MAX_GRAPHS={self.max_graphs}")
        try:
            parse_warm_classes(self.warm_classes)
        except ValueError as e:
            raise ConfigError(f"KEV_WARM_CLASSES: {e}") from None
        if not self.node or any(c in self.node for c in "{}@"):
            raise ConfigError(f"--node must be non-empty without '{{', '}}' or '@', got {self.node!r}")
        for name in ("block_size", "avg_doc_tokens", "max_document_tokens", "max_pass_tokens",
                     "max_pass_documents", "grpc_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_wait_ms < 0 or self.full_wait_ms < 0 or self.epoch_check_s <= 0 or self.grace_s < 0:
            raise ConfigError("--max-wait-ms, --full-wait-ms and --grace-s must be >= 0, --epoch-check-s > 0")
        if self.switch_interval_ms < 0:
            raise ConfigError(f"--switch-interval-ms must be >= 0, got {self.switch_interval_ms}")

    @classmethod
    def from_env(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> "BankConfig":
        def need(name: str) -> str:
            value = env.get(name, "")
            if not value:
                raise ConfigError(f"{name} is required")
            return value

        def number(name: str, value: str, kind=int):
            try:
                return kind(value)
            except ValueError:
                raise ConfigError(f"{name} must be a number, got {value!r}") from None

        p = argparse.ArgumentParser(prog="python -m bank_service", description="Kev bank service (see docs/settings.md)")
        d = cls.__dataclass_fields__
        p.add_argument("--node", default=socket.gethostname())
        p.add_argument("--ops", default=d["ops"].default, choices=("torch", "triton"))
        p.add_argument("--graph-docs", default=env.get("KEV_GRAPH_DOCS", "") or d["graph_docs"].default)
        p.add_argument("--max-graphs", default=env.get("KEV_MAX_GRAPHS", "") or str(d["max_graphs"].default))
        p.add_argument("--warm-classes", default=env.get("KEV_WARM_CLASSES", "") or d["warm_classes"].default)
        for name in ("block_size", "avg_doc_tokens", "max_document_tokens", "max_pass_tokens", "max_pass_documents",
                     "grpc_workers", "torch_threads"):
            p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name].default)
        for name in ("max_wait_ms", "full_wait_ms", "max_lease_seconds", "epoch_check_s", "grace_s",
                     "switch_interval_ms"):
            p.add_argument("--" + name.replace("_", "-"), type=float, default=d[name].default)
        p.add_argument("--shm-dir", type=Path, default=d["shm_dir"].default)
        flags = vars(p.parse_args(list(argv)))
        flags["max_graphs"] = number("KEV_MAX_GRAPHS", flags["max_graphs"])

        adapter = env.get("KEV_ADAPTER", "")
        return cls(
            checkpoint=Path(need("KEV_CHECKPOINT")),
            device=need("KEV_DEVICE"),
            memory_bytes=number("KEV_BANK_MEMORY_BYTES", need("KEV_BANK_MEMORY_BYTES")),
            redis_url=need("KEV_REDIS_URL"),
            adapter=Path(adapter) if adapter else None,
            listen=env.get("KEV_BANK_LISTEN", "") or d["listen"].default,
            metrics_port=number("KEV_METRICS_PORT", env.get("KEV_METRICS_PORT", "") or str(d["metrics_port"].default)),
            lease_seconds=number("KEV_LEASE_SECONDS", env.get("KEV_LEASE_SECONDS", "") or "30", float),
            **flags,
        )

    @property
    def ops_backend(self) -> str:
        """The kernels state passes run: `--ops`, else torch reference ops on CPU, indexed Triton on CUDA."""
        return self.ops or ("torch" if self.device == "cpu" else "triton")

    @property
    def graph_plan(self) -> GraphPlan:
        """What the state passes capture on CUDA (ignored on CPU)."""
        return GraphPlan(rows=(), docs=parse_doc_buckets(self.graph_docs), max_graphs=self.max_graphs,
                         warm=parse_warm_classes(self.warm_classes))

    def redacted(self) -> dict:
        """Every field for the start-up log, with the Redis password masked."""
        out = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        parts = urlsplit(self.redis_url)
        if parts.password:
            netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
            out["redis_url"] = urlunsplit(parts._replace(netloc=netloc))
        out["ops_backend"] = self.ops_backend
        return out
