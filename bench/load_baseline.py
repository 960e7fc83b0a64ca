"""The naive baseline of issue 7's side-by-side load test: transformers, no state reuse at all.

What users would otherwise run: transformers' `Qwen3_5TextModel` (fla's kernels on GPU, its torch
reference paths on CPU) with the project's weights, prompts (`kev.request.prompts`) and pointer head
(`kev.request.head`), served on the same `kev.v1.Scorer` gRPC API so the same load generator drives it.
One batching thread takes whatever requests are waiting (up to `--max-requests`, 64) and runs
EVERY question row as a full sequence, document + row, in ONE right-padded forward: a six-short
request re-reads its 48 document tokens six times, a five-long one its 2,200 tokens five times.
Right padding needs no attention mask (every layer is causal, so real positions never see the
padding). `--max-batch-tokens` (padded rows x longest sequence) caps a forward's size; a forward
that runs out of GPU memory is split in halves and retried, and the split is logged.

Naive in algorithm, not handicapped by cold compiles: a forward's shape is bucketed (rows padded
with whole padding rows up to 1, 2, 4, 8, 16, 24, 32, 48, ... 512; the width up to a multiple of
`--length-multiple`, 16: no compute is added to a fixed-length workload, whose width is the same in
every batch, and Triton's integer specialisation is by 16), and `--warm-widths` / `--warm-rows` /
`--warm-min-rows` run every such shape once before the server reports SERVING (bench/load_compare.py
passes the shapes its sweep will use: row buckets from one request's questions to the sweep's widest
batch), so fla's autotuning and Triton's compiles happen before the measurement, never in it. Each
new shape costs 10-20 s on the H200 with a cold compile cache (fla's l2norm autotunes per token
count bucket), so the buckets no forward can take (five-long's 5 rows a request: 1, 2, 4) are skipped.

It exposes the scorer's metric names (`kev_scorer_rows_per_pass`, `kev_scorer_tokens_per_pass`
= padded tokens per forward, `kev_scorer_row_pass_seconds`) so bench/load.py reads both alike.
Usage is reported with `cached_state_tokens` 0 (nothing is ever cached).

    python -m bench.load_baseline --checkpoint CKPT --device cuda --listen 127.0.0.1:50061 --metrics-port 9461
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from tokenizers import Tokenizer

from kev.request import api
from kev.rpc import wire
from kev.model.checkpoint import load_checkpoint
from kev.request.answers import answer_rows
from kev.request.errors import InvalidRequest
from kev.request.head import load_head
from kev.request.prompts import Delimiters, Limits, PreparedRequest, PromptBuilder, validate_and_build
from kev.serving.grpc_server import GrpcServer, ListenError
from kev.v1 import scorer_pb2 as pb
from scorer_service.server import SERVICE, scorer_rpc_handler

log = logging.getLogger("bench.load_baseline")

HF_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
# Module globals transformers binds to fla / causal-conv1d kernels at import when installed.
KERNEL_GLOBALS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update")
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)
PAD_ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # rows of a padded forward
_TOKEN_BUCKETS = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def use_torch_paths() -> None:
    """Makes transformers' Qwen3.5 layers run their torch reference code in this process (CPU:
    fla's Triton kernels cannot run there). tests/tiny_checkpoints.hide_fla is the scoped version."""
    modeling = importlib.import_module(HF_MODELING)
    for name in KERNEL_GLOBALS:
        fn = inspect.unwrap(getattr(modeling, name))
        params = inspect.signature(fn).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            # The dispatcher drops keywords its target does not take; keep that contract.
            fn = _keywords_of(fn, frozenset(params))
        setattr(modeling, name, fn)


def _keywords_of(fn, names: frozenset[str]):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in names})

    return call


def kernel_paths() -> dict[str, str]:
    """Which implementation each kernel global of transformers' Qwen3.5 module runs, for the log."""
    modeling = importlib.import_module(HF_MODELING)
    out = {}
    for name in KERNEL_GLOBALS:
        fn = getattr(modeling, name)
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", fn) if fn.__closure__ else fn
        out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return out


@dataclass
class Pending:
    prepared: PreparedRequest
    done: threading.Event = field(default_factory=threading.Event)
    answers: dict | None = None
    error: BaseException | None = None
    model_ms: float = 0.0


def padded_rows(rows: int) -> int:
    """Rows of the padded forward: the next of PAD_ROWS, beyond them the next multiple of 128."""
    return next((r for r in PAD_ROWS if r >= rows), -(-rows // 128) * 128)


class BaselineScorer:
    """The model, head and prompt builder, and the one-padded-forward scoring of a batch."""

    def __init__(self, checkpoint: str | Path, device: str = "cpu", max_document_tokens: int = 65536,
                 attn_implementation: str = "sdpa", length_multiple: int = 16):
        if length_multiple < 1:
            raise ValueError(f"length_multiple must be >= 1, got {length_multiple}")
        self.length_multiple = length_multiple
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

        self.device = torch.device(device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        ckpt = load_checkpoint(checkpoint, dtype=dtype, device=device, require_head=True, require_tokenizer=True)
        # The project's checkpoint names are transformers' Qwen3_5TextModel names (kev.model.checkpoint maps
        # both nestings onto them), and its flat config is a Qwen3_5TextConfig.
        text = ckpt.config.to_text_dict()
        hf_config = Qwen3_5TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
        hf_config._attn_implementation = attn_implementation
        with torch.device(self.device):
            model = Qwen3_5TextModel(hf_config)
        # assign: parameters become the loaded tensors (dtype included); the rotary tables, which
        # are buffers outside the state dict, stay fp32 as transformers keeps them.
        model.load_state_dict(ckpt.weights, strict=True, assign=True)
        self.model = model.eval()
        self.model_id = ckpt.meta.model_id
        delimiters = Delimiters(**ckpt.meta.delimiters) if ckpt.meta.delimiters else Delimiters()
        self.builder = PromptBuilder(Tokenizer.from_file(str(ckpt.tokenizer_path)), delimiters,
                                     Limits(max_document_tokens=max_document_tokens))
        self.head = load_head(ckpt.head_path, ckpt.config.hidden_size, device=device)

    @torch.inference_mode()
    def answer(self, prepared: list[PreparedRequest]) -> list[dict[str, api.Answer]]:
        """Answers of each request: one padded forward over every (document + row) sequence."""
        seqs, picks = [], []
        for req in prepared:
            base = len(req.document_ids)
            for row in req.rows:
                seqs.append(req.document_ids + row.prompt.ids)
                picks.append([base + row.prompt.decide_index, *(base + i for i in row.prompt.option_end_indices)])
        rows, width = self.padded_shape(prepared)
        ids = torch.zeros(rows, width, dtype=torch.long)  # right padding with id 0; whole padding rows
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        hidden = self.model(input_ids=ids.to(self.device), use_cache=False).last_hidden_state  # [R, W, d]
        rows = torch.tensor([i for i, p in enumerate(picks) for _ in p], device=self.device)
        cols = torch.tensor([c for p in picks for c in p], device=self.device)
        return answer_rows(self.head, prepared, hidden[rows, cols])  # [P, d]: decide, option ends per row

    def padded_shape(self, prepared: list[PreparedRequest]) -> tuple[int, int]:
        """(rows, width) of the padded forward: bucketed, so few shapes ever run."""
        rows = sum(len(r.rows) for r in prepared)
        width = max(len(r.document_ids) + len(q.prompt.ids) for r in prepared for q in r.rows)
        return padded_rows(rows), -(-width // self.length_multiple) * self.length_multiple

    def padded_tokens(self, prepared: list[PreparedRequest]) -> int:
        rows, width = self.padded_shape(prepared)
        return rows * width

    @torch.inference_mode()
    def warm(self, widths: list[int], max_rows: int, max_batch_tokens: int,
             min_rows: int = 1) -> tuple[list[tuple[int, int]], int]:
        """One forward of every padded shape (rows bucket from the bucket of `min_rows`, the rows of
        the smallest request, to that of `max_rows`; width rounded up) that `max_batch_tokens`
        admits. A shape that runs out of GPU memory (beside an idle stack holding its bank) ends its
        width's shapes and caps the batch size. Returns the shapes run and the padded tokens a
        forward may hold: `max_batch_tokens`, or below the smallest shape that ran out of memory,
        the largest that ran."""
        bottom, top = padded_rows(min_rows), padded_rows(max_rows)
        if bottom > top:
            raise ValueError(f"min_rows {min_rows} is above max_rows {max_rows}")
        shapes = [(r, -(-w // self.length_multiple) * self.length_multiple)
                  for w in sorted(set(widths)) for r in PAD_ROWS if bottom <= r <= top]
        shapes = [(r, w) for r, w in dict.fromkeys(shapes) if r == bottom or r * w <= max_batch_tokens]
        ran, failed, seconds = [], [], []
        for r, w in shapes:
            if any(fw == w for _, fw in failed):
                continue
            try:
                start = time.perf_counter()
                self.model(input_ids=torch.zeros(r, w, dtype=torch.long, device=self.device), use_cache=False)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()  # each shape's own time: compiles and autotuning included
                seconds.append(f"{r}x{w} {time.perf_counter() - start:.1f} s")
                ran.append((r, w))
            except torch.OutOfMemoryError:
                failed.append((r, w))
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        log.info("warm-up forwards: %s", ", ".join(seconds))  # each shape synchronized above
        if failed:
            limit = min(r * w for r, w in failed)
            max_batch_tokens = max((r * w for r, w in ran if r * w < limit), default=0)
            log.warning("out of GPU memory warming %s: forwards capped at %d padded tokens",
                        ", ".join(f"{r}x{w}" for r, w in failed), max_batch_tokens)
        return ran, max_batch_tokens


class BaselineBatcher:
    """One thread: takes the waiting requests (up to `max_requests`, `max_batch_tokens` padded), runs them."""

    def __init__(self, scorer: BaselineScorer, max_requests: int = 64, max_batch_tokens: int = 786432,
                 registry: CollectorRegistry | None = None):
        self.scorer, self.max_requests, self.max_batch_tokens = scorer, max_requests, max_batch_tokens
        self.registry = registry or CollectorRegistry()
        self.rows_per_pass = Histogram("kev_scorer_rows_per_pass", "Rows per padded forward", buckets=_ROW_BUCKETS,
                                       registry=self.registry)
        self.tokens_per_pass = Histogram("kev_scorer_tokens_per_pass", "Padded tokens per forward",
                                         buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.pass_seconds = Histogram("kev_scorer_row_pass_seconds", "Forward wall time", buckets=_SECONDS_BUCKETS,
                                      registry=self.registry)
        self._queue: collections.deque[Pending] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="baseline-batcher", daemon=True)
        self._thread.start()

    def submit(self, prepared: PreparedRequest) -> Pending:
        job = Pending(prepared)
        with self._cond:
            self._queue.append(job)
            self._cond.notify()
        return job

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _take(self) -> list[Pending] | None:
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            batch = [self._queue.popleft()]
            while self._queue and len(batch) < self.max_requests:
                grown = [j.prepared for j in batch] + [self._queue[0].prepared]
                if self.scorer.padded_tokens(grown) > self.max_batch_tokens:
                    break
                batch.append(self._queue.popleft())
            return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._run(batch)
            except BaseException as e:  # noqa: BLE001 - every waiting request gets the error
                log.exception("baseline forward failed")
                for job in batch:
                    job.error = e
            for job in batch:
                job.done.set()

    def _run(self, batch: list[Pending]) -> None:
        prepared = [j.prepared for j in batch]
        start = time.perf_counter()
        try:
            answers = self.scorer.answer(prepared)
        except torch.OutOfMemoryError:
            if len(batch) == 1:
                raise
            answers = None
        if answers is None:
            # Retried here, not inside the except block: there the exception's traceback still holds
            # the failed forward's frames and their activations, so the halves ran with that memory
            # still taken (five-long x 64 beside the stack at 763d436: every half down to single
            # requests ran out too, 614 requests failed).
            tokens = self.scorer.padded_tokens(prepared)
            self.max_batch_tokens = min(self.max_batch_tokens, tokens - 1)  # later batches are taken smaller
            if self.scorer.device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("out of GPU memory on %d requests (%d padded tokens): splitting in halves; forwards "
                        "capped at %d padded tokens from now on", len(batch), tokens, self.max_batch_tokens)
            half = len(batch) // 2
            self._run(batch[:half])
            self._run(batch[half:])
            return
        if self.scorer.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.rows_per_pass.observe(sum(len(p.rows) for p in prepared))
        self.tokens_per_pass.observe(self.scorer.padded_tokens(prepared))
        self.pass_seconds.observe(seconds)
        for job, ans in zip(batch, answers, strict=True):
            job.answers, job.model_ms = ans, seconds * 1e3


class BaselineService:
    """ScoreQuestions / ListModels of kev.v1.Scorer on the baseline (errors: INVALID_ARGUMENT, INTERNAL)."""

    def __init__(self, scorer: BaselineScorer, batcher: BaselineBatcher, max_request_bytes: int = 64 << 20):
        self.scorer, self.batcher, self.max_request_bytes = scorer, batcher, max_request_bytes

    def score(self, request: api.ScoreRequest, timeout_s: float | None = None) -> api.ScoreResponse:
        prepared = validate_and_build(request, self.scorer.builder)
        job = self.batcher.submit(prepared)
        if not job.done.wait(timeout_s):
            raise TimeoutError("the baseline did not answer in time")
        if job.error is not None:
            raise job.error
        doc = len(prepared.document_ids)
        usage = api.Usage(input_tokens=prepared.input_tokens, cached_state_tokens=0, document_tokens=doc,
                          truncated=prepared.truncated)
        return api.ScoreResponse(job.answers, usage, job.model_ms, self.scorer.model_id)

    def score_questions(self, raw: bytes, context: grpc.ServicerContext) -> pb.ScoreQuestionsResponse:
        try:
            request = wire.request_from_proto(wire.parse_request(raw, self.max_request_bytes))
            return wire.response_to_proto(self.score(request, context.time_remaining()))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except Exception as e:  # noqa: BLE001 - INTERNAL, never a hung client
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")

    def list_models(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        limits = self.scorer.builder.limits
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.scorer.model_id, max_document_tokens=limits.max_document_tokens,
            max_row_tokens=limits.max_row_tokens, is_default=True)])


def build_server(service: BaselineService, threads: int = 256) -> GrpcServer:
    """kev.v1.Scorer on the baseline (kev/serving/grpc_server.py: NOT_SERVING until warmed up); not yet bound."""
    server = GrpcServer([SERVICE], workers=threads, thread_name_prefix="baseline-rpc",
                        max_message_bytes=service.max_request_bytes)
    server.add_handlers([scorer_rpc_handler(service.score_questions, service.list_models)])
    return server


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.load_baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    p.add_argument("--listen", default="127.0.0.1:50061")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus endpoint port (0: none)")
    p.add_argument("--max-requests", type=int, default=64, help="requests per padded forward at most")
    p.add_argument("--max-batch-tokens", type=int, default=786432, help="padded tokens per forward at most")
    p.add_argument("--max-document-tokens", type=int, default=65536)
    p.add_argument("--torch-threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--length-multiple", type=int, default=16, help="a forward's width is padded to a multiple")
    p.add_argument("--warm-widths", default="", help="comma-separated sequence lengths (document + row) "
                   "whose padded shapes run once before SERVING")
    p.add_argument("--warm-rows", type=int, default=0, help="most rows a forward of the load will hold")
    p.add_argument("--warm-min-rows", type=int, default=1, help="fewest rows a forward of the load holds "
                   "(one request's questions): smaller row buckets are not warmed")
    args = p.parse_args(argv)

    log.info("starting: %s", vars(args))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not args.device.startswith("cuda"):
        use_torch_paths()
    start = time.perf_counter()
    scorer = BaselineScorer(args.checkpoint, args.device, args.max_document_tokens,
                            length_multiple=args.length_multiple)
    log.info("loaded %s on %s in %.1f s; kernels: %s", scorer.model_id, args.device, time.perf_counter() - start,
             kernel_paths())
    widths = [int(w) for w in args.warm_widths.split(",") if w.strip()]
    if widths and args.warm_rows:
        t0 = time.perf_counter()
        shapes, args.max_batch_tokens = scorer.warm(widths, args.warm_rows, args.max_batch_tokens,
                                                       args.warm_min_rows)
        log.info("warmed %d padded shapes (rows x width) in %.1f s: %s", len(shapes), time.perf_counter() - t0,
                 ", ".join(f"{r}x{w}" for r, w in shapes))
    batcher = BaselineBatcher(scorer, args.max_requests, args.max_batch_tokens)
    service = BaselineService(scorer, batcher)
    server = build_server(service)
    try:
        server.start(args.listen)
    except ListenError as e:
        log.error("%s", e)
        return 2
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=batcher.registry)
    service.score(api.ScoreRequest("Baseline warm-up.", {"w": api.Question.noul("Is this a warm-up?")}), 600)
    server.set_serving(True)
    log.info("serving on %s (ready after %.1f s)", args.listen, time.perf_counter() - start)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(5)
    batcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
