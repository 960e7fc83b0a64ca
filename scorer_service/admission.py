"""Bounded memory on big input (issue 27): a size bound before tokenising, and a memory budget for
what is being tokenised.

Size before tokens. A token of the served tokenizers covers at most a few characters of natural
text, so a document of more than `max_document_tokens x max_chars_per_token` characters
(KEV_MAX_CHARS_PER_TOKEN, 16) is refused as INVALID_ARGUMENT on sight, before a single token is
made; with `truncate_document` it is cut to that many characters first and the usual head
truncation follows (reported as truncated). A JSON document is checked twice: its raw text against
JSON_SLACK times the bound before it is parsed, its rendered text against the bound itself. This
is a documented limit in characters beside the one in tokens: a document whose tokens average
more than 16 characters (long runs of one character) is refused though it might fit in tokens.

Memory budget. Parsing and tokenising hold a multiple of the request's bytes for a moment
(message, strings, the tokenizer's encodings with their token strings, the id lists):
`TOKENIZE_BYTES_PER_BYTE` per request byte is the estimate (a rough figure from the encodings'
per-token fields, not yet measured per tokenizer). `TokenizeGate` admits requests to that work while their estimates fit in
KEV_TOKENIZE_MEMORY_BYTES (512 MiB) and at most `workers` at once; the others wait (until their
deadline, then RESOURCE_EXHAUSTED). One request's estimate counts at most 3/4 of the budget, so a
big request tokenises beside small ones, never two big ones together.

Worst case per concurrent request, with the defaults (--max-request-bytes 16 MiB): the
received message (16 MiB, gRPC's buffer) + its parsed copy (~16 MiB) + Python strings (~16 MiB)
while it waits; tokenising is bounded by the gate for all requests together
(KEV_TOKENIZE_MEMORY_BYTES). So RSS <= base + grpc_threads x ~48 MiB + KEV_TOKENIZE_MEMORY_BYTES,
measured: four concurrent 15 MiB documents add < 200 MiB peak (tests/services/test_hardening.py).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from kev.request.errors import InvalidRequest
from kev.serving.errors import Exhausted

JSON_SLACK = 4  # raw JSON characters per rendered character, at most, for the check before parsing
TOKENIZE_BYTES_PER_BYTE = 32  # memory while parsing + tokenising, per request byte (estimate, upper bound)


def document_char_limit(max_document_tokens: int, max_chars_per_token: int) -> int:
    return max_document_tokens * max_chars_per_token


def check_document_size(chars: int, limit: int, *, truncate: bool, json: bool, per_token: int) -> None:
    """INVALID_ARGUMENT when a document of `chars` characters is over the limit and may not be cut."""
    bound = limit * (JSON_SLACK if json else 1)
    if chars > bound and not (truncate and not json):
        what = "JSON text" if json else "text"
        raise InvalidRequest("document", f"document {what} of {chars} characters is over the limit of {bound} "
                                         f"characters ({limit // per_token} tokens x {per_token} characters a token, "
                                         "refused before tokenising; set truncate_document to keep its beginning)"
                             if not json else
                             f"document JSON text of {chars} characters is over the limit of {bound} characters "
                             f"({JSON_SLACK} x {limit // per_token} tokens x {per_token} characters a token), "
                             "refused before parsing")


class TokenizeGate:
    """A byte-weighted semaphore over parsing and tokenising (module docstring)."""

    def __init__(self, budget_bytes: int, workers: int):
        self.budget, self.workers = budget_bytes, workers
        self._used = 0
        self._active = 0
        self._cond = threading.Condition()

    def cost(self, request_bytes: int) -> int:
        return min(request_bytes * TOKENIZE_BYTES_PER_BYTE, self.budget * 3 // 4)

    @property
    def used(self) -> int:
        return self._used

    @contextmanager
    def hold(self, request_bytes: int, deadline: float):
        """Admits the work of one request of `request_bytes` (waits until `deadline`, monotonic)."""
        cost = self.cost(request_bytes)
        with self._cond:
            while self._active >= self.workers or (self._active and self._used + cost > self.budget):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Exhausted(f"tokeniser busy ({self._active} requests, {self._used >> 20} MiB of the "
                                    f"{self.budget >> 20} MiB budget in use); retry later")
                self._cond.wait(remaining)
            self._used += cost
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._used -= cost
                self._active -= 1
                self._cond.notify_all()
