"""A process's start-up plan for its passes: its role, the CUDA-graph buckets it captures before it
serves, how many graphs it keeps and which autotune classes it warms; and the parsers of the
services' settings that name them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kev.exec.static_pass import PICKS_PER_ROW
from kev.ops.shapes import ShapeClass

DEFAULT_ROW_BUCKETS = ",".join([f"{r}x{n}" for n in (32, 64) for r in (1, 2, 4, 8, 16, 32, 64, 96)])  # 16 graphs
# 13 graphs: 1..64 short documents of up to 48 tokens (six-short's; powers of two, the rest are captured
# when idle), 1..6 documents of 2,208 (five-long's 2,200; 6 x 2,208 is the largest bucket under 16,384
# tokens: 7 is no document count), two between.
DEFAULT_DOC_BUCKETS = ",".join([*(f"{d}x48" for d in (1, 2, 4, 8, 16, 32, 64)), "1x256", "1x1024",
                                *(f"{d}x2208" for d in (1, 2, 4, 6))])


class PassRole(enum.Enum):
    """Which passes a process runs: decides the classes it warms and the buckets it captures."""

    ROWS = "rows"  # a scorer: row passes over a bank another process owns
    STATES = "states"  # the bank: state passes
    BOTH = "both"  # the in-process engine

    @property
    def rows(self) -> bool:
        return self is not PassRole.STATES

    @property
    def states(self) -> bool:
        return self is not PassRole.ROWS


def _parse_buckets(text: str, what: str, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """'8x32,16x64x128' -> ((8, 32), (16, 64, 128)); 'none' -> (). Each item has one of `sizes` parts."""
    text = text.strip()
    if text.lower() == "none":
        return ()
    out = []
    for item in text.split(","):
        try:
            parts = tuple(int(p) for p in item.strip().lower().split("x"))
        except ValueError:
            parts = ()
        if len(parts) not in sizes or min(parts) < 1:
            raise ValueError(f"{what}: {item.strip()!r} is not {' or '.join(_FORMS[n] for n in sizes)} "
                             f"of positive integers (or write 'none')")
        out.append(parts)
    return tuple(out)


_FORMS = {2: "NxL", 3: "NxLxP"}


def parse_row_buckets(text: str) -> tuple[tuple[int, int, int], ...]:
    """Start-up row buckets, 'RxL' (rows x tokens each; picks PICKS_PER_ROW x R) or 'RxLxP'."""
    return tuple((p[0], p[1], p[2] if len(p) == 3 else PICKS_PER_ROW * p[0])
                 for p in _parse_buckets(text, "row buckets", (2, 3)))


def parse_doc_buckets(text: str) -> tuple[tuple[int, int], ...]:
    """Start-up state buckets, 'DxL' (documents x tokens each)."""
    return tuple((p[0], p[1]) for p in _parse_buckets(text, "document buckets", (2,)))


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
    """What a process captures at start-up and how many graphs it keeps (CUDA only)."""

    rows: tuple[tuple[int, int, int], ...] = parse_row_buckets(DEFAULT_ROW_BUCKETS)  # (rows, tokens, picks)
    docs: tuple[tuple[int, int], ...] = parse_doc_buckets(DEFAULT_DOC_BUCKETS)  # (documents, tokens each)
    max_graphs: int = 32  # graphs kept, least recently used dropped; 0: no CUDA graphs
    max_rows_per_pass: int | None = None  # row buckets no pass of this size can use are skipped
    # autotune classes warmed at start-up; None: the role's (`PassBuilder.warm_classes`); a class
    # not warmed autotunes at its first pass, on that pass's shape alone
    warm: tuple[ShapeClass, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {self.max_graphs}")
        if self.warm is not None and not all(isinstance(c, ShapeClass) for c in self.warm):
            raise ValueError(f"warm must hold ShapeClass members, got {self.warm!r}")
