"""What Acquire calls wait on: outcomes, failures (kev.serving.errors, each with its gRPC status),
and the pending-job records the state-pass worker resolves (kept apart from the worker so its flow
reads on its own)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kev.bank.bank import BankHandle
from kev.bank.directory import Lease
from kev.request.head import DecisionHead
from kev.serving.errors import ServiceError


@dataclass(frozen=True)
class Acquired:
    doc_key: str
    handle: BankHandle
    length: int
    cached: bool  # the state was in the bank already: no state pass ran for this call
    lease: Lease | None  # None: a swept caller's, who reads nothing from the bank, so holds no pin
    probabilities: list[float] | None = None  # the caller's rows answered in the document's sweep


@dataclass(frozen=True)
class SweepRows:
    """An Acquire's question rows (AcquireRequest.rows): each row's token ids and its picks
    ([decide, option ends...])."""

    ids: list[list[int]]
    picks: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.ids)


@dataclass(frozen=True, eq=False)
class SweepLimits:
    """The bank's idle sweeps: the most rows and row tokens one takes, and the head that answers them."""

    rows: int
    row_tokens: int
    head: DecisionHead

    def admit(self, rows: SweepRows) -> bool:
        return len(rows.ids) <= self.rows and rows.tokens <= self.row_tokens


@dataclass(frozen=True)
class LiveEntry:
    handle: BankHandle
    length: int


class Waiter:
    """One Acquire call waiting for its document's state pass."""

    def __init__(self, lease_s: float, rows: SweepRows | None = None):
        self.lease_s = lease_s
        self.rows = rows  # to answer in the document's sweep if the bank is idle (else ignored)
        self.done = threading.Event()
        self.result: Acquired | None = None
        self.error: ServiceError | None = None
        self._abandoned = False
        self._lock = threading.Lock()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def resolve(self, result: Acquired) -> bool:
        """False when the caller has gone: the lease is then the resolver's to release."""
        with self._lock:
            if self._abandoned:
                return False
            self.result = result
        self.done.set()
        return True

    def fail(self, error: ServiceError) -> None:
        with self._lock:
            self.error = error
        self.done.set()

    def abandon(self) -> Acquired | None:
        """The caller gives up; returns a result that arrived meanwhile (its lease to release)."""
        with self._lock:
            self._abandoned = True
            return self.result


@dataclass(eq=False)
class Job:
    doc_key: str
    tokens: list[int]
    enqueued: float
    waiters: list[Waiter] = field(default_factory=list)
    waited_for_space: bool = False  # found every entry pinned at least once (counted once)
    # A document read over several passes: its slot from its first piece on, and how many of its
    # tokens are in it (nobody hears of the slot until the last piece is in).
    handle: BankHandle | None = None
    done: int = 0
    held_back: bool = False  # a pass once cut it off to fit its key: it is not cut off again


@dataclass(frozen=True)
class Piece:
    """What one state pass reads of a job's document: tokens [start, end)."""

    job: Job
    start: int
    end: int

    @property
    def tokens(self) -> list[int]:
        return self.job.tokens[self.start : self.end]

    @property
    def last(self) -> bool:
        return self.end == len(self.job.tokens)
