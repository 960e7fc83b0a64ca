"""Wire <-> typed API: `kev.v1` protobuf messages and `kev.request.api` dataclasses, one to one.

The scorer receives `ScoreQuestions` requests as raw bytes and parses them here, so a request
that protobuf cannot parse (invalid UTF-8 in a string field, a truncated message) or that is too
large is an `InvalidRequest` naming the field, like every other bad input, instead of gRPC's
generic INTERNAL "Exception deserializing request!".
"""

from __future__ import annotations

import json

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from kev.request import api
from kev.request.errors import InvalidRequest
from kev.request.prompts import parse_json_document
from kev.v1 import scorer_pb2 as pb

_TYPES = {pb.Question.NOUL: api.QuestionType.NOUL, pb.Question.CHOICE: api.QuestionType.CHOICE,
          pb.Question.SCORE: api.QuestionType.SCORE}
_WIRE_TYPES = {v: k for k, v in _TYPES.items()}


class UnknownType(int):
    """A wire enum value that is not a question type; `validate_and_build` rejects it by name."""

    def __repr__(self) -> str:
        return pb.Question.Type.Name(self) if self in pb.Question.Type.values() else f"type number {int(self)}"


# ---------------------------------------------------------------------------------------------
# Requests


def parse_request(raw: bytes, max_bytes: int) -> pb.ScoreQuestionsRequest:
    """The request message from its wire bytes; InvalidRequest when too large or unparseable."""
    if len(raw) > max_bytes:
        field, size = _largest_field(raw, pb.ScoreQuestionsRequest.DESCRIPTOR)
        raise InvalidRequest(field, f"request of {len(raw)} bytes exceeds the limit of {max_bytes} bytes "
                                    f"(this field holds {size} bytes)")
    try:
        return pb.ScoreQuestionsRequest.FromString(raw)
    except DecodeError:
        bad = _find_bad_utf8(raw, pb.ScoreQuestionsRequest.DESCRIPTOR, "")
        if bad is not None:
            raise InvalidRequest(bad, "invalid UTF-8 in a string field") from None
        raise InvalidRequest("request", "malformed protobuf message") from None


def request_from_proto(msg: pb.ScoreQuestionsRequest) -> api.ScoreRequest:
    kind = msg.WhichOneof("document")
    if kind is None:
        raise InvalidRequest("document", "set document_text or document_json")
    document = msg.document_text if kind == "document_text" else parse_json_document(msg.document_json)
    questions = {name: _question_from_proto(q) for name, q in msg.questions.items()}
    return api.ScoreRequest(document=document, questions=questions, truncate_document=msg.truncate_document,
                            model=msg.model or None)


def _question_from_proto(q: pb.Question) -> api.Question:
    return api.Question(
        type=_TYPES.get(q.type, UnknownType(q.type)),
        instructions=q.instructions,
        true_description=q.true_description if q.HasField("true_description") else None,
        false_description=q.false_description if q.HasField("false_description") else None,
        options=tuple(api.Choice(o.name, o.description if o.HasField("description") else None) for o in q.options),
        levels=tuple(q.levels),
    )


def request_to_proto(req: api.ScoreRequest) -> pb.ScoreQuestionsRequest:
    msg = pb.ScoreQuestionsRequest(model=req.model or "", truncate_document=req.truncate_document)
    if isinstance(req.document, str):
        msg.document_text = req.document
    else:
        msg.document_json = json.dumps(req.document, ensure_ascii=False)
    for name, q in req.questions.items():
        out = msg.questions[name]
        out.type = _WIRE_TYPES[q.type]
        out.instructions = q.instructions
        if q.true_description is not None:
            out.true_description = q.true_description
        if q.false_description is not None:
            out.false_description = q.false_description
        for c in q.options:
            opt = out.options.add(name=c.name)
            if c.description is not None:
                opt.description = c.description
        out.levels.extend(q.levels)
    return msg


# ---------------------------------------------------------------------------------------------
# Responses


def response_to_proto(resp: api.ScoreResponse) -> pb.ScoreQuestionsResponse:
    u = resp.usage
    out = pb.ScoreQuestionsResponse(
        usage=pb.Usage(input_tokens=u.input_tokens, cached_state_tokens=u.cached_state_tokens,
                       document_tokens=u.document_tokens, truncated=u.truncated,
                       unknown_tokens=u.unknown_tokens),
        model_ms=resp.model_ms or 0.0, model=resp.model or "")
    for name, a in resp.answers.items():
        slot = out.answers[name]
        if isinstance(a, api.NoulAnswer):
            slot.noul.p_yes = a.p_yes
        elif isinstance(a, api.ChoiceAnswer):
            slot.choice.choice = a.choice
            slot.choice.confidence = a.confidence
            slot.choice.probabilities.update(a.probabilities)
        else:
            slot.score.score = a.score
            slot.score.confidence = a.confidence
            slot.score.legend.extend(a.legend)
            slot.score.probabilities.extend(a.probabilities)
    return out


def response_from_proto(msg: pb.ScoreQuestionsResponse, request: api.ScoreRequest) -> api.ScoreResponse:
    """The typed response; `request` restores the choice order that a proto map does not keep."""
    answers: dict[str, api.Answer] = {}
    for name, q in request.questions.items():
        a = msg.answers[name]
        kind = a.WhichOneof("answer")
        if kind == "noul":
            answers[name] = api.NoulAnswer(a.noul.p_yes)
        elif kind == "choice":
            probs = {c.name: a.choice.probabilities[c.name] for c in q.options}
            answers[name] = api.ChoiceAnswer(a.choice.choice, probs, a.choice.confidence)
        else:
            answers[name] = api.ScoreAnswer(a.score.score, tuple(a.score.legend), tuple(a.score.probabilities),
                                            a.score.confidence)
    u = msg.usage
    usage = api.Usage(u.input_tokens, u.cached_state_tokens, u.document_tokens, u.truncated, u.unknown_tokens)
    return api.ScoreResponse(answers, usage, msg.model_ms, msg.model or None)


# ---------------------------------------------------------------------------------------------
# Wire walking (only on the error path)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise DecodeError("truncated varint")
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, payload bytes or None) of each field of one message."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
            yield number, wire, None
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
            yield number, wire, None
        elif wire == 2:
            n, pos = _varint(data, pos)
            if pos + n > len(data):
                raise DecodeError("truncated field")
            yield number, wire, data[pos : pos + n]
            pos += n
        else:
            raise DecodeError(f"unsupported wire type {wire}")


def _find_bad_utf8(data: bytes, desc: Descriptor, base: str) -> str | None:
    """The path of the first string field that is not valid UTF-8, or None."""
    seen: dict[int, int] = {}
    try:
        for number, _, payload in _fields(data):
            f = desc.fields_by_number.get(number)
            if f is None or payload is None:
                continue
            index = seen.get(number, 0)
            seen[number] = index + 1
            path = f"{base}.{f.name}" if base else f.name
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                found = _bad_in_map_entry(payload, f, path, index)
            elif f.type == FieldDescriptor.TYPE_STRING:
                found = _bad_string(payload, f"{path}[{index}]" if f.is_repeated else path)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                found = _find_bad_utf8(payload, f.message_type, f"{path}[{index}]" if f.is_repeated else path)
            else:
                found = None
            if found is not None:
                return found
    except DecodeError:
        return None
    return None


def _bad_string(payload: bytes, path: str) -> str | None:
    try:
        payload.decode("utf-8")
        return None
    except UnicodeDecodeError:
        return path


def _bad_in_map_entry(payload: bytes, f: FieldDescriptor, path: str, index: int) -> str | None:
    parts = {number: value for number, _, value in _fields(payload)}
    key = parts.get(1, b"")
    try:
        key_text = key.decode("utf-8")
    except UnicodeDecodeError:
        return f"{path} (key of entry {index})"
    value_type = f.message_type.fields_by_number[2]
    if 2 in parts and value_type.type == FieldDescriptor.TYPE_MESSAGE:
        return _find_bad_utf8(parts[2], value_type.message_type, f"{path}[{json.dumps(key_text, ensure_ascii=False)}]")
    return None


def _largest_field(data: bytes, desc: Descriptor) -> tuple[str, int]:
    """The top-level field holding the most bytes (repeated fields summed), for the size error."""
    sizes: dict[str, int] = {}
    try:
        for number, _, payload in _fields(data):
            f = desc.fields_by_number.get(number)
            name = f.name if f is not None else f"field {number}"
            sizes[name] = sizes.get(name, 0) + (len(payload) if payload is not None else 8)
    except DecodeError:
        pass
    if not sizes:
        return "request", len(data)
    name = max(sizes, key=sizes.__getitem__)
    return name, sizes[name]
