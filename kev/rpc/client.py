"""Client library for the public `kev.v1.Scorer` API, with document-affinity routing.

Every call carries the `x-kev-doc-key` header: the same document key the Redis directory and
the bank use (`kev.bank.doc_key.document_key` over the rendered document's token ids), so a
consistent-hash load balancer (deploy/: Envoy ring hash on that header) sends every repeat of
a document to the scorer whose bank already holds its state. Computing the key needs the
model's tokenizer and prompt format, so the client loads them from the checkpoint directory.
The key starts with the model id, derived exactly as the servers derive it
(`kev.model.checkpoint.find_side_files`: kev.json, else the sanitised name of the adapter's or
checkpoint's directory): give the client the same checkpoint and adapter (`adapter_dir`, the
servers' KEV_ADAPTER) as the servers, or affinity is silently lost.

    from kev.request.api import Question, ScoreRequest
    from kev.rpc.client import KevClient

    with KevClient("localhost:50051", "kev/demo_model") as client:
        response = client.score(ScoreRequest("the document", {
            "urgent": Question.noul("Is it urgent?"),
            "team": Question.choice("Which team?", ["billing", "tech"])}), timeout=30)
        response.answers["urgent"].p_yes, response.answers["team"].choice, response.usage

`score` returns the typed response (`kev.request.api`), answers in the request's question order;
a gRPC error raises `grpc.RpcError` (INVALID_ARGUMENT names the bad field). When
`usage.unknown_tokens` is a noticeable share of the input (>= 10%, `UNKNOWN_TOKENS_WARN_SHARE`:
text outside the model's vocabulary), `score` warns with `UnknownTokensWarning` (Python's
`warnings`: `warnings.simplefilter("error", UnknownTokensWarning)` makes it an exception).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from kev.request import api
from kev.rpc import wire
from kev.model.checkpoint import find_side_files
from kev.bank.doc_key import AFFINITY_HEADER, document_key
from kev.request.prompts import Delimiters, PromptBuilder
from kev.v1 import scorer_pb2_grpc


class UnknownTokensWarning(UserWarning):
    """Much of a request's text is outside the model's vocabulary: its answers are not meaningful."""


class KevClient:
    """A client of one scorer (or a load balancer in front of several) at `address`.

    `checkpoint_dir`: the served model's checkpoint directory (its tokenizer and prompt format give
    the affinity key); `adapter_dir`: the servers' separate LoRA adapter directory, if any (its
    kev.json / name gives the model id, so the key matches the servers'); `channel`: a channel to
    use instead of an insecure one to `address`;
    `warn_unknown_share`: the unknown-token share from which `score` warns (None: never).
    """

    def __init__(self, address: str, checkpoint_dir: str | Path, adapter_dir: str | Path | None = None, *,
                 channel: grpc.Channel | None = None,
                 warn_unknown_share: float | None = api.UNKNOWN_TOKENS_WARN_SHARE):
        self.warn_unknown_share = warn_unknown_share
        side = find_side_files(checkpoint_dir, adapter_dir, require_tokenizer=True)
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
        """Scores `request` (`timeout`: seconds, None: no deadline); the typed response, answers
        in request order. Raises grpc.RpcError; warns `UnknownTokensWarning` (module docstring)."""
        reply = self.stub.ScoreQuestions(wire.request_to_proto(request), timeout=timeout,
                                         metadata=[(AFFINITY_HEADER, self.affinity_key(request))])
        response = wire.response_from_proto(reply, request)
        if self.warn_unknown_share is not None:
            message = api.unknown_tokens_warning(response.usage, self.warn_unknown_share)
            if message is not None:
                warnings.warn(message, UnknownTokensWarning, stacklevel=2)
        return response

    def close(self) -> None:
        """Closes the channel."""
        self.channel.close()

    def __enter__(self) -> "KevClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
