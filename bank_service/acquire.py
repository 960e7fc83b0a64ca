"""Acquire without gRPC: directory look-up, batched state passes, eviction, registration.

    acquire(tokens)  --hit-->  directory.lookup_and_pin  ->  handle (cached)
          | miss
          v
    pending[doc_key]: a job per distinct document; concurrent Acquires of one document join it
          |
    worker thread: takes what is queued at once (it waits for each pass, so it is free only when
    its device is idle: documents that arrive during a pass share the next one, and a document
    that finds the bank idle waits for no window; on CUDA a pass that fits a
    graph bucket takes no document that would make it fit none), up to the pass's token cap: the
    document that crosses it gives what fits (whole delta-rule chunks) and the rest waits at the
    queue's front, as does a document longer than a chunk after each chunk; allocates a slot per new
    document at its first piece (evicting LRU unpinned entries when full; with every entry pinned the document goes
    back to the queue's front and is retried every SPACE_RETRY_S until full_wait after its arrival,
    as the requests holding the pins finish), runs ONE state pass for the batch (an idle sweep
    instead when the pass holds one new document alone, nothing is queued behind it and its caller
    brought its question rows: the document and the rows in one sweep, the rows' answers returned
    with the handle, `_sweeper`), waits for the GPU to finish it (a scorer reads the states from its own process),
    answers the swept caller (no pin: it reads nothing from the bank), then
    registers each finished entry READY with a pin per waiter (register(..., pin_lease_s)).
    Idle after a pass, it keeps the room of one more entry (`_keep_room`); idle, it captures one
    queued CUDA graph at a time (kev/exec/passes.py; CUDA only).
    An Acquire that brings rows looks the directory up only for a document the bank holds
    (`live`): its scorer missed the directory just now, or took the document for new unasked.

One thread mutates the bank and the directory's view of it (allocation, eviction, registration,
recovery after a Redis restart), so no two of those interleave. `live` (doc_key -> handle) is
the bank's truth about what it holds; a directory hit is only returned when it agrees with it.
A new entry is put in `live` before it is registered, so a concurrent hit always finds it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kev.bank.bank import Bank, BankFull, BankHandle
from kev.bank.directory import Directory, DirectoryConflict, DirectoryEntry, DirectoryUnavailable, Lease, Registration
from kev.bank.doc_key import document_key, key_fingerprint
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.request.answers import option_probabilities

from kev.serving.errors import DeadlineExceeded, Exhausted, Internal, ServiceError, Unavailable

from bank_service.jobs import Acquired, Job, LiveEntry, Piece, SweepLimits, SweepRows, Waiter
from bank_service.metrics import BankMetrics

log = logging.getLogger(__name__)

# How often documents waiting for space retry while every entry is pinned: pins are released in
# Redis by the scorers, so the bank is not told; a retry is one eviction script call.
SPACE_RETRY_S = 0.01


class Acquirer:
    def __init__(self, passes: Passes, bank: Bank, directory: Directory, metrics: BankMetrics, *,
                 sweeps: SweepLimits | None = None, lease_s: float, max_wait_s: float, max_pass_tokens: int, max_pass_documents: int,
                 epoch_check_s: float, full_wait_s: float = 0.0):
        self.passes, self.bank, self.directory, self.metrics = passes, bank, directory, metrics
        self.sweeps = sweeps  # None: callers' rows are ignored (`_sweeper`)
        self.model_id = directory.model_id
        self.lease_s = lease_s
        # The cap of a wait for companions while a state pass is in flight (--max-wait-ms). This
        # worker waits for each pass before it takes the next batch, so it is never busy when it
        # takes one and never waits (continuous batching, issue 26; docs/decisions.md, "Bank").
        self.max_wait_s = max_wait_s
        self.full_wait_s = full_wait_s
        self.max_pass_tokens = max_pass_tokens
        self.max_pass_documents = max_pass_documents
        self.epoch_check_s = epoch_check_s
        self.hits = self.misses = self.evictions = 0
        self._live: dict[str, LiveEntry] = {}
        self._lock = threading.Lock()  # _live and the counters
        self._cv = threading.Condition()  # _queue, _pending, _stopping, _reconcile_due
        self._queue: deque[Job] = deque()
        self._pending: dict[str, Job] = {}
        self._stopping = False
        self._reconcile_due = False
        self._space_retry_at = 0.0  # monotonic: documents waiting for space are not retried before
        self._epoch: str | None = None
        self._epoch_checked = -float("inf")  # monotonic: the last check that found our epoch
        self._thread = threading.Thread(target=self._run, name="state-pass-worker", daemon=True)

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Empties this bank's directory namespace (its memory is new) and starts the worker."""
        self._epoch = self.directory.reset()
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
        with self._cv:
            jobs, self._queue = list(self._queue), deque()
        for job in jobs:
            self._fail(job, Unavailable("the bank is shutting down"))

    # -- callers' side ------------------------------------------------------------------------

    def acquire(self, tokens: Sequence[int], lease_s: float, timeout_s: float | None,
                is_active: Callable[[], bool] = lambda: True, rows: SweepRows | None = None) -> Acquired:
        """The document's pinned handle; with `rows`, their answers too (`Acquired.probabilities`)
        when the document is new and its pass runs it alone (`_sweeper`)."""
        start = time.perf_counter()
        doc_key = document_key(self.model_id, tokens)
        # A caller that brings rows takes the document for new: it missed the directory just now, or
        # skipped it (an idle scorer that has not seen the document lately). The directory is asked
        # only for a document the bank holds; one registered meanwhile is found live by the worker
        # and pinned there (`_process`), at the cost of a hop to the worker, not of a pass.
        with self._lock:
            look_up = rows is None or doc_key in self._live
        try:
            lease = self.directory.lookup_and_pin(doc_key, lease_s) if look_up else None
        except DirectoryUnavailable as e:
            raise Unavailable(str(e)) from e
        if lease is not None:
            handle = BankHandle(lease.slot, lease.generation)
            with self._lock:
                live = self._live.get(doc_key)
                agrees = live is not None and live.handle == handle
                if agrees:
                    self.hits += 1
            if agrees:
                self._observe(start, cached=True)
                return Acquired(doc_key, handle, lease.length, True, lease)
            # Never hand out a handle the bank does not hold at that generation.
            log.error("directory entry %s -> %s disagrees with the bank (%s); reconciling", doc_key, handle, live)
            self._release_quietly(lease.lease_id)
            self.request_reconcile()
        waiter = Waiter(lease_s, rows if rows is not None and self.sweeps is not None and self.sweeps.admit(rows)
                        else None)
        self._submit(doc_key, list(tokens), waiter)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not waiter.done.wait(0.05):
            if not is_active() or (deadline is not None and time.monotonic() > deadline):
                if (late := waiter.abandon()) is not None and late.lease is not None:
                    self._release_quietly(late.lease.lease_id)
                raise DeadlineExceeded("gave up waiting for the state pass")
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        with self._lock:
            if waiter.result.cached:
                self.hits += 1
            else:
                self.misses += 1
        self._observe(start, cached=waiter.result.cached)
        return waiter.result

    def release(self, lease_id: str) -> bool:
        try:
            return self.directory.release(lease_id)
        except DirectoryUnavailable as e:
            raise Unavailable(str(e)) from e

    def request_reconcile(self) -> None:
        with self._cv:
            self._reconcile_due = True
            self._cv.notify_all()

    def live_count(self) -> int:
        with self._lock:
            return len(self._live)

    def _observe(self, start: float, cached: bool) -> None:
        self.metrics.acquire_seconds.labels(cached=str(cached).lower()).observe(time.perf_counter() - start)

    def _submit(self, doc_key: str, tokens: list[int], waiter: Waiter) -> None:
        with self._cv:
            if self._stopping:
                raise Unavailable("the bank is shutting down")
            job = self._pending.get(doc_key)
            if job is None:  # the first Acquire of this document since its last pass
                job = self._pending[doc_key] = Job(doc_key, tokens, time.monotonic())
                self._queue.append(job)
                self.metrics.queue_depth.set(len(self._queue))
                self._cv.notify_all()
            job.waiters.append(waiter)

    def _release_quietly(self, lease_id: str) -> None:
        try:
            self.directory.release(lease_id)
        except DirectoryUnavailable:
            pass  # the lease expires on its own

    # -- the worker ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (pause := self._space_retry_at - time.monotonic()) > 0:
                    self._cv.wait(pause)  # the queue's front waits for space (_hold_for_space)
                # documents that came during the last pass: the bank is loaded, more come during the next
                loaded = bool(self._queue)
                if not (self._queue or self._stopping or self._reconcile_due or self.passes.idle_work):
                    self._cv.wait(self.epoch_check_s)
                if self._stopping:
                    return
                batch = self._take_batch(loaded) if self._queue else []
                reconcile, self._reconcile_due = self._reconcile_due, False
            try:
                self._process(batch, reconcile)
                if not batch:  # idle: nothing waits behind a capture
                    self.passes.capture_when_idle()
                else:
                    self._keep_room()
            except Exception as e:  # noqa: BLE001 - the worker must survive; its jobs learn why
                log.exception("state-pass worker failed")
                for piece in batch:
                    self._fail(piece.job, Internal(f"bank worker error: {e}"))

    def _take_batch(self, loaded: bool = False) -> list[Piece]:
        """Called with _cv held: the next pass's pieces, taken at once (no pass is in flight when the
        worker comes here, so waiting for companions would only add latency), up to the pass caps
        (always at least one). A document that does not fit whole gives the pass what fits of it
        (`Passes.piece_tokens`) and the rest goes in the next pass, so a bank with more queued than
        a pass holds runs full passes, padded to no graph key; so does a document longer than a chunk,
        one chunk a pass, beside others. When more work follows (documents still queued, or
        `loaded`: some arrived during the last pass, so more will during this one) a pass that would
        pad up to its key is cut back to the key below instead when that pads less
        (`Passes.pieces_to_take`). Every job taken leaves the queue; one not finished by its piece
        goes back to its front after the pass (`_requeue`)."""
        pieces: list[Piece] = []
        tokens = 0
        while self._queue and len(pieces) < self.max_pass_documents:
            job = self._queue[0]
            n = self.passes.piece_tokens(len(job.tokens) - job.done, self.max_pass_tokens - tokens)
            if n == 0 and pieces:
                break  # the pass is full
            n = n or min(len(job.tokens) - job.done, self.passes.state_chunk_tokens)  # a pass takes one at least
            lens = [p.end - p.start for p in pieces]
            if pieces and self.passes.state_keyed(lens) and not self.passes.state_keyed(lens + [n]):
                break  # it would push a graphed pass off the CUDA graphs (docs/decisions.md)
            self._queue.popleft()
            pieces.append(Piece(job, job.done, job.done + n))
            tokens += n
        if len(pieces) > 1 and (self._queue or loaded):
            # more work follows this pass: fit it to the graph key below when that pads less (the
            # last piece kept cut short at whole chunks); what is cut goes first in the next pass.
            # A document is cut off whole at most once: behind a long one (a chunk a pass, always
            # first) a short one would otherwise be cut off pass after pass.
            lens = self.passes.pieces_to_take([p.end - p.start for p in pieces])
            k = len(lens)
            if not any(p.job.held_back for p in pieces[k:]):
                for p in pieces[k:]:
                    p.job.held_back = True
                self._queue.extendleft(reversed([p.job for p in pieces[k:]]))
                last = pieces[k - 1]
                pieces = pieces[: k - 1] + [Piece(last.job, last.start, last.start + lens[-1])]
        self.metrics.queue_depth.set(len(self._queue))
        return pieces

    def _process(self, batch: list[Piece], reconcile: bool) -> None:
        directory_start = time.perf_counter()
        try:
            self._ensure_epoch()
            if reconcile:
                self._reconcile()
        except DirectoryUnavailable as e:
            if batch:
                log.warning("directory unavailable: %s", e)
            for piece in batch:
                self._fail(piece.job, Unavailable(str(e)))
            return
        run: list[Piece] = []
        full: list[Job] = []
        for i, piece in enumerate(batch):
            job = piece.job
            if job.handle is None:  # its first piece
                with self._lock:
                    live = self._live.get(job.doc_key)
                if live is not None:  # state-passed since this Acquire's look-up: pin it
                    self._finish([(job, live, False)])
                    continue
                try:
                    handle = self._alloc(len(job.tokens), wanted=len(batch) - i)
                    try:
                        self.bank.bind(handle, key_fingerprint(job.doc_key))  # before anyone hears of the slot
                    except BaseException:
                        self.bank.free(handle)  # the slot is nobody's yet: never leak it
                        raise
                    job.handle = handle
                except BankFull:
                    full.append(job)
                    continue
                except DirectoryUnavailable as e:
                    self._fail(job, Unavailable(str(e)))
                    continue
            run.append(piece)
        self._hold_for_space(full)
        if not run:
            return
        start, cpu_start = time.perf_counter(), time.thread_time()
        self.metrics.state_pass_steps.labels(step="directory").inc(start - directory_start)
        sweeper = self._sweeper(run)
        try:
            if sweeper is not None:
                probs = self._sweep(run[0], sweeper.rows)
            else:
                self.passes.state_pass([p.tokens for p in run], [p.job.handle for p in run], [p.start for p in run])
            launched, cpu = time.perf_counter(), time.thread_time() - cpu_start
            self._evict_ahead(self._next_documents())  # Redis while the GPU runs the pass
            evicted = time.perf_counter()
            self.passes.synchronize()  # the states are on the GPU before any scorer hears of them
            if sweeper is not None:
                self._answer_sweeper(run[0].job, sweeper, probs.tolist())
        except Exception as e:
            log.exception("state pass failed")
            for piece in run:
                self._fail(piece.job, Internal(f"state pass failed: {e}"))  # gives its slot back
            return
        m, end = self.metrics, time.perf_counter()
        m.state_pass_seconds.observe(end - start - (evicted - launched))
        m.state_pass_steps.labels(step="launch").inc(launched - start)
        m.state_pass_steps.labels(step="directory").inc(evicted - launched)
        m.state_pass_steps.labels(step="device_wait").inc(end - evicted)
        m.state_pass_cpu_seconds.inc(cpu)
        m.state_passes.inc()
        m.state_pass_documents.inc(len(run))
        m.state_pass_tokens.inc(sum(p.end - p.start for p in run))
        for piece in run:
            piece.job.done = piece.end
        self._requeue([p.job for p in run if not p.last])
        self._finish([(p.job, LiveEntry(p.job.handle, len(p.job.tokens)), True) for p in run if p.last])
        m.state_pass_steps.labels(step="directory").inc(time.perf_counter() - end)

    def _sweeper(self, run: list[Piece]) -> Waiter | None:
        """The waiter whose rows this pass answers too: only a pass of one new document, read whole
        in one sweep, with nothing else queued (an idle bank: under load the rows would slow the
        pass that others wait for), and the first of its callers that brought rows."""
        if self.sweeps is None or len(run) != 1:
            return None
        piece = run[0]
        if piece.start != 0 or not piece.last or not self.passes.fits_one_sweep([piece.tokens]):
            return None
        with self._cv:
            if self._queue:
                return None
            return next((w for w in piece.job.waiters if w.rows is not None and not w.abandoned), None)

    def _answer_sweeper(self, job: Job, waiter: Waiter, probabilities: list[float]) -> None:
        """The swept caller's answers, before the entry's registration: it reads nothing from the
        bank and holds no pin, so it need not wait for Redis (a round trip of its request's time).
        It leaves the job's waiters; the entry is registered by `_finish` as for any pass."""
        with self._cv:
            job.waiters.remove(waiter)
        waiter.resolve(Acquired(job.doc_key, job.handle, len(job.tokens), False, None, probabilities))
        self.metrics.sweeps.inc()
        self.metrics.sweep_rows.inc(len(waiter.rows.ids))

    def _sweep(self, piece: Piece, rows: SweepRows):
        """The document's state pass and `rows` (continuing it) in one sweep, then the head: [O]
        option probabilities on the device, rows in order."""
        handle, n = piece.job.handle, len(rows.ids)
        batch = RowBatch.build(rows.ids, [handle] * n, [len(piece.job.tokens)] * n, rows.picks,
                               device=self.passes.device)
        hidden = self.passes.sweep([piece.tokens], [handle], batch)
        return option_probabilities(self.sweeps.head, hidden, [len(p) - 1 for p in rows.picks])

    def _next_documents(self) -> list[int]:
        """The lengths of the new documents the next pass would take, roughly: those queued now
        without a slot, in order, up to the pass caps."""
        lens: list[int] = []
        tokens = 0
        with self._cv:
            for job in self._queue:
                if len(lens) >= self.max_pass_documents or tokens >= self.max_pass_tokens:
                    break
                if job.handle is None:
                    lens.append(len(job.tokens))
                    tokens += lens[-1]
        return lens

    def _evict_ahead(self, doc_lens: list[int]) -> None:
        """Evicts least-recently-used unpinned entries until documents of `doc_lens` tokens fit,
        off the path of the documents that need the room: while the GPU runs a pass, for those
        queued for the next (a full bank, any long-running one, would otherwise ask Redis between
        its passes, the GPU idle meanwhile); after a pass that left the bank idle, for one more of
        the entries' mean size (`_keep_room`, the only room kept for documents not yet come: each
        entry evicted for them is one a repeat could have hit). Best effort: a Redis fault, or
        nothing evictable, leaves it to `_alloc`."""
        for _ in range(4):  # the entries evicted may hold fewer pages than their mean
            count = self.bank.entries_to_free(doc_lens)
            if not count:
                return
            try:
                if not self._evict(count):
                    return
            except Exception as e:  # noqa: BLE001 - best effort beside a running pass, never its failure
                log.warning("eviction ahead of the next pass failed: %s", e)
                return

    def _keep_room(self) -> None:
        """After a pass that left nothing queued, room for one more document of the held entries'
        mean size (least recently used unpinned entries evicted). A full bank, as any long-running
        one is, would otherwise make the next new document that finds it idle wait for an eviction
        round trip to Redis before its pass; this spends it now, off that document's path, for one
        entry of the bank's. Under load `_evict_ahead` does it for the documents already queued."""
        with self._cv:
            if self._queue:
                return
        self._evict_ahead([self.bank.mean_entry_tokens()])

    def _requeue(self, jobs: list[Job]) -> None:
        """Documents part-way through go back to the queue's front, in order, for their next piece;
        one whose callers have all gone gives its slot back instead (nobody would read it)."""
        if not jobs:
            return
        self.metrics.split_documents.inc(len(jobs))
        with self._cv:  # the check and the drop under one lock: no caller joins in between
            keep = [job for job in jobs if not all(w.abandoned for w in job.waiters)]
            self._queue.extendleft(reversed(keep))
            self.metrics.queue_depth.set(len(self._queue))
        for job in jobs:
            if job not in keep:
                self._fail(job, DeadlineExceeded("every caller gave up"))

    def _hold_for_space(self, jobs: list[Job]) -> None:
        """Documents that found every entry pinned go back to the queue's front, in order, to be
        retried in SPACE_RETRY_S: the pins belong to requests whose rows are running, and each
        holds one document, so space comes as they finish. A document refused for `full_wait_s`
        since its arrival gets RESOURCE_EXHAUSTED; one whose callers have all given up is dropped."""
        now = time.monotonic()
        keep = []
        with self._cv:  # the checks and the drop under one lock: no caller joins in between
            for job in jobs:
                if all(w.abandoned for w in job.waiters):
                    self._fail(job, DeadlineExceeded("every caller gave up"))
                elif now - job.enqueued >= self.full_wait_s:
                    self._fail(job, Exhausted(f"bank full, every entry pinned for {self.full_wait_s:g} s"))
                else:
                    keep.append(job)
            if keep:
                self._queue.extendleft(reversed(keep))
                self._space_retry_at = now + SPACE_RETRY_S
                self.metrics.queue_depth.set(len(self._queue))
        for job in keep:
            if not job.waited_for_space:
                job.waited_for_space = True
                self.metrics.space_waits.inc()

    def _alloc(self, tokens: int, wanted: int = 1) -> BankHandle:
        """A slot and pages, evicting least-recently-used unpinned entries while the bank is full.
        The first eviction takes `wanted` entries at least (the documents of this pass still to
        place: a full bank needs a slot for each, so one Redis call for the pass, not one per
        document), and as many as this document's pages need at the entries' mean size
        (`Bank.entries_to_free`: a long document at a bank of short entries, one call, not one
        per entry); again while the entries evicted held fewer pages than that."""
        while True:
            try:
                return self.bank.alloc(tokens)
            except BankFull:
                if not self._evict(max(1, wanted, self.bank.entries_to_free([tokens]))):
                    raise
                wanted = 1

    def _evict(self, count: int) -> bool:
        """Evicts up to `count` least-recently-used unpinned entries and frees their slots; False:
        none could go (every entry pinned)."""
        victims = self.directory.evict_if_unpinned(count)
        for victim in victims:
            self._drop(victim)
        return bool(victims)

    def _drop(self, victim: DirectoryEntry) -> None:
        handle = BankHandle(victim.slot, victim.generation)
        with self._lock:
            live = self._live.get(victim.doc_key)
            if live is None or live.handle != handle:
                log.warning("evicted directory entry %s -> %s is not live in the bank", victim.doc_key, handle)
                return
            del self._live[victim.doc_key]
            self.evictions += 1
        self.bank.free(handle)
        self.metrics.evictions.inc()

    def _finish(self, done: list[tuple[Job, LiveEntry, bool]]) -> None:
        """Register each entry (new ones) and pin it once per waiter, late joiners included: every
        registration of the pass in one Redis round trip (`Directory.register_many`)."""
        plan = []
        with self._cv:
            for job, entry, new in done:
                waiters, job.waiters = job.waiters, []
                job.handle = None  # the slot is the entry's now, not a part-read job's
                self._pending.pop(job.doc_key, None)
                plan.append((job, entry, new, [w for w in waiters if not w.abandoned]))
        with self._lock:
            for job, entry, new, _ in plan:
                if new:
                    self._live[job.doc_key] = entry
        regs = []
        for job, entry, new, active in plan:
            h = entry.handle
            if new and not active:  # registered unpinned: the next Acquire finds it
                regs.append(Registration(job.doc_key, h.slot, h.generation, entry.length))
            regs.extend(Registration(job.doc_key, h.slot, h.generation, entry.length, w.lease_s) for w in active)
        try:
            results: list = self.directory.register_many(regs)
            unreachable = None
        except DirectoryUnavailable as e:
            results, unreachable = [e] * len(regs), e
        k = 0
        for job, entry, new, active in plan:
            n = len(active) or int(new)
            self._settle(job, entry, new, active, results[k : k + n], unsure=unreachable is not None)
            k += n

    def _settle(self, job: Job, entry: LiveEntry, new: bool, active: list[Waiter], results: list,
                unsure: bool) -> None:
        """One document's registrations: each waiter gets its pin, or, from the first failed
        registration on, the error (a pin taken after it is given back). A new entry nobody could
        register gives its slot back; `unsure` (Redis went away mid-call, some may have run): the
        slot goes back too and the directory is reconciled."""
        h = entry.handle
        failure = next((r for r in results if isinstance(r, Exception)), None)
        registered = not new or (not unsure and any(not isinstance(r, Exception) for r in results))
        if failure is not None:
            if isinstance(failure, DirectoryConflict):
                log.error("registering %s at %s: %s", job.doc_key, h, failure)
            if isinstance(failure, DirectoryConflict) or (unsure and new):
                self.request_reconcile()
            if not registered:  # nobody can reach the state (every waiter fails below): the slot goes
                with self._lock:  # back before any caller hears of the failure
                    self._live.pop(job.doc_key, None)
                self.bank.free(h)
        failed = False
        for waiter, r in zip(active, results[: len(active)], strict=True):  # (none: the one unpinned)
            failed = failed or isinstance(r, Exception)
            if failed:
                if isinstance(r, Lease):
                    self._release_quietly(r.lease_id)
                waiter.fail(Unavailable(f"directory: {failure}"))
            elif not waiter.resolve(Acquired(job.doc_key, h, entry.length, not new, r)) \
                    and r is not None:
                self._release_quietly(r.lease_id)

    def _fail(self, job: Job, error: ServiceError) -> None:
        with self._cv:
            waiters = job.waiters
            job.waiters = []
            self._pending.pop(job.doc_key, None)
        if job.handle is not None:  # read part-way (or the pass failed): nobody has heard of the slot
            self.bank.free(job.handle)
            job.handle = None
        for waiter in waiters:
            waiter.fail(error)

    # -- directory recovery -------------------------------------------------------------------

    def _ensure_epoch(self) -> None:
        """If Redis lost this bank's namespace (restart, flush), start it afresh and re-register
        every live entry, unpinned (issue 27: protective pins of a whole lease kept a full bank
        from taking new documents for ~30 s). Requests that were reading lost their pins with
        Redis; an entry evicted under one is caught by the scorer's handle checks, before its row
        pass and again after it (scorer_service/batcher.py), and retried: never a wrong answer."""
        now = time.monotonic()
        if self._epoch is not None and now < self._epoch_checked + self.epoch_check_s:
            return  # checked lately: a busy worker asks Redis once per epoch_check_s, not once a pass
        current = self.directory.epoch()
        if current is not None and current == self._epoch:
            self._epoch_checked = now
            return
        log.warning("directory epoch changed (%s -> %s): re-registering %d entries", self._epoch, current,
                    self.live_count())
        self._epoch = None  # a failure part-way leaves a mismatch, so the next check starts over
        epoch = self.directory.reset()
        with self._lock:
            live = list(self._live.items())
        for doc_key, entry in live:
            self.directory.register(doc_key, entry.handle.slot, entry.handle.generation, entry.length)
        self._epoch = epoch
        self.metrics.directory_resets.inc()

    def _reconcile(self) -> None:
        """Make the directory agree with the bank: drop entries at handles the bank does not hold
        (unless pinned: those go once their leases end), register live entries it lacks."""
        entries = self.directory.entries()
        with self._lock:
            live = dict(self._live)
        seen = set()
        for e in entries:
            ours = live.get(e.doc_key)
            if ours is not None and ours.handle == BankHandle(e.slot, e.generation):
                seen.add(e.doc_key)
                continue
            try:
                self.directory.unregister(e.doc_key, e.slot, e.generation)
            except DirectoryConflict:
                log.warning("stale directory entry %s is pinned; it goes when its leases end", e.doc_key)
        for doc_key, entry in live.items():
            if doc_key not in seen:
                try:
                    self.directory.register(doc_key, entry.handle.slot, entry.handle.generation, entry.length)
                except DirectoryConflict as err:
                    log.error("cannot register %s: %s", doc_key, err)
