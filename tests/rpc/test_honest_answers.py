"""Issue 29: honest answers and client ergonomics, without a stack.

`Usage.unknown_tokens` (document + rows tokens that are the tokenizer's unknown token) from the
engine on the demo model, on the wire, and the warning the client gives from 10% of the input;
`Question.choice` forms; the CLI's output order and number types; help() texts.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from kev.engine import Engine
from kev.request import api
from kev.request.api import Choice, Question, ScoreRequest, Usage, unknown_tokens_warning
from kev.rpc import cli, wire
from kev.rpc.client import KevClient, UnknownTokensWarning
from kev.v1 import bank_pb2, scorer_pb2

DEMO = Path(__file__).resolve().parents[2] / "kev" / "demo_model"
NEWS = ("The central bank raised interest rates by a quarter point on Wednesday, citing persistent inflation "
        "and a tight labour market, while signalling that further increases may be needed later this year.")
TICKET = "hello , i was charged twice for my last order . i would like a refund . thanks , anna"


@pytest.fixture(scope="module")
def demo_engine() -> Engine:
    return Engine.from_checkpoint(DEMO, bank_bytes=8 << 20)


def questions() -> dict[str, Question]:
    return {"refund": Question.noul("does the customer ask for a refund ?"),
            "team": Question.choice("which team should handle this ticket ?", ["billing", "technical"])}


def test_unknown_tokens_counted_in_document_and_rows(demo_engine):
    known = demo_engine.score(ScoreRequest(TICKET, questions()))
    assert known.usage.unknown_tokens == 0 and unknown_tokens_warning(known.usage) is None
    news = demo_engine.score(ScoreRequest(NEWS, questions()))
    unk = demo_engine.loaded.builder.unknown_id
    doc_ids, _ = demo_engine.loaded.builder.document_tokens(NEWS)
    assert unk is not None and news.usage.unknown_tokens == doc_ids.count(unk) > 10
    assert news.usage.unknown_share >= api.UNKNOWN_TOKENS_WARN_SHARE
    assert "unknown to the model's tokenizer" in unknown_tokens_warning(news.usage)
    # a question's unknown words count too (the row is tokenized with the same vocabulary)
    odd = demo_engine.score(ScoreRequest(TICKET, {"q": Question.noul("does the customer want zebras ?")}))
    assert odd.usage.unknown_tokens == 1


def test_unknown_tokens_on_the_wire():
    usage = Usage(input_tokens=63, cached_state_tokens=0, document_tokens=35, truncated=False, unknown_tokens=18)
    response = api.ScoreResponse({"refund": api.NoulAnswer(0.25)}, usage, 1.5, "m")
    msg = wire.response_to_proto(response)
    assert msg.usage.unknown_tokens == 18
    back = wire.response_from_proto(scorer_pb2.ScoreQuestionsResponse.FromString(msg.SerializeToString()),
                                    ScoreRequest("x", {"refund": Question.noul("?")}))
    assert back.usage == usage


def test_warning_threshold_is_ten_percent():
    assert unknown_tokens_warning(Usage(100, 0, 50, False, 9)) is None
    assert unknown_tokens_warning(Usage(100, 0, 50, False, 10)) is not None
    assert unknown_tokens_warning(Usage(0, 0, 0, False, 0)) is None


def test_question_choice_takes_names_pairs_choices_and_dicts():
    want = (Choice("billing", "money"), Choice("tech"))
    assert Question.choice("?", [("billing", "money"), "tech"]).options == want
    assert Question.choice("?", [Choice("billing", "money"), Choice("tech")]).options == want
    assert Question.choice("?", {"billing": "money", "tech": None}).options == want
    assert Question.choice("?", ["billing", "tech"]).options == (Choice("billing"), Choice("tech"))
    msg = wire.request_to_proto(ScoreRequest("doc", {"team": Question.choice("?", ["a", "b"])}))
    assert [o.name for o in msg.questions["team"].options] == ["a", "b"]
    with pytest.raises(TypeError):
        Question.choice("?", "ab")


def test_client_warns_on_unknown_tokens(monkeypatch):
    client = KevClient("localhost:1", DEMO)
    try:
        request = ScoreRequest(NEWS, {"refund": Question.noul("?")})
        reply = wire.response_to_proto(api.ScoreResponse({"refund": api.NoulAnswer(1e-30)},
                                                         Usage(60, 0, 40, False, 30), 1.0, "kev-demo-tiny"))
        monkeypatch.setattr(client, "stub", type("Stub", (), {"ScoreQuestions": staticmethod(lambda *a, **k: reply)}))
        with pytest.warns(UnknownTokensWarning, match="30 of 60 input tokens"):
            assert client.score(request).usage.unknown_tokens == 30
        client.warn_unknown_share = None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            client.score(request)
    finally:
        client.close()


def test_cli_prints_answers_in_request_order_and_numbers():
    obj = {"document": "doc", "questions": {
        "zeta": {"type": "noul", "instructions": "?"},
        "alpha": {"type": "choice", "instructions": "?", "options": ["z", ["a", "the letter a"], "m"]},
        "mid": {"type": "score", "instructions": "?", "levels": ["lo", "hi"]}}}
    request = cli.request_message(obj)
    assert request.questions["alpha"].options[1].description == "the letter a"
    reply = scorer_pb2.ScoreQuestionsResponse(model="m", usage=scorer_pb2.Usage(input_tokens=9, unknown_tokens=1))
    reply.answers["mid"].score.score = 0.5
    reply.answers["alpha"].choice.probabilities.update({"m": 0.2, "a": 0.3, "z": 0.5})
    reply.answers["zeta"].noul.p_yes = 0.5
    out = cli.response_json(reply, request, list(obj["questions"]))
    assert list(out["answers"]) == ["zeta", "alpha", "mid"]
    assert list(out["answers"]["alpha"]["choice"]["probabilities"]) == ["z", "a", "m"]
    assert out["usage"]["input_tokens"] == 9 and out["usage"]["unknown_tokens"] == 1


def test_bank_stats_prints_numbers():
    stats = bank_pb2.StatsResponse(slots_used=3, slots_total=12, blocks_used=5, blocks_total=10, pins_held=2,
                                   hits=7, misses=1, evictions=4, node="n", instance="i")
    out = cli.bank_stats_json(stats)
    assert out["pins_held"] == 2 and out["blocks_used"] == 5 and out["hits"] == 7 and out["evictions"] == 4
    assert out["slots_occupancy"] == 0.25 and out["blocks_occupancy"] == 0.5 and out["node"] == "n"


def test_help_texts_are_readable(capsys):
    import pydoc

    text = pydoc.render_doc(KevClient, renderer=pydoc.plaintext)
    assert "warn_unknown_share" in text and "Scores `request`" in text
    assert "(name, description) pair" in pydoc.render_doc(Question.choice, renderer=pydoc.plaintext)
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "A request file is JSON" in capsys.readouterr().out
