"""The passes a serving process runs, built in one place for the bank, a scorer and the engine.

On CPU, or with the torch reference ops, a process runs a plain `Runner`, exactly as before.
On CUDA with the indexed `TritonOps` it runs the speed machinery of issue 5:
- one `ClassTuner` per process (shape-class autotune caches, Triton's disk cache off);
- `kev.exec.warm_up.warm_up` of every class its passes can use (or the plan's `warm` classes), with
  the real model, dtypes and pools, once per process and before any CUDA-graph capture;
- `GraphedPasses` under the WHEN_IDLE policy: the start-up buckets (`GraphPlan`) captured before
  the process serves; a bucket used twice without a graph is queued and captured by the process's
  pass thread when its queue is empty (`ServedPasses.capture_when_idle`); at most `max_graphs` kept.

A scorer re-attaches when its bank restarts. `PassBuilder.build` then makes a new Runner and new
graphs for the new memory (a graph holds the old pools' addresses) but keeps the tuner and its
warm caches; the start-up buckets are queued, not captured, because the thread that re-attaches
serves a request and must not capture while the row worker may be running a pass.

    builder = PassBuilder(model, ops, PassRole.ROWS, GraphPlan(...))   # once per process
    passes = builder.build(bank)                    # start-up: warm, capture the start-up buckets
    passes = builder.build(new_bank, capture=False) # re-attach: queue them instead
    passes.row_pass(batch); passes.state_pass(docs, handles)
    if queue_empty and passes.idle_work: passes.capture_when_idle()
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kev.bank.bank import BankHandle
from kev.model.qwen35 import Qwen35Model
from kev.ops import Ops
from kev.ops.shapes import ShapeClass
from kev.ops.autotune import ClassTuner, serving_tuner
from kev.exec.warm_up import warm_up
from kev.exec.runner import RowBatch, Runner
from kev.exec.static_pass import PICKS_PER_ROW

if TYPE_CHECKING:
    from kev.exec.graphs import Buckets, GraphedPasses, GraphStats
    from kev.exec.static_pass import GraphKey

log = logging.getLogger(__name__)

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


class ServedPasses:
    """`Runner`'s two passes against one bank, through CUDA graphs where the process has them."""

    def __init__(self, runner: Runner, graphed: GraphedPasses | None = None):
        self.runner, self.graphed = runner, graphed
        self.device = runner.device

    def row_pass(self, batch: RowBatch) -> torch.Tensor:
        """[P, d] final hidden states at `batch.picks` (see `Runner.row_pass`)."""
        if self.graphed is not None:
            return self.graphed.row_pass(batch)
        return self.runner.row_pass(batch)

    def state_pass(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle]) -> None:
        """Each document's final states into its slot (see `Runner.state_pass`)."""
        if self.graphed is not None:
            return self.graphed.state_pass(documents, handles)
        return self.runner.state_pass(documents, handles)

    def state_and_row_pass(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle],
                           batch: RowBatch) -> torch.Tensor:
        """New documents and rows (that may read them) in one sweep over the weights (see
        `Runner.state_and_row_pass`); [P, d] hidden states at `batch.picks`."""
        if self.graphed is not None:
            return self.graphed.state_and_row_pass(documents, handles, batch)
        return self.runner.state_and_row_pass(documents, handles, batch)

    def synchronize(self) -> None:
        """Returns once every pass launched so far is done on the device. Graph replays and kernels
        return before the GPU has run them; the bank calls this before it tells anyone a new state is
        there, because a scorer reads it from another process, on its own stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def state_bucketed(self, num_docs: int, max_len: int) -> bool | None:
        """Whether a state pass of `num_docs` new documents, the longest `max_len` tokens, runs in a
        CUDA-graph bucket (padded static shapes, a graph once captured); None: no graphs here."""
        if self.graphed is None:
            return None
        return self.graphed.state_bucket(num_docs, max_len) is not None

    @property
    def idle_work(self) -> bool:
        """Whether a graph waits to be captured (`capture_when_idle`)."""
        return self.graphed is not None and bool(self.graphed.pending)

    def capture_when_idle(self, limit: int = 1) -> int:
        """Captures up to `limit` queued graphs; returns how many were tried. Call it only from the
        thread that runs this process's passes, and only when its queue is empty: a capture takes
        about two passes' time."""
        return self.graphed.capture_pending(limit) if self.graphed is not None else 0


class PassBuilder:
    """Makes a process's `ServedPasses` for each bank it runs against. One per process: it owns
    the process's `ClassTuner` (CUDA), warms every class once, and keeps one `GraphStats` for the
    process's graphs over re-attaches."""

    def __init__(self, model: Qwen35Model, ops: Ops, role: PassRole, plan: GraphPlan = GraphPlan(),
                 state_chunk_tokens: int = 8192):
        self.model, self.ops, self.role, self.plan = model, ops, role, plan
        self.state_chunk_tokens = state_chunk_tokens
        self.tuner: ClassTuner | None = None  # made by the first CUDA build
        self.graph_stats: GraphStats | None = None  # likewise
        self.warmed: list[ShapeClass] = []
        self._warm_done = False  # `warmed` may stay empty (a plan that warms nothing)
        self._lock = threading.Lock()  # a re-attach may race another

    @property
    def warm_classes(self) -> list[ShapeClass]:
        """The plan's `warm` when set (ShapeClass order, once each). Else by role: a scorer's passes
        are row-like (the row buckets stop at 128 tokens a row); the bank's and the engine's state
        passes reach every class."""
        if self.plan.warm is not None:
            return [c for c in ShapeClass if c in self.plan.warm]
        return [c for c in ShapeClass if c.rows] if self.role is PassRole.ROWS else list(ShapeClass)

    def build(self, bank, *, capture: bool = True) -> ServedPasses:
        """Passes against `bank` (a `Bank` or an attached view). On CUDA with TritonOps: warm the
        classes (first build only), then capture the start-up buckets now (`capture`) or queue them
        for `capture_when_idle`."""
        if bank.block_table.device.type != "cuda" or not _indexed(self.ops):
            if bank.block_table.device.type == "cuda":
                log.info("%s ops on CUDA: no class tuning and no CUDA graphs", self.ops.name)
            return ServedPasses(Runner(self.model, bank, self.ops, self.state_chunk_tokens))
        from kev.exec.graphs import CapturePolicy, GraphedPasses, GraphStats

        with self._lock:
            if self.tuner is None:
                self.tuner, self.graph_stats = serving_tuner(), GraphStats()
            runner = Runner(self.model, bank, self.ops, self.state_chunk_tokens, tuner=self.tuner)
            if not self._warm_done:
                start = time.perf_counter()
                self.warmed, self._warm_done = warm_up(runner, self.warm_classes), True
                log.info("autotune classes %s warmed in %.1f s", [c.value for c in self.warmed],
                         time.perf_counter() - start)
            if self.plan.max_graphs == 0:
                return ServedPasses(runner)
            graphed = GraphedPasses(runner, policy=CapturePolicy.WHEN_IDLE, max_graphs=self.plan.max_graphs,
                                    stats=self.graph_stats)
            keys = self.start_keys(graphed.buckets)
            if capture:
                start = time.perf_counter()
                graphed.capture(keys)
                log.info("captured %d CUDA graphs in %.1f s: %s", len(keys), time.perf_counter() - start,
                         [str(k) for k in keys])
            else:
                graphed.queue(keys)
                log.info("queued %d CUDA graphs for capture when idle", len(keys))
            return ServedPasses(runner, graphed)

    def start_keys(self, buckets: Buckets) -> list[GraphKey]:
        """The plan's buckets for this role, as graph keys (each at most once, in plan order)."""
        plan, keys = self.plan, []
        widest = None if plan.max_rows_per_pass is None else buckets.row_key(plan.max_rows_per_pass, 1, 1)
        if self.role.rows:
            for R, L, P in plan.rows:
                key = buckets.row_key(R, L, P)
                if key is None:
                    raise ValueError(f"row bucket {R}x{L}x{P} is beyond the graph buckets {buckets}")
                if widest is None or key.seqs <= widest.seqs:
                    keys.append(key)
        if self.role.states:
            for D, L in plan.docs:
                key = buckets.state_key(D, L)
                if key is None or L > self.state_chunk_tokens:
                    raise ValueError(f"document bucket {D}x{L} is beyond the graph buckets {buckets}")
                keys.append(key)
        keys = list(dict.fromkeys(keys))
        if len(keys) > plan.max_graphs:
            raise ValueError(f"{len(keys)} start-up graphs but at most {plan.max_graphs} are kept")
        return keys


def _indexed(ops: Ops) -> bool:
    """Whether `ops` are the bank-indexed Triton ops that class tuning and CUDA graphs need."""
    from kev.ops.triton_ops import TritonOps

    return isinstance(ops, TritonOps)
