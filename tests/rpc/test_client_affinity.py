"""The client library's affinity header equals the directory's document key (deploy/ hashes on it)."""

from __future__ import annotations

import grpc

from kev.rpc.client import KevClient
from kev.bank.doc_key import AFFINITY_HEADER
from service_support import (  # noqa: F401
    directory, make_documents, make_requests, stack_for, wait_for,
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
        # The stack's own start-up probe may leave one more entry; every request's key must be stored.
        # An idle bank answers a swept request before it registers the entry: the last may follow.
        stored = lambda: {e.doc_key for e in directory(stack).entries()}  # noqa: E731
        wait_for(lambda: set(keys) <= stored(), 10, f"the client keys {set(keys) - stored()} in the directory")
    assert [h[AFFINITY_HEADER] for h in recorder.seen] == keys


def _server_key(checkpoint, adapter, request) -> str:
    """The key the servers derive: the loaded model's id over its builder's document tokens
    (scorer_service/bank_link.py: document_key(loaded.model_id, document_ids))."""
    from kev.bank.doc_key import document_key
    from kev.loading import LoadedModel

    loaded = LoadedModel.load(checkpoint, adapter)
    ids, _ = loaded.builder.document_tokens(request.document, request.truncate_document)
    return document_key(loaded.model_id, ids)


def test_client_key_equals_server_key_with_and_without_adapter(checkpoint, tmp_path):
    import shutil

    from tiny_checkpoints import make_lora_adapter

    base = shutil.copytree(checkpoint, tmp_path / "kev-base")
    (base / "kev.json").unlink()  # ids from directory names: the case where the adapter changes the id
    adapter = make_lora_adapter(tmp_path / "kev-lora@v2", base)
    inside = shutil.copytree(base, tmp_path / "kev-run")
    make_lora_adapter(inside, base)
    (request,) = make_requests(1, make_documents(1, seed=7), seed=8)
    cases = {"no-adapter": (base, None), "separate-adapter": (base, adapter), "adapter-inside": (inside, None)}
    keys = {}
    for name, (ckpt, lora) in cases.items():
        with KevClient("localhost:1", ckpt, lora) as client:  # the channel never connects
            keys[name] = client.affinity_key(request)
        assert keys[name] == _server_key(ckpt, lora, request), name
    assert [k.split(":")[0] for k in keys.values()] == ["kev-base", "kev-lora-v2", "kev-run"]
    # Without its adapter argument the client would have routed by another model's key.
    assert keys["no-adapter"] != keys["separate-adapter"]
