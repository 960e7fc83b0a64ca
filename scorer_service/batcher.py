"""The cross-request row batcher: question rows of many requests into shared row passes.

Decisions only, no tensors of its own: `submit` queues a request's rows; ONE worker thread builds
each pass and hands it to the engine's shared pieces: `row_batch_for` -> `launch_rows` (the
attachment's row pass, kev/exec/passes.py, with the decision head in its CUDA graph when it has one).

When a pass starts (continuous batching, issue 26). With no pass of this scorer on the device
(none launched and not yet finished there), whatever rows wait go at once: a request that finds
the scorer idle waits for no window. While a pass runs on the device the worker waits to fill the
next one, since the GPU is busy anyway: it launches it as soon as it holds `max_rows_per_pass` rows
or `max_tokens_per_pass` row tokens (a single row is always taken), as soon as the device is done,
or once the oldest waiting row has waited `max_wait_ms`, whichever comes first. A small thread
(`kev-row-device`) waits on each launched pass's CUDA event and wakes the worker when it is done,
so nothing polls. On CPU a pass is done when its launch returns: rows that arrive during a pass go
together in the next one.

Fairness (issue 27). Rows are queued per request, and a pass takes them round robin: one row of
each waiting request in turn (starting after the request served last), so every request gets an
equal share of every pass and a small request is in the next pass however big the others are; a
big request is slower, never the others' failure. Admission counts each request's rows only up to
one pass (`max_rows_per_pass`): the queue (`max_queue`) is full only when that many shares wait,
which one request can never cause; a request that does not fit gets `Exhausted` (an empty queue
takes any request). The question count per request is capped before this, by the server
(KEV_MAX_QUESTIONS).
When the queue is empty and a CUDA graph waits to be captured, the worker captures one, then looks
at the queue again: a capture never delays a row that was already waiting.

Two passes in flight. A pass is launched (its rows packed, its graph replayed, its head queued and
copied to the host) without waiting for the device; the worker reads a pass's answers only when it
has no pass to launch (see above), so the GPU runs pass N+1 while the host turns pass N into
answers and packs N+2. At most two passes are launched and not yet read. On CPU everything runs in
the launch and nothing overlaps.

A request's rows may be split over several passes (each pass sees a partial `PreparedRequest`
holding its rows); rows never depend on what else shares their pass (batch-invariant kernels), so
the answers are the in-process engine's. Rows of a cancelled or failed request are dropped when
they come up. Before a pass every handle is checked against the mapped bank (`check`: generation
and document fingerprint), and rows whose handle belongs to a replaced attachment are failed with
`StaleAttachment` (retried by the server): a pass never reads a state that is not its document's.
After the pass, once its answers are read, the handles are checked again: an entry evicted during
the pass (possible only after Redis lost the pins) fails its request with `StaleAttachment` instead
of answering from pages that may have changed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kev.request.answers import PendingAnswers, launch_rows

from kev.request.rows import row_batch_for
from kev.request.head import DecisionHead
from kev.request.prompts import PreparedRequest
from kev.serving.errors import Exhausted, ServiceError
from scorer_service.bank_link import BankLink, DocLease, StaleAttachment
from scorer_service.metrics import ScorerMetrics

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 2  # row passes launched and not yet read


@dataclass(eq=False)
class Job:
    """One request's rows in flight; `done` is set once every row is answered or the job failed."""

    prepared: PreparedRequest
    lease: DocLease
    answers: dict = field(default_factory=dict)
    model_ms: float = 0.0  # wall time of the row passes that held this job's rows
    error: BaseException | None = None
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled = True
        self.done.set()


@dataclass(eq=False)
class _Launched:
    """A pass on its way: its jobs' row indices and the answers still to be read."""

    jobs: dict[Job, list[int]]
    pending: PendingAnswers
    start: float  # perf_counter at launch
    tokens: int


@dataclass(eq=False)
class _Row:
    job: Job
    index: int  # into job.prepared.rows
    tokens: int
    passed_over: bool = False  # cut from a pass once (`_cut_back`): never again


@dataclass(eq=False)
class _Waiting:
    """One request's rows still waiting for a pass (in request order)."""

    since: float  # monotonic: when the request was queued
    rows: deque[_Row]


class RowBatcher:
    def __init__(self, link: BankLink, head: DecisionHead, metrics: ScorerMetrics, *, max_rows_per_pass: int,
                 max_tokens_per_pass: int, max_wait_ms: float, max_queue: int, cut_back: bool = True):
        self.link, self.head, self.metrics = link, head, metrics
        self.cut_back = cut_back  # KEV_ROW_CUT_BACK (`_cut_back`)
        self.max_rows, self.max_tokens = max_rows_per_pass, max_tokens_per_pass
        self.max_wait_s, self.max_queue = max_wait_ms / 1000, max_queue
        self._queue: deque[_Waiting] = deque()  # requests with rows waiting, round-robin order
        self._rows = 0  # rows waiting in all
        self._open = 0  # passes taken from the queue and not yet answered (launching, on the device or read)
        self._cond = threading.Condition()
        self._stopping = False
        # Launched passes whose device work is not known to be done (CUDA only; under _cond): while
        # one is, the worker waits to fill the next pass. The watcher drops each once its event fired.
        self._running: set[_Launched] = set()
        self._device_waits: queue.SimpleQueue[_Launched | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run, name="kev-row-worker", daemon=True)
        self._watcher = threading.Thread(target=self._watch_device, name="kev-row-device", daemon=True)
        self._worker.start()
        self._watcher.start()

    @property
    def depth(self) -> int:
        return self._rows

    @property
    def idle(self) -> bool:
        """No row waiting and no pass open: a request's rows would have the next pass to themselves
        (the server then sends them with a new document's Acquire: an idle bank sweeps them)."""
        return self._rows == 0 and self._open == 0

    def _share(self, rows: int) -> int:
        """How many of a request's waiting rows count against `max_queue`: at most one pass's."""
        return min(rows, self.max_rows)

    def submit(self, prepared: PreparedRequest, lease: DocLease) -> Job:
        job = Job(prepared, lease)
        rows = deque(_Row(job, i, len(r.prompt.ids)) for i, r in enumerate(prepared.rows))
        now = time.monotonic()
        with self._cond:
            if self._stopping:
                raise ServiceError("the scorer is shutting down")
            self._drop_done()
            counted = sum(self._share(len(w.rows)) for w in self._queue)
            if self._queue and counted + self._share(len(rows)) > self.max_queue:
                raise Exhausted(f"row queue full ({counted} of {self.max_queue} rows waiting, counting each "
                                f"request's rows up to one pass; this request adds {self._share(len(rows))}); "
                                "retry later")
            self._queue.append(_Waiting(now, rows))
            self._rows += len(rows)
            self.metrics.queue_depth.set(self._rows)
            self._cond.notify()
        return job

    def _drop_done(self) -> None:
        """Called with _cond held: forgets the rows of cancelled or failed requests."""
        if any(w.rows[0].job.done.is_set() for w in self._queue):
            for w in [w for w in self._queue if w.rows[0].job.done.is_set()]:
                self._queue.remove(w)
                self._rows -= len(w.rows)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Finishes what is queued, then stops the worker."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._worker.join(timeout_s)
        self._device_waits.put(None)
        self._watcher.join(timeout_s)

    # ------------------------------------------------------------------------------ worker

    def _take(self, inflight: deque[_Launched]) -> list[_Row] | None:
        """What the worker does next: the rows of a pass to launch now; [] to read the oldest
        launched pass's answers (with `inflight`) or to capture one CUDA graph (without); None:
        stopped and drained.

        Rows go at once while no pass is on the device; while one is, only a full pass, or rows
        whose oldest has waited `max_wait_ms`, go ahead of it (a second pass in flight), and the
        worker waits for more rows, the window or the device (the watcher's notify), whichever
        comes first. The oldest pass's answers are read when nothing is to be launched now."""
        with self._cond:
            while True:
                self._drop_done()
                timeout = None
                if self._queue and len(inflight) < MAX_IN_FLIGHT:
                    picks = self._round_robin()
                    full = len(picks) < self._rows or len(picks) >= self.max_rows \
                        or sum(r.tokens for _, r in picks) >= self.max_tokens
                    timeout = min(w.since for w in self._queue) + self.max_wait_s - time.monotonic()
                    if not self._running or full or timeout <= 0 or self._stopping:
                        if len(picks) < self._rows:  # rows wait beyond this pass: fit it to its graph key
                            picks = picks[: self._rows_to_take(picks)]
                        elif self.cut_back and self._running:  # loaded: the next pass follows this one
                            picks = self._cut_back(picks)
                        return self._pop(picks)
                if inflight:
                    if len(inflight) >= MAX_IN_FLIGHT or inflight[0] not in self._running or self._stopping:
                        return []  # read the oldest pass's answers (waiting for the device if need be)
                elif self._stopping:
                    return None  # nothing queued (rows would have gone above), nothing in flight
                elif self._idle_work():
                    return []  # nothing queued: time for one capture
                busy, waited = bool(self._running), time.perf_counter()
                self._cond.wait(timeout)
                if busy:  # blocked while the GPU runs a pass: the worker's device_wait phase
                    self.metrics.row_pass_phase("device_wait", time.perf_counter() - waited)

    def _round_robin(self) -> list[tuple[_Waiting, _Row]]:
        """Called with _cond held: the next pass's rows, one of each waiting request in turn (round
        robin from the queue's front) until the pass is full; at least one row."""
        picks: list[tuple[_Waiting, _Row]] = []
        tokens, depth = 0, 0
        while True:
            added = False
            for w in self._queue:
                if depth >= len(w.rows):
                    continue
                r = w.rows[depth]
                if picks and (len(picks) + 1 > self.max_rows or tokens + r.tokens > self.max_tokens):
                    return picks
                picks.append((w, r))
                tokens += r.tokens
                added = True
            if not added:
                return picks
            depth += 1

    def _rows_to_take(self, picks: list[tuple[_Waiting, _Row]]) -> int:
        """How many of a full pass's rows to take when more wait: the trailing ones (the deepest of
        their requests, so each request's rows taken stay a prefix) go first in the next pass
        rather than spill this one just past a CUDA-graph key's tokens (kev/exec/graphs.py)."""
        att = self.link.current
        return len(picks) if att is None else att.passes.rows_to_take([r.tokens for _, r in picks])

    def _cut_back(self, picks: list[tuple[_Waiting, _Row]]) -> list[tuple[_Waiting, _Row]]:
        """Called with _cond held, every queued row picked and a pass on the device: the rows to
        take when the trailing ones can join the next pass, which will follow this one, rather than
        pad this one up to its key. A row is passed over once at most: a request's deepest rows go
        first, and its served ones send it to the queue's back, so it could be cut pass after pass."""
        n = self._rows_to_take(picks)
        if n == len(picks) or any(r.passed_over for _, r in picks[n:]):
            return picks
        for _, r in picks[n:]:
            r.passed_over = True
        self.metrics.rows_passed_over.inc(len(picks) - n)
        return picks[:n]

    def _pop(self, picks: list[tuple[_Waiting, _Row]]) -> list[_Row]:
        """Called with _cond held: removes `picks` from their requests; the requests served move to
        the queue's back in order, so the next pass starts with those that got nothing or least."""
        served: list[_Waiting] = []
        for w, _ in picks:
            w.rows.popleft()
            if not served or served[-1] is not w and w not in served:
                served.append(w)
        self._rows -= len(picks)
        self._open += 1  # closed by `_run` once the pass is answered (or failed to launch)
        for w in served:
            self._queue.remove(w)
            if w.rows:
                self._queue.append(w)
        self.metrics.queue_depth.set(self._rows)
        return [r for _, r in picks]

    def _idle_work(self) -> bool:
        att = self.link.current
        return att is not None and att.passes.idle_work

    def _capture_when_idle(self) -> None:
        att = self.link.current
        try:
            if att is not None:
                att.passes.capture_when_idle(limit=1)
        except Exception:  # noqa: BLE001 - a failed capture leaves its bucket eager; serving goes on
            log.exception("idle CUDA-graph capture failed")

    def _run(self) -> None:
        inflight: deque[_Launched] = deque()  # launched, answers not read yet; oldest first
        while True:
            rows = self._take(inflight)
            if rows is None:
                break
            if rows:
                launched = self._launch(rows)
                if launched is not None:
                    inflight.append(launched)
                else:
                    self._close_pass()
            elif inflight:
                try:
                    self._finish(inflight.popleft())
                finally:
                    self._close_pass()
            else:
                self._capture_when_idle()
            # Hold nothing of a pass while waiting for the next: its leases reference their bank's
            # mappings, which must go when that bank does (BankLink._watch_owner).
            rows = launched = None

    def _close_pass(self) -> None:
        with self._cond:
            self._open -= 1

    def _watch_device(self) -> None:
        """The `kev-row-device` thread: waits for each launched pass's device work (in launch
        order) and wakes the worker, which may then launch the rows it held back."""
        while (launched := self._device_waits.get()) is not None:
            try:
                launched.pending.wait()
            except Exception:  # noqa: BLE001 - the worker's own wait raises it again and fails the pass
                pass
            with self._cond:
                self._running.discard(launched)
                self._cond.notify()
            launched = None  # as in `_run`: keep no finished pass while waiting

    def _launch(self, rows: list[_Row]) -> _Launched | None:
        """Checks the rows' handles, packs them and queues their pass and head (no device wait)."""
        start, cpu_start = time.perf_counter(), time.thread_time()
        live = [r for r in rows if not r.job.done.is_set()]
        jobs: dict[Job, list[int]] = {}
        for r in live:
            jobs.setdefault(r.job, []).append(r.index)
        try:
            current = self.link.current
            for job in list(jobs):
                err = None
                if job.lease.attachment is not current:
                    err = StaleAttachment("the bank was re-attached since this document's handle was taken")
                else:
                    try:
                        current.bank.check(job.lease.handle, job.lease.fingerprint)
                    except Exception as e:  # noqa: BLE001 - StaleHandle or the mapping's own error
                        err = StaleAttachment(f"bank entry no longer live: {e}")
                if err is not None:
                    self._fail(job, err)
                    del jobs[job]
            if not jobs:
                return None
            checked = time.perf_counter()
            partial = [dataclasses.replace(job.prepared, rows=tuple(job.prepared.rows[i] for i in idx))
                       for job, idx in jobs.items()]
            batch = row_batch_for(partial, [job.lease.handle for job in jobs], current.passes.device)
            packed = time.perf_counter()
            pending = launch_rows(current.passes, self.head, partial, batch)
            passed = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - every job of the pass gets the error
            self._fail_pass(jobs, e)
            return None
        end = time.perf_counter()
        self.metrics.row_pass_phase("launch", end - start)
        self.metrics.row_launch({"check": checked - start, "pack": packed - checked, "pass": passed - packed,
                                 "head": end - passed}, time.thread_time() - cpu_start)
        launched = _Launched(jobs, pending, start, batch.num_tokens)
        if pending.ready is not None:  # on the device until its event: the watcher says when
            with self._cond:
                self._running.add(launched)
            self._device_waits.put(launched)
        return launched

    def _finish(self, launched: _Launched) -> None:
        """Waits for the pass's answers and hands them to its jobs."""
        jobs = launched.jobs
        try:
            waited = time.perf_counter()
            try:
                launched.pending.wait()
            finally:
                with self._cond:
                    self._running.discard(launched)
            answered = time.perf_counter()
            answers = launched.pending.result()
        except BaseException as e:  # noqa: BLE001 - every job of the pass gets the error
            self._fail_pass(jobs, e)
            return
        # Validate after reading (seqlock style): a slot freed during the pass had its generation
        # bumped before its pages changed, so a handle still live now was read intact. Such an
        # eviction can only follow a Redis data loss (pins gone); the request retries.
        current = self.link.current
        for job in list(jobs):
            try:
                if job.lease.attachment is not current:
                    raise StaleAttachment("the bank was re-attached during the row pass")
                current.bank.check(job.lease.handle, job.lease.fingerprint)
            except Exception as e:  # noqa: BLE001 - StaleHandle / WrongDocument / StaleAttachment
                self._fail(job, e if isinstance(e, StaleAttachment) else
                           StaleAttachment(f"bank entry changed during the row pass: {e}"))
        end = time.perf_counter()
        self.metrics.row_pass_phase("device_wait", answered - waited)
        self.metrics.row_pass_phase("answers", end - answered)
        seconds = end - launched.start
        self.metrics.row_pass(sum(len(i) for i in jobs.values()), launched.tokens, seconds)
        for job, got in zip(jobs, answers, strict=True):
            if job.done.is_set():
                continue  # failed (its handle went during the pass) or cancelled: no answers from it
            job.answers.update(got)
            job.model_ms += seconds * 1000
            if len(job.answers) == len(job.prepared.rows):
                job.done.set()

    def _fail_pass(self, jobs: dict[Job, list[int]], e: BaseException) -> None:
        log.error("row pass failed", exc_info=e)
        for job in jobs:
            self._fail(job, e if isinstance(e, ServiceError) else ServiceError(f"row pass failed: {e}"))

    @staticmethod
    def _fail(job: Job, err: BaseException) -> None:
        if not job.done.is_set():
            job.error = err
            job.done.set()
