"""The scorer's side of the bank: attachment, pinned document handles, leases.

Handles. A document's handle comes from the Redis directory (`lookup_and_pin`, the fast path)
or, on a miss, from the bank (`Bank.Acquire`, which runs the state pass and pins). Either way the
scorer holds a directory lease that it renews while the request waits and releases at the end,
in the directory itself (one Lua script; `Bank.Release` would do the same one hop further).

Never a wrong state. The scorer reads the bank through memory it mapped at `Attach` time. A slot
and generation only mean something in the memory of the bank instance that registered them, so
every handle is confirmed against the attachment before it is used: the directory's epoch (a
fresh token written by each `reset`, i.e. by each bank start and after each Redis data loss;
tokens never repeat) is read *after* the handle was obtained. If it still equals the epoch read
when the attachment was made, no reset happened in between and the entry belongs to the attached
instance. Otherwise the scorer asks the bank (`Attach`) who it is now: the same instance (Redis
restarted, the bank re-registered its entries) keeps the attachment with the new epoch; a new
instance (the bank restarted) is re-attached, and the handle is dropped (`StaleAttachment`, the
request retries once). Right before each row pass the batcher also checks every handle against
the mapped slot generations (`AttachedBank.check`).

Never another document's state (issue 27). The bank stores each live slot's document key
fingerprint beside its generation in the shared memory; a handle is checked against the request's
own fingerprint when it is obtained and again before every row pass. A directory entry pointing at
a live slot of another document (a forged or corrupted entry) is a `WrongEntry`: the entry is
dropped from the directory (repair), the request retries once through the bank (which holds the
truth), and fails with a clear UNAVAILABLE if the entry cannot be dropped (pinned).

Passes. Each attachment has its own model and passes (`kev.exec.passes.PassBuilder.build`): the
model is bound to the weights the bank shares (`AttachResponse.weights`, kev/bank/shared_weights.py:
one copy per GPU; the scorer reads its own only from a bank that shares none), and on CUDA the
graphs hold the mapped memory's addresses, so a new bank instance gets a new model and new graphs
and the old mappings go with the old attachment. The process's tuner and its warm-up are kept;
the first attachment (start-up, before SERVING) captures every key, a re-attachment queues them
(each captured at its first use).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from kev.bank.bank import BankHandle
from kev.bank.directory import Directory, DirectoryUnavailable, connect
from kev.bank.doc_key import document_key, key_fingerprint
from kev.bank.shared import WrongDocument
from kev.bank.shared_weights import map_weights
from kev.exec.memory import check_memory_plan, memory_plan
from kev.exec.plan import PassRole
from kev.loading import LoadedModel
from kev.request.errors import InvalidRequest
from kev.request.prompts import QuestionRow
from kev.request.rows import row_picks
from kev.exec.passes import PassBuilder, Passes
from kev.serving.security import client_channel, read_token
from kev.v1 import bank_pb2, bank_pb2_grpc
from scorer_service.config import ScorerConfig
from kev.serving.errors import DeadlineExceeded, Exhausted, ServiceError, Unavailable
from scorer_service.metrics import ScorerMetrics

log = logging.getLogger(__name__)


class StaleAttachment(Unavailable):
    """The handle belongs to another bank instance or is no longer live: the request retries once."""


class WrongEntry(StaleAttachment):
    """The directory's entry for the document points at a slot holding another document."""


@dataclass(eq=False)
class Attachment:
    """One mapping of one bank instance, and the passes reading it."""

    instance: str
    node: str
    epoch: str | None  # directory epoch confirmed for this instance; updated after a Redis restart
    bank: object  # kev.bank.shared.AttachedBank: .pools, .block_table, .check(handle)
    passes: Passes
    directory: Directory


@dataclass(eq=False)
class DocLease:
    handle: BankHandle
    lease_id: str
    length: int
    cached: bool  # the state was in the bank already (no state pass for this request)
    attachment: Attachment
    acquire_ms: float  # time spent getting the handle (includes the bank's state pass on a miss)
    fingerprint: int | None = None  # key_fingerprint of the document: what its slot must hold
    probabilities: list[float] | None = None  # the rows sent with a miss, answered in the bank's sweep
    renewed_at: float = field(default_factory=time.monotonic)
    released: bool = False


# The bank is in the same pod: after it restarts, reconnect within a second, not after gRPC's default
# exponential backoff (up to 120 s; 6.6 s after the new bank served was seen in the chaos test).
BANK_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                        ("grpc.max_reconnect_backoff_ms", 1000)]


class BankLink:
    def __init__(self, config: ScorerConfig, loaded: LoadedModel, builder: PassBuilder, metrics: ScorerMetrics,
                 attach_fn=None):
        if attach_fn is None:
            from kev.bank.shared import attach as attach_fn  # the bank engineer's mapping code
        self.config, self.loaded, self.builder, self.metrics = config, loaded, builder, metrics
        self._attach_fn = attach_fn
        self.channel = client_channel(config.bank_addr, ca=config.bank_tls_ca,
                                      token=read_token(config.bank_token_file),
                                      cert=config.bank_tls_cert, key=config.bank_tls_key, options=BANK_CHANNEL_OPTIONS)
        self.stub = bank_pb2_grpc.BankStub(self.channel)
        self.redis = connect(config.redis_url)
        self._lock = threading.Lock()  # guards attach / re-attach
        self._current: Attachment | None = None
        self._own_model = None  # this process's weights, only when a bank shares none
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch_owner, name="kev-bank-watch", daemon=True)
        self._watcher.start()
        self._pins = 0
        self._pins_lock = threading.Lock()

    # ------------------------------------------------------------------------------ attachment

    @property
    def current(self) -> Attachment | None:
        return self._current

    def attachment(self) -> Attachment:
        att = self._current
        return att if att is not None else self.reattach(None)

    def reattach(self, seen: Attachment | None) -> Attachment:
        """Asks the bank who it is; maps it anew if it is not the instance of `seen`. Thread-safe:
        concurrent callers that saw the same attachment share one Attach."""
        with self._lock:
            if self._current is not seen and self._current is not None:
                return self._current  # somebody else already re-checked
            resp, directory, epoch = self._who_is_there()
            if seen is not None and seen.instance == resp.instance and seen.node == resp.node:
                if seen.epoch != epoch:
                    log.info("directory epoch changed (%s -> %s), bank instance %s unchanged",
                             seen.epoch, epoch, resp.instance)
                seen.epoch = epoch
                return seen
            try:
                bank = self._attach_fn(resp)
                model = self._model_for(resp)
            except (OSError, ValueError) as e:  # the segment is gone (bank crashed), or a layout mismatch
                raise Unavailable(f"cannot map the memory of bank instance {resp.instance}: {e}") from None
            # Start-up captures here (nothing runs yet); a re-attach leaves capture to the row worker.
            passes = self.builder.build(bank, capture=self._current is None, model=model)
            att = Attachment(resp.instance, resp.node, epoch, bank, passes, directory)
            log.info("attached bank instance %s (node %s, %d slots, %d blocks)", resp.instance, resp.node,
                     resp.slot_count, resp.block_count)
            self._current = att
            return att

    def _watch_owner(self, every_s: float = 0.5) -> None:
        """Drops the attachment once its bank is gone (its files unlinked: stopped, or dead and
        reaped), so this process holds no mapping of the old instance's pools and weights: on a GPU
        a dead bank's memory stays allocated while anyone maps it, and the next bank needs it. The
        next request re-attaches; passes still running on the old mappings finish first."""
        while not self._stop.wait(every_s):
            att = self._current
            if att is None or att.bank.owner_alive():
                continue
            with self._lock:
                if self._current is att:
                    self._current = None
                    log.warning("bank instance %s is gone: dropped its mappings (pools, weights, graphs)",
                                att.instance)

    def _model_for(self, resp: bank_pb2.AttachResponse):
        """The model for this bank instance: bound to the weights it shares (no copy here; a new
        instance's replace the old ones with the old attachment), else this process's own copy,
        read once from the checkpoint."""
        if resp.weights_shared:
            model = self.loaded.bind(map_weights(resp.weights))
            log.info("mapped the weights of bank instance %s (%d tensors): no copy of them here",
                     resp.instance, len(resp.weights))
            return model
        if self._own_model is None:
            log.info("bank instance %s shares no weights: reading them from %s", resp.instance,
                     self.loaded.source[0])
            # the start-up check counted none of them (kev/exec/memory.py): check again with them
            check_memory_plan(memory_plan(self.loaded.config, PassRole.ROWS, self.builder.plan, weights_shared=False,
                                          max_doc_tokens=self.config.max_document_tokens, dtype=self.loaded.dtype),
                              self.config.device)
            self._own_model = self.loaded.own_model()
        return self._own_model

    def _who_is_there(self) -> tuple[bank_pb2.AttachResponse, Directory, str | None]:
        """The bank's Attach answer with the directory epoch that held throughout a second Attach:
        an epoch read between two answers naming the same instance is that instance's (or later)."""
        resp = self._attach_rpc()
        for _ in range(5):
            directory = Directory(self.redis, self.loaded.model_id, resp.node)
            before = self._epoch(directory)
            again = self._attach_rpc()
            after = self._epoch(directory)
            if before == after and (again.instance, again.node) == (resp.instance, resp.node):
                return again, directory, after
            resp = again
        raise Unavailable("the bank or the directory keeps changing; retry")

    def _attach_rpc(self) -> bank_pb2.AttachResponse:
        resp = self._call(self.stub.Attach, bank_pb2.AttachRequest(model=self.loaded.model_id), 10.0)
        if resp.model != self.loaded.model_id:
            raise Unavailable(f"bank serves model {resp.model!r}, this scorer {self.loaded.model_id!r}")
        return resp

    def _epoch(self, directory: Directory) -> str | None:
        try:
            return directory.epoch()
        except DirectoryUnavailable as e:
            raise Unavailable(f"directory (Redis) unreachable: {e}") from None

    def _confirm(self, att: Attachment, epoch: str | None) -> bool:
        """True if handles obtained under `att` since it was confirmed are still valid, given the
        directory's epoch read after they were obtained (or in the script that pinned one)."""
        if epoch is not None and epoch == att.epoch and self._current is att:
            return True
        return self.reattach(att) is att

    # ------------------------------------------------------------------------------ handles

    def acquire(self, document_ids, timeout_s: float | None, rows: Sequence[QuestionRow] = (),
                look_up: bool = True) -> DocLease:
        """A pinned, confirmed handle for the document (raises ServiceError / InvalidRequest). On a
        miss `rows` go with the Acquire: an idle bank answers them in the document's sweep
        (`DocLease.probabilities`), a busy one ignores them. `look_up=False` skips the directory
        and asks the bank straight away (a document taken for new: the bank pins a stored one)."""
        start = time.perf_counter()
        att = self.attachment()
        key = document_key(self.loaded.model_id, document_ids)
        try:
            found = att.directory.lookup_and_pin(key, self.config.lease_seconds) if look_up else None
        except DirectoryUnavailable as e:
            raise Unavailable(f"directory (Redis) unreachable: {e}") from None
        if not look_up:
            self.metrics.directory_skips.inc()
        if found is not None:
            lease = DocLease(BankHandle(found.slot, found.generation), found.lease_id, found.length, True, att, 0.0)
        else:
            if timeout_s is not None and timeout_s <= 0:
                raise DeadlineExceeded("deadline exceeded before the document's state pass")
            request = bank_pb2.AcquireRequest(model=self.loaded.model_id,
                                              token_ids_le_i32=np.asarray(document_ids, dtype="<i4").tobytes(),
                                              lease_ms=round(self.config.lease_seconds * 1000),
                                              rows=[bank_pb2.SweepRow(token_ids_le_i32=np.asarray(r.prompt.ids, dtype="<i4")
                                                                      .tobytes(), picks=row_picks(r)) for r in rows])
            # Always a bounded deadline: never more than --bank-timeout-s (a huge value overflows gRPC's).
            resp = self._call(self.stub.Acquire, request, self.config.bank_timeout_s if timeout_s is None
                              else min(timeout_s, self.config.bank_timeout_s))
            lease = DocLease(BankHandle(resp.handle.slot, resp.handle.generation), resp.lease_id,
                             resp.document_length, resp.cached, att, 0.0,
                             probabilities=list(resp.row_probabilities) if resp.swept else None)
        # answered in the bank's sweep, no pin: nothing is read from the bank, so nothing to check or release
        pinned = lease.probabilities is None or bool(lease.lease_id)
        if pinned:
            self._count_pin(+1)
        else:
            lease.released = True
        try:
            if pinned:
                # a directory hit brought the epoch with its pin (no second call); a bank's handle reads it
                epoch = found.epoch if found is not None else self._epoch(att.directory)
                if not self._confirm(att, epoch):
                    raise StaleAttachment("the bank restarted while the document was looked up")
                lease.fingerprint = key_fingerprint(key)
                self._check_document(att, key, lease)
            if lease.length != len(document_ids):
                raise ServiceError(f"bank entry holds {lease.length} tokens, the document has {len(document_ids)}")
        except BaseException:
            self.release(lease)
            raise
        lease.acquire_ms = (time.perf_counter() - start) * 1000
        self.metrics.lookup(lease.cached)
        return lease

    def _check_document(self, att: Attachment, key: str, lease: DocLease) -> None:
        """WrongEntry (after dropping the entry) if the handle's slot holds another document."""
        try:
            att.bank.check(lease.handle, lease.fingerprint)
        except WrongDocument as e:
            h = lease.handle
            self.metrics.wrong_entries.inc()
            self.release(lease)
            try:
                att.directory.unregister(key, h.slot, h.generation)
                repaired = "the entry was dropped from the directory; the request retries through the bank"
            except Exception as err:  # noqa: BLE001 - DirectoryConflict (pinned) or Redis down
                repaired = f"the entry could not be dropped ({type(err).__name__}: {err})"
            log.error("directory entry of %s points at %s: %s; %s", key, h, e, repaired)
            raise WrongEntry(f"directory entry of document {key} points at {h}, which holds another document "
                             f"(key fingerprint mismatch); {repaired}") from None
        except Exception:  # noqa: BLE001 - StaleHandle: left to the batcher's check (retried there)
            pass

    def renew_if_due(self, lease: DocLease) -> None:
        """Extends the lease when a third of it has passed (a request waiting long keeps its pin)."""
        if lease.released or time.monotonic() - lease.renewed_at < self.config.lease_seconds / 3:
            return
        try:
            if lease.attachment.directory.renew(lease.lease_id, self.config.lease_seconds) is None:
                log.warning("lease %s expired before renewal", lease.lease_id)
                self.metrics.lease_renewals.labels(result="expired").inc()
            else:
                self.metrics.lease_renewals.labels(result="ok").inc()
            lease.renewed_at = time.monotonic()
        except DirectoryUnavailable as e:
            log.warning("lease renewal failed (Redis unreachable): %s", e)
            self.metrics.lease_renewals.labels(result="failed").inc()

    def release(self, lease: DocLease) -> None:
        """Drops the pin (idempotent). If Redis is unreachable the lease simply expires."""
        if lease.released:
            return
        lease.released = True
        self._count_pin(-1)
        try:
            lease.attachment.directory.release(lease.lease_id)
        except DirectoryUnavailable as e:
            log.warning("lease %s not released (Redis unreachable; it expires): %s", lease.lease_id, e)

    def _count_pin(self, delta: int) -> None:
        with self._pins_lock:
            self._pins += delta
            self.metrics.pins_held.set(self._pins)

    @property
    def pins_held(self) -> int:
        return self._pins

    # ------------------------------------------------------------------------------ bank RPCs

    def stats(self, timeout_s: float = 2.0) -> bank_pb2.StatsResponse:
        return self._call(self.stub.Stats, bank_pb2.StatsRequest(), timeout_s)

    def refresh_occupancy(self) -> None:
        s = self.stats()
        self.metrics.set_occupancy(s.slots_used, s.slots_total, s.blocks_used, s.blocks_total)

    def _call(self, method, request, timeout_s: float):
        """The RPC's reply; its failure as the scorer's error. Only Acquire's INVALID_ARGUMENT is
        the client's (a document the bank will not take, e.g. over its --max-document-tokens)."""
        try:
            return method(request, timeout=timeout_s)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if code == grpc.StatusCode.INVALID_ARGUMENT and isinstance(request, bank_pb2.AcquireRequest) \
                    and not details.startswith("rows["):  # rows are this scorer's own making
                raise InvalidRequest("document", f"rejected by the bank: {details}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"bank call exceeded the deadline: {details}") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise Exhausted(f"bank full: {details}") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                raise Unavailable(f"bank unreachable at {self.config.bank_addr}: {details}") from None
            raise ServiceError(f"bank error {code.name}: {details}") from None

    def close(self) -> None:
        self._stop.set()
        self.channel.close()
        self.redis.close()
