"""A long document tokenized in pieces, the pieces in parallel, with the ids of the whole text.

HF tokenizers runs the texts of one `encode_batch_fast` call on its thread pool, but one text on
one thread: a 2,200-token document took 0.95 ms of one core on the CI VM, on the path of a request
that finds the services idle (its state pass waits for it). Cut into pieces of about
`PIECE_CHARS` characters, the pieces run side by side.

Exact where the tokenizer's pipeline never lets a token or a pre-token span the cut: each piece is
tokenized alone, so the concatenated ids equal the whole text's only if the whole text's
pre-tokens already break there. A cut goes only at a space between two ASCII words
(`[A-Za-z0-9] [A-Za-z]`, cut before the space), and only for tokenizers built from parts for which
that is a pre-token boundary whatever the text around it (`splits_between_words`):

- normalizers that map characters one by one (Unicode normal forms, lowercasing, BERT's): an
  ASCII letter and a space map to themselves, and nothing composes across the cut;
- at least one pre-tokenizer that breaks at every space before a letter whatever surrounds it:
  `Whitespace`, `WhitespaceSplit`, `BertPreTokenizer`, `ByteLevel` with its GPT-2 regex, or `Split`
  on the GPT-2-family regexes below (Qwen2, Qwen3.5, Llama 3 / cl100k: a run of letters or a digit
  ends at a space and the next match starts with it, " word"; the whitespace alternatives, the only
  ones that look ahead, never reach a cut whose left neighbour is a letter or digit). Pre-tokenizers
  only ever split further, so a boundary made by one step stays;
- other steps only from those that act within each pre-token: `Digits`, `Punctuation`,
  `ByteLevel` without its regex (a prefix space goes to no piece that starts with a space);
- no added token that contains whitespace or strips it around itself (`lstrip` / `rstrip`): added
  tokens are matched in the raw text before anything else.

Anything else (a `Metaspace` pre-tokenizer, whose prefix scheme decides what a piece's first word
becomes; a `Strip` or `Replace` normalizer; an unknown regex) is tokenized whole, as before. The
models (BPE, WordLevel, WordPiece, Unigram) work within pre-tokens. tests/request/test_pieces.py
checks whole == pieces on random texts for a byte-level BPE with each regex, and on the
word-level tokenizers.
"""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer

PIECE_CHARS = 2048  # about 330 tokens of English: enough to amortise a piece's own cost

_CUT = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z])")  # the space between two ASCII words

_PER_CHARACTER_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "BertNormalizer", "StripAccents"}
_WORD_BREAKING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
_WITHIN_PRE_TOKEN = {"Digits", "Punctuation"}
# Split regexes of the GPT-2 family (as tokenizer.json writes them): Qwen2 / Qwen2.5 / Qwen3,
# Qwen3.5, Llama 3 / cl100k.
_WORD_BREAKING_REGEXES = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
}


def _steps(part: dict | None) -> list[dict]:
    if part is None:
        return []
    return [s for p in part["normalizers" if "normalizers" in part else "pretokenizers"] for s in _steps(p)] \
        if part.get("type") == "Sequence" else [part]


def _pre_tokenizer_breaks(step: dict) -> bool:
    """Whether `step` breaks at every space between two ASCII words."""
    kind = step.get("type")
    if kind in _WORD_BREAKING_PRE_TOKENIZERS:
        return True
    if kind == "ByteLevel":
        return step.get("use_regex", True)
    if kind == "Split":
        pattern = step.get("pattern") or {}
        return (not step.get("invert") and step.get("behavior") in ("Isolated", "Removed")
                and pattern.get("Regex") in _WORD_BREAKING_REGEXES)
    return False


def splits_between_words(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` gives a text's ids as the concatenation of its pieces' ids when the
    text is cut at spaces between ASCII words (module docstring)."""
    spec = json.loads(tokenizer.to_str())
    if not all(s.get("type") in _PER_CHARACTER_NORMALIZERS for s in _steps(spec.get("normalizer"))):
        return False
    steps = _steps(spec.get("pre_tokenizer"))
    breaking = [_pre_tokenizer_breaks(s) for s in steps]
    if not any(breaking) or not all(b or s.get("type") in _WITHIN_PRE_TOKEN or s.get("type") == "ByteLevel"
                                    for b, s in zip(breaking, steps)):
        return False
    return not any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or any(c.isspace() for c in t["content"])
                   for t in spec.get("added_tokens") or [])


def word_pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at least `size` characters (the last may be shorter), each cut at
    the first space between two ASCII words from there; one piece when there is none."""
    pieces, start = [], 0
    while len(text) - start >= 2 * size:
        cut = _CUT.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces
