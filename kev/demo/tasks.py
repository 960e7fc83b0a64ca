"""The demo task family: seeded synthetic documents with `noul`, `choice` and `score` questions.

`generate(n, seed)` returns n `Example`s: a document (a string, or for some tickets a JSON object
the prompt builder renders), one question about it and the gold option index in the rendered
option order (noul: 0 = no, 1 = yes; choice: the position in `question.options`; score: the
level). Consecutive examples share a document (`questions_per_doc` of them, one of each type in
turn), so `as_requests` can send them as System One requests with several questions each.
`generate_documents(n, seed)` (training) asks every question a document's domain has.

Each example also carries its evidence: the token spans of the document that state the answer
(the whole sentence, or the words `domains` marks as deciding). Training uses them to teach the
model where to look; serving never sees them.

A document is 20-400 tokens: the sentences that decide its answers (in `kev.demo.domains`), the
near-miss distractors of facts stated the other way, and fillers that bear on no question, in
random order. Everything is drawn from one `random.Random(seed)`: the same seed gives the same
examples on every machine.

`build_tokenizer()` makes the demo's word-level tokenizer from `vocabulary()`: every word the
generator and the prompt builder can write, plus the five Kev delimiters as special tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer, normalizers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kev.request.api import Choice, JsonDocument, Question, QuestionType, ScoreRequest
from kev.demo.domains import CITIES, COMPANIES, DOMAINS, EXTRA_WORDS, NAMES, Domain
from kev.request.prompts import Delimiters

MIN_DOC_TOKENS, MAX_DOC_TOKENS = 20, 400
UNK = "[UNK]"
_WORD = re.compile(r"\w+|[^\w\s]+")  # what the Whitespace pre-tokenizer splits text into
_SLOT = re.compile(r"\{(\w+)\}")
JSON_FIELDS = ("customer", "message")  # keys of the JSON form of a ticket


@dataclass(frozen=True)
class Example:
    document: JsonDocument
    name: str  # the question's name in its request
    question: Question
    gold: int  # index of the right option in rendered order
    kind: str  # ticket | contract | review
    # Token spans [start, end) of the document text (render_document's tokens, without <state>)
    # that state the answer; empty when a noul fact is not mentioned. Used as a training signal.
    evidence: tuple[tuple[int, int], ...] = ()

    @property
    def qtype(self) -> QuestionType:
        return self.question.type

    @property
    def gold_label(self) -> str:
        q = self.question
        if q.type is QuestionType.NOUL:
            return ("no", "yes")[self.gold]
        if q.type is QuestionType.CHOICE:
            return q.options[self.gold].name
        return f"{self.gold}: {q.levels[self.gold]}"


def count_tokens(text: str) -> int:
    return len(_WORD.findall(text))


def _unmark(sentence: str) -> tuple[str, list[tuple[int, int]]]:
    """(text without `*` marks, token spans of the marked words; [] when nothing is marked)."""
    parts = sentence.split("*")  # even parts plain, odd parts marked
    spans, at = [], 0
    for i, part in enumerate(parts):
        n = count_tokens(part)
        if i % 2:
            spans.append((at, at + n))
        at += n
    return " ".join(p.strip() for p in parts if p.strip()), spans


# ---------------------------------------------------------------------------------------------
# Documents


def _number_after(sentence: str, rng: random.Random) -> int:
    unit = sentence.split("{n}", 1)[1].split()[0] if "{n}" in sentence else ""
    lo, hi = {"weeks": (2, 3), "months": (2, 11), "years": (2, 10), "days": (2, 29)}.get(unit, (2, 60))
    return rng.randint(lo, hi)


def _fill(sentence: str, rng: random.Random, thing: str = "") -> str:
    values = {"name": rng.choice(NAMES), "city": rng.choice(CITIES), "company": rng.choice(COMPANIES),
              "thing": thing}
    values["n"] = str(_number_after(sentence, rng))
    return _SLOT.sub(lambda m: values[m.group(1)], sentence)


@dataclass(frozen=True)
class _Doc:
    kind: str
    document: JsonDocument
    category: int  # option index in the domain's category
    fine_level: int
    facts: tuple[bool, ...]  # stated as true, per domain fact
    evidence: dict[str, tuple[tuple[int, int], ...]]  # "category" | "scale" | fact key -> token spans


def _make_document(domain: Domain, rng: random.Random) -> _Doc:
    target = round(MIN_DOC_TOKENS * (MAX_DOC_TOKENS / MIN_DOC_TOKENS) ** rng.random())  # log-uniform
    category = rng.randrange(len(domain.category.options))
    option = domain.category.options[category]
    thing = rng.choice(option.things) if option.things else ""
    fine = rng.randrange(len(domain.scale.sentences))
    # (sentence, the question it answers or None)
    core = [(_fill(s, rng, thing), "category") for s in rng.sample(option.sentences, rng.choice((1, 1, 2)))]
    core += [(_fill(s, rng), "scale") for s in rng.sample(domain.scale.sentences[fine], rng.choice((1, 1, 2)))]
    facts = []
    for fact in domain.facts:
        state = rng.choices(("yes", "no", "absent"), weights=(0.45, 0.2, 0.35))[0]
        facts.append(state == "yes")
        if state != "absent":
            core.append((_fill(rng.choice(fact.yes if state == "yes" else fact.no), rng), fact.key))
    opening, closing = _fill(rng.choice(domain.openings), rng), _fill(rng.choice(domain.closings), rng)
    used = count_tokens(opening) + count_tokens(closing) + sum(count_tokens(_unmark(s)[0]) for s, _ in core)
    body = list(core)
    while used < target:
        filler = _fill(rng.choice(domain.fillers), rng)
        if used + count_tokens(filler) > MAX_DOC_TOKENS - 4:  # room for the JSON keys
            break
        body.append((filler, None))
        used += count_tokens(filler)
    rng.shuffle(body)
    pieces = [(opening, None), *body, (closing, None)]  # sentences may still hold `*` marks
    text = " ".join(_unmark(s)[0] for s, _ in pieces)
    document: JsonDocument = text
    offset = 0
    if domain.kind == "ticket" and rng.random() < 0.3:
        customer = rng.choice(NAMES)
        document = {"customer": customer, "message": text}  # renders as "customer: ...\nmessage: <text>"
        offset = count_tokens(f"customer: {customer}\nmessage:")
    evidence: dict[str, list[tuple[int, int]]] = {}
    for sentence, role in pieces:
        plain, marked = _unmark(sentence)
        n = count_tokens(plain)
        if role is not None:
            marked = marked or [(0, n)]  # the marked words, else the whole sentence
            evidence.setdefault(role, []).extend((offset + s, offset + e) for s, e in marked)
        offset += n
    return _Doc(domain.kind, document, category, fine, tuple(facts),
                {k: tuple(v) for k, v in evidence.items()})


# ---------------------------------------------------------------------------------------------
# Questions


def _noul(domain: Domain, doc: _Doc, rng: random.Random) -> tuple[str, Question, int]:
    i = rng.randrange(len(domain.facts))
    fact = domain.facts[i]
    if rng.random() < 0.3:
        q = Question.noul(rng.choice(fact.questions), fact.true_description, fact.false_description)
    else:
        q = Question.noul(rng.choice(fact.questions))
    return fact.key, q, int(doc.facts[i])


def _choice(domain: Domain, doc: _Doc, rng: random.Random) -> tuple[str, Question, int]:
    cat = domain.category
    others = [i for i in range(len(cat.options)) if i != doc.category]
    shown = [doc.category, *rng.sample(others, rng.choice((len(others), len(others), 1, 2)))]
    rng.shuffle(shown)
    describe = rng.random() < 0.5
    options = [Choice(cat.options[i].name, cat.options[i].description if describe else None) for i in shown]
    return cat.key, Question.choice(rng.choice(cat.questions), options), shown.index(doc.category)


def _score(domain: Domain, doc: _Doc, rng: random.Random) -> tuple[str, Question, int]:
    scale = domain.scale
    level_set = rng.choice(scale.level_sets)
    q = Question.score(rng.choice(scale.questions), level_set.levels)
    return scale.key, q, level_set.of_fine[doc.fine_level]


def _evidence(domain: Domain, doc: _Doc, name: str) -> tuple[tuple[int, int], ...]:
    role = {domain.category.key: "category", domain.scale.key: "scale"}.get(name, name)
    return doc.evidence.get(role, ())


_ASK = {QuestionType.NOUL: _noul, QuestionType.CHOICE: _choice, QuestionType.SCORE: _score}
_TYPES = (QuestionType.NOUL, QuestionType.CHOICE, QuestionType.SCORE)


def generate_documents(n_docs: int, seed: int) -> list[list[Example]]:
    """n documents, each with every question its domain has (each fact, the choice, the score)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_docs):
        domain = rng.choice(DOMAINS)
        doc = _make_document(domain, rng)
        asked = [_choice(domain, doc, rng), _score(domain, doc, rng)]
        for i, fact in enumerate(domain.facts):
            describe = rng.random() < 0.3
            q = Question.noul(rng.choice(fact.questions), *((fact.true_description, fact.false_description)
                                                              if describe else ()))
            asked.append((fact.key, q, int(doc.facts[i])))
        rng.shuffle(asked)
        out.append([Example(doc.document, name, q, gold, doc.kind, _evidence(domain, doc, name))
                    for name, q, gold in asked])
    return out


def generate(n: int, seed: int, questions_per_doc: int = 3) -> list[Example]:
    """n examples, `questions_per_doc` per document (types in turn from a random start; at most
    one question per name per document)."""
    rng = random.Random(seed)
    out: list[Example] = []
    while len(out) < n:
        domain = rng.choice(DOMAINS)
        doc = _make_document(domain, rng)
        start = rng.randrange(len(_TYPES))
        names: set[str] = set()
        for j in range(min(questions_per_doc, n - len(out))):
            for _ in range(8):  # a fresh name: noul facts can repeat
                name, question, gold = _ASK[_TYPES[(start + j) % len(_TYPES)]](domain, doc, rng)
                if name not in names:
                    break
            else:
                continue
            names.add(name)
            out.append(Example(doc.document, name, question, gold, doc.kind, _evidence(domain, doc, name)))
    return out


def as_requests(examples: Sequence[Example]) -> Iterator[tuple[ScoreRequest, list[Example]]]:
    """Consecutive examples about the same document as one request (question names are unique)."""
    group: list[Example] = []
    for ex in examples:
        if group and ex.document is not group[0].document:
            yield ScoreRequest(group[0].document, {e.name: e.question for e in group}), group
            group = []
        group.append(ex)
    if group:
        yield ScoreRequest(group[0].document, {e.name: e.question for e in group}), group


# ---------------------------------------------------------------------------------------------
# Vocabulary and tokenizer


def _words(text: str) -> list[str]:
    return _WORD.findall(_SLOT.sub(" ", text.lower().replace("*", " ")))


def vocabulary() -> list[str]:
    """Every word the generator and the prompt builder can write, in a fixed order."""
    texts: list[str] = [*EXTRA_WORDS, *JSON_FIELDS, *NAMES, *CITIES, *COMPANIES]
    texts += [str(i) for i in range(101)]
    for d in DOMAINS:
        texts += [*d.fillers, *d.openings, *d.closings]
        texts += [*d.category.questions, *d.scale.questions]
        for o in d.category.options:
            texts += [o.name, o.description, *o.sentences, *o.things]
        for level in d.scale.sentences:
            texts += level
        for ls in d.scale.level_sets:
            texts += ls.levels
        for f in d.facts:
            texts += [*f.questions, *f.yes, *f.no, f.true_description, f.false_description]
    seen: dict[str, None] = {}
    for t in texts:
        for w in _words(t):
            seen.setdefault(w, None)
    return list(seen)


def build_tokenizer(delimiters: Delimiters = Delimiters()) -> Tokenizer:
    """Word level, lower-cased; ids: [UNK] = 0, the vocabulary, then the delimiters (special)."""
    vocab = {UNK: 0}
    for w in vocabulary():
        vocab.setdefault(w, len(vocab))
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(delimiters.strings().values()))
    return tokenizer
