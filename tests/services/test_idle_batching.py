"""Continuous batching in both services (issue 26, idle-path latency): a request that finds the
scorer or the bank idle waits for no batch window; while a pass is in flight the next one fills,
for at most the window (scorer_service/batcher.py, bank_service/acquire.py).

Real components in process, on CPU: the tiny checkpoint, a shared bank mapped as a scorer maps it,
the real row batcher and the real Acquirer over a real redis-server. The windows are set far above
what any assertion waits (`WINDOW_S`), so a request answered quickly did not wait for one. A pass is
held "in flight" by standing in for the device only: the scorer's pass gets an event that the test
completes (on the GPU its CUDA event), the bank's state pass blocks until the test lets it finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import scorer_service.batcher as batcher_module
from bank_service.acquire import Acquirer
from bank_service.jobs import SweepLimits, SweepRows
from bank_service.metrics import BankMetrics
from kev.bank.bank import Bank, BankHandle
from kev.bank.directory import Directory
from kev.bank.doc_key import document_key, key_fingerprint
from kev.bank.shared import SharedBank, attach
from kev.engine import Engine
from kev.exec.passes import PassBuilder
from kev.exec.plan import GraphPlan, PassRole
from kev.loading import LoadedModel
from kev.ops import get_ops
from kev.request import api
from kev.request.answers import option_probabilities
from kev.exec.batch import RowBatch
from kev.request.prompts import validate_and_build
from kev.request.rows import row_picks
from kev.serving.errors import DeadlineExceeded
from scorer_service.bank_link import Attachment, DocLease
from scorer_service.batcher import RowBatcher
from scorer_service.metrics import ScorerMetrics
from tiny_stack import WORDS

WINDOW_S = 2.0  # max_wait of every batcher here: far above what an answer may take
QUICK_S = 1.0  # "well under the window"
PLAIN = [w for w in WORDS if w.isalpha()]


def request(i: int, questions: int = 1) -> api.ScoreRequest:
    doc = " ".join(PLAIN[(i * 7 + k) % len(PLAIN)] for k in range(12 + i))
    return api.ScoreRequest(doc, {f"q{j}": api.Question.noul(f"is it {PLAIN[(i + j) % len(PLAIN)]}")
                                  for j in range(questions)})


def wait_until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return LoadedModel.load(checkpoint)


# ---- the scorer's row batcher ------------------------------------------------------------------


class Scorer:
    """A shared bank (owned here, mapped as a scorer maps it), its documents' states, and row
    batchers over the mapping; every row pass is recorded as the request numbers it held."""

    def __init__(self, loaded: LoadedModel, shm_dir):
        self.loaded = loaded
        ops = get_ops("torch")
        self.shared = SharedBank.create(loaded.model.cfg, 4 << 20, instance=f"idle-{os.getpid()}",
                                        avg_doc_tokens=64, max_doc_tokens=512, shm_dir=shm_dir)
        self.states = PassBuilder(loaded.model, ops, PassRole.STATES, GraphPlan()).build(self.shared.bank)
        mapped = attach(self.shared.attach_response(loaded.model_id, "node"))
        passes = PassBuilder(loaded.model, ops, PassRole.ROWS, GraphPlan()).build(mapped)
        self.attachment = Attachment("idle", "node", None, mapped, passes, directory=None)
        self.link = SimpleNamespace(current=self.attachment)  # what the batcher reads of a BankLink
        self.leases: dict[int, DocLease] = {}
        self.prepared = {}
        self.passes: list[list[int]] = []  # per row pass: the request number of each row
        self.batchers: list[RowBatcher] = []
        real_row_pass = passes.row_pass
        slot_of = {}

        def recorded(batch):
            self.passes.append([slot_of[s] for s in batch.slots.tolist()])
            return real_row_pass(batch)

        passes.row_pass = recorded
        for i in range(8):
            prepared = validate_and_build(request(i, questions=3), loaded.builder)
            ids = prepared.document_ids
            fingerprint = key_fingerprint(document_key(loaded.model_id, ids))
            handle = self.shared.bank.alloc(len(ids))
            self.shared.bank.bind(handle, fingerprint)
            self.states.state_pass([ids], [handle])
            slot_of[handle.slot] = i
            self.prepared[i] = prepared
            self.leases[i] = DocLease(handle, f"lease-{i}", len(ids), False, self.attachment, 0.0, fingerprint)

    def batcher(self, max_rows: int = 96, max_wait_s: float = WINDOW_S) -> RowBatcher:
        b = RowBatcher(self.link, self.loaded.head, ScorerMetrics(), max_rows_per_pass=max_rows,
                       max_tokens_per_pass=8192, max_wait_ms=max_wait_s * 1000, max_queue=4096)
        self.batchers.append(b)
        return b

    def submit(self, b: RowBatcher, i: int, rows: int | None = None):
        """Request i (its first `rows` questions)."""
        prepared = self.prepared[i]
        if rows is not None:
            prepared = dataclasses.replace(prepared, rows=prepared.rows[:rows])
        return b.submit(prepared, self.leases[i])

    def stop_batchers(self) -> None:
        for b in self.batchers:
            b.stop(5)
        self.batchers.clear()
        self.passes.clear()

    def close(self) -> None:
        self.stop_batchers()
        self.attachment.bank.close()
        self.shared.close()


@pytest.fixture(scope="module")
def mapped(loaded, tmp_path_factory):
    s = Scorer(loaded, tmp_path_factory.mktemp("shm"))
    yield s
    s.close()


@pytest.fixture
def scorer(mapped):
    """The mapped bank with fresh batchers (stopped after the test) and an empty pass record."""
    mapped.passes.clear()
    yield mapped
    mapped.stop_batchers()


class HeldDevice:
    """Stands in for a row pass's CUDA event: the pass is on the device until `finish()`."""

    def __init__(self):
        self.finished = threading.Event()

    def synchronize(self) -> None:
        assert self.finished.wait(30), "a held pass was never finished"

    def finish(self) -> None:
        self.finished.set()


@pytest.fixture
def device(monkeypatch):
    """Every row pass launched from here on is 'on the device' until the test finishes it (in order)."""
    held: list[HeldDevice] = []
    real = batcher_module.launch_rows

    def launch_rows(passes, head, prepared, batch):
        pending = real(passes, head, prepared, batch)
        pending.ready = HeldDevice()
        held.append(pending.ready)
        return pending

    monkeypatch.setattr(batcher_module, "launch_rows", launch_rows)
    yield held
    for h in held:
        h.finish()


def test_a_lone_request_on_an_idle_scorer_waits_for_no_window(loaded, scorer):
    b = scorer.batcher()
    start = time.monotonic()
    job = scorer.submit(b, 0)
    assert job.done.wait(10) and job.error is None
    assert time.monotonic() - start < QUICK_S, "the lone request waited for the batch window"
    assert scorer.passes == [[0, 0, 0]]
    # the answers are the in-process engine's, bit for bit
    engine = Engine(loaded, Bank.from_budget(loaded.model.cfg, 4 << 20, avg_doc_tokens=64, max_doc_tokens=512))
    assert job.answers == engine.score(request(0, questions=3)).answers


def test_rows_that_arrive_during_a_pass_share_the_next_one(scorer, monkeypatch):
    """On CPU a pass is done when its launch returns: rows that came meanwhile go together next, at once."""
    b = scorer.batcher()
    passes = scorer.attachment.passes
    real, gate, inside = passes.row_pass, threading.Event(), threading.Event()

    def held(batch):
        if not inside.is_set():
            inside.set()
            assert gate.wait(10)
        return real(batch)

    monkeypatch.setattr(passes, "row_pass", held)
    first = scorer.submit(b, 0, rows=1)
    assert inside.wait(5)  # the first pass is running
    others = [scorer.submit(b, i, rows=1) for i in (1, 2, 3)]
    released = time.monotonic()
    gate.set()
    assert all(j.done.wait(10) and j.error is None for j in [first, *others])
    assert time.monotonic() - released < QUICK_S
    assert scorer.passes == [[0], [1, 2, 3]]


def test_while_a_pass_is_on_the_device_the_next_one_fills(scorer, device):
    """The device busy: rows wait for companions (not for the window) and go as soon as it is done."""
    b = scorer.batcher(max_rows=4)
    first = scorer.submit(b, 0, rows=1)
    wait_until(lambda: len(device) == 1, "the first pass's launch")
    others = [scorer.submit(b, i, rows=1) for i in (1, 2)]  # 2 rows: not a full pass
    time.sleep(0.2)
    assert scorer.passes == [[0]], "a part-full pass went while the device was busy, before the window"
    released = time.monotonic()
    device[0].finish()
    assert first.done.wait(5)
    wait_until(lambda: len(device) == 2, "the second pass's launch", timeout=QUICK_S)
    assert time.monotonic() - released < QUICK_S, "the waiting rows did not go when the device was done"
    assert scorer.passes == [[0], [1, 2]]
    device[1].finish()
    assert all(j.done.wait(5) and j.error is None for j in others)


def test_a_full_pass_goes_ahead_while_one_is_on_the_device(scorer, device):
    """Two passes in flight: a full pass is launched behind the running one at once; a third waits."""
    b = scorer.batcher(max_rows=2)
    first = scorer.submit(b, 0, rows=1)
    wait_until(lambda: len(device) == 1, "the first pass's launch")
    full = scorer.submit(b, 1, rows=2)  # a whole pass
    wait_until(lambda: len(device) == 2, "the full pass's launch behind the running one", timeout=QUICK_S)
    third = scorer.submit(b, 2, rows=2)  # full too, but two passes are in flight
    time.sleep(0.2)
    assert len(device) == 2 and scorer.passes == [[0], [1, 1]]
    device[0].finish()
    wait_until(lambda: len(device) == 3, "the third pass once the first was read")
    for h in device:
        h.finish()
    assert all(j.done.wait(5) and j.error is None for j in (first, full, third))
    assert scorer.passes == [[0], [1, 1], [2, 2]]


def test_the_window_caps_the_wait_while_the_device_is_busy(scorer, device):
    b = scorer.batcher(max_wait_s=0.15)
    first = scorer.submit(b, 0, rows=1)
    wait_until(lambda: len(device) == 1, "the first pass's launch")
    queued = time.monotonic()
    second = scorer.submit(b, 1, rows=1)
    wait_until(lambda: len(device) == 2, "the window's end", timeout=QUICK_S)
    assert time.monotonic() - queued >= 0.14, "launched before its window while the device was busy"
    assert not device[0].finished.is_set()  # still on the device: the window, not the device, ended the wait
    for h in device:
        h.finish()
    assert first.done.wait(5) and second.done.wait(5) and second.error is None
    assert scorer.passes == [[0], [1]]


# ---- the bank's state passes -------------------------------------------------------------------


class HeldStatePasses:
    """The bank's real state passes, recorded (the lengths and starts of the documents' pieces per
    pass); while `hold` is set a pass stays in flight until `release()`."""

    def __init__(self, passes):
        self.real, self.passes, self.starts = passes.state_pass, [], []
        self.hold, self.inside, self.gate = False, threading.Event(), threading.Event()
        passes.state_pass = self

    def __call__(self, documents, handles, starts=None):
        self.passes.append([len(d) for d in documents])
        self.starts.append(list(starts) if starts is not None else [0] * len(documents))
        if self.hold:
            self.inside.set()
            assert self.gate.wait(10)
        return self.real(documents, handles, starts)

    def release(self) -> None:
        self.hold = False
        self.gate.set()


@contextlib.contextmanager
def running_bank(loaded, redis_server, namespace: str, max_pass_tokens: int, slots: int | None = None,
                 sweeps: SweepLimits | None = None, blocks: int | None = None):
    """An Acquirer over torch state passes (`HeldStatePasses`), started, stopped on the way out;
    `slots` (and `blocks`, of 64 tokens: twice the slots by default) for a small bank."""
    store = (Bank.from_budget(loaded.model.cfg, 4 << 20, avg_doc_tokens=64, max_doc_tokens=512) if slots is None
             else Bank.allocate(loaded.model.cfg, num_slots=slots, num_blocks=blocks or slots * 2, block_size=64,
                                max_doc_tokens=512 if blocks else 128))
    passes = PassBuilder(loaded.model, get_ops("torch"), PassRole.STATES, GraphPlan()).build(store)
    held = HeldStatePasses(passes)
    directory = Directory(redis_server.client(), loaded.model_id, namespace)
    acq = Acquirer(passes, store, directory, BankMetrics(store.stats), sweeps=sweeps, lease_s=30, max_wait_s=WINDOW_S,
                   max_pass_tokens=max_pass_tokens, max_pass_documents=64, epoch_check_s=1)
    acq.start()
    try:
        yield SimpleNamespace(acq=acq, held=held, directory=directory, store=store, passes=passes)
    finally:
        held.release()
        acq.stop()


@pytest.fixture
def bank(loaded, redis_server):
    with running_bank(loaded, redis_server, "idle", 16384) as started:
        yield started


@pytest.fixture
def small_bank(loaded, redis_server):
    """A bank whose state passes hold 128 document tokens at most."""
    with running_bank(loaded, redis_server, "small", 128) as started:
        yield started


def tokens(i: int, n: int = 20) -> list[int]:
    return [(i * 31 + k) % 200 + 1 for k in range(n)]


def in_threads(fn, args):
    results = [None] * len(args)

    def run(k):
        try:
            results[k] = fn(*args[k])
        except Exception as e:  # noqa: BLE001 - returned for the assertion
            results[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(args))]
    for t in threads:
        t.start()
    return threads, results


def test_a_new_document_on_an_idle_bank_waits_for_no_window(bank):
    start = time.monotonic()
    got = bank.acq.acquire(tokens(0), 30, 10)
    assert time.monotonic() - start < QUICK_S, "the lone document waited for the batch window"
    assert not got.cached and bank.held.passes == [[20]]
    assert bank.acq.acquire(tokens(0), 30, 10).cached


def test_documents_that_arrive_during_a_state_pass_share_the_next_one(bank):
    bank.held.hold = True
    threads, results = in_threads(bank.acq.acquire, [(tokens(0, 10), 30, 10)])
    assert bank.held.inside.wait(5)  # the first document's pass is in flight
    more, more_results = in_threads(bank.acq.acquire, [(tokens(i, 10 + i), 30, 10) for i in (1, 2, 3, 4)])
    wait_until(lambda: len(bank.acq._queue) == 4, "the four documents queued behind the pass")
    released = time.monotonic()
    bank.held.release()
    for t in threads + more:
        t.join(10)
    assert time.monotonic() - released < QUICK_S
    assert all(not isinstance(r, Exception) and not r.cached for r in results + more_results), results + more_results
    assert [sorted(p) for p in bank.held.passes] == [[10], [11, 12, 13, 14]]


def test_an_abandoned_acquire_keeps_no_pin(bank):
    """The caller gives up while its document's state pass runs: the entry is registered unpinned."""
    bank.held.hold = True
    ids = tokens(7)
    threads, results = in_threads(bank.acq.acquire, [(ids, 30, 0.05)])
    assert bank.held.inside.wait(5)
    threads[0].join(5)
    assert isinstance(results[0], DeadlineExceeded), results
    bank.held.release()
    key = document_key(bank.acq.model_id, ids)
    wait_until(lambda: [e for e in bank.directory.entries() if e.doc_key == key], "the entry's registration")
    (entry,) = [e for e in bank.directory.entries() if e.doc_key == key]
    assert entry.pins == 0
    again = bank.acq.acquire(ids, 30, 10)
    assert again.cached


# ---- idle sweeps: a new document and its caller's rows in one pass ---------------------------


def sweep_rows(loaded, i: int, questions: int = 3) -> tuple[list[int], SweepRows, list]:
    """(document ids, its rows as an Acquire brings them, the prepared request) of `request(i)`."""
    prepared = validate_and_build(request(i, questions), loaded.builder)
    return (list(prepared.document_ids),
            SweepRows([list(r.prompt.ids) for r in prepared.rows], [row_picks(r) for r in prepared.rows]), prepared)


def two_pass_probabilities(loaded, ids, rows: SweepRows) -> list[float]:
    """The reference: the document's state pass, then its rows' pass, then the head (no sweep)."""
    store = Bank.from_budget(loaded.model.cfg, 1 << 20, avg_doc_tokens=64, max_doc_tokens=512)
    passes = PassBuilder(loaded.model, get_ops("torch"), PassRole.STATES, GraphPlan()).build(store)
    h = store.alloc(len(ids))
    passes.state_pass([ids], [h])
    n = len(rows.ids)
    hidden = passes.row_pass(RowBatch.build(rows.ids, [h] * n, [len(ids)] * n, rows.picks))
    return option_probabilities(loaded.head, hidden, [len(p) - 1 for p in rows.picks]).tolist()


@pytest.fixture
def sweeping_bank(loaded, redis_server):
    with running_bank(loaded, redis_server, "sweep", 16384, sweeps=SweepLimits(8, 512, loaded.head)) as started:
        yield started


def test_an_idle_bank_answers_a_new_documents_rows_in_its_sweep(loaded, sweeping_bank):
    """Bit for bit the two passes' answers (CPU: batch-invariant projections), no state pass of its
    own; the document is stored as by any pass, and a hit (or a caller without rows) gets no answers."""
    ids, rows, _ = sweep_rows(loaded, 0)
    got = sweeping_bank.acq.acquire(ids, 30, 10, rows=rows)
    assert not got.cached and got.probabilities == two_pass_probabilities(loaded, ids, rows)
    assert got.lease is None  # the caller reads nothing from the bank: it holds no pin
    assert sweeping_bank.held.passes == []  # the sweep, not `state_pass`
    assert sweeping_bank.acq.metrics.sweeps._value.get() == 1
    again = sweeping_bank.acq.acquire(ids, 30, 10, rows=rows)
    assert again.cached and again.probabilities is None and again.handle == got.handle and again.lease is not None
    other, _, _ = sweep_rows(loaded, 1)
    assert sweeping_bank.acq.acquire(other, 30, 10).probabilities is None


def test_a_swept_caller_is_answered_before_its_entry_is_registered(loaded, sweeping_bank):
    """The swept caller holds no pin and reads nothing from the bank: its answers do not wait for
    the entry's Redis registration, which follows (unpinned: the next Acquire finds it)."""
    b = sweeping_bank
    entered, go = threading.Event(), threading.Event()
    register = b.directory.register_many

    def held_register(regs):
        entered.set()
        assert go.wait(10)
        return register(regs)

    b.directory.register_many = held_register
    ids, rows, _ = sweep_rows(loaded, 7)
    threads, results = in_threads(lambda: b.acq.acquire(ids, 30, 10, rows=rows), [()])
    threads[0].join(5)
    assert entered.is_set() and not threads[0].is_alive(), "the swept caller waited for the registration"
    (got,) = results
    assert got.probabilities == two_pass_probabilities(loaded, ids, rows) and got.lease is None
    go.set()
    key = document_key(b.acq.model_id, ids)
    wait_until(lambda: [e for e in b.directory.entries() if e.doc_key == key], "the entry's registration")
    (entry,) = [e for e in b.directory.entries() if e.doc_key == key]
    assert entry.pins == 0 and BankHandle(entry.slot, entry.generation) == got.handle
    again = b.acq.acquire(ids, 30, 10)
    assert again.cached and again.handle == got.handle


def test_an_acquire_with_rows_looks_the_directory_up_only_for_a_document_the_bank_holds(loaded, sweeping_bank):
    """Rows come with a document its caller takes for new (it missed the directory, or an idle scorer
    skipped it): the bank asks the directory only for a document it holds, and answers that one from
    the directory at once, not behind its worker's pass of another document: cached, a lease, no
    answers, no pass of its own."""
    b = sweeping_bank
    looked = []
    lookup = b.directory.lookup_and_pin
    b.directory.lookup_and_pin = lambda *a, **kw: looked.append(a[0]) or lookup(*a, **kw)
    ids, rows, _ = sweep_rows(loaded, 8)
    first = b.acq.acquire(ids, 30, 10, rows=rows)
    assert looked == [] and not first.cached and first.probabilities is not None
    sweeps = b.acq.metrics.sweeps._value.get()
    b.held.hold = True
    threads, results = in_threads(b.acq.acquire, [(tokens(0, 10), 30, 10)])
    assert b.held.inside.wait(5)  # another document's pass is in flight (it looked itself up first)
    looked.clear()
    try:
        again = b.acq.acquire(ids, 30, 2, rows=rows)
        assert looked == [first.doc_key] and again.cached and again.probabilities is None
        assert again.handle == first.handle and again.lease is not None
    finally:
        b.held.release()
    threads[0].join(10)
    assert not isinstance(results[0], BaseException), results
    assert b.held.passes == [[10]] and b.acq.metrics.sweeps._value.get() == sweeps
    b.acq.release(again.lease.lease_id)
    b.acq.release(results[0].lease.lease_id)


def test_rows_over_the_sweep_caps_or_on_a_bank_without_sweeps_are_ignored(loaded, sweeping_bank, bank):
    ids, rows, _ = sweep_rows(loaded, 2, questions=9)  # one more row than the caps' 8
    got = sweeping_bank.acq.acquire(ids, 30, 10, rows=rows)
    assert not got.cached and got.probabilities is None and sweeping_bank.held.passes == [[len(ids)]]
    ids, rows, _ = sweep_rows(loaded, 3)
    got = bank.acq.acquire(ids, 30, 10, rows=rows)
    assert not got.cached and got.probabilities is None and bank.held.passes == [[len(ids)]]


def test_a_busy_bank_ignores_rows_and_sweeps_a_document_left_alone(loaded, sweeping_bank):
    """Documents that queue behind a pass share the next one: their rows are ignored (they would slow
    a pass others wait for). A document alone in its pass with nothing queued is swept."""
    b = sweeping_bank
    b.held.hold = True
    threads, results = in_threads(b.acq.acquire, [(tokens(0, 10), 30, 10)])
    assert b.held.inside.wait(5)  # a pass in flight
    cases = [sweep_rows(loaded, i) for i in (4, 5)]
    more, more_results = in_threads(lambda ids, rows: b.acq.acquire(ids, 30, 10, rows=rows),
                                    [(ids, rows) for ids, rows, _ in cases])
    wait_until(lambda: len(b.acq._queue) == 2, "the two documents queued behind the pass")
    b.held.release()
    for t in threads + more:
        t.join(10)
    assert all(not r.cached and r.probabilities is None for r in results + more_results), results + more_results
    assert sorted(map(sorted, b.held.passes)) == sorted([[10], sorted(len(ids) for ids, _, _ in cases)])
    ids, rows, _ = sweep_rows(loaded, 6)
    assert b.acq.acquire(ids, 30, 10, rows=rows).probabilities == two_pass_probabilities(loaded, ids, rows)


def test_a_pass_registers_its_documents_in_one_round_trip_and_a_conflict_costs_only_its_own(bank):
    """The pass's registrations go to Redis together (`Directory.register_many`); one that
    conflicts (here: its document already registered at another handle) fails its own caller with
    UNAVAILABLE, gives its slot back and asks for a reconcile; the others get their pins."""
    from kev.serving.errors import Unavailable

    bank.held.hold = True
    threads, results = in_threads(bank.acq.acquire, [(tokens(30, 10), 30, 10)])
    assert bank.held.inside.wait(5)
    docs = [tokens(i, 12) for i in (31, 32, 33)]
    more, more_results = in_threads(bank.acq.acquire, [(d, 30, 10) for d in docs])
    wait_until(lambda: len(bank.acq._queue) == 3, "three documents queued behind the pass")
    clash = document_key(bank.acq.model_id, docs[1])
    bank.directory.register(clash, slot=10_000, generation=1, length=12)  # another handle holds it
    calls = []
    real = bank.directory.register_many
    bank.directory.register_many = lambda regs: calls.append(len(regs)) or real(regs)
    used = bank.acq.bank.stats().slots_used
    bank.held.release()
    for t in threads + more:
        t.join(10)
    assert calls == [1, 3]  # one round trip a pass, whatever its documents
    assert not isinstance(results[0], Exception)
    assert isinstance(more_results[1], Unavailable) and "KEV_CONFLICT" in str(more_results[1])
    for got in (more_results[0], more_results[2]):
        assert not isinstance(got, Exception) and not got.cached
    assert bank.acq.bank.stats().slots_used == used + 2  # the conflicting one's slot went back
    pins = {e.doc_key: e.pins for e in bank.directory.entries()}
    assert pins[document_key(bank.acq.model_id, docs[0])] == 1 and pins[document_key(bank.acq.model_id, docs[2])] == 1
    wait_until(lambda: clash not in {e.doc_key for e in bank.directory.entries()}, "the reconcile's clean-up")


def queue_behind_a_pass(bank, docs, timeouts=None):
    """One document's pass held in flight while `docs` queue behind it (each caller with its own
    timeout, 10 s by default); returns both callers' (threads, results)."""
    bank.held.hold = True
    first = in_threads(bank.acq.acquire, [(tokens(0, 10), 30, 10)])
    assert bank.held.inside.wait(5)
    results = [None] * len(docs)

    def call(k, doc, timeout_s):
        try:
            results[k] = bank.acq.acquire(doc, 30, timeout_s)
        except Exception as e:  # noqa: BLE001 - returned for the assertion
            results[k] = e

    threads = []
    for k, (doc, timeout_s) in enumerate(zip(docs, timeouts or [10] * len(docs))):  # one at a time: queued in order
        threads.append(threading.Thread(target=call, args=(k, doc, timeout_s)))
        threads[-1].start()
        wait_until(lambda: len(bank.acq._queue) == k + 1, "the documents queued behind the pass")
    return first, (threads, results)


def test_a_document_crossing_the_pass_cap_gives_what_fits_and_ends_in_the_next_pass(small_bank):
    """More queued than a pass holds: the document that crosses the cap goes in with its first whole
    chunks and finishes in the next pass, its states as one pass would write them; only then is it
    registered and its caller answered."""
    bank = small_bank
    long = tokens(3, 100)
    (threads, results), (more, more_results) = queue_behind_a_pass(bank, [tokens(1, 20), tokens(2, 20), long])
    bank.held.release()
    for t in threads + more:
        t.join(10)
    assert all(not isinstance(r, Exception) and not r.cached for r in results + more_results), more_results
    assert bank.held.passes == [[10], [20, 20, 64], [36]] and bank.held.starts == [[0], [0, 0, 0], [64]]
    assert bank.acq.metrics.split_documents._value.get() == 1
    got = more_results[2]
    assert got.length == 100 and bank.acq.acquire(long, 30, 10).cached
    ref = bank.store.alloc(100)
    bank.held.real([long], [ref])  # one pass over the whole document
    for pool in bank.store.pools.recurrent + bank.store.pools.conv:
        assert torch.equal(pool[got.handle.slot], pool[ref.slot])


def test_a_document_read_part_way_whose_callers_left_gives_its_slot_back(small_bank):
    """Its caller gives up while the document waits; its first piece still runs (the pass was
    taken), but then its slot goes back instead of a second pass, and nothing is registered."""
    bank = small_bank
    used = bank.store.stats().slots_used
    long = tokens(4, 100)
    (threads, _), (more, more_results) = queue_behind_a_pass(bank, [tokens(5, 40), long], [10, 0.2])
    more[1].join(5)
    assert isinstance(more_results[1], DeadlineExceeded)
    bank.held.release()
    for t in threads + more:
        t.join(10)
    key = document_key(bank.acq.model_id, long)
    wait_until(lambda: key not in bank.acq._pending and bank.store.stats().slots_used == used + 2,
               "the long document's slot back")
    assert bank.held.passes == [[10], [40, 64]]
    assert key not in {e.doc_key for e in bank.directory.entries()}
    assert not bank.acq.acquire(long, 30, 10).cached


def test_a_failed_pass_frees_a_document_read_part_way(small_bank):
    """The pass that would finish a split document fails: its caller gets INTERNAL and the slot of
    its first piece goes back; the bank serves on."""
    from kev.serving.errors import Internal

    bank = small_bank
    used = bank.store.stats().slots_used
    long = tokens(6, 100)
    real = bank.held.real

    def failing(documents, handles, starts=None):
        if starts and starts[0] == 64:
            raise RuntimeError("device fault")
        return real(documents, handles, starts)

    bank.held.real = failing
    (threads, results), (more, more_results) = queue_behind_a_pass(bank, [tokens(7, 40), long])
    bank.held.release()
    for t in threads + more:
        t.join(10)
    assert isinstance(more_results[1], Internal) and "device fault" in str(more_results[1])
    assert not isinstance(more_results[0], Exception)
    assert bank.store.stats().slots_used == used + 2  # the first and the 40-token document's; not the long one's
    bank.held.real = real
    assert not bank.acq.acquire(long, 30, 10).cached  # read again, whole, on request


def test_the_worker_survives_a_fault_around_a_pass(small_bank):
    """An unexpected error in the worker's own steps (here binding a new slot) fails that pass's
    callers with INTERNAL, gives a part-read document's slot back, and the worker serves on."""
    from kev.serving.errors import Internal

    bank = small_bank
    used = bank.store.stats().slots_used
    real_bind = bank.store.bind
    long = tokens(8, 100)

    def bind(handle, fingerprint):
        if bank.held.passes and len(bank.held.passes) >= 2:  # the pass after the long one's first piece
            raise RuntimeError("shared memory gone")
        return real_bind(handle, fingerprint)

    bank.store.bind = bind
    (threads, results), (more, more_results) = queue_behind_a_pass(bank, [tokens(9, 40), long, tokens(10, 30)])
    bank.held.release()
    for t in threads + more:
        t.join(10)
    assert not isinstance(results[0], Exception) and not isinstance(more_results[0], Exception)
    assert isinstance(more_results[1], Internal) and "shared memory gone" in str(more_results[1])
    assert isinstance(more_results[2], Internal)
    assert bank.held.passes == [[10], [40, 64]]
    assert bank.store.stats().slots_used == used + 2  # the first two documents'; the long one's went back
    bank.store.bind = real_bind
    assert not bank.acq.acquire(long, 30, 10).cached  # served on


def test_a_full_bank_evicts_for_the_next_pass_while_this_one_runs(loaded, redis_server):
    """Three slots holding released entries, one kept free (`_keep_room`): the document of the next
    pass, queued during this one, gets its room (the least recently used entry) while this pass is
    on the device, before this pass's registration, not between the passes; idle again, the bank
    frees the room of one more."""
    with running_bank(loaded, redis_server, "ahead", 16384, slots=3) as bank:
        for i in (1, 2, 3):
            bank.acq.release(bank.acq.acquire(tokens(40 + i), 30, 10).lease.lease_id)
        events = []
        evict, register = bank.directory.evict_if_unpinned, bank.directory.register_many
        bank.directory.evict_if_unpinned = lambda n, **kw: events.append(("evict", n)) or evict(n, **kw)
        bank.directory.register_many = lambda regs: events.append(("register", len(regs))) or register(regs)
        real = bank.held.real
        bank.held.real = lambda docs, handles, starts=None: events.append(("pass", len(docs))) or real(docs, handles, starts)
        bank.held.hold = True
        first = in_threads(bank.acq.acquire, [(tokens(44), 30, 10)])
        assert bank.held.inside.wait(5)
        more = in_threads(bank.acq.acquire, [(tokens(45), 30, 10)])
        wait_until(lambda: len(bank.acq._queue) == 1, "the next document queued")
        bank.held.release()
        for t in first[0] + more[0]:
            t.join(10)
        assert all(not isinstance(r, Exception) for r in first[1] + more[1])
        wait_until(lambda: bank.acq.evictions == 3, "the room kept after the last pass")
        assert events == [("pass", 1), ("evict", 1), ("register", 1), ("pass", 1), ("register", 1), ("evict", 1)]
        assert bank.store.stats().slots_used == 2


def test_an_idle_full_bank_keeps_room_for_the_next_document(loaded, redis_server):
    """A full bank that goes idle evicts the least recently used unpinned entry (room for one of
    the entries' mean size) after its pass, so the next new document finds room at once: no
    eviction on its own path. Pinned entries are never taken for it."""
    with running_bank(loaded, redis_server, "room", 16384, slots=3) as bank:
        leases = []
        for i in (1, 2, 3):
            leases.append(bank.acq.acquire(tokens(60 + i), 30, 10).lease)
        assert bank.store.stats().slots_used == 3 and bank.acq.evictions == 0  # every entry pinned
        for lease in leases:
            bank.acq.release(lease.lease_id)
        bank.acq.release(bank.acq.acquire(tokens(64), 30, 10).lease.lease_id)  # evicts 61 on its path
        wait_until(lambda: bank.acq.evictions == 2, "the room kept after the pass")
        assert bank.store.stats().slots_used == 2
        events = []
        evict = bank.directory.evict_if_unpinned
        bank.directory.evict_if_unpinned = lambda n, **kw: events.append(("evict", n)) or evict(n, **kw)
        real = bank.held.real
        bank.held.real = lambda docs, handles, starts=None: events.append(("pass", len(docs))) or real(docs, handles, starts)
        assert not bank.acq.acquire(tokens(65), 30, 10).cached
        wait_until(lambda: bank.acq.evictions == 3, "the room kept after the pass")
        assert events == [("pass", 1), ("evict", 1)]  # nothing evicted before the pass
        remaining = {e.doc_key for e in bank.directory.entries()}
        assert remaining == {document_key(bank.acq.model_id, tokens(i)) for i in (64, 65)}


def test_a_long_document_at_a_bank_of_short_entries_evicts_in_one_call(loaded, redis_server):
    """Twelve slots and twelve pages, eleven held by released one-page entries (the room of one
    kept, `_keep_room`): a 300-token document (five pages) gets its room in one eviction of four
    entries (`Bank.entries_to_free`: the pages missing at the entries' mean size), not four calls
    of one."""
    with running_bank(loaded, redis_server, "long-after-short", 16384, slots=12, blocks=12) as bank:
        for i in range(12):
            bank.acq.release(bank.acq.acquire(tokens(i, 40), 30, 10).lease.lease_id)
        wait_until(lambda: bank.acq.evictions == 1, "the room kept after the last pass")
        assert bank.store.shortfall([300]) == (0, 4) and bank.store.entries_to_free([300]) == 4
        events = []
        evict = bank.directory.evict_if_unpinned
        bank.directory.evict_if_unpinned = lambda n, **kw: events.append(n) or evict(n, **kw)
        got = bank.acq.acquire(tokens(99, 300), 30, 10)
        assert not got.cached and events[0] == 4 and bank.acq.evictions >= 5


def test_an_acquire_during_a_passs_registration_joins_that_pass(loaded, redis_server):
    """An Acquire of a document whose pass is over but whose entry is not in the directory yet
    finds the directory without it and queues it again; the worker then finds it live and pins
    it (`_process`): one pass, one entry, both callers pinned on it, never a second pass whose
    registration would conflict with the first (UNAVAILABLE for a good request)."""
    with running_bank(loaded, redis_server, "join-late", 16384) as bank:
        ids = tokens(7, 60)
        entered, go = threading.Event(), threading.Event()
        register = bank.directory.register_many

        def held_register(regs):
            if not entered.is_set():
                entered.set()
                assert go.wait(10)
            return register(regs)

        bank.directory.register_many = held_register
        first = in_threads(bank.acq.acquire, [(ids, 30, 10)])
        assert entered.wait(10)  # the pass is over, its registration held
        second = in_threads(bank.acq.acquire, [(ids, 30, 10)])
        time.sleep(0.2)  # the second Acquire finds the directory without the document meanwhile
        go.set()
        for t in first[0] + second[0]:
            t.join(10)
        (a,), (b,) = first[1], second[1]
        assert not isinstance(a, Exception) and not isinstance(b, Exception), (a, b)
        assert a.handle == b.handle and bank.held.passes == [[60]] and not a.cached and b.cached
        assert bank.directory.stats().pins_held == 2
        for got in (a, b):
            bank.acq.release(got.lease.lease_id)


def test_entries_to_free_counts_the_missing_pages_at_the_mean_entry(loaded):
    cfg = loaded.model.cfg
    store = Bank.allocate(cfg, num_slots=8, num_blocks=8, block_size=64, max_doc_tokens=512)
    assert store.entries_to_free([448]) == 0  # seven pages of eight free
    assert store.mean_entry_tokens() == 64  # none held: one page
    for _ in range(2):
        store.alloc(128)  # two entries of two pages: six slots and four pages left
    assert store.mean_entry_tokens() == 128
    assert store.shortfall([448]) == (0, 3) and store.entries_to_free([448]) == 2  # 3 pages at 2 an entry
    assert store.shortfall([64] * 7) == (1, 3) and store.entries_to_free([64] * 7) == 2
    assert store.entries_to_free([64] * 4) == 0
    slots_only = Bank.allocate(cfg, num_slots=2, num_blocks=8, block_size=64, max_doc_tokens=512)
    for _ in range(2):
        slots_only.alloc(64)
    assert slots_only.shortfall([64]) == (1, 0) and slots_only.entries_to_free([64]) == 1


# ---- the whole path ----------------------------------------------------------------------------


@pytest.mark.slow  # a stack's start-up (~10-15 s on 2 cores); in CI the in-process tests above cover both services
def test_a_lone_request_through_the_stack_waits_for_no_window(checkpoint):
    """Scorer -> bank Acquire -> state pass -> row pass over real gRPC, both windows at 2 s: a new
    document's request on the idle stack answers well under one window (it waited for neither)."""
    import grpc

    from kev.v1 import scorer_pb2_grpc
    from service_support import score, stack_for

    stack = stack_for(checkpoint, scorer_env={"KEV_MAX_WAIT_MS": str(WINDOW_S * 1000)},
                      bank_flags=["--avg-doc-tokens", "64", "--epoch-check-s", "0.2",
                                  "--max-wait-ms", str(WINDOW_S * 1000)])
    with stack, grpc.insecure_channel(stack.scorer_addr) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        for i in (20, 21, 22):  # a new document each time: a state pass and a row pass
            start = time.monotonic()
            got = score(stub, request(i, questions=3))
            assert time.monotonic() - start < QUICK_S, "the request waited for a batch window"
            assert len(got.answers) == 3 and got.usage.cached_state_tokens == 0
