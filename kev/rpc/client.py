"""Client library for the public `kev.v1.Scorer` API, with document-affinity routing.

Every call carries the `x-kev-doc-key` header: the same document key the Redis directory and
the bank use (`kev.bank.doc_key.document_key` over the rendered document's token ids), so a
consistent-hash load balancer (deploy/: Envoy ring hash on that header) sends every repeat of
a document to the scorer whose bank already holds its state. Computing the key needs the
model's tokenizer and prompt format, so the client loads them from the checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from tokenizers import Tokenizer

from kev.request import api
from kev.rpc import wire
from kev.model.checkpoint import find_side_files
from kev.bank.doc_key import AFFINITY_HEADER, document_key
from kev.request.prompts import Delimiters, PromptBuilder
from kev.v1 import scorer_pb2_grpc


class KevClient:
    def __init__(self, address: str, checkpoint_dir: str | Path, *, channel: grpc.Channel | None = None):
        side = find_side_files(checkpoint_dir, require_tokenizer=True)
        meta, tokenizer_path = side.meta, side.tokenizer_path
        self.model_id = meta.model_id
        delimiters = Delimiters(**meta.delimiters) if meta.delimiters else Delimiters()
        self.builder = PromptBuilder(Tokenizer.from_file(str(tokenizer_path)), delimiters)
        self.channel = channel or grpc.insecure_channel(address)
        self.stub = scorer_pb2_grpc.ScorerStub(self.channel)

    def affinity_key(self, request: api.ScoreRequest) -> str:
        """The directory's key of the request's document (what the load balancer hashes)."""
        ids, _ = self.builder.document_tokens(request.document, request.truncate_document)
        return document_key(self.model_id, ids)

    def score(self, request: api.ScoreRequest, timeout: float | None = None) -> api.ScoreResponse:
        reply = self.stub.ScoreQuestions(wire.request_to_proto(request), timeout=timeout,
                                         metadata=[(AFFINITY_HEADER, self.affinity_key(request))])
        return wire.response_from_proto(reply, request)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "KevClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
