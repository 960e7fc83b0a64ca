"""Typed request and response of the public scoring API (docs/design.md section 1).

These are plain frozen dataclasses with no tensors and no validation: the gRPC layer maps its
messages onto them one to one, and `kev.request.prompts.validate_and_build` checks them, so every error
names its field in one place. Sequences are stored as tuples; `Question.choice` and friends accept
lists and mappings for convenience.

`Question` is flat like the wire message. Choice options are an ordered *sequence* of
`Choice(name, description)` rather than a dict: the wire format (a repeated field) can carry
duplicate names, and the validator must see them to reject them. `Question.type` may hold a
value that is not a `QuestionType` (an unset or unknown wire enum): the validator rejects it.

Answer semantics (computed by `kev.request.head.answer`):
- `NoulAnswer.p_yes`: probability of "yes" (options are rendered "no" then "yes").
- `ChoiceAnswer`: `choice` = argmax name (ties -> first listed), `probabilities` per name in
  request order, `confidence` = (p_max - 1/K) / (1 - 1/K), 1 when K = 1.
- `ScoreAnswer`: levels are 0..L-1 in request order; `score` = sum(i * p_i), `legend[i]` = the
  description of level i, `probabilities[i]` = p(level i), `confidence` = 1 - E|level - mode| / (L - 1),
  1 when L = 1, mode = argmax (ties -> lowest level).

Usage: `document_tokens` counts the document's state tokens including the `<state>` delimiter
(after truncation); `cached_state_tokens` is how many of those came from the bank instead of a
state pass (0 or document_tokens); `input_tokens` = document_tokens + every row's tokens;
`unknown_tokens` counts the document's and the rows' tokens that are the tokenizer's unknown token:
text outside the model's vocabulary, which the model cannot read. Its answers stay probabilities
over the options whatever it read, so a noticeable share (`Usage.unknown_share` >=
`UNKNOWN_TOKENS_WARN_SHARE`, 10%) makes them meaningless however confident they look; the client
and the CLI warn then (`unknown_tokens_warning`). The demo model knows only its 666-word vocabulary.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

# The share of unknown tokens (of input_tokens) from which the client and the CLI warn.
UNKNOWN_TOKENS_WARN_SHARE = 0.10

# A JSON value as the document field accepts it at the top level (scalars only nested inside).
JsonDocument: TypeAlias = str | dict | list


class QuestionType(enum.Enum):
    NOUL = "noul"  # yes/no
    CHOICE = "choice"
    SCORE = "score"


@dataclass(frozen=True)
class Choice:
    name: str
    description: str | None = None  # None: the option renders as just the name


@dataclass(frozen=True)
class Question:
    """One question; the fields of the other types must stay empty (the validator checks).

    Flat like the wire message (kev/v1/scorer.proto `Question`), so error field paths read the
    same on both sides: noul uses the two descriptions, choice `options`, score `levels`.
    """

    type: QuestionType
    instructions: str
    true_description: str | None = None  # noul: what "yes" means
    false_description: str | None = None  # noul: what "no" means
    options: tuple[Choice, ...] = ()  # choice, in prompt order
    levels: tuple[str, ...] = ()  # score: level i (0-based) is levels[i]

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", tuple(self.options))
        object.__setattr__(self, "levels", tuple(self.levels))

    @classmethod
    def noul(
        cls, instructions: str, true_description: str | None = None, false_description: str | None = None
    ) -> "Question":
        """A yes/no question; the descriptions say what "yes" and "no" mean (optional)."""
        return cls(QuestionType.NOUL, instructions, true_description, false_description)

    @classmethod
    def choice(cls, instructions: str,
               options: Mapping[str, str | None] | Sequence[str | tuple[str, str | None] | Choice]) -> "Question":
        """A choice question: one of `options`, in this order. Each option is a name, a
        (name, description) pair or a `Choice`; or pass a dict name -> description (None: no
        description).

            Question.choice("Which team?", ["billing", "tech"])
            Question.choice("Which team?", [("billing", "money matters"), "tech"])
            Question.choice("Which team?", {"billing": "money matters", "tech": None})
        """
        if isinstance(options, str):
            raise TypeError("options must be a list of names (or (name, description) pairs), not one string")
        if isinstance(options, Mapping):
            items = [Choice(name, desc) for name, desc in options.items()]
        else:
            items = [_choice(o) for o in options]
        return cls(QuestionType.CHOICE, instructions, options=tuple(items))

    @classmethod
    def score(cls, instructions: str, levels: Sequence[str]) -> "Question":
        """A score question: level i (0-based) is described by `levels[i]`, lowest first."""
        return cls(QuestionType.SCORE, instructions, levels=tuple(levels))


def _choice(option: str | tuple[str, str | None] | Choice) -> Choice:
    """One option of `Question.choice` as a `Choice` (anything else is left for the validator)."""
    if isinstance(option, Choice):
        return option
    if isinstance(option, tuple) and len(option) == 2:
        return Choice(option[0], option[1])
    return Choice(option)  # a name (a wrong type is rejected by the validator, naming the field)


@dataclass(frozen=True)
class ScoreRequest:
    document: JsonDocument
    questions: Mapping[str, Question]
    truncate_document: bool = False
    model: str | None = None  # None: the server's only / default model


@dataclass(frozen=True)
class NoulAnswer:
    type: ClassVar[QuestionType] = QuestionType.NOUL
    p_yes: float


@dataclass(frozen=True)
class ChoiceAnswer:
    type: ClassVar[QuestionType] = QuestionType.CHOICE
    choice: str
    probabilities: dict[str, float]
    confidence: float


@dataclass(frozen=True)
class ScoreAnswer:
    type: ClassVar[QuestionType] = QuestionType.SCORE
    score: float
    legend: tuple[str, ...]  # legend[i] = description of level i
    probabilities: tuple[float, ...]  # probabilities[i] = p(level i)
    confidence: float


Answer: TypeAlias = NoulAnswer | ChoiceAnswer | ScoreAnswer


def option_probabilities(answer: Answer) -> list[float]:
    """An answer's probabilities as a flat list (noul: [p_yes]; choice: in option order; score:
    by level), for comparing answers across paths."""
    if isinstance(answer, NoulAnswer):
        return [answer.p_yes]
    if isinstance(answer, ChoiceAnswer):
        return list(answer.probabilities.values())
    return list(answer.probabilities)


@dataclass(frozen=True)
class Usage:
    """Token counts of one answered request (module docstring)."""

    input_tokens: int  # document_tokens + every question row's tokens
    cached_state_tokens: int  # document tokens whose state came from the bank (0 or document_tokens)
    document_tokens: int  # the document's state tokens, <state> included, after any truncation
    truncated: bool  # the document was cut to the model's limit
    unknown_tokens: int = 0  # document and row tokens the tokenizer does not know (its unknown token)

    @property
    def unknown_share(self) -> float:
        """unknown_tokens / input_tokens (0 when there are no tokens)."""
        return self.unknown_tokens / self.input_tokens if self.input_tokens else 0.0


def unknown_tokens_warning(usage: Usage, share: float = UNKNOWN_TOKENS_WARN_SHARE) -> str | None:
    """The warning the client and the CLI give when `usage.unknown_share >= share`, else None."""
    if usage.unknown_tokens == 0 or usage.unknown_share < share:
        return None
    return (f"{usage.unknown_tokens} of {usage.input_tokens} input tokens ({usage.unknown_share:.0%}) are unknown "
            f"to the model's tokenizer: that much of the text is outside the model's vocabulary, so its answers "
            f"are not meaningful, however confident they look")


@dataclass(frozen=True)
class ScoreResponse:
    answers: dict[str, Answer]
    usage: Usage
    model_ms: float | None = None  # wall time of the state and row passes for this request, when measured
    model: str | None = None  # the model that answered
