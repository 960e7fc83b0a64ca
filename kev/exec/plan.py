"""A process's start-up plan for its passes: its role, the per-pass caps its CUDA-graph keys
cover (every key up to them is captured at start-up: `kev.exec.graphs.KeyLadder`), and which
autotune classes it warms; and the parser of the setting that names those classes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kev.ops.shapes import ShapeClass


class PassRole(enum.Enum):
    """Which passes a process runs: decides the classes it warms and the keys it captures."""

    ROWS = "rows"  # a scorer: row passes over a bank another process owns
    STATES = "states"  # the bank: state passes
    BOTH = "both"  # the in-process engine

    @property
    def rows(self) -> bool:
        return self is not PassRole.STATES

    @property
    def states(self) -> bool:
        return self is not PassRole.ROWS


def parse_warm_classes(text: str) -> tuple[ShapeClass, ...] | None:
    """The autotune classes warmed at start-up: 'all' or '' -> None (the role's own classes);
    'none' -> () (nothing warmed: every class autotunes at its first pass); otherwise ShapeClass
    values separated by commas ('rows_few,rows_mid'), returned in ShapeClass order, once each."""
    text = text.strip().lower()
    if text in ("", "all"):
        return None
    if text == "none":
        return ()
    known = {c.value: c for c in ShapeClass}
    names = [n.strip() for n in text.split(",")]
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"unknown autotune class(es) {unknown}; known: {', '.join(known)} (or 'all', 'none')")
    return tuple(c for c in ShapeClass if c.value in names)


@dataclass(frozen=True)
class GraphPlan:
    """What a process captures at start-up (CUDA only): every key of its role's ladders, whose caps
    are the services' own pass caps (a scorer's rows and row tokens per pass, the bank's documents
    and document tokens per state pass), so no pass the services build runs outside a graph."""

    cuda_graphs: bool = True
    row_tokens: int = 8192  # tokens of a row pass at most (the scorer's KEV_MAX_TOKENS_PER_PASS)
    row_seqs: int = 96  # rows of a row pass at most (KEV_MAX_ROWS_PER_PASS)
    state_tokens: int = 16384  # tokens of a state pass at most (the bank's max_pass_tokens)
    state_seqs: int = 64  # documents of a state pass at most (max_pass_documents)
    # the bank's idle sweeps: one document, read whole in one chunk, and its rows (the memory plan's
    # largest eager sweep); the in-process engine's sweeps take any state pass and any row pass
    sweep_one_document: bool = False
    # autotune classes warmed at start-up; None: the classes of the role's keys; a class not
    # warmed autotunes at its first pass, on that pass's shape alone
    warm: tuple[ShapeClass, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("row_tokens", "row_seqs", "state_tokens", "state_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warm is not None and not all(isinstance(c, ShapeClass) for c in self.warm):
            raise ValueError(f"warm must hold ShapeClass members, got {self.warm!r}")
