"""A long document tokenized in pieces gives the whole text's ids (kev/request/pieces.py)."""

from __future__ import annotations

import random

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kev.request.pieces import _WORD_BREAKING_REGEXES, splits_between_words, word_pieces
from kev.request.prompts import PromptBuilder
from tiny_tokenizer import KEV_DELIMITERS, make_test_tokenizer

QWEN2, QWEN35, LLAMA3 = sorted(_WORD_BREAKING_REGEXES, key=lambda r: ("[\\p{L}\\p{M}]" in r, "{1,3}" in r))

# Text with every neighbour a cut may have, and the kinds of character the regexes treat apart:
# contractions, digit runs, punctuation runs, repeated and mixed whitespace, line breaks, accents
# (precomposed and combining), other scripts, symbols.
FRAGMENTS = ["the", "word", "It's", "we'll", "you'D", "x", "A", "42", "2026", "3.14", "--", "...", "(a)", "\"q\"",
             "café", "nai\u0308ve", "Ωμέγα", "данные", "数据", "😀", "naïve", "e\u0301", "#tag", "a_b", "CamelCase"]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", " \n ", "\r\n", ", ", ". ", " - ", "", "   "]


def random_text(rng: random.Random, words: int) -> str:
    return "".join(rng.choice(FRAGMENTS) + rng.choice(SEPARATORS) for _ in range(words))


def byte_level_bpe(pre_tokenizer, normalizer=None) -> Tokenizer:
    """A byte-level BPE trained on the test texts, with the given pre-tokenizer (as Qwen's file)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(KEV_DELIMITERS))
    tok.train_from_iterator([random_text(rng, 200) for _ in range(50)], trainer)
    return tok


def split_regex(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


SPLITTING = {
    "qwen2": lambda: byte_level_bpe(split_regex(QWEN2), normalizers.NFC()),
    "qwen3.5": lambda: byte_level_bpe(split_regex(QWEN35), normalizers.NFC()),
    "llama3": lambda: byte_level_bpe(split_regex(LLAMA3)),
    "gpt2": lambda: byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)),
    "word-level": lambda: make_test_tokenizer(["the", "word", "x", "a", "café"]),
    "lowercase-words-digits": lambda: _with(make_test_tokenizer(["the", "word"]), normalizers.Lowercase(),
                                            pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                                     pre_tokenizers.Digits(individual_digits=True)])),
}


def _with(tok: Tokenizer, normalizer, pre_tokenizer) -> Tokenizer:
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    return tok


def whole_and_pieces(tok: Tokenizer, text: str, size: int) -> tuple[list[int], list[int]]:
    pieces = word_pieces(text, size)
    return (tok.encode(text, add_special_tokens=False).ids,
            [i for enc in tok.encode_batch_fast(pieces, add_special_tokens=False) for i in enc.ids])


@pytest.mark.parametrize("name", sorted(SPLITTING))
def test_pieces_give_the_whole_texts_ids(name):
    tok = SPLITTING[name]()
    assert splits_between_words(tok)
    rng = random.Random(name)
    cuts = 0
    for _ in range(60):
        text = random_text(rng, rng.randrange(20, 300))
        size = rng.choice([1, 8, 40])
        cuts += len(word_pieces(text, size)) - 1
        whole, pieces = whole_and_pieces(tok, text, size)
        assert pieces == whole, text
    assert cuts > 500


NOT_SPLITTING = {
    # whether a piece's first word gets the prefix "▁" depends on the scheme: not proven, left whole
    "metaspace": lambda: _with(byte_level_bpe(pre_tokenizers.ByteLevel()), None,
                               pre_tokenizers.Metaspace(prepend_scheme="always")),
    "strip-normalizer": lambda: _with(make_test_tokenizer(["the"]), normalizers.Strip(), pre_tokenizers.Whitespace()),
    "unknown-regex": lambda: byte_level_bpe(split_regex(r"\w+ \w+|\s+")),
    "digits-alone": lambda: _with(make_test_tokenizer(["the"]), None, pre_tokenizers.Digits()),
    "byte-level-without-regex": lambda: byte_level_bpe(pre_tokenizers.ByteLevel(use_regex=False)),
    "no-pre-tokenizer": lambda: _with(byte_level_bpe(pre_tokenizers.ByteLevel()), None, None),
}


def test_the_demo_and_load_tokenizer_splits():
    from bench.random_checkpoint import DEMO_TOKENIZER

    assert splits_between_words(Tokenizer.from_file(str(DEMO_TOKENIZER)))


@pytest.mark.parametrize("name", sorted(NOT_SPLITTING))
def test_other_tokenizers_are_tokenized_whole(name):
    assert not splits_between_words(NOT_SPLITTING[name]())


def test_a_tokenizer_the_rule_excludes_does_change_at_a_cut():
    """The gate matters: a BPE with a merge across a space, and no pre-tokenizer breaking there,
    gives other ids in pieces; the rule turns pieces off for it."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["eĠ"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("e", "Ġ")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert not splits_between_words(tok)
    whole, pieces = whole_and_pieces(tok, "the word", 1)
    assert whole != pieces and vocab["eĠ"] in whole


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word", "space"])
def test_added_tokens_that_reach_across_whitespace_turn_pieces_off(flag):
    from tokenizers import AddedToken

    tok = make_test_tokenizer(["the"])
    assert splits_between_words(tok)
    content = "two words" if flag == "space" else "<think>"
    tok.add_tokens([AddedToken(content, **({} if flag == "space" else {flag: True}))])
    assert not splits_between_words(tok)


def test_word_pieces_cut_only_between_ascii_words():
    rng = random.Random(2)
    for _ in range(200):
        text = random_text(rng, rng.randrange(0, 200))
        size = rng.choice([1, 5, 30, 1000])
        pieces = word_pieces(text, size)
        assert "".join(pieces) == text
        assert all(len(p) >= size for p in pieces[:-1])
        for left, right in zip(pieces, pieces[1:]):
            assert left[-1].isascii() and left[-1].isalnum() and right[0] == " " and right[1].isascii() \
                and right[1].isalpha(), (left[-3:], right[:3])
    assert word_pieces("", 4) == [""]
    assert word_pieces("数据" * 100, 4) == ["数据" * 100]  # nowhere to cut: whole


def test_a_long_document_is_encoded_in_pieces_in_one_call():
    tok = SPLITTING["qwen3.5"]()
    builder, whole = PromptBuilder(tok), PromptBuilder(tok)
    whole.piece_chars = 0
    assert builder.piece_chars > 0
    calls = []
    plain = builder._plain
    builder._plain = type("Counting", (), {"encode_batch_fast": lambda self, texts, **kw: calls.append(len(texts))
                                           or plain.encode_batch_fast(texts, **kw)})()
    text = random_text(random.Random(3), 3000)
    assert builder.document_tokens(text) == whole.document_tokens(text)
    assert calls == [len(word_pieces(text, builder.piece_chars))] and calls[0] > 4
