"""Helpers of the end-to-end service tests (tests/services, tests/serving, tests/rpc, tests/bench): a
stack over the tiny checkpoint, random documents and requests, the in-process engine's answers to
compare with, and looks into the bank and the directory."""

from __future__ import annotations

import random
import time

import grpc
import torch

from kev.request import api
from kev.bank.directory import Directory, connect
from kev.bank.bank import Bank
from kev.engine import Engine
from kev.loading import LoadedModel
from kev.request.prompts import Limits
from kev.stack import Stack
from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2_grpc
from kev.rpc.wire import request_to_proto, response_from_proto
from tiny_stack import TINY_MODEL_ID, WORDS

MAX_DOC_TOKENS = 512
NODE = "stack"  # kev.stack's bank node name
PLAIN = [w for w in WORDS if w.isalpha()]


def stack_for(checkpoint, **kw) -> Stack:
    """A test-sized stack: 512-token documents, 64-token average (4 MiB bank = ~120 slots)."""
    kw.setdefault("bank_memory_bytes", 4 << 20)
    kw.setdefault("max_document_tokens", MAX_DOC_TOKENS)
    kw.setdefault("bank_flags", ["--avg-doc-tokens", "64", "--epoch-check-s", "0.2"])
    return Stack(checkpoint, **kw)


# ---------------------------------------------------------------------------------------------
# requests and the reference


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(PLAIN) for _ in range(n))


def make_question(rng: random.Random) -> api.Question:
    kind = rng.choice(list(api.QuestionType))
    instructions = _text(rng, rng.randint(1, 12))
    if kind is api.QuestionType.NOUL:
        return api.Question.noul(instructions, rng.choice([None, _text(rng, 3)]), rng.choice([None, _text(rng, 2)]))
    if kind is api.QuestionType.CHOICE:
        names = rng.sample(PLAIN, rng.randint(1, 6))
        return api.Question.choice(instructions, {n: rng.choice([None, _text(rng, 3)]) for n in names})
    return api.Question.score(instructions, [_text(rng, rng.randint(0, 3)) for _ in range(rng.randint(1, 5))])


def make_documents(count: int, seed: int = 0) -> list[api.JsonDocument]:
    rng = random.Random(seed)
    docs: list[api.JsonDocument] = []
    for i in range(count):
        if i % 5 == 4:  # some JSON documents (rendered to labelled text by the server)
            docs.append({"customer": _text(rng, 2), "items": [_text(rng, rng.randint(1, 8)) for _ in range(3)],
                         "urgent": rng.random() < 0.5, "n": i})
        else:
            docs.append(_text(rng, rng.randint(1, 120)))
    return docs


def make_requests(count: int, documents: list[api.JsonDocument], seed: int = 1, max_questions: int = 6,
                  cycle: bool = False) -> list[api.ScoreRequest]:
    """Requests on random documents (`cycle`: request i on document i % len(documents))."""
    rng = random.Random(seed)
    return [api.ScoreRequest(documents[i % len(documents)] if cycle else rng.choice(documents),
                             {f"q{j}": make_question(rng) for j in range(rng.randint(1, max_questions))})
            for i in range(count)]


def make_engine(checkpoint) -> Engine:
    """The in-process reference with the stack's limits (truncation must cut at the same token)."""
    loaded = LoadedModel.load(checkpoint, limits=Limits(max_document_tokens=MAX_DOC_TOKENS))
    return Engine(loaded, Bank.from_budget(loaded.model.cfg, 64 << 20, max_doc_tokens=MAX_DOC_TOKENS))


def engine_answers(checkpoint, requests: list[api.ScoreRequest]) -> list[api.ScoreResponse]:
    # One torch thread: on a busy 2-core machine OpenMP's spinning threads make the tiny model's
    # passes ~50x slower (restored after, so no test sees a changed global).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(checkpoint)
        out = []
        for i in range(0, len(requests), 32):
            for r in engine.score_many(requests[i : i + 32]):
                assert not isinstance(r, Exception), r
                out.append(r)
        return out
    finally:
        torch.set_num_threads(threads)


def score(stub: scorer_pb2_grpc.ScorerStub, request: api.ScoreRequest, timeout: float = 60.0) -> api.ScoreResponse:
    return response_from_proto(stub.ScoreQuestions(request_to_proto(request), timeout=timeout), request)


def assert_same(got: api.ScoreResponse, want: api.ScoreResponse) -> None:
    assert got.answers == want.answers  # exact floats
    assert list(got.answers) == list(want.answers)
    for f in ("input_tokens", "document_tokens", "truncated"):
        assert getattr(got.usage, f) == getattr(want.usage, f), f
    assert got.usage.cached_state_tokens in (0, got.usage.document_tokens)
    assert got.model == TINY_MODEL_ID and got.model_ms > 0


def directory(stack: Stack) -> Directory:
    return Directory(connect(stack.redis_url), TINY_MODEL_ID, NODE)


def bank_stats(stack: Stack) -> bank_pb2.StatsResponse:
    with grpc.insecure_channel(stack.bank_addr) as channel:
        return bank_pb2_grpc.BankStub(channel).Stats(bank_pb2.StatsRequest(), timeout=10)


def wait_for(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
