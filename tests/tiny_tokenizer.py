"""A small real `tokenizers.Tokenizer` for tests: word level, with Kev's delimiters as added
special tokens, so delimiter matching inside raw text behaves exactly as with the real Qwen file.

Ids: 0 is [UNK], then PROMPT_WORDS (the words the prompt builder writes itself: "no", "yes", ":",
the digits), then `words` in order (duplicates skipped), then the special tokens that are not
already words. The default pre-tokenizer is `Whitespace` (runs of word characters, runs of
punctuation), so "no: late" is ["no", ":", "late"] and a literal "<|fim_prefix|>" in *plain* text
splits into "<|", "fim_prefix", "|>".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import PreTokenizer, Whitespace

KEV_DELIMITERS = ("<|fim_prefix|>", "<|fim_middle|>", "<|box_start|>", "<|box_end|>", "<|fim_suffix|>")
EXTRA_SPECIAL = ("<|endoftext|>",)  # a special token that is not a delimiter, as in Qwen's file
UNK = "[UNK]"
PROMPT_WORDS = ("no", "yes", ":", *(str(i) for i in range(10)))


def make_test_tokenizer(
    words: Iterable[str],
    special_tokens: Sequence[str] = KEV_DELIMITERS + EXTRA_SPECIAL,
    pre_tokenizer: PreTokenizer | None = None,
) -> Tokenizer:
    vocab = {UNK: 0}
    for word in (*PROMPT_WORDS, *words):
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizer if pre_tokenizer is not None else Whitespace()
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer
