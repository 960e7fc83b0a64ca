"""`kev`: a small command line for a running Kev stack.

    kev score REQUEST.json [--addr localhost:50051] [--timeout 60]   score a request file, print answers
    kev models [--addr localhost:50051]                                list the scorer's models
    kev bank-stats [--bank-addr localhost:50052]                      show the bank's occupancy and pins
    kev convert RUN_DIR OUT_DIR [--base BASE_DIR] [--model-id ID] [--link] [--force] [--no-check]
                                        a Kev training run -> a servable checkpoint directory
                                        (kev/model/convert.py, docs/models.md); errors exit 2

A request file is JSON, either the wire message in protobuf's JSON mapping (it has
`document_text` or `document_json`), or this shorter form:

    {"model": "kev-demo",                      optional: the scorer's default model
     "document": "text" | {...} | [...],       or "state" (System One's name)
     "truncate_document": false,               optional
     "questions": {
        "urgent": {"type": "noul", "instructions": "...", "true": "...", "false": "..."},
        "team":   {"type": "choice", "instructions": "...", "options": {"billing": "money", "tech": null}},
        "anger":  {"type": "score", "instructions": "...", "levels": ["calm", "annoyed", "furious"]}}}

(`options` may also be a list of names, or of [name, description] pairs.) The server validates the
request; the CLI only maps it onto the wire. Output is the response as JSON on stdout, answers in
the request's question order (choice probabilities in option order). When
`usage.unknown_tokens` is at least 10% of `usage.input_tokens` (text outside the model's
vocabulary: the answers are not meaningful) a warning goes to stderr; the exit code stays 0.
A gRPC error prints `CODE: message` on stderr and exits 1; an unreadable request file exits 2.
`kev bank-stats` prints the bank's counters as JSON numbers, plus the occupancy shares.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import grpc
from google.protobuf import json_format

from kev.request.api import UNKNOWN_TOKENS_WARN_SHARE, Usage, unknown_tokens_warning
from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2, scorer_pb2_grpc


class RequestFileError(ValueError):
    """The request file is not a request (the message says why)."""


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
        items = options.items() if isinstance(options, Mapping) else (
            tuple(o) if isinstance(o, list) and len(o) == 2 else (o, None) for o in options)
        for option, description in items:
            opt = out.options.add(name=option)
            if description is not None:
                opt.description = description
        out.levels.extend(q.get("levels") or ())
    return msg


def _as_dict(message) -> dict:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def _print(message) -> None:
    print(json.dumps(_as_dict(message), indent=2, ensure_ascii=False))


def response_json(reply: scorer_pb2.ScoreQuestionsResponse, request: scorer_pb2.ScoreQuestionsRequest,
                  order: list[str] | None = None) -> dict:
    """The response as a JSON object with the answers in request order (`order`: the question
    names as the request file lists them; proto maps keep no order) and each choice's
    probabilities in option order; uint counts as numbers."""
    out = _as_dict(reply)
    answers = out.get("answers", {})
    names = [n for n in (order or list(request.questions)) if n in answers]
    ordered = {}
    for name in names + [n for n in answers if n not in names]:
        answer = answers[name]
        if "choice" in answer and name in request.questions:
            probs = answer["choice"].get("probabilities", {})
            keys = [o.name for o in request.questions[name].options if o.name in probs]
            answer["choice"]["probabilities"] = {k: probs[k] for k in keys + [k for k in probs if k not in keys]}
        ordered[name] = answer
    out["answers"] = ordered
    out["usage"] = {k: (v if isinstance(v, bool) else int(v)) for k, v in out.get("usage", {}).items()}
    return out


def _usage(reply: scorer_pb2.ScoreQuestionsResponse) -> Usage:
    u = reply.usage
    return Usage(u.input_tokens, u.cached_state_tokens, u.document_tokens, u.truncated, u.unknown_tokens)


def _score(args: argparse.Namespace) -> int:
    try:
        obj = json.loads(Path(args.file).read_text())
        message = request_message(obj)
    except (OSError, ValueError, json_format.ParseError) as e:
        print(f"{args.file}: {e}", file=sys.stderr)
        return 2
    questions = obj.get("questions")
    order = [str(n) for n in questions] if isinstance(questions, Mapping) else None
    with grpc.insecure_channel(args.addr) as channel:
        reply = scorer_pb2_grpc.ScorerStub(channel).ScoreQuestions(message, timeout=args.timeout)
    print(json.dumps(response_json(reply, message, order), indent=2, ensure_ascii=False))
    warning = unknown_tokens_warning(_usage(reply), args.warn_unknown_share)
    if warning is not None:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _models(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.addr) as channel:
        _print(scorer_pb2_grpc.ScorerStub(channel).ListModels(scorer_pb2.ListModelsRequest(), timeout=args.timeout))
    return 0


def _bank_stats(args: argparse.Namespace) -> int:
    with grpc.insecure_channel(args.bank_addr) as channel:
        reply = bank_pb2_grpc.BankStub(channel).Stats(bank_pb2.StatsRequest(), timeout=args.timeout)
    out = bank_stats_json(reply)
    print(json.dumps(out, indent=2))
    return 0


def bank_stats_json(reply: bank_pb2.StatsResponse) -> dict:
    """The bank's Stats as a JSON object: every count a number (protobuf's JSON mapping would write
    64-bit integers as strings), plus `slots_occupancy` and `blocks_occupancy` (used / total)."""
    out = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}
    for used, total in (("slots_used", "slots_total"), ("blocks_used", "blocks_total")):
        out[used.replace("_used", "_occupancy")] = round(out[used] / max(out[total], 1), 4)
    return out


def _convert(args: argparse.Namespace) -> int:
    import logging

    from kev.model.config import CheckpointError
    from kev.model.convert import convert_run  # imports torch: only for this command

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = convert_run(args.run_dir, args.out_dir, args.base, model_id=args.model_id, link=args.link,
                          overwrite=args.force, check=not args.no_check)
    except CheckpointError as e:
        print(f"kev convert: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kev", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    score = sub.add_parser("score", help="score a JSON request file against a running scorer")
    score.add_argument("file", help="the request file (JSON; its format: `kev --help`)")
    score.add_argument("--warn-unknown-share", type=float, default=UNKNOWN_TOKENS_WARN_SHARE,
                       help="warn on stderr when this share of the input tokens is unknown to the model's "
                            f"tokenizer (default {UNKNOWN_TOKENS_WARN_SHARE:g})")
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
    convert = sub.add_parser("convert", help="make a servable checkpoint directory of a Kev training run "
                                             "(adapter or full weights + head.pt); see docs/models.md")
    convert.add_argument("run_dir", help="the run: adapter_config.json + adapter_model.safetensors, or config.json + "
                                         "model*.safetensors; head.pt; the tokenizer")
    convert.add_argument("out_dir", help="the checkpoint directory to write (must not exist, unless --force)")
    convert.add_argument("--base", help="the base checkpoint directory head.pt's 'base' names (needed for an adapter "
                                        "run; a full run takes only its tokenizer from it, when the run has none)")
    convert.add_argument("--model-id", help="kev.json's model_id (default: the run directory's name, sanitised)")
    convert.add_argument("--link", action="store_true", help="hard-link the weight files instead of copying them")
    convert.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    convert.add_argument("--no-check", action="store_true",
                         help="skip loading the result (weights included) as a server would before it is moved into place")
    convert.set_defaults(run=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `kev ARGS` (sys.argv when `argv` is None); returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except grpc.RpcError as e:
        print(f"{e.code().name}: {e.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
