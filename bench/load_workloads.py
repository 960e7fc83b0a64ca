"""The load generator's workloads (docs/design.md section 4): requests of exact token lengths.

Lengths are in tokens of the served tokenizer, as the server counts them, so figures compare
whatever the tokenizer: a document of N tokens is a state pass of N tokens (`usage.document_tokens`,
the `<state>` delimiter included), a row of R tokens is `<q> ... <decide>` with every delimiter.

| name | document tokens | questions | row tokens | documents |
|---|---|---|---|---|
| six-short | 48 | 6 | 32 | new each request |
| five-long | 2,200 | 5 | 32 | new each request |
| mixed | 32-512, log-uniform | 1-6 | 16-64, uniform | 30% repeat an earlier document |
| longdoc | 16,384 or 61,440 | 1-3 | 32 | new each request |
| six-short-varied | 48 | 6 | 16-64, log-uniform (mean 34.6) | new each request |
| five-long-varied | 2,200 | 5 | 16-64, log-uniform (mean 34.6) | new each request |
| varied | 32-4,096, log-uniform (mean 838) | 1-8 | 12-128, log-uniform (mean 49); floor 12 for every kind | 30% repeat an earlier document |

Log-uniform lengths (the length's logarithm uniform): as many rows of 12-24 tokens as of 64-128, so
short rows are the common case and long ones are there too, and no single length dominates the
way six-short's 32 does. The varied rows run from a bare yes/no question to a choice whose options
carry descriptions: descriptions grow with a row over 64 tokens and instructions fill the rest.
Every kind (noul, choice, score) reaches both 12 and 128 tokens: its shortest row is 9 tokens
(`<q>`, one word, two one-word options, `<decide>`), so no kind's floor rises above 12. A stream
measures that shortest row under the served tokenizer (`TextMaker.min_row_tokens`) and raises
a kind's floor to it where a tokenizer makes it longer.

Text is random words that the tokenizer encodes as one token each, wherever they stand, so a
document's ids are known without encoding it (the first requests of a stream and every comparison
sample are re-encoded with the prompt builder to prove it); rows are measured with the prompt
builder and their instructions trimmed or extended until exact (a row that cannot be made exact
raises). Question types cycle noul / choice / score from a random first one.
`Workload.scaled(f)` shrinks documents for CPU runs (CI); rows keep their lengths.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from kev.request import api
from kev.rpc import wire
from kev.model.checkpoint import find_side_files
from kev.bank.doc_key import document_key
from kev.request.prompts import Delimiters, Limits, PromptBuilder

MAX_FIT_STEPS = 32  # measure-and-adjust rounds before giving up on an exact length
REPEAT_POOL = 1024  # documents a repeat may draw from (the most recent)


@dataclass(frozen=True)
class Workload:
    name: str
    doc_tokens: tuple[int, ...] = ()  # one of these (uniformly), or
    doc_range: tuple[int, int] | None = None  # log-uniform in [lo, hi]
    questions: tuple[int, int] = (1, 1)  # per request, uniform in [lo, hi]
    row_tokens: tuple[int, int] = (32, 32)  # per row, in [lo, hi]
    row_spread: str = "uniform"  # of row lengths in row_tokens: uniform | log-uniform
    repeat_share: float = 0.0  # share of requests that reuse an earlier document
    # Questions made per (kind, row length); a workload of many row lengths needs fewer of each
    # to vary, and each costs ~0.3 ms of client CPU to make.
    question_variants: int = 16

    def scaled(self, factor: float) -> "Workload":
        """Documents `factor` times as long (at least 8 tokens); for CPU runs."""
        if factor == 1:
            return self
        scale = lambda n: max(8, round(n * factor))  # noqa: E731
        rng = None if self.doc_range is None else (scale(self.doc_range[0]), scale(self.doc_range[1]))
        return replace(self, doc_tokens=tuple(scale(n) for n in self.doc_tokens), doc_range=rng)

    def pick_doc_tokens(self, rng: random.Random) -> int:
        if self.doc_range is not None:
            return log_uniform(rng, *self.doc_range)
        return rng.choice(self.doc_tokens)

    def pick_row_tokens(self, rng: random.Random, floor: int) -> int:
        """A row length in [max(lo, floor), hi]: `floor` is the kind's shortest row."""
        lo, hi = max(self.row_tokens[0], floor), self.row_tokens[1]
        return log_uniform(rng, lo, hi) if self.row_spread == "log-uniform" else rng.randint(lo, hi)

    def row_lengths(self, floor: int) -> range:
        return range(max(self.row_tokens[0], floor), self.row_tokens[1] + 1)

    @property
    def longest_document(self) -> int:
        return self.doc_range[1] if self.doc_range is not None else max(self.doc_tokens)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


WORKLOADS = {
    w.name: w
    for w in (
        Workload("six-short", doc_tokens=(48,), questions=(6, 6), row_tokens=(32, 32)),
        Workload("five-long", doc_tokens=(2200,), questions=(5, 5), row_tokens=(32, 32)),
        Workload("mixed", doc_range=(32, 512), questions=(1, 6), row_tokens=(16, 64), repeat_share=0.3),
        Workload("longdoc", doc_tokens=(16384, 61440), questions=(1, 3), row_tokens=(32, 32)),
        Workload("six-short-varied", doc_tokens=(48,), questions=(6, 6), row_tokens=(16, 64),
                 row_spread="log-uniform", question_variants=4),
        Workload("five-long-varied", doc_tokens=(2200,), questions=(5, 5), row_tokens=(16, 64),
                 row_spread="log-uniform", question_variants=4),
        Workload("varied", doc_range=(32, 4096), questions=(1, 8), row_tokens=(12, 128), row_spread="log-uniform",
                 repeat_share=0.3, question_variants=4),
    )
}


def load_builder(checkpoint: str | Path, max_document_tokens: int = 65536) -> tuple[str, Tokenizer, PromptBuilder]:
    """(model id, tokenizer, prompt builder) of a checkpoint directory, as the server builds them."""
    side = find_side_files(checkpoint, require_tokenizer=True)
    tokenizer = Tokenizer.from_file(str(side.tokenizer_path))
    delimiters = Delimiters(**side.meta.delimiters) if side.meta.delimiters else Delimiters()
    builder = PromptBuilder(tokenizer, delimiters, Limits(max_document_tokens=max_document_tokens))
    return side.meta.model_id, tokenizer, builder


class TextMaker:
    """Documents and questions of exact token lengths under one prompt builder."""

    def __init__(self, tokenizer: Tokenizer, builder: PromptBuilder, max_words: int = 2000):
        self.builder = builder
        self.words, self.first_ids, self.next_ids = single_token_words(tokenizer, builder, max_words)

    def text(self, rng: random.Random, words: int) -> str:
        return " ".join(rng.choices(self.words, k=words))

    def document(self, rng: random.Random, tokens: int, verify: bool = False) -> tuple[str, list[int]]:
        """(text, its state ids): exactly `tokens` ids, `<state>` included.

        The ids are assembled from the words' known ids (encoding a 61k-word text costs ~50 ms of
        client CPU); `verify` re-encodes the text with the prompt builder and raises on any difference.
        """
        if tokens < 2:
            raise ValueError(f"a document needs at least 2 tokens (<state> and one word), asked {tokens}")
        picks = rng.choices(range(len(self.words)), k=tokens - 1)
        text = " ".join(self.words[i] for i in picks)
        ids = [self.builder.ids.state, self.first_ids[picks[0]], *(self.next_ids[i] for i in picks[1:])]
        if verify:
            encoded, _ = self.builder.document_tokens(text)
            if encoded != ids:
                raise ValueError(f"document of {tokens} tokens encodes to {len(encoded)} tokens "
                                 "(or other ids) under this tokenizer")
        return text, ids

    def question(self, rng: random.Random, kind: api.QuestionType, tokens: int) -> api.Question:
        """A question of `kind` whose row is exactly `tokens` ids."""
        options = self._options(rng, kind, tokens)
        row = lambda instr_words: self._build(kind, self.text(rng, instr_words), options)  # noqa: E731
        # Fewer or plainer options until one word of instructions fits.
        while self._row_len(row(1)) > tokens:
            options = self._plainer(kind, options)
            if options is None:
                raise ValueError(f"a {kind.value} question cannot fit in {tokens} row tokens")
        words = 1
        for _ in range(MAX_FIT_STEPS):
            q = row(words)
            n = self._row_len(q)
            if n == tokens:
                return q
            words = max(1, words + tokens - n)
        raise ValueError(f"could not make a {kind.value} row of exactly {tokens} tokens")

    def min_row_tokens(self, kind: api.QuestionType) -> int:
        """The shortest row of `kind`: one word of instructions, two options without descriptions."""
        plainest = {api.QuestionType.NOUL: [("no", None), ("yes", None)],
                    api.QuestionType.CHOICE: [(w, None) for w in self.words[:2]],
                    api.QuestionType.SCORE: [("", "")] * 2}[kind]
        return self._row_len(self._build(kind, self.words[0], plainest))

    def _row_len(self, q: api.Question) -> int:
        return len(self.builder.row_tokens(q).ids)

    def _options(self, rng: random.Random, kind: api.QuestionType, tokens: int) -> list[tuple[str, str | None]]:
        """(label, description) pairs: noul (false, true), choice (name, desc), score (-, level desc).
        Descriptions run to 2 words, more in rows over 64 tokens (up to 18 at 128): long rows
        carry long options, not only long instructions. Rows of 64 tokens or fewer draw exactly
        what they drew before the varied workloads: the older workloads' requests are unchanged."""
        most = 2 + max(0, tokens - 64) // 4
        desc = lambda: self.text(rng, rng.randint(1, most)) if rng.random() < 0.5 else None  # noqa: E731
        if kind is api.QuestionType.NOUL:
            return [("no", desc()), ("yes", desc())]
        if kind is api.QuestionType.CHOICE:
            return [(name, desc()) for name in rng.sample(self.words, rng.randint(2, 4))]
        return [("", self.text(rng, 1)) for _ in range(3)]

    @staticmethod
    def _plainer(kind: api.QuestionType, options: list) -> list | None:
        if any(d is not None for _, d in options) and kind is not api.QuestionType.SCORE:
            return [(label, None) for label, _ in options]
        if len(options) > 2:
            return options[:-1]
        if kind is api.QuestionType.SCORE and any(d for _, d in options):
            return [(label, "") for label, _ in options]
        return None

    @staticmethod
    def _build(kind: api.QuestionType, instructions: str, options: list) -> api.Question:
        if kind is api.QuestionType.NOUL:
            return api.Question.noul(instructions, true_description=options[1][1], false_description=options[0][1])
        if kind is api.QuestionType.CHOICE:
            return api.Question.choice(instructions, [api.Choice(n, d) for n, d in options])
        return api.Question.score(instructions, [d or "" for _, d in options])


def single_token_words(tokenizer: Tokenizer, builder: PromptBuilder,
                       max_words: int) -> tuple[list[str], list[int], list[int]]:
    """(words, id at the start of a text, id after a space): lower-case words of the vocabulary
    that encode as one token in both places, so a text of n of them is n tokens; sorted."""
    candidates = set()
    for piece in tokenizer.get_vocab():
        word = piece.lstrip("\u0120\u2581")  # byte-level BPE / sentencepiece word-start marks
        if word.isascii() and word.isalpha() and word.islower() and 2 <= len(word) <= 10:
            candidates.add(word)
    words = sorted(candidates)
    encoded = builder.encode_text([f"{w} {w} {w}" for w in words], ["word"] * len(words))
    good = [(w, ids[0], ids[1]) for w, ids in zip(words, encoded) if len(ids) == 3 and ids[1] == ids[2]]
    if len(good) < 16:
        raise ValueError(f"the tokenizer has only {len(good)} single-token lower-case words; need 16")
    good = good[:max_words]
    return [g[0] for g in good], [g[1] for g in good], [g[2] for g in good]


@dataclass(frozen=True)
class LoadRequest:
    request: api.ScoreRequest
    payload: bytes  # the serialized kev.v1.ScoreQuestionsRequest
    affinity: str  # the x-kev-doc-key header (document key)
    doc_tokens: int
    row_tokens: int  # all rows together
    repeat: bool  # the document was sent before in this stream

    @property
    def questions(self) -> int:
        return len(self.request.questions)


class RequestStream:
    """Thread-safe source of a workload's requests: request i is the same on every run with the
    same seed (repeats draw from the documents this stream made before)."""

    TYPES = (api.QuestionType.NOUL, api.QuestionType.CHOICE, api.QuestionType.SCORE)

    def __init__(self, maker: TextMaker, model_id: str, workload: Workload, seed: int = 0):
        self.maker, self.model_id, self.workload, self.seed = maker, model_id, workload, seed
        self._lock = threading.Lock()
        self._count = 0
        self._pool: list[tuple[str, list[int]]] = []
        # Questions come from a fixed set per (type, row length): rows re-run on every request
        # anyway, and building one costs ~0.4 ms of client CPU that would cap the offered load.
        self._questions: dict[tuple[str, api.QuestionType, int], list[api.Question]] = {}
        self.row_floor = {kind: maker.min_row_tokens(kind) for kind in self.TYPES}
        if too_long := {k.value: n for k, n in self.row_floor.items() if n > workload.row_tokens[1]}:
            raise ValueError(f"{workload.name}: the shortest rows {too_long} are over {workload.row_tokens[1]} tokens")

    def prepare(self) -> None:
        """Makes every question the stream can send now, so that no client waits for one under the
        lock mid-run (varied: 3 kinds x 117 row lengths)."""
        with self._lock:
            for kind in self.TYPES:
                for tokens in self.workload.row_lengths(self.row_floor[kind]):
                    self._question_set(str(self.seed), kind, tokens)

    def next(self) -> LoadRequest:
        with self._lock:
            index = self._count
            self._count += 1
            # The first requests re-encode their documents: a tokenizer the id shortcut does not fit fails at once.
            return self.make(random.Random(f"{self.seed}:{index}"), self._pool, str(self.seed), verify=index < 4)

    def sample(self, n: int, seed: int = 10**6) -> list[LoadRequest]:
        """`n` requests of their own seed (new documents), for answer comparisons: the same for every
        stream of this workload and tokenizer, whatever the stream's seed."""
        pool: list[tuple[str, list[int]]] = []
        with self._lock:
            return [self.make(random.Random(f"sample:{seed}:{i}"), pool, f"sample:{seed}", verify=True)
                    for i in range(n)]

    def make(self, rng: random.Random, pool: list[tuple[str, list[int]]], question_seed: str,
             verify: bool = False) -> LoadRequest:
        w = self.workload
        repeat = bool(pool) and rng.random() < w.repeat_share
        if repeat:
            text, ids = rng.choice(pool)
        else:
            text, ids = self.maker.document(rng, w.pick_doc_tokens(rng), verify)
            if w.repeat_share > 0:
                pool.append((text, ids))
                del pool[:-REPEAT_POOL]
        first = rng.randrange(3)
        questions, rows = {}, 0
        for j in range(rng.randint(*w.questions)):
            kind = self.TYPES[(first + j) % 3]
            tokens = w.pick_row_tokens(rng, self.row_floor[kind])
            questions[f"q{j}"] = rng.choice(self._question_set(question_seed, kind, tokens))
            rows += tokens
        request = api.ScoreRequest(text, questions)
        return LoadRequest(request, wire.request_to_proto(request).SerializeToString(),
                           document_key(self.model_id, ids), len(ids), rows, repeat)

    def _question_set(self, seed: str, kind: api.QuestionType, tokens: int) -> list[api.Question]:
        key = (seed, kind, tokens)
        if key not in self._questions:  # callers hold the lock
            rng = random.Random(f"{seed}:{kind.value}:{tokens}")
            self._questions[key] = [self.maker.question(rng, kind, tokens)
                                    for _ in range(self.workload.question_variants)]
        return self._questions[key]
