"""Typed request errors that name the offending field.

Every problem with what a client sent is an `InvalidRequest` (a `ValueError`), so the gRPC layer
needs one `except InvalidRequest` to answer INVALID_ARGUMENT with `field` in the field violation.
The two "too long" cases are subclasses because clients act on them differently (truncate the
document, shorten the question) and they carry the measured token count and the limit.

Field paths read like the request they point into, with question names quoted as JSON strings so
any name is unambiguous:

    document
    questions
    questions["q1"]                     (RowTooLong: the whole row)
    questions["q1"].type
    questions["q1"].instructions
    questions["q1"].true_description   (noul; also false_description)
    questions["q1"].options             (choice: the option count, or set on another type)
    questions["q1"].options[2].name     (choice option 2, 0-based)
    questions["q1"].options[2].description
    questions["q1"].levels[1]           (score level 1)

The names follow kev/v1/scorer.proto, except that `document` stands for whichever of
`document_text` / `document_json` was set.

Problems with server-side files (tokenizer, head) are not request errors: they raise
`kev.model.config.CheckpointError`.
"""

from __future__ import annotations

import json


class InvalidRequest(ValueError):
    """The request is malformed; `field` is the path of the bad field (see the module docstring)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field = field
        self.message = message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class DocumentTooLong(InvalidRequest):
    """The rendered document needs more tokens than the limit and truncation was not asked for."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(
            "document",
            f"{tokens} tokens exceed the limit of {limit} (set truncate_document to keep the first {limit})",
        )
        self.tokens = tokens
        self.limit = limit
        # Pickling rebuilds an exception as cls(*args): keep args equal to this constructor's.
        self.args = (tokens, limit)


class RowTooLong(InvalidRequest):
    """One question's row (instructions plus options plus delimiters) exceeds the row limit."""

    def __init__(self, field: str, tokens: int, limit: int):
        super().__init__(field, f"question row of {tokens} tokens exceeds the limit of {limit}")
        self.tokens = tokens
        self.limit = limit
        self.args = (field, tokens, limit)


def question_field(name: str, suffix: str = "") -> str:
    """`questions["<name>"]<suffix>`, the name JSON-quoted so quotes and brackets in it stay readable."""
    return f"questions[{json.dumps(name, ensure_ascii=False)}]{suffix}"
