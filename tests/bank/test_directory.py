"""The Redis directory against a real redis-server (tests/redis_server.py): pins as leases, LRU
eviction of unpinned entries only, generations, atomicity under threads, and a Redis restart."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

from kev.bank.directory import (
    Directory,
    DirectoryConflict,
    DirectoryUnavailable,
    EntryState,
    Registration,
    connect,
)
from kev.bank.doc_key import document_key

MODEL = "kev-test"
NODE = "node-0"
SHORT_LEASE_S = 0.3  # long enough to outlast a script call, short enough to wait out in a test


def key(i: int) -> str:
    return document_key(MODEL, [i, i + 1, i + 2])


@pytest.fixture
def directory(redis_server: RedisServer) -> Directory:  # noqa: F811
    d = Directory(connect(redis_server.url), MODEL, NODE)
    d.reset()
    return d


def test_pin_release_roundtrip(directory: Directory) -> None:
    assert directory.lookup_and_pin(key(0), 5.0) is None
    assert directory.register(key(0), slot=3, generation=7, length=3) is None

    lease = directory.lookup_and_pin(key(0), 5.0)
    assert lease is not None
    assert (lease.doc_key, lease.slot, lease.generation, lease.length) == (key(0), 3, 7, 3)
    (entry,) = directory.entries()
    assert (entry.slot, entry.generation, entry.length, entry.node, entry.pins) == (3, 7, 3, NODE, 1)
    # Millisecond leases on the Redis clock, which is last_used_ms's clock too.
    assert lease.expires_at_ms - entry.last_used_ms == 5000

    assert directory.pins_held() == 1
    assert directory.release(lease.lease_id)
    assert not directory.release(lease.lease_id)  # a second release is a no-op
    assert directory.pins_held() == 0
    stats = directory.stats()
    assert (stats.entries, stats.hits, stats.misses, stats.evictions) == (1, 1, 1, 0)


def test_filling_entry_is_neither_pinnable_nor_evictable(directory: Directory) -> None:
    directory.register(key(0), 0, 1, 3, state=EntryState.FILLING)
    assert directory.lookup_and_pin(key(0), 5.0) is None
    assert directory.evict_if_unpinned(10) == []
    with pytest.raises(ValueError):
        directory.register(key(0), 0, 1, 3, state=EntryState.FILLING, pin_lease_s=1.0)

    # filling -> ready at the same handle, pinning for the requester in the same script
    lease = directory.register(key(0), 0, 1, 3, pin_lease_s=5.0)
    assert lease is not None and lease.slot == 0
    assert directory.entries()[0].pins == 1
    with pytest.raises(DirectoryConflict, match="cannot go back"):
        directory.register(key(0), 0, 1, 3, state=EntryState.FILLING)


def test_unregister_failed_fill_and_refuses_pinned(directory: Directory) -> None:
    directory.register(key(0), 0, 1, 3, state=EntryState.FILLING)
    assert not directory.unregister(key(0), 0, 2)  # wrong generation: not this entry
    assert directory.unregister(key(0), 0, 1)
    assert directory.entries() == []

    directory.register(key(1), 0, 2, 3, pin_lease_s=5.0)
    with pytest.raises(DirectoryConflict, match="live pins"):
        directory.unregister(key(1), 0, 2)


def test_renew_extends_and_expired_lease_stays_dead(directory: Directory) -> None:
    directory.register(key(0), 0, 1, 3)
    lease = directory.lookup_and_pin(key(0), SHORT_LEASE_S)
    assert lease is not None
    time.sleep(0.2)
    renewed = directory.renew(lease.lease_id, SHORT_LEASE_S)
    assert renewed is not None and renewed > lease.expires_at_ms
    time.sleep(0.2)  # past the original expiry, inside the renewed one
    assert directory.evict_if_unpinned(10) == []
    assert directory.pins_held() == 1
    time.sleep(0.25)  # past the renewed expiry
    assert directory.renew(lease.lease_id, SHORT_LEASE_S) is None
    assert not directory.release(lease.lease_id)
    assert [e.doc_key for e in directory.evict_if_unpinned(10)] == [key(0)]


def test_crashed_holder_pin_expires(directory: Directory) -> None:
    directory.register(key(0), 0, 1, 3)
    assert directory.lookup_and_pin(key(0), SHORT_LEASE_S) is not None  # holder "crashes": never releases
    assert directory.evict_if_unpinned(10) == []
    time.sleep(SHORT_LEASE_S + 0.05)
    assert directory.pins_held() == 0
    (evicted,) = directory.evict_if_unpinned(10)
    assert (evicted.doc_key, evicted.slot, evicted.generation) == (key(0), 0, 1)
    assert directory.entries() == [] and directory.pins_held() == 0


def test_evict_takes_lru_among_unpinned_only(directory: Directory) -> None:
    for i in range(5):
        directory.register(key(i), slot=i, generation=1, length=3)
        time.sleep(0.002)  # distinct last-use milliseconds
    # Use key(0) again (now most recent) and keep key(1), the oldest after it, pinned.
    first = directory.lookup_and_pin(key(0), 5.0)
    assert first is not None and directory.release(first.lease_id)
    pinned = directory.lookup_and_pin(key(1), 5.0)
    assert pinned is not None
    assert [e.doc_key for e in directory.entries()] == [key(2), key(3), key(4), key(0), key(1)]

    assert [e.doc_key for e in directory.evict_if_unpinned(2)] == [key(2), key(3)]
    assert [e.doc_key for e in directory.evict_if_unpinned(10)] == [key(4), key(0)]
    assert directory.evict_if_unpinned(10) == []  # only the pinned one is left
    assert directory.release(pinned.lease_id)
    assert [e.doc_key for e in directory.evict_if_unpinned(10)] == [key(1)]
    assert directory.stats().evictions == 5


def test_evict_retry_returns_the_same_victims(directory: Directory) -> None:
    for i in range(3):
        directory.register(key(i), i, 1, 3)
    first = directory.evict_if_unpinned(2, op_id="op-1")
    assert directory.evict_if_unpinned(2, op_id="op-1") == first  # reply lost, redis-py retried
    assert [e.doc_key for e in directory.entries()] == [key(2)]


def test_generations_guard_slot_reuse(directory: Directory) -> None:
    big = 2**63 + 5  # beyond a double's 53 bits: must compare exactly
    directory.register(key(0), slot=0, generation=big, length=3)
    with pytest.raises(DirectoryConflict, match="held by"):
        directory.register(key(1), slot=0, generation=big + 1, length=3)
    with pytest.raises(DirectoryConflict, match="already at slot"):
        directory.register(key(0), slot=1, generation=1, length=3)
    directory.register(key(0), slot=0, generation=big, length=3)  # same handle again: a no-op retry

    (evicted,) = directory.evict_if_unpinned(1)
    assert evicted.generation == big
    # The bank bumps the generation before reusing the slot; reusing the old one is refused.
    with pytest.raises(DirectoryConflict, match="not newer"):
        directory.register(key(1), slot=0, generation=big, length=4)
    directory.register(key(1), slot=0, generation=big + 1, length=4)

    assert directory.lookup_and_pin(key(0), 5.0) is None  # the old document is gone
    lease = directory.lookup_and_pin(key(1), 5.0)
    assert lease is not None and (lease.slot, lease.generation, lease.length) == (0, big + 1, 4)


def test_register_many_is_each_register_in_one_round_trip(redis_server: RedisServer,  # noqa: F811
                                                            directory: Directory) -> None:
    """A state pass's registrations in one pipeline: each gets what `register` would have given it
    (a pin, none, or its own conflict) and a conflict fails only its own registration."""
    twin = Directory(connect(redis_server.url), MODEL, "node-twin")  # the same calls one by one
    twin.reset()
    directory.register(key(9), slot=5, generation=3, length=3)  # slot 5 is taken: key(2) conflicts
    twin.register(key(9), slot=5, generation=3, length=3)
    regs = [Registration(key(0), 0, 1, 3, pin_lease_s=5.0), Registration(key(0), 0, 1, 3, pin_lease_s=5.0),
            Registration(key(1), 1, 1, 4), Registration(key(2), 5, 4, 3, pin_lease_s=5.0),
            Registration(key(3), 2, 1, 3, pin_lease_s=5.0)]
    got = directory.register_many(regs)
    one_by_one = []
    for r in regs:
        try:
            one_by_one.append(twin.register(r.doc_key, r.slot, r.generation, r.length, pin_lease_s=r.pin_lease_s))
        except DirectoryConflict as e:
            one_by_one.append(e)
    kinds = lambda results: [type(x).__name__ for x in results]  # noqa: E731
    assert kinds(got) == kinds(one_by_one) == ["Lease", "Lease", "NoneType", "DirectoryConflict", "Lease"]
    assert str(got[3]) == str(one_by_one[3]) and "KEV_CONFLICT" in str(got[3])
    for mine, theirs in zip(got, one_by_one):
        if mine is not None and not isinstance(mine, Exception):
            assert (mine.doc_key, mine.slot, mine.generation, mine.length) == \
                (theirs.doc_key, theirs.slot, theirs.generation, theirs.length)
            assert mine.lease_id != theirs.lease_id and len(mine.lease_id) == 32
    assert got[0].lease_id != got[1].lease_id
    assert {e.doc_key: e.pins for e in directory.entries()} == {e.doc_key: e.pins for e in twin.entries()} == \
        {key(9): 0, key(0): 2, key(1): 0, key(3): 1}
    assert directory.register_many([]) == []
    with pytest.raises(ValueError):  # checked before anything is sent
        directory.register_many([Registration(key(4), -1, 1, 3)])
    assert key(4) not in {e.doc_key for e in directory.entries()}


def test_concurrent_pins_lose_no_update(directory: Directory) -> None:
    directory.register(key(0), 0, 1, 3)
    threads, per_thread = 16, 40
    leases: list[str] = []
    lock = threading.Lock()

    def pin() -> None:
        mine = [directory.lookup_and_pin(key(0), 30.0) for _ in range(per_thread)]
        with lock:
            leases.extend(lease.lease_id for lease in mine if lease is not None)

    workers = [threading.Thread(target=pin) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert len(set(leases)) == threads * per_thread
    assert directory.pins_held() == threads * per_thread
    assert directory.entries()[0].pins == threads * per_thread
    assert directory.stats().hits == threads * per_thread

    def release(ids: list[str]) -> None:
        assert all(directory.release(i) for i in ids)

    chunks = [leases[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=release, args=(c,)) for c in chunks]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert directory.pins_held() == 0 and directory.entries()[0].pins == 0


def test_eviction_never_takes_a_held_entry_under_concurrency(directory: Directory) -> None:
    """Pinners and an evicting, re-registering bank race for ~0.6 s. A split look-up/pin or
    check/evict would let an entry go while a pinner holds it; the atomic scripts never do."""
    docs = 6
    generation = {i: 1 for i in range(docs)}
    for i in range(docs):
        directory.register(key(i), slot=i, generation=1, length=3)
    held: Counter[tuple[str, int]] = Counter()  # (doc_key, generation) -> holders right now
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[str] = []
    pins = evictions = 0

    def pinner(seed: int) -> None:
        nonlocal pins
        n = seed
        while not stop.is_set():
            n += 1
            lease = directory.lookup_and_pin(key(n % docs), 30.0)
            if lease is None:
                continue  # evicted and not yet re-registered
            with lock:
                held[(lease.doc_key, lease.generation)] += 1
                pins += 1
            time.sleep(0.0005)  # "row pass"
            with lock:
                held[(lease.doc_key, lease.generation)] -= 1
            directory.release(lease.lease_id)

    def bank() -> None:
        nonlocal evictions
        while not stop.is_set():
            for e in directory.evict_if_unpinned(2):
                with lock:
                    if held[(e.doc_key, e.generation)] > 0:
                        errors.append(f"evicted {e.doc_key} gen {e.generation} while held")
                    evictions += 1
                i = e.slot  # slot i holds document i in this test
                generation[i] += 1
                directory.register(key(i), slot=i, generation=generation[i], length=3)

    workers = [threading.Thread(target=pinner, args=(s,)) for s in range(8)] + [threading.Thread(target=bank)]
    for t in workers:
        t.start()
    time.sleep(0.6)
    stop.set()
    for t in workers:
        t.join()
    assert not errors, errors[:5]
    assert pins > 100 and evictions > 10, (pins, evictions)  # both sides really raced
    assert directory.pins_held() == 0
    assert sorted(e.generation for e in directory.entries()) == sorted(generation.values())


def test_nodes_are_separate_namespaces(redis_server: RedisServer, directory: Directory) -> None:  # noqa: F811
    other = Directory(connect(redis_server.url), MODEL, "node-1")
    other.register(key(0), 0, 1, 3)
    directory.register(key(1), 0, 1, 3)  # same slot number, other node's memory: no conflict
    assert directory.lookup_and_pin(key(0), 5.0) is None  # another node's state is not ours to read
    assert [e.doc_key for e in directory.evict_if_unpinned(10)] == [key(1)]
    directory.register(key(2), 0, 2, 3)

    assert directory.drop_all_for_node("node-1") == 1
    assert other.entries() == []
    assert [e.doc_key for e in directory.entries()] == [key(2)]


def test_doc_key_of_another_model_is_rejected(directory: Directory) -> None:
    with pytest.raises(ValueError, match="not a key of model"):
        directory.lookup_and_pin(document_key("other-model", [1]), 5.0)
    with pytest.raises(ValueError):
        Directory(directory.client, "bad{model}", NODE)


def test_redis_restart(redis_server: RedisServer, directory: Directory) -> None:  # noqa: F811
    epoch = directory.epoch()
    assert epoch is not None
    directory.register(key(0), 0, 1, 3)
    lease = directory.lookup_and_pin(key(0), 5.0)
    assert lease is not None

    redis_server.kill()
    calls = [
        lambda: directory.lookup_and_pin(key(0), 5.0),
        lambda: directory.renew(lease.lease_id, 5.0),
        lambda: directory.release(lease.lease_id),
        lambda: directory.register(key(1), 1, 1, 3),
        lambda: directory.register_many([Registration(key(1), 1, 1, 3, pin_lease_s=5.0)]),
        lambda: directory.evict_if_unpinned(1),
        directory.entries,
        directory.pins_held,
        directory.epoch,
        directory.reset,
    ]
    for call in calls:
        with pytest.raises(DirectoryUnavailable):
            call()

    redis_server.restart()  # no persistence: it comes back empty, scripts unloaded
    assert directory.epoch() is None  # how the bank learns to re-register
    assert directory.entries() == [] and directory.pins_held() == 0
    assert directory.lookup_and_pin(key(0), 5.0) is None
    assert directory.renew(lease.lease_id, 5.0) is None  # leases from before are gone
    assert not directory.release(lease.lease_id)

    # The bank re-registers what it holds, with a protective pin of one lease length.
    new_epoch = directory.reset()
    assert new_epoch != epoch and directory.epoch() == new_epoch
    guard = directory.register(key(0), 0, 1, 3, pin_lease_s=5.0)
    assert guard is not None and directory.evict_if_unpinned(10) == []
    again = directory.lookup_and_pin(key(0), 5.0)
    assert again is not None and (again.slot, again.generation) == (0, 1)
    assert lease.epoch == epoch and again.epoch == new_epoch  # each pin says which epoch it was made in
    redis_server.restart()  # a pipeline of scripts Redis no longer has loads them first
    directory.reset()
    (pinned,) = directory.register_many([Registration(key(1), 1, 1, 3, pin_lease_s=5.0)])
    assert pinned is not None and directory.entries()[0].pins == 1
