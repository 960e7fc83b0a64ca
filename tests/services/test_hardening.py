"""Issue 27 hardening on the real CPU stack (tiny model, real Redis, bank and scorer processes):
deadlines, fair admission, bounded memory on big input, directory integrity.

One small stack per module; each test leaves it as it found it (no pin held)."""

from __future__ import annotations

import grpc
import pytest

from kev.request import api
from kev.rpc.client import KevClient
from kev.rpc.wire import request_to_proto, response_from_proto
from kev.v1 import scorer_pb2_grpc
from service_support import (  # noqa: F401
    PLAIN, assert_same, directory, engine_answers, make_documents, make_requests, stack_for, wait_for,
)


@pytest.fixture(scope="module")
def stack(checkpoint):
    with stack_for(checkpoint) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        yield scorer_pb2_grpc.ScorerStub(channel)


def no_pins_left(stack) -> None:
    wait_for(lambda: directory(stack).pins_held() == 0, 10, "pins released")


# ---------------------------------------------------------------------------------------------
# 1. deadlines


def test_a_call_without_deadline_answers_a_new_document(stack, stub, checkpoint):
    """No deadline means the server's default budget (KEV_DEFAULT_DEADLINE_S), never an instant
    DEADLINE_EXCEEDED from a ~9.2e18 s time_remaining() passed on to Bank.Acquire."""
    requests = make_requests(2, make_documents(2, seed=2701), seed=2702, cycle=True)
    want = engine_answers(checkpoint, requests)
    got = response_from_proto(stub.ScoreQuestions(request_to_proto(requests[0])), requests[0])  # no timeout
    assert_same(got, want[0])
    assert got.usage.cached_state_tokens == 0  # a new document: the bank ran its state pass
    client = KevClient(stack.scorer_addr, checkpoint)
    try:
        assert_same(client.score(requests[1], timeout=None), want[1])
    finally:
        client.close()
    no_pins_left(stack)
