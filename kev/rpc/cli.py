"""`kev`: a small command line for a running Kev stack.

    kev score REQUEST.json [--addr localhost:50051] [--timeout 60]   score a request file, print answers
    kev models [--addr localhost:50051]                                list the scorer's models
    kev bank-stats [--bank-addr localhost:50052]                      show the bank's occupancy and pins

A request file is JSON, either the wire message in protobuf's JSON mapping (it has
`document_text` or `document_json`), or this shorter form:

    {"model": "kev-demo",                      optional: the scorer's default model
     "document": "text" | {...} | [...],       or "state" (System One's name)
     "truncate_document": false,               optional
     "questions": {
        "urgent": {"type": "noul", "instructions": "...", "true": "...", "false": "..."},
        "team":   {"type": "choice", "instructions": "...", "options": {"billing": "money", "tech": null}},
        "anger":  {"type": "score", "instructions": "...", "levels": ["calm", "annoyed", "furious"]}}}

(`options` may also be a list of names.) The server validates the request; the CLI only maps
it onto the wire. Output is the response as JSON on stdout. A gRPC error prints `CODE: message`
on stderr and exits 1; an unreadable request file exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from google.protobuf import json_format

from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2, scorer_pb2_grpc


class RequestFileError(ValueError):
    pass


def request_message(obj: object) -> scorer_pb2.ScoreQuestionsRequest:
    """A request file's JSON as the wire message (module docstring)."""
    if not isinstance(obj, Mapping):
        raise RequestFileError("the request must be a JSON object")
    if "document_text" in obj or "document_json" in obj:
        return json_format.ParseDict(obj, scorer_pb2.ScoreQuestionsRequest())
    unknown = sorted(set(obj) - {"model", "document", "state", "truncate_document", "questions"})
    if unknown:
        raise RequestFileError(f"unknown field {unknown[0]!r}")
    if ("document" in obj) == ("state" in obj):
        raise RequestFileError("give exactly one of 'document' / 'state'")
    doc = obj.get("document", obj.get("state"))
    msg = scorer_pb2.ScoreQuestionsRequest(model=obj.get("model") or "",
                                           truncate_document=bool(obj.get("truncate_document", False)))
    if isinstance(doc, str):
        msg.document_text = doc
    else:
        msg.document_json = json.dumps(doc, ensure_ascii=False)
    questions = obj.get("questions")
    if not isinstance(questions, Mapping):
        raise RequestFileError("'questions' must be an object of name -> question")
    for name, q in questions.items():
        if not isinstance(q, Mapping):
            raise RequestFileError(f"question {name!r} must be an object")
        out = msg.questions[name]
        try:
            out.type = scorer_pb2.Question.Type.Value(str(q.get("type", "")).upper())
        except ValueError:
            raise RequestFileError(f"question {name!r}: type must be noul, choice or score") from None
        out.instructions = q.get("instructions", "")
        for key, attr in (("true", "true_description"), ("false", "false_description")):
            value = q.get(key, q.get(attr))
            if value is not None:
                setattr(out, attr, value)
        options = q.get("options") or {}
        items = options.items() if isinstance(options, Mapping) else ((o, None) for o in options)
        for option, description in items:
            opt = out.options.add(name=option)
            if description is not None:
                opt.description = description
        out.levels.extend(q.get("levels") or ())
    return msg


def _print(message) -> None:
    print(json_format.MessageToJson(message, preserving_proto_field_name=True, ensure_ascii=False,
                                    always_print_fields_with_no_presence=True))


def _score(args: argparse.Namespace) -> int:
    try:
        message = request_message(json.loads(Path(args.file).read_text()))
    except (OSError, ValueError, json_format.ParseError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args.addr) as channel:
        _print(scorer_pb2_grpc.ScorerStub(channel).ScoreQuestions(message, timeout=args.timeout))
    return 0


def _models(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.addr) as channel:
        _print(scorer_pb2_grpc.ScorerStub(channel).ListModels(scorer_pb2.ListModelsRequest(), timeout=args.timeout))
    return 0


def _bank_stats(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.bank_addr) as channel:
        reply = bank_pb2_grpc.BankStub(channel).Stats(bank_pb2.StatsRequest(), timeout=args.timeout)
    out = json_format.MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for used, total in (("slots_used", "slots_total"), ("blocks_used", "blocks_total")):
        out[used.replace("_used", "_occupancy")] = round(int(out[used]) / max(int(out[total]), 1), 4)
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kev", description="Kev serving command line")
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score a JSON request file against a running scorer")
    score.add_argument("file")
    score.set_defaults(run=_score)
    models = sub.add_parser("models", help="list the models a scorer serves")
    models.set_defaults(run=_models)
    for p in (score, models):
        p.add_argument("--addr", default="localhost:50051", help="scorer address (default localhost:50051)")
    stats = sub.add_parser("bank-stats", help="show a bank's occupancy, pins and hit counts")
    stats.add_argument("--bank-addr", default="localhost:50052", help="bank address (default localhost:50052)")
    stats.set_defaults(run=_bank_stats)
    for p in (score, models, stats):
        p.add_argument("--timeout", type=float, default=60.0, help="seconds (default 60)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except grpc.RpcError as e:
        print(f"{e.code().name}: {e.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
