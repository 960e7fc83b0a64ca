"""The public `kev.v1.Scorer` gRPC service: request handling and the status mapping.

One request: parse (raw bytes, see kev/rpc/wire.py) -> validate + render (`validate_and_build`) ->
a pinned document handle (bank_link.py) -> rows into the batcher -> wait (renewing the lease,
watching the deadline and the client) -> answers. The pin is released on every way out:
success, error, deadline, client cancellation.

Status mapping (InvalidRequest here; the others are kev.serving.errors exceptions, each carrying its code):
    INVALID_ARGUMENT    kev.request.errors.InvalidRequest: the message starts with the field path, which is
                        also sent as trailing metadata `kev-field-bin` (UTF-8). Includes requests over
                        KEV_MAX_REQUEST_BYTES (the field holding the most bytes is named), invalid
                        UTF-8, unknown models and more than KEV_MAX_QUESTIONS questions (field
                        `questions`). Above TRANSPORT_LIMIT_FACTOR x that limit gRPC itself
                        refuses the message with RESOURCE_EXHAUSTED before the server sees it.
    RESOURCE_EXHAUSTED  the row queue is full (KEV_MAX_QUEUE; each request counts one pass's rows at most),
                        or the bank stayed full of pinned entries
                        for its --full-wait-ms (a new document waits that long for a pin to go)
    UNAVAILABLE         the bank or Redis cannot be reached, the scorer is draining, or the document's
                        entry went stale twice in a row (bank restarts); safe to retry
    DEADLINE_EXCEEDED   the client's deadline (or, without one, KEV_DEFAULT_DEADLINE_S) passed first
                        (rows still queued are dropped)
    CANCELLED           the client went away (nothing is sent; the pin is released)
    INTERNAL            anything else (logged with its traceback)
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from kev.request import api
from kev.loading import LoadedModel
from kev.request.answers import request_answers
from kev.request.errors import InvalidRequest
from kev.request.prompts import render_document, validate_and_build
from kev.serving.errors import Cancelled, DeadlineExceeded, ServiceError, Unavailable
from kev.serving.grpc_server import GrpcServer
from kev.serving.security import ServerSecurity
from kev.v1 import scorer_pb2 as pb
from kev.rpc import wire
from scorer_service.admission import TokenizeGate, check_document_size
from scorer_service.bank_link import BankLink, StaleAttachment
from scorer_service.batcher import Job, RowBatcher
from scorer_service.config import ScorerConfig
from scorer_service.metrics import ScorerMetrics

log = logging.getLogger(__name__)

SERVICE = "kev.v1.Scorer"
NO_DEADLINE_S = 1e8  # time_remaining() above this (~3 years) means the client set no deadline
FIELD_METADATA = "kev-field-bin"


class ScorerService:
    def __init__(self, config: ScorerConfig, loaded: LoadedModel, link: BankLink, batcher: RowBatcher,
                 metrics: ScorerMetrics):
        self.config, self.loaded, self.link, self.batcher, self.metrics = config, loaded, link, batcher, metrics
        self.draining = False
        self.gate = TokenizeGate(config.tokenize_memory_bytes, config.tokenize_workers)

    # ------------------------------------------------------------------------------ RPCs

    def score_questions(self, raw: bytes, context: grpc.ServicerContext) -> pb.ScoreQuestionsResponse:
        start = time.perf_counter()
        code, message, field = grpc.StatusCode.OK, "", None
        try:
            return wire.response_to_proto(self._score(raw, context))
        except InvalidRequest as e:
            code, message, field = grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field
        except ServiceError as e:
            code, message = e.code, str(e)
        except Exception as e:  # noqa: BLE001 - mapped to INTERNAL, never a hung client
            log.exception("ScoreQuestions failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        finally:
            if not context.is_active() and code is grpc.StatusCode.OK:
                code = grpc.StatusCode.CANCELLED
            self.metrics.request_seconds.labels(code=code.name).observe(time.perf_counter() - start)
        if field is not None:
            context.set_trailing_metadata(((FIELD_METADATA, field.encode()),))
        context.abort(code, message)

    def list_models(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        limits = self.loaded.builder.limits
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.loaded.model_id, max_document_tokens=limits.max_document_tokens,
            max_row_tokens=limits.max_row_tokens, is_default=True)])

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """One request through the whole path (bank, directory, row pass, head) before SERVING."""
        request = api.ScoreRequest("Kev warm-up.", {"warm-up": api.Question.noul("Is this a warm-up?")})
        prepared = validate_and_build(request, self.loaded.builder)
        lease = self.link.acquire(prepared.document_ids, timeout_s)
        try:
            job = self.batcher.submit(prepared, lease)
            if not job.done.wait(timeout_s):
                job.cancel()
                raise DeadlineExceeded("warm-up request timed out")
        finally:
            self.link.release(lease)
        if job.error is not None:
            raise job.error

    # ------------------------------------------------------------------------------ one request

    def _score(self, raw: bytes, context: grpc.ServicerContext) -> api.ScoreResponse:
        if self.draining:
            raise Unavailable("the scorer is draining; retry on another")
        clock = PhaseClock()
        deadline = time.monotonic() + self.budget_s(context)
        msg = wire.parse_request(raw, self.config.max_request_bytes)
        if len(msg.questions) > self.config.max_questions:
            raise InvalidRequest("questions", f"{len(msg.questions)} questions is over the limit of "
                                              f"{self.config.max_questions} per request (KEV_MAX_QUESTIONS)")
        kind = msg.WhichOneof("document")
        if kind is not None:  # the size bound before parsing and tokenising (scorer_service/admission.py)
            check_document_size(len(getattr(msg, kind)), self.config.document_char_limit,
                                truncate=msg.truncate_document, json=kind == "document_json",
                                per_token=self.config.max_chars_per_token)
        with self.gate.hold(len(raw), deadline):
            request = wire.request_from_proto(msg)
            del msg
            if request.model not in (None, self.loaded.model_id):
                raise InvalidRequest("model", f"unknown model {request.model!r} (this scorer serves "
                                              f"{self.loaded.model_id!r}; see ListModels)")
            request, cut = self._bounded_document(request)
            prepared = validate_and_build(request, self.loaded.builder)
            if cut and not prepared.truncated:
                prepared = dataclasses.replace(prepared, truncated=True)
        clock.lap("prepare")
        for attempt in (1, 2):
            try:
                # Idle, a new document's rows go with its Acquire (an idle bank sweeps them: no row pass
                # here). A document this scorer has not seen lately is taken for new: it goes to the bank
                # with no directory look-up first (the bank finds a stored one itself and just pins it).
                sweep = prepared.rows if self.config.idle_sweeps and self.batcher.idle else ()
                lease = self.link.acquire(prepared.document_ids, deadline - time.monotonic(), rows=sweep,
                                          look_up=not sweep or prepared.document_seen)
                clock.lap("acquire")
                try:
                    if lease.probabilities is not None:
                        answers, rows_ms = request_answers(prepared, lease.probabilities), 0.0
                        self.metrics.idle_sweeps.inc()
                    else:
                        job = self.batcher.submit(prepared, lease)
                        self._wait(job, context, deadline)
                        clock.lap("rows")
                        if job.error is not None:
                            raise job.error
                        answers, rows_ms = job.answers, job.model_ms
                finally:
                    self.link.release(lease)
                    clock.lap("release")
                break
            except StaleAttachment as e:
                if attempt == 2:
                    raise
                log.info("retrying a request whose bank entry went stale: %s", e)
        for phase, seconds in clock.seconds.items():
            self.metrics.request_phase_seconds.labels(phase=phase).inc(seconds)
        doc = len(prepared.document_ids)
        usage = api.Usage(input_tokens=prepared.input_tokens, cached_state_tokens=doc if lease.cached else 0,
                          document_tokens=doc, truncated=prepared.truncated,
                          unknown_tokens=prepared.unknown_tokens)
        model_ms = rows_ms + (0.0 if lease.cached else lease.acquire_ms)
        return api.ScoreResponse(answers={r.name: answers[r.name] for r in prepared.rows}, usage=usage,
                                 model_ms=model_ms, model=self.loaded.model_id)

    def _bounded_document(self, request: api.ScoreRequest) -> tuple[api.ScoreRequest, bool]:
        """The request with its document as text of at most KEV_MAX_CHARS_PER_TOKEN x the token limit
        characters (cut when it asks for truncation), and whether it was cut. JSON is rendered here,
        exactly as the prompt builder would, so its rendered size is checked before tokenising."""
        doc, limit = request.document, self.config.document_char_limit
        text = doc if isinstance(doc, str) else render_document(doc)
        if len(text) <= limit:
            return (request if text is doc else dataclasses.replace(request, document=text)), False
        if not request.truncate_document:
            check_document_size(len(text), limit, truncate=False, json=False,
                                per_token=self.config.max_chars_per_token)
        return dataclasses.replace(request, document=text[:limit]), True

    def budget_s(self, context: grpc.ServicerContext) -> float:
        """Seconds this request may take: the client's deadline, or KEV_DEFAULT_DEADLINE_S without one.
        gRPC reports "no deadline" as None or as ~9.2e18 s (its infinite-future deadline), which must
        never be passed on to another call (it overflows to an instant DEADLINE_EXCEEDED)."""
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            return self.config.default_deadline_s
        return remaining

    def _wait(self, job: Job, context: grpc.ServicerContext, deadline: float) -> None:
        """Until the job is done, the deadline passes or the client leaves; renews the lease."""
        if not context.add_callback(job.cancel):  # cancellation (and RPC end) wakes the wait at once
            job.cancel()  # the RPC had already ended
        tick = self.config.lease_seconds / 3
        while True:
            remaining = deadline - time.monotonic()
            timeout = max(0.0, min(tick, remaining))
            if job.done.wait(timeout):
                break
            if remaining <= timeout:
                job.cancel()
                raise DeadlineExceeded("deadline exceeded while the request's rows were queued or running")
            self.link.renew_if_due(job.lease)
        if job.error is None and job.cancelled:
            if deadline - time.monotonic() <= 0:
                raise DeadlineExceeded("deadline exceeded")
            raise Cancelled("the client cancelled the request")


class PhaseClock:
    """One request's seconds by phase (kev_scorer_request_phase_seconds): each lap is charged to the
    phase it ends; a retried attempt adds to the same phases."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now


def scorer_rpc_handler(score_questions, list_models) -> grpc.GenericRpcHandler:
    """The kev.v1.Scorer methods. ScoreQuestions takes raw bytes: the service parses them itself
    so that bad input is INVALID_ARGUMENT with a field (bench/load_baseline.py serves the same API)."""
    return grpc.method_handlers_generic_handler(SERVICE, {
        "ScoreQuestions": grpc.unary_unary_rpc_method_handler(
            score_questions, request_deserializer=None,
            response_serializer=pb.ScoreQuestionsResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            list_models, request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString),
    })


def build_server(service: ScorerService) -> GrpcServer:
    """kev.v1.Scorer (NOT_SERVING until `set_serving(True)`), health and reflection; not yet bound."""
    config = service.config
    security = ServerSecurity(config.tls_cert, config.tls_key, config.tls_client_ca, config.auth_token_file)
    server = GrpcServer([SERVICE], workers=config.grpc_threads, thread_name_prefix="kev-rpc",
                        reflect=config.reflection == "on", credentials=security.credentials(),
                        interceptors=security.interceptors(),
                        max_message_bytes=config.transport_max_bytes)
    server.add_handlers([scorer_rpc_handler(service.score_questions, service.list_models)])
    return server
