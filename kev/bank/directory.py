"""The Redis directory: document key -> bank entry, pins as leases, LRU order for eviction.

One `Directory` is one namespace: a model served by one bank (`node`). Entries of another node
live in other GPU memory, so they are never visible here, and a bank only ever evicts its own.
Every read-modify-write is one Lua script (kev.bank.directory_lua), so it is atomic in Redis.

Contract with the bank (the source of truth for memory):
- The bank registers an entry after its state pass, optionally pinning it for the requester in
  the same script. A slot reused after eviction must carry a bumped generation (checked here).
- `evict_if_unpinned` removes entries from the directory; the bank then frees their slots and
  bumps their generations. Nothing with a live lease is ever returned.
- Pins are leases: a holder that dies stops renewing, the lease expires (Redis clock, ms) and the
  entry becomes evictable. Holders renew before expiry while they still read the slot.
- At start-up the bank calls `reset()` (its memory is new) and keeps the returned epoch. If
  `epoch()` no longer returns it, Redis lost its data: re-register what the bank holds, unpinned
  (readers of before the restart that may still be mid-pass re-check their handles after the
  pass, scorer_service/batcher.py), or free it.

Every script is safe to retry (redis-py retries on connection errors): lease ids come from the
client, re-registering the same handle is a no-op, and an eviction returns its first result again.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from kev.bank import directory_lua as lua


class DirectoryError(Exception):
    """Base class of directory errors."""


class DirectoryUnavailable(DirectoryError):
    """Redis cannot be reached (the services answer UNAVAILABLE)."""


class DirectoryConflict(DirectoryError):
    """The request contradicts the directory: a taken slot, a stale generation, a live pin."""


class EntryState(enum.Enum):
    READY = "ready"  # state written; pinnable and evictable
    FILLING = "filling"  # slot reserved for a running state pass; neither pinnable nor evictable


@dataclass(frozen=True)
class DirectoryEntry:
    doc_key: str
    slot: int
    generation: int
    length: int
    node: str
    state: EntryState
    last_used_ms: int  # Redis clock
    pins: int  # live leases when read


@dataclass(frozen=True)
class Lease:
    lease_id: str
    doc_key: str
    slot: int
    generation: int
    length: int
    expires_at_ms: int  # Redis clock
    epoch: str | None = None  # `lookup_and_pin`: the directory's epoch when it pinned (None: none set)


@dataclass(frozen=True)
class Registration:
    """One `register` call's arguments (`Directory.register_many` takes a list)."""

    doc_key: str
    slot: int
    generation: int
    length: int
    pin_lease_s: float | None = None  # pin it for a requester in the same script
    state: EntryState = EntryState.READY


@dataclass(frozen=True)
class DirectoryStats:
    entries: int
    pins_held: int
    hits: int
    misses: int
    evictions: int


def connect(url: str, *, timeout_s: float = 1.0) -> redis.Redis:
    """A client for `Directory`: short timeouts so an outage surfaces as DirectoryUnavailable
    quickly, and one immediate retry so a pooled connection from before a Redis restart is
    replaced without failing the call (every script is retry-safe)."""
    return redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
    )


def _lease_ms(lease_s: float) -> int:
    ms = round(lease_s * 1000)
    if ms < 1:
        raise ValueError(f"lease_s must be at least 0.001 s, got {lease_s}")
    return ms


def _str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry(fields: Sequence[bytes | str]) -> DirectoryEntry:
    doc, slot, gen, length, node, state, last_used, pins = (_str(f) for f in fields)
    # The LRU score is in microseconds.
    return DirectoryEntry(doc, int(slot), int(gen), int(length), node, EntryState(state),
                          int(float(last_used)) // 1000, int(pins))


def _check_name(what: str, name: str) -> None:
    # Braces would break the hash tag; '@' separates model from node inside it.
    if not name or any(c in name for c in "{}@"):
        raise ValueError(f"{what} must be non-empty without '{{', '}}' or '@': {name!r}")


class Directory:
    def __init__(self, client: redis.Redis, model_id: str, node: str) -> None:
        _check_name("model_id", model_id)
        _check_name("node", node)
        self.client = client
        self.model_id = model_id
        self.node = node
        self.prefix = self._prefix(node)
        self._lookup_and_pin = client.register_script(lua.LOOKUP_AND_PIN)
        self._renew = client.register_script(lua.RENEW)
        self._release = client.register_script(lua.RELEASE)
        self._register = client.register_script(lua.REGISTER)
        self._unregister = client.register_script(lua.UNREGISTER)
        self._evict = client.register_script(lua.EVICT_IF_UNPINNED)
        self._entries = client.register_script(lua.ENTRIES)
        self._stats = client.register_script(lua.STATS_READ)
        self._drop_all = client.register_script(lua.DROP_ALL)

    def _prefix(self, node: str) -> str:
        return f"kev:{{{self.model_id}@{node}}}:"

    def _run(self, script: Script, *args: object, prefix: str | None = None, client=None) -> object:
        """`script` on this namespace; `client`: a pipeline to queue it on (its reply comes with the batch)."""
        prefix = self.prefix if prefix is None else prefix
        with _translate_errors():
            return script(keys=[prefix + "lru"], args=[prefix, *args], client=client)

    def _check_doc_key(self, doc_key: str) -> None:
        if not doc_key.startswith(self.model_id + ":"):
            raise ValueError(f"doc_key {doc_key!r} is not a key of model {self.model_id!r}")

    def lookup_and_pin(self, doc_key: str, lease_s: float) -> Lease | None:
        """Pins a ready entry with a new lease and marks it used; None on a miss (or while filling).
        The lease carries the epoch read in the same script (`Lease.epoch`)."""
        self._check_doc_key(doc_key)
        lease_id = uuid.uuid4().hex
        reply = self._run(self._lookup_and_pin, doc_key, lease_id, _lease_ms(lease_s))
        if reply is None:
            return None
        slot, gen, length, expiry, epoch = (_str(x) for x in reply)  # type: ignore[union-attr]
        return Lease(lease_id, doc_key, int(slot), int(gen), int(length), int(expiry), epoch or None)

    def renew(self, lease_id: str, lease_s: float) -> int | None:
        """Extends a live lease to now + lease_s; returns the new expiry (ms), None if it expired."""
        reply = self._run(self._renew, lease_id, _lease_ms(lease_s))
        return None if reply is None else int(_str(reply))  # type: ignore[arg-type]

    def release(self, lease_id: str) -> bool:
        """Drops a pin; False when it had already expired (or was unknown / already released)."""
        return bool(self._run(self._release, lease_id))

    def register(
        self,
        doc_key: str,
        slot: int,
        generation: int,
        length: int,
        *,
        state: EntryState = EntryState.READY,
        pin_lease_s: float | None = None,
    ) -> Lease | None:
        """Records the bank's entry (and pins it when `pin_lease_s` is given, in the same script).

        Raises DirectoryConflict when the document is already at another handle, the slot holds
        another entry, or the generation is not newer than the slot's last one.
        """
        r = Registration(doc_key, slot, generation, length, pin_lease_s, state)
        lease_id, args = self._register_args(r)
        return self._lease(r, lease_id, self._run(self._register, *args))

    def register_many(self, registrations: Sequence[Registration]) -> list[Lease | None | DirectoryConflict]:
        """`register` of each, in order, in one round trip (a pipeline of the same script, each
        call atomic on its own): a state pass's documents cost the bank one wait for Redis, not
        one each. Per registration its `register` result, or the DirectoryConflict it raised;
        DirectoryUnavailable if Redis could not be reached (some may then have run: each is
        retry-safe, and the bank reconciles)."""
        calls = [(r, *self._register_args(r)) for r in registrations]
        if not calls:
            return []
        with _translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for _, _, args in calls:
                self._run(self._register, *args, client=pipe)
            replies = pipe.execute(raise_on_error=False)
        out: list[Lease | None | DirectoryConflict] = []
        for (r, lease_id, _), reply in zip(calls, replies, strict=True):
            if isinstance(reply, Exception):
                try:
                    with _translate_errors():
                        raise reply
                except DirectoryConflict as conflict:  # this one's answer; any other error is the call's
                    out.append(conflict)
                    continue
            out.append(self._lease(r, lease_id, reply))
        return out

    def _register_args(self, r: Registration) -> tuple[str, tuple]:
        self._check_doc_key(r.doc_key)
        if r.slot < 0 or r.generation < 0 or r.length < 0:
            raise ValueError(f"slot, generation and length must be >= 0: {r.slot}, {r.generation}, {r.length}")
        if r.pin_lease_s is not None and r.state is not EntryState.READY:
            raise ValueError("only a ready entry can be pinned")
        lease_id = "" if r.pin_lease_s is None else uuid.uuid4().hex
        lease_ms = 0 if r.pin_lease_s is None else _lease_ms(r.pin_lease_s)
        return lease_id, (r.doc_key, r.slot, str(r.generation), r.length, self.node, r.state.value, lease_id, lease_ms)

    @staticmethod
    def _lease(r: Registration, lease_id: str, reply) -> Lease | None:
        if reply is None:
            return None
        return Lease(lease_id, r.doc_key, r.slot, r.generation, r.length, int(_str(reply)))

    def unregister(self, doc_key: str, slot: int, generation: int) -> bool:
        """Removes the entry at exactly this handle (e.g. a failed state pass); False if absent.
        Raises DirectoryConflict while it has live pins."""
        self._check_doc_key(doc_key)
        return bool(self._run(self._unregister, doc_key, slot, str(generation)))

    def evict_if_unpinned(self, max_count: int, *, op_id: str | None = None) -> list[DirectoryEntry]:
        """Removes up to `max_count` least-recently-used ready entries with no live pin, oldest
        first, and returns them; the bank then frees their slots and bumps their generations.
        `op_id` makes a retry return the same result (kept 60 s); a fresh one is drawn if None."""
        if max_count < 1:
            return []
        reply = self._run(self._evict, max_count, op_id or uuid.uuid4().hex)
        flat = list(reply)  # type: ignore[call-overload]
        # Evicted entries had no live pin by construction.
        return [_entry([*flat[i : i + 7], "0"]) for i in range(0, len(flat), 7)]

    def entries(self) -> list[DirectoryEntry]:
        """Every entry, least recently used first, with its live pin count (stats, recovery)."""
        flat = list(self._run(self._entries))  # type: ignore[call-overload]
        return [_entry(flat[i : i + 8]) for i in range(0, len(flat), 8)]

    def stats(self) -> DirectoryStats:
        entries, pins, hits, misses, evictions = (int(_str(x)) for x in self._run(self._stats))  # type: ignore[union-attr]
        return DirectoryStats(entries, pins, hits, misses, evictions)

    def pins_held(self) -> int:
        return self.stats().pins_held

    def reset(self) -> str:
        """Empties this namespace and writes a new epoch token, which it returns."""
        epoch = uuid.uuid4().hex
        self._run(self._drop_all, epoch)
        return epoch

    def epoch(self) -> str | None:
        """The token of the last reset(); None after Redis lost its data (restart, flush)."""
        with _translate_errors():
            value = self.client.get(self.prefix + "epoch")
        return None if value is None else _str(value)

    def drop_all_for_node(self, node: str) -> int:
        """Empties the namespace of `node` for this model (a bank that is gone); returns entries dropped."""
        _check_name("node", node)
        return int(self._run(self._drop_all, "", prefix=self._prefix(node)))  # type: ignore[call-overload]


@contextmanager
def _translate_errors() -> Iterator[None]:
    try:
        yield
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise DirectoryUnavailable(f"redis unreachable: {e}") from e
    except redis.ResponseError as e:
        message = str(e)
        if message.startswith(("KEV_CONFLICT", "KEV_PINNED")):
            raise DirectoryConflict(message) from e
        raise
