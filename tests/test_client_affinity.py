"""The client library's affinity header equals the directory's document key (deploy/ hashes on it)."""

from __future__ import annotations

import grpc

from kev.rpc.client import KevClient
from kev.bank.doc_key import AFFINITY_HEADER
from service_support import (  # noqa: F401
    directory, make_documents, make_requests, stack_for,
)


class RecordHeaders(grpc.UnaryUnaryClientInterceptor):
    def __init__(self):
        self.seen: list[dict] = []

    def intercept_unary_unary(self, continuation, details, request):
        self.seen.append(dict(details.metadata or ()))
        return continuation(details, request)


def test_affinity_key_is_the_directory_key(checkpoint):
    requests = make_requests(4, make_documents(4, seed=5), seed=6, cycle=True)
    recorder = RecordHeaders()
    with stack_for(checkpoint) as stack:
        channel = grpc.intercept_channel(grpc.insecure_channel(stack.scorer_addr), recorder)
        with KevClient(stack.scorer_addr, checkpoint, channel=channel) as client:
            for req in requests:
                client.score(req, timeout=30)
            keys = [client.affinity_key(r) for r in requests]
        stored = {e.doc_key for e in directory(stack).entries()}
    # The stack's own start-up probe may leave one more entry; every request's key must be stored.
    missing = set(keys) - stored
    assert not missing, f"client keys not in the directory: {missing} (stored: {stored})"
    assert [h[AFFINITY_HEADER] for h in recorder.seen] == keys
