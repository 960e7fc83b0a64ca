"""Prompt rendering: documents and question rows as token ids, and request validation.

Layout (docs/design.md section 1). The state is `<state>` followed by the document's tokens. A question
row continues right after the state:

    <q>instructions<opt>option 1</opt><opt>option 2</opt> ... <decide>

with no whitespace around delimiters: each text segment (the instructions, each option) is
encoded on its own and the ids are concatenated, which equals what the full tokenizer gives for
the concatenated string when the text holds no added tokens (delimiters split the text anyway).
The head reads the row at `<decide>` and at each `</opt>` (`RowPrompt.decide_index`,
`RowPrompt.option_end_indices`, positions within the row).

Option texts, one segment each:
- noul: `no` or `no: <false description>`, then `yes` or `yes: <true description>` (always no, yes).
- choice: `name` or `name: description`, in request order.
- score: level i (0-based, the number the expected score is measured in) is `i: description`,
  or just `i` when the description is empty.
A description that is None, empty or whitespace-only is absent.

Security: user text (document, instructions, names, descriptions) can never produce a delimiter
id. HF tokenizers match added tokens inside raw text, so user text is encoded with a *plain* copy
of the tokenizer whose added-token table lost every special token and every delimiter (the
`split_special_tokens=True` behaviour of transformers, plus the delimiters whatever their flag).
Non-special added tokens (e.g. `<think>`) stay, as ordinary vocabulary. As a second guard every
encoded segment is checked against the delimiter ids; a hit (only possible when the model's own
vocabulary maps some plain word to a delimiter id) rejects the request with the field named.
The plain copy also drops any truncation/padding stored in tokenizer.json (it would silently cut
documents). Delimiters must be added tokens of the tokenizer, so plain text cannot reach them.

Validation choices: instructions must be non-blank; choice names must be non-blank and unique
(exact string match, as they key the answer); choice and score take 1..max_options entries; the
fields of the other question types must be empty; a request needs at least one question, with
non-blank names. Documents over the token limit are
rejected unless `truncate_document`, which keeps the *head*: the first tokens usually carry the
title/subject/headers, and a truncated state is a prefix of the full document's state. Token
limits count delimiters (`<state>` in the document, every delimiter in a row).

Document rendering (`render_document`): a string is used as is. A JSON object/array becomes
labelled, indented text, deterministic for equal values (object keys sorted by code point, since
JSON objects and protobuf Structs carry no order and a repeat must hit the same bank entry):

    customer:                 object member holding a non-empty container
      name: Ann               object member holding a scalar
      tags:
        1. vip                array items numbered from 1
        2.                    array item holding a container
          note: first line
            second line       continuation lines of a multi-line string, one level deeper
    items: []                 empty containers as {} / []

Indent is two spaces per level. Scalars: strings as is (empty as ""), numbers as JSON writes them,
true/false/null. Keys are written as is unless empty, containing ':' or control characters,
starting with '"' or with leading/trailing whitespace: those are JSON-quoted. A top-level empty
object/array renders as {} / []. Non-finite floats, non-string keys, other types and nesting
deeper than MAX_JSON_DEPTH are InvalidRequest("document").
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import chain

from tokenizers import Tokenizer

from kev.request.api import Choice, JsonDocument, Question, QuestionType, ScoreRequest
from kev.request.doc_cache import DocumentCache
from kev.request.pieces import PIECE_CHARS, splits_between_words, word_pieces
from kev.model.config import CheckpointError
from kev.request.errors import DocumentTooLong, InvalidRequest, RowTooLong, question_field

MAX_JSON_DEPTH = 64


@dataclass(frozen=True)
class Limits:
    max_options: int = 255
    max_document_tokens: int = 65536  # including <state>
    max_row_tokens: int = 8192  # including every delimiter

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class DelimiterIds:
    state: int
    q: int
    opt: int
    opt_end: int
    decide: int

    @property
    def all(self) -> frozenset[int]:
        return frozenset((self.state, self.q, self.opt, self.opt_end, self.decide))


@dataclass(frozen=True)
class Delimiters:
    """Delimiter token strings; Kev checkpoints reuse existing Qwen special tokens.

    Field names are the roles of `kev.model.checkpoint.DELIMITER_ROLES`, so a checkpoint's kev.json
    overrides apply as `Delimiters(**meta.delimiters)`.
    """

    state: str = "<|fim_prefix|>"
    q: str = "<|fim_middle|>"
    opt: str = "<|box_start|>"
    opt_end: str = "<|box_end|>"
    decide: str = "<|fim_suffix|>"

    def strings(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def resolve(self, tokenizer: Tokenizer) -> DelimiterIds:
        added = tokenizer.get_added_tokens_decoder()
        ids = {}
        for role, text in self.strings().items():
            token_id = tokenizer.token_to_id(text)
            if token_id is None:
                raise CheckpointError(f"tokenizer: delimiter {role}={text!r} is not in the vocabulary")
            if token_id not in added or added[token_id].content != text:
                raise CheckpointError(
                    f"tokenizer: delimiter {role}={text!r} is not an added token, so plain text could produce it"
                )
            ids[role] = token_id
        if len(set(ids.values())) != len(ids):
            raise CheckpointError(f"tokenizer: delimiters must be distinct tokens, got {ids}")
        return DelimiterIds(**ids)


# ---------------------------------------------------------------------------------------------
# Document rendering


def render_document(doc: JsonDocument) -> str:
    """The document as text (format in the module docstring)."""
    if isinstance(doc, str):
        return doc
    if isinstance(doc, (dict, list)):
        if not doc:
            return "{}" if isinstance(doc, dict) else "[]"
        lines: list[str] = []
        _render_children(doc, 0, lines, "$")
        return "\n".join(lines)
    raise InvalidRequest("document", f"must be a string, a JSON object or a JSON array, not {type(doc).__name__}")


def _render_children(value: dict | list, depth: int, lines: list[str], path: str) -> None:
    if depth >= MAX_JSON_DEPTH:
        raise InvalidRequest("document", f"JSON nested deeper than {MAX_JSON_DEPTH} levels at {path}")
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise InvalidRequest("document", f"object key {key!r} at {path} is not a string")
        entries = [(f"{_render_key(k)}:", value[k], f"{path}.{k}") for k in sorted(value)]
    else:
        entries = [(f"{i}.", item, f"{path}[{i - 1}]") for i, item in enumerate(value, 1)]
    pad = "  " * depth
    for label, child, child_path in entries:
        if isinstance(child, (dict, list)) and child:
            lines.append(pad + label)
            _render_children(child, depth + 1, lines, child_path)
            continue
        first, *rest = _render_scalar(child, child_path).split("\n")
        lines.append(f"{pad}{label} {first}")
        lines.extend(f"{pad}  {line}" for line in rest)


def _render_key(key: str) -> str:
    plain = (
        key != ""
        and key == key.strip()
        and ":" not in key
        and not key.startswith('"')
        and all(ch.isprintable() for ch in key)
    )
    return key if plain else json.dumps(key, ensure_ascii=False)


def _render_scalar(value: object, path: str) -> str:
    if isinstance(value, str):
        return value if value else '""'
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest("document", f"non-finite number {value!r} at {path} is not JSON")
        return json.dumps(value)
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    raise InvalidRequest("document", f"value of type {type(value).__name__} at {path} is not JSON")


def parse_json_document(text: str, field: str = "document_json") -> dict | list:
    """The wire's JSON document text as a value for `render_document` (object or array only)."""

    def reject_constant(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(field, f"malformed JSON: {e}") from None
    if not isinstance(value, (dict, list)):
        raise InvalidRequest(field, f"must be a JSON object or array, not {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------------------------
# Token ids


@dataclass(frozen=True)
class RowPrompt:
    ids: tuple[int, ...]
    decide_index: int  # position of <decide> within the row
    option_end_indices: tuple[int, ...]  # position of each </opt>, in option order


@dataclass(frozen=True)
class QuestionRow:
    name: str
    question: Question
    prompt: RowPrompt


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request as token ids: what the scorer needs to run it."""

    document_ids: tuple[int, ...]  # starts with <state>
    truncated: bool
    rows: tuple[QuestionRow, ...]  # in the request's question order
    unknown_tokens: int = 0  # document and row tokens that are the tokenizer's unknown token (Usage.unknown_tokens)
    # The document's ids came from the builder's cache of recent documents (`PromptBuilder.documents`):
    # this scorer saw it lately, so it is likely stored in the bank already.
    document_seen: bool = False

    @property
    def input_tokens(self) -> int:
        return len(self.document_ids) + sum(len(r.prompt.ids) for r in self.rows)


def _plain_text_tokenizer(tokenizer: Tokenizer, delimiters: Delimiters) -> Tokenizer:
    """A copy of `tokenizer` in which no special token or delimiter is matched inside text."""
    spec = json.loads(tokenizer.to_str())
    reserved = set(delimiters.strings().values())
    spec["added_tokens"] = [
        t for t in spec.get("added_tokens") or [] if not t.get("special") and t["content"] not in reserved
    ]
    spec["truncation"] = None
    spec["padding"] = None
    return Tokenizer.from_str(json.dumps(spec))


def _unknown_token_id(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer model's unknown token (WordLevel / WordPiece / BPE / Unigram), or None."""
    model = json.loads(tokenizer.to_str()).get("model") or {}
    unk = model.get("unk_token")
    if isinstance(unk, str):
        return tokenizer.token_to_id(unk)
    if isinstance(model.get("unk_id"), int):  # Unigram
        return model["unk_id"]
    return None


class PromptBuilder:
    """Turns documents and questions into token ids; safe against delimiter forging."""

    def __init__(self, tokenizer: Tokenizer, delimiters: Delimiters = Delimiters(), limits: Limits = Limits()):
        self.delimiters = delimiters
        self.limits = limits
        self.ids = delimiters.resolve(tokenizer)
        self._reserved = self.ids.all
        self._plain = _plain_text_tokenizer(tokenizer, delimiters)
        # A long document goes to the tokenizer in pieces, tokenized side by side, where that gives
        # the whole text's ids (kev/request/pieces.py); 0: always whole.
        self.piece_chars = PIECE_CHARS if splits_between_words(self._plain) else 0
        self.unknown_id = _unknown_token_id(tokenizer)  # None: the tokenizer has no unknown token
        self.documents: DocumentCache | None = None  # set: repeated documents are not tokenized again

    def count_unknown(self, ids: Sequence[int]) -> int:
        """How many of `ids` are the tokenizer's unknown token (text outside the vocabulary)."""
        return 0 if self.unknown_id is None else sum(1 for i in ids if i == self.unknown_id)

    def encode_text(self, texts: Sequence[str], fields: Sequence[str]) -> list[list[int]]:
        """Ids of user texts (never a delimiter); `fields[i]` names texts[i] in errors."""
        # _fast: no character offsets (nothing here reads them), ~0.6x the time on a long document
        encodings = self._plain.encode_batch_fast(list(texts), add_special_tokens=False)
        out = []
        for enc, field in zip(encodings, fields, strict=True):
            ids = enc.ids  # a new list at every access
            if not self._reserved.isdisjoint(ids):
                raise InvalidRequest(field, "text encodes to a reserved prompt delimiter token")
            out.append(ids)
        return out

    def document_tokens(self, doc: JsonDocument, truncate: bool = False) -> tuple[list[int], bool]:
        """`[<state>] + tokens(render_document(doc))`, at most max_document_tokens (head kept)."""
        _, ids, _ = self._encode_with_document([], [], render_document(doc))
        return self._document(ids, truncate)

    def _encode_with_document(self, texts: list[str], fields: list[str], document: str
                              ) -> tuple[list[list[int]], list[int], bool]:
        """`encode_text` of `texts` and of `document` (a long one in pieces, tokenized side by side:
        kev/request/pieces.py) in one tokenizer call, the document's ids
        from `documents` when it was seen lately (then only `texts` are encoded; the flag says so)."""
        cache = self.documents
        key = cache.key(document) if cache is not None else None
        doc_ids = cache.get(key) if cache is not None else None
        if doc_ids is not None:
            return (self.encode_text(texts, fields) if texts else []), doc_ids, True
        pieces = word_pieces(document, self.piece_chars) if self.piece_chars else [document]
        ids = self.encode_text([*texts, *pieces], [*fields, *["document"] * len(pieces)])
        ids, doc_parts = ids[: len(texts)], ids[len(texts):]
        doc_ids = doc_parts[0] if len(doc_parts) == 1 else list(chain.from_iterable(doc_parts))
        if cache is not None:
            cache.put(key, doc_ids)
        return ids, doc_ids, False

    def _document(self, ids: list[int], truncate: bool) -> tuple[list[int], bool]:
        limit = self.limits.max_document_tokens
        total = 1 + len(ids)
        if total <= limit:
            return [self.ids.state, *ids], False
        if not truncate:
            raise DocumentTooLong(total, limit)
        return [self.ids.state, *ids[: limit - 1]], True

    def row_tokens(self, question: Question, name: str | None = None) -> RowPrompt:
        """Validates `question` and renders its row; `name` prefixes error fields."""
        prefix = question_field(name) if name is not None else "question"
        texts, text_fields = _row_texts(question, prefix, self.limits)
        return self._row(self.encode_text(texts, text_fields), prefix)

    def request_tokens(self, questions: Sequence[tuple[str, Question]], doc: JsonDocument, truncate: bool = False
                       ) -> tuple[list[RowPrompt], list[int], bool, bool]:
        """`row_tokens` of each (name, question), then `document_tokens` and whether the document's
        ids came from the cache of recent documents, in one tokenizer call: each
        call gives the GIL up and takes it back, which on a loaded scorer waits behind the other
        request threads (six-short's seven calls took 0.25-0.32 ms on one core, one 0.11). Every
        question is checked before the document is rendered."""
        prefixes, texts, fields, counts = [], [], [], []
        for name, question in questions:
            prefixes.append(question_field(name))
            t, f = _row_texts(question, prefixes[-1], self.limits)
            texts += t
            fields += f
            counts.append(len(t))
        ids, doc_ids, seen = self._encode_with_document(texts, fields, render_document(doc))
        rows, at = [], 0
        for prefix, n in zip(prefixes, counts):
            rows.append(self._row(ids[at : at + n], prefix))
            at += n
        return rows, *self._document(doc_ids, truncate), seen

    def _row(self, segments: Sequence[list[int]], prefix: str) -> RowPrompt:
        """A row from its encoded instructions and options (`_row_texts` order)."""
        instructions, *options = segments
        d = self.ids
        ids = [d.q, *instructions]
        ends = []
        for option in options:
            ids += [d.opt, *option, d.opt_end]
            ends.append(len(ids) - 1)
        ids.append(d.decide)
        if len(ids) > self.limits.max_row_tokens:
            raise RowTooLong(prefix, len(ids), self.limits.max_row_tokens)
        return RowPrompt(tuple(ids), len(ids) - 1, tuple(ends))


def _description(text: object, field: str) -> str | None:
    if text is None:
        return None
    if not isinstance(text, str):
        raise InvalidRequest(field, f"must be a string or null, not {type(text).__name__}")
    return text if text.strip() else None


def _labelled(label: str, description: str | None) -> str:
    return label if description is None else f"{label}: {description}"


def _row_texts(q: object, prefix: str, limits: Limits) -> tuple[list[str], list[str]]:
    """(segment texts, their error fields): instructions first, then each option's text."""
    if not isinstance(q, Question):
        raise InvalidRequest(prefix, f"must be a Question, not {type(q).__name__}")
    if not isinstance(q.type, QuestionType):
        raise InvalidRequest(f"{prefix}.type", f"unknown question type {q.type!r} (expected noul, choice or score)")
    if not isinstance(q.instructions, str) or not q.instructions.strip():
        raise InvalidRequest(f"{prefix}.instructions", "must be a non-empty string")
    # A field of another type that is set is a client bug (wrong type or misplaced options).
    used = {
        QuestionType.NOUL: ("true_description", "false_description"),
        QuestionType.CHOICE: ("options",),
        QuestionType.SCORE: ("levels",),
    }[q.type]
    for name in ("true_description", "false_description", "options", "levels"):
        if name not in used and getattr(q, name):
            raise InvalidRequest(f"{prefix}.{name}", f"must be empty for a {q.type.value} question")
    texts, text_fields = [q.instructions], [f"{prefix}.instructions"]
    if q.type is QuestionType.NOUL:
        for label, name in (("no", "false_description"), ("yes", "true_description")):
            texts.append(_labelled(label, _description(getattr(q, name), f"{prefix}.{name}")))
            text_fields.append(f"{prefix}.{name}")
        return texts, text_fields
    items = q.options if q.type is QuestionType.CHOICE else q.levels
    where = f"{prefix}.options" if q.type is QuestionType.CHOICE else f"{prefix}.levels"
    if not 1 <= len(items) <= limits.max_options:
        raise InvalidRequest(where, f"needs 1 to {limits.max_options} entries, got {len(items)}")
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if q.type is QuestionType.SCORE:
            if not isinstance(item, str):
                raise InvalidRequest(at, f"level description must be a string, not {type(item).__name__}")
            texts.append(_labelled(str(i), _description(item, at)))
        else:
            if not isinstance(item, Choice):
                raise InvalidRequest(at, f"must be a Choice, not {type(item).__name__}")
            if not isinstance(item.name, str) or not item.name.strip():
                raise InvalidRequest(f"{at}.name", "option name must be a non-empty string")
            if item.name in seen:
                raise InvalidRequest(f"{at}.name", f"duplicate option name {item.name!r} (also options[{seen[item.name]}])")
            seen[item.name] = i
            texts.append(_labelled(item.name, _description(item.description, f"{at}.description")))
        text_fields.append(at)
    return texts, text_fields


def validate_and_build(request: ScoreRequest, builder: PromptBuilder) -> PreparedRequest:
    """Checks the whole request and renders it; raises InvalidRequest (or a subclass) naming the field.

    Questions are checked and rendered before the document is tokenized, so a malformed question
    fails fast even on a long document.
    """
    if not isinstance(request.truncate_document, bool):
        raise InvalidRequest("truncate_document", "must be a boolean")
    if not isinstance(request.questions, Mapping):
        raise InvalidRequest("questions", "must be a map of name -> question")
    if not request.questions:
        raise InvalidRequest("questions", "at least one question is required")
    for name in request.questions:
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest(question_field(str(name)), "question names must be non-empty strings")
    prompts, doc_ids, truncated, seen = builder.request_tokens(list(request.questions.items()), request.document,
                                                               request.truncate_document)
    rows = [QuestionRow(name, question, prompt) for (name, question), prompt in zip(request.questions.items(), prompts)]
    unknown = builder.count_unknown(doc_ids) + sum(builder.count_unknown(r.prompt.ids) for r in rows)
    return PreparedRequest(tuple(doc_ids), truncated, tuple(rows), unknown, seen)
