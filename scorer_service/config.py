"""The scorer's settings: one frozen dataclass, built once at start-up from flags and environment.

Every `KEV_*` variable the scorer reads is read here and nowhere else (docs/settings.md lists
them); a flag named after the field (`--max-rows-per-pass` for `KEV_MAX_ROWS_PER_PASS`) overrides
the environment. Knobs deployments rarely change are flags only. The result is logged at start-up
and passed down explicitly. The loading, the flags and the logged form are kev/serving/settings.py's;
the fields and their checks are here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kev.exec.plan import GraphPlan
from kev.request.prompts import Limits
from kev.serving import settings
from kev.serving.settings import ConfigError, check_server_security, env_field as _env

__all__ = ["ConfigError", "ScorerConfig", "TRANSPORT_LIMIT_FACTOR"]

# gRPC's own limit is this many times the request limit: requests between the two are received
# and answered INVALID_ARGUMENT naming the biggest field; beyond it the transport refuses them
# (RESOURCE_EXHAUSTED) before the server sees a byte, which protects the process's memory.
TRANSPORT_LIMIT_FACTOR = 4
OPS_BACKENDS = ("torch", "triton", "gathered")  # kev.ops.get_ops names


@dataclass(frozen=True)
class ScorerConfig:
    # Environment (docs/settings.md); a flag of the same name overrides.
    checkpoint: str = _env("KEV_CHECKPOINT")
    redis_url: str = _env("KEV_REDIS_URL")
    device: str = _env("KEV_DEVICE")  # cpu | cuda
    adapter: str | None = _env("KEV_ADAPTER", None)  # must match the bank's
    listen: str = _env("KEV_SCORER_LISTEN", "0.0.0.0:50051")
    bank_addr: str = _env("KEV_BANK_ADDR", "localhost:50052")
    bank_tls_ca: str | None = _env("KEV_BANK_TLS_CA", None)  # set: the bank is reached over TLS
    bank_token_file: str | None = _env("KEV_BANK_TOKEN_FILE", None)  # the bank's bearer token (needs TLS)
    # The scorer's client certificate to a bank that requires one (its KEV_TLS_CLIENT_CA, mTLS).
    bank_tls_cert: str | None = _env("KEV_BANK_TLS_CERT", None)
    bank_tls_key: str | None = _env("KEV_BANK_TLS_KEY", None)
    # TLS and bearer-token auth of this service's gRPC API (kev/serving/security.py); unset: insecure, open.
    tls_cert: str | None = _env("KEV_TLS_CERT", None)
    tls_key: str | None = _env("KEV_TLS_KEY", None)
    tls_client_ca: str | None = _env("KEV_TLS_CLIENT_CA", None)  # set: clients need a certificate it signed (mTLS)
    auth_token_file: str | None = _env("KEV_AUTH_TOKEN_FILE", None)  # every call but health: Bearer <token>
    reflection: str = _env("KEV_REFLECTION", "on")  # on | off: gRPC server reflection
    max_rows_per_pass: int = _env("KEV_MAX_ROWS_PER_PASS", 96)
    max_tokens_per_pass: int = _env("KEV_MAX_TOKENS_PER_PASS", 8192)
    # cap of a row's wait for companions while a row pass is on the device; idle: no wait (batcher.py)
    max_wait_ms: float = _env("KEV_MAX_WAIT_MS", 2.0)
    # A request for a new document that finds this scorer idle (no rows waiting or running) sends its
    # rows with the Acquire: an idle bank then answers them in the document's own pass (one sweep
    # over the weights instead of two passes; docs/decisions.md, "Batch windows")
    idle_sweeps: bool = _env("KEV_IDLE_SWEEPS", True)
    # While a row pass is on the device, the next one is cut back to the graph key below when that
    # pads less (as a loaded bank's are), its trailing rows passed over once at most
    # (docs/decisions.md, "A full pass fits its key": measured on the GPU at bf14043)
    row_cut_back: bool = _env("KEV_ROW_CUT_BACK", True)
    # Token ids of the documents seen lately, by their text (kev/request/doc_cache.py): a repeated
    # document is not tokenized again. Up to this many tokens, 4 bytes each; 0: no cache
    document_cache_tokens: int = _env("KEV_DOCUMENT_CACHE_TOKENS", 1 << 20)
    max_queue: int = _env("KEV_MAX_QUEUE", 4096)  # rows waiting (each request counts at most one pass's rows)
    max_questions: int = _env("KEV_MAX_QUESTIONS", 10000)  # per request; more is INVALID_ARGUMENT
    # Bounded memory (scorer_service/admission.py): documents over max tokens x this many characters are
    # refused (or cut, with truncation) before tokenising; parsing + tokenising share a memory budget.
    max_chars_per_token: int = _env("KEV_MAX_CHARS_PER_TOKEN", 16)
    tokenize_memory_bytes: int = _env("KEV_TOKENIZE_MEMORY_BYTES", 512 << 20)
    # A request without a deadline gets this budget (seconds), never an instant failure (issue 27).
    default_deadline_s: float = _env("KEV_DEFAULT_DEADLINE_S", 60.0)
    metrics_port: int = _env("KEV_METRICS_PORT", 9090)  # 0: no metrics endpoint
    metrics_addr: str = _env("KEV_METRICS_ADDR", "0.0.0.0")  # the address the metrics endpoint binds
    lease_seconds: float = _env("KEV_LEASE_SECONDS", 30.0)
    # CUDA only (kev/exec/passes.py): every row pass up to the pass caps above runs as a CUDA graph,
    # all captured at start-up; off: none
    cuda_graphs: bool = _env("KEV_CUDA_GRAPHS", True)
    warm_classes: str = _env("KEV_WARM_CLASSES", "all")  # autotune classes warmed at start-up: all, none or a list
    # Row-pass kernels: unset = torch on CPU, triton (bank-indexed) on GPU; "gathered" is the
    # gathered-state baseline (kev/ops/gathered_ops.py) that bench/load_compare.py serves side by side.
    ops: str | None = _env("KEV_OPS", None)
    # KEV_OPS=gathered only: tokens of stored prefix a row's gathered page buffer holds. Under CUDA
    # graphs the buffer has this fixed size, so the scorer's document limit is capped at it.
    gathered_max_prefix_tokens: int = _env("KEV_GATHERED_MAX_PREFIX_TOKENS", 4096)
    # Flags only: knobs deployments rarely change.
    max_request_bytes: int = 16 << 20  # serialized ScoreQuestionsRequest; larger is INVALID_ARGUMENT
    grpc_threads: int = 256  # concurrent RPCs being handled (each waits on its rows)
    tokenize_workers: int = 4  # requests parsed and tokenised at once (within KEV_TOKENIZE_MEMORY_BYTES)
    bank_timeout_s: float = 30.0  # cap on one Acquire (a state pass), whatever the client's deadline
    max_document_tokens: int = Limits.max_document_tokens  # including <state>; at most the bank's
    max_row_tokens: int = Limits.max_row_tokens  # one question row, every delimiter included
    switch_interval_ms: float = 0.0  # the GIL's (kev/serving/interpreter.py); 0 = CPython's 5 ms

    def __post_init__(self) -> None:
        check_server_security(self)
        if self.bank_token_file and not self.bank_tls_ca:
            raise ConfigError("KEV_BANK_TOKEN_FILE needs KEV_BANK_TLS_CA (a token is never sent in clear)")
        if bool(self.bank_tls_cert) != bool(self.bank_tls_key):
            raise ConfigError("KEV_BANK_TLS_CERT and KEV_BANK_TLS_KEY go together")
        if self.bank_tls_cert and not self.bank_tls_ca:
            raise ConfigError("KEV_BANK_TLS_CERT needs KEV_BANK_TLS_CA (a client certificate is a TLS thing)")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"KEV_DEVICE must be cpu or cuda[:N], got {self.device!r}")
        for name in ("max_rows_per_pass", "max_tokens_per_pass", "max_queue", "max_questions", "max_request_bytes",
                     "grpc_threads", "max_chars_per_token", "tokenize_memory_bytes", "tokenize_workers",
                     "max_document_tokens", "max_row_tokens", "gathered_max_prefix_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ops not in (None, *OPS_BACKENDS):
            raise ConfigError(f"KEV_OPS must be one of {', '.join(OPS_BACKENDS)}, got {self.ops!r}")
        if self.max_wait_ms < 0:
            raise ConfigError(f"KEV_MAX_WAIT_MS must be >= 0, got {self.max_wait_ms}")
        if self.document_cache_tokens < 0:
            raise ConfigError(f"KEV_DOCUMENT_CACHE_TOKENS must be >= 0 (0: no cache), got {self.document_cache_tokens}")
        if self.switch_interval_ms < 0:
            raise ConfigError(f"--switch-interval-ms must be >= 0, got {self.switch_interval_ms}")
        if self.lease_seconds <= 0 or self.bank_timeout_s <= 0 or self.default_deadline_s <= 0:
            raise ConfigError("KEV_LEASE_SECONDS, KEV_DEFAULT_DEADLINE_S and --bank-timeout-s must be > 0")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"KEV_METRICS_PORT must be 0-65535, got {self.metrics_port}")
        self.graph_plan  # noqa: B018 - raises ConfigError on bad graph settings

    @property
    def ops_backend(self) -> str:
        """The explicit kernel choice: KEV_OPS, else torch reference ops on CPU and the bank-indexed
        Triton ops on GPU."""
        if self.ops is not None:
            return self.ops
        return "torch" if self.device == "cpu" else "triton"

    @property
    def graph_plan(self) -> GraphPlan:
        """What the row passes capture on CUDA (ignored on CPU)."""
        return settings.graph_plan(cuda_graphs=self.cuda_graphs, warm_classes=self.warm_classes,
                                   row_tokens=self.max_tokens_per_pass, row_seqs=self.max_rows_per_pass)

    @property
    def document_limit(self) -> int:
        """Longest document this scorer takes: `max_document_tokens`, capped for the gathered ops at
        KEV_GATHERED_MAX_PREFIX_TOKENS (longer ones are INVALID_ARGUMENT, or truncated on request)."""
        if self.ops_backend == "gathered":
            return min(self.max_document_tokens, self.gathered_max_prefix_tokens)
        return self.max_document_tokens

    @property
    def document_char_limit(self) -> int:
        """Characters of document text taken to the tokenizer at most (scorer_service/admission.py)."""
        return self.document_limit * self.max_chars_per_token

    @property
    def limits(self) -> Limits:
        return Limits(max_document_tokens=self.document_limit, max_row_tokens=self.max_row_tokens)

    @property
    def transport_max_bytes(self) -> int:
        return min(self.max_request_bytes * TRANSPORT_LIMIT_FACTOR, 2**31 - 1)

    def redacted(self) -> dict:
        """The settings as logged: the Redis password is masked."""
        return settings.redacted(self, ops_backend=self.ops_backend, document_limit=self.document_limit)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> "ScorerConfig":
        return settings.load_settings(cls, os.environ if environ is None else environ, argv,
                                      prog="python -m scorer_service", description="Kev scorer service")
