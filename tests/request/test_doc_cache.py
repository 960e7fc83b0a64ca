"""The tokenized-document cache (kev/request/doc_cache.py): a repeated document's ids are the
tokenizer's, bit for bit, its questions are still encoded each time, and the cache keeps to its
token budget."""

from __future__ import annotations

import dataclasses
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kev.loading import LoadedModel
from kev.request.api import Question, ScoreRequest
from kev.request.doc_cache import DocumentCache
from kev.request.errors import DocumentTooLong, InvalidRequest
from kev.request.prompts import Limits, PromptBuilder, validate_and_build

DEMO = Path(__file__).resolve().parents[2] / "kev" / "demo_model"


def builder(cache_tokens: int = 0, max_document_tokens: int = 65536) -> PromptBuilder:
    b = LoadedModel.load(DEMO, weights=False, limits=Limits(max_document_tokens=max_document_tokens)).builder
    b.documents = DocumentCache(cache_tokens) if cache_tokens else None
    return b


def random_document(rng: random.Random):
    words = ["the", "invoice", "was", "late", "support", "team", "ticket", "refund", "é", "日本", "ok?", "\n", "  ",
             "<|fim_prefix|>", "<|box_end|>"]  # delimiter text: plain text in a document, cached or not
    text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 400)))
    if rng.random() < 0.3:  # a JSON document: cached by its rendered text
        return {"title": text[:30], "body": text, "n": rng.randint(0, 99), "tags": ["a", "b"]}
    return text


def random_request(rng: random.Random, document) -> ScoreRequest:
    questions = {}
    for j in range(rng.randint(1, 4)):
        questions[f"q{j}"] = rng.choice([Question.noul("was it late"), Question.choice("team", {"billing": None,
                                         "support": "the support team"}), Question.score("how calm", ["calm", "angry"])])
    return ScoreRequest(document=document, questions=questions, truncate_document=rng.random() < 0.5)


def outcome(b: PromptBuilder, request: ScoreRequest):
    """The prepared request (whether its document came from the cache aside), or the error."""
    try:
        return dataclasses.replace(validate_and_build(request, b), document_seen=False)
    except (DocumentTooLong, InvalidRequest) as e:
        return type(e).__name__, str(e)


def test_a_prepared_request_says_whether_its_document_came_from_the_cache():
    cached, plain = builder(1 << 20), builder(0)
    request = ScoreRequest(document="the invoice was late", questions={"q": Question.noul("was it late")})
    first, again = validate_and_build(request, cached), validate_and_build(request, cached)
    assert not first.document_seen and again.document_seen
    assert not validate_and_build(request, plain).document_seen and not validate_and_build(request, plain).document_seen


@pytest.mark.parametrize("max_document_tokens", [65536, 120])  # 120: some documents cut, some refused
def test_a_cached_document_is_what_the_tokenizer_gives(max_document_tokens):
    rng = random.Random(max_document_tokens)
    plain, cached = builder(0, max_document_tokens), builder(1 << 20, max_document_tokens)
    documents = [random_document(rng) for _ in range(30)]
    for _ in range(200):  # documents repeat: most look-ups hit
        request = random_request(rng, rng.choice(documents))
        assert outcome(cached, request) == outcome(plain, request)
    assert cached.documents.hits > 100 and cached.documents.misses <= 30


def test_a_hit_encodes_only_the_questions():
    b = builder(1 << 20)
    seen = []
    encode = b._plain.encode_batch_fast
    b._plain = type("Recording", (), {"encode_batch_fast": lambda self, texts, **kw: seen.append(len(texts)) or
                                      encode(texts, **kw)})()
    request = ScoreRequest(document="the invoice was late " * 50, questions={"q": Question.noul("was it late")})
    first, again = validate_and_build(request, b), validate_and_build(request, b)
    assert dataclasses.replace(first, document_seen=True) == again and again.document_seen
    assert len(seen) == 2 and seen[0] == seen[1] + 1  # the row's texts + the document, then the row's


def test_the_cache_keeps_its_token_budget_least_recently_used_first():
    cache = DocumentCache(10)
    a, b, c, d = (DocumentCache.key(t) for t in "abcd")
    cache.put(a, [1, 2, 3, 4])
    cache.put(b, [5, 6, 7, 8])
    assert cache.get(a) == [1, 2, 3, 4]  # a is now the most recent
    cache.put(c, [9, 10, 11, 12])  # 12 tokens: b, the least recent, goes
    assert cache.get(b) is None and cache.get(a) == [1, 2, 3, 4] and cache.get(c) == [9, 10, 11, 12]
    assert cache.tokens == 8
    cache.put(d, list(range(11)))  # longer than the whole budget: not kept, nothing dropped for it
    assert cache.get(d) is None and cache.tokens == 8
    cache.put(a, [1])  # replaced, not counted twice
    assert cache.tokens == 5 and cache.get(a) == [1]
    with pytest.raises(ValueError):
        DocumentCache(0)


def test_threads_share_one_cache():
    plain, cached = builder(0), builder(4000)  # a small budget: entries come and go under the threads
    rng = random.Random(5)
    documents = [random_document(rng) for _ in range(40)]
    requests = [random_request(rng, rng.choice(documents)) for _ in range(400)]
    want = [outcome(plain, r) for r in requests]
    barrier = threading.Barrier(8)

    def run(k):
        barrier.wait()
        return [outcome(cached, r) for r in requests[k::8]]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(run, range(8)))
    for k in range(8):
        assert got[k] == want[k::8]
    assert cached.documents.tokens <= 4000
