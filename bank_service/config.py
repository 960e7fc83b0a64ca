"""The bank service's settings: one frozen object, built once at start-up and passed down.

Environment (docs/settings.md): KEV_CHECKPOINT, KEV_ADAPTER, KEV_DEVICE, KEV_BANK_LISTEN,
KEV_BANK_MEMORY_BYTES, KEV_REDIS_URL, KEV_METRICS_PORT (0 = off), KEV_METRICS_ADDR, KEV_LEASE_SECONDS,
the TLS settings, and the CUDA settings KEV_CUDA_GRAPHS and KEV_WARM_CLASSES (their flags,
--cuda-graphs and --warm-classes, override).
Tuning knobs that deployments rarely change are command-line flags (`python -m bank_service
--help`). Nothing else in the service reads the environment; the loading, the flags and the logged
form are kev/serving/settings.py's, the fields and their checks are here.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kev.exec.plan import GraphPlan, PassRole
from kev.serving import settings
from kev.serving.settings import ConfigError, check_server_security, env_field, flag_field

__all__ = ["BankConfig", "ConfigError"]


@dataclass(frozen=True)
class BankConfig:
    # Environment only (docs/settings.md)
    checkpoint: Path = env_field("KEV_CHECKPOINT", flag=False)
    device: str = env_field("KEV_DEVICE", flag=False)  # "cpu" or "cuda" / "cuda:N"
    memory_bytes: int = env_field("KEV_BANK_MEMORY_BYTES", flag=False)  # recurrent + conv + paged K/V pools
    redis_url: str = env_field("KEV_REDIS_URL", flag=False)
    adapter: Path | None = env_field("KEV_ADAPTER", None, flag=False)
    listen: str = env_field("KEV_BANK_LISTEN", "0.0.0.0:50052", flag=False)
    # TLS and bearer-token auth of this service's gRPC API (kev/serving/security.py); unset: insecure, open.
    tls_cert: str | None = env_field("KEV_TLS_CERT", None)
    tls_key: str | None = env_field("KEV_TLS_KEY", None)
    tls_client_ca: str | None = env_field("KEV_TLS_CLIENT_CA", None)  # set: clients need a certificate it signed (mTLS)
    auth_token_file: str | None = env_field("KEV_AUTH_TOKEN_FILE", None)  # every call but health: Bearer <token>
    reflection: str = env_field("KEV_REFLECTION", "on")  # on | off: gRPC server reflection
    metrics_port: int = env_field("KEV_METRICS_PORT", 9091, flag=False)  # 0 = no metrics server
    metrics_addr: str = env_field("KEV_METRICS_ADDR", "0.0.0.0", flag=False)  # the address it binds
    # default pin lease
    lease_seconds: float = env_field("KEV_LEASE_SECONDS", 30.0, flag=False)
    # Environment, the flag of the same name overrides: CUDA graphs (kev/exec/passes.py)
    # every state pass up to the pass caps below runs as a CUDA graph, all captured at start-up; off: none
    cuda_graphs: bool = env_field("KEV_CUDA_GRAPHS", True)
    # the model's weights in shared memory (CUDA IPC on GPU) for the scorers to map: one copy per GPU
    share_weights: bool = env_field("KEV_SHARE_WEIGHTS", True)
    warm_classes: str = env_field("KEV_WARM_CLASSES", "all")  # autotune classes warmed at start-up ("all", "none", a list)
    # Flags
    node: str = ""  # directory namespace of this bank; default (from_env): the host name
    ops: str = flag_field("", choices=("torch", "triton"))  # kev.ops backend; "": torch on CPU, triton on CUDA
    block_size: int = 64  # tokens per paged K/V block
    avg_doc_tokens: int = 1024  # how memory_bytes is split between slots and K/V pages
    max_document_tokens: int = 65536  # longest document Acquire takes (including <state>)
    # cap of a new document's wait for companions while a state pass is in flight; the worker waits
    # for each pass, so it never does: an idle bank passes a document at once (docs/settings.md)
    max_wait_ms: float = 2.0
    # longest a new document waits for space while every entry is pinned (their requests finish and
    # release them), counted from its arrival; then RESOURCE_EXHAUSTED. 0: refused at once. The
    # default lease's length: a pin its crashed holder never releases expires within the wait.
    full_wait_ms: float = 30000.0
    max_pass_tokens: int = 16384  # document tokens per state pass at most (a longer document goes a chunk a pass)
    max_pass_documents: int = 64
    # Idle sweeps (docs/decisions.md, "Batch windows"): an Acquire that brings its request's rows to
    # an idle bank gets the document and those rows read in one sweep, up to these many rows and
    # row tokens (more go the usual way: the scorer's row pass). 0 rows or tokens: no sweeps. The
    # sweep saves one pass's fixed cost (the weights read once more, ~700 kernels), which matters
    # for a request a pass of its own would hardly fill, not for one of thousands of row tokens.
    sweep_rows: int = 32
    sweep_row_tokens: int = 2048
    max_lease_seconds: float = 120.0  # longest lease a caller may ask for (issue 27: was 3600)
    grpc_workers: int = 64  # concurrent RPCs (Acquire blocks while its state pass runs)
    epoch_check_s: float = 1.0  # how often the bank checks that Redis still holds its epoch (idle or busy)
    shm_dir: Path = Path("/dev/shm")  # where the CPU bank's shared-memory file lives
    torch_threads: int = 0  # 0 = torch's default
    switch_interval_ms: float = 0.0  # the GIL's (kev/serving/interpreter.py); 0 = CPython's 5 ms
    grace_s: float = 5.0  # drain time for in-flight RPCs at shutdown

    def __post_init__(self) -> None:
        check_server_security(self)
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
        if not self.node or any(c in self.node for c in "{}@"):
            raise ConfigError(f"--node must be non-empty without '{{', '}}' or '@', got {self.node!r}")
        for name in ("block_size", "avg_doc_tokens", "max_document_tokens", "max_pass_tokens",
                     "max_pass_documents", "grpc_workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.sweep_rows < 0 or self.sweep_row_tokens < 0:
            raise ConfigError("--sweep-rows and --sweep-row-tokens must be >= 0 (0: no idle sweeps)")
        if self.max_wait_ms < 0 or self.full_wait_ms < 0 or self.epoch_check_s <= 0 or self.grace_s < 0:
            raise ConfigError("--max-wait-ms, --full-wait-ms and --grace-s must be >= 0, --epoch-check-s > 0")
        if self.switch_interval_ms < 0:
            raise ConfigError(f"--switch-interval-ms must be >= 0, got {self.switch_interval_ms}")
        self.graph_plan  # noqa: B018 - raises ConfigError on bad graph settings (after the caps it takes)

    @classmethod
    def from_env(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> "BankConfig":
        return settings.load_settings(cls, env, list(argv), prog="python -m bank_service",
                                      description="Kev bank service (see docs/settings.md)",
                                      defaults={"node": socket.gethostname()})

    @property
    def ops_backend(self) -> str:
        """The kernels state passes run: `--ops`, else torch reference ops on CPU, indexed Triton on CUDA."""
        return self.ops or ("torch" if self.device == "cpu" else "triton")

    @property
    def sweeps(self) -> bool:
        """Whether the bank runs idle sweeps (a document and its request's rows in one pass)."""
        return self.sweep_rows > 0 and self.sweep_row_tokens > 0

    @property
    def pass_role(self) -> PassRole:
        """STATES; BOTH with idle sweeps (their rows' keys: `graph_plan`)."""
        return PassRole.BOTH if self.sweeps else PassRole.STATES

    @property
    def graph_plan(self) -> GraphPlan:
        """What the passes capture on CUDA (ignored on CPU), all at start-up: every state pass key,
        and with sweeps every row key up to the sweep caps."""
        rows = dict(row_tokens=self.sweep_row_tokens, row_seqs=self.sweep_rows, sweep_one_document=True) \
            if self.sweeps else {}
        return settings.graph_plan(cuda_graphs=self.cuda_graphs, warm_classes=self.warm_classes,
                                   state_tokens=self.max_pass_tokens, state_seqs=self.max_pass_documents, **rows)

    def redacted(self) -> dict:
        """Every field for the start-up log, with the Redis password masked."""
        return settings.redacted(self, ops_backend=self.ops_backend)
