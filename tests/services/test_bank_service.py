"""The bank service as a separate process (`python -m bank_service`) against a real redis-server.

Acquire look-up/pass/pin, batching of concurrent misses, the bank memory mapped from this process
(bit-identical to an in-process state pass, writes landing in the owner's pages), LRU eviction of
unpinned entries only, lease expiry of a crashed holder, Redis outages and restarts, bad input.
Which documents share a state pass depends on timing here (an idle bank passes a document at once);
tests/services/test_idle_batching.py holds a pass in flight to test that, and abandoned Acquires.
"""

import json
import os
import threading
import time
from concurrent import futures

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kev.bank.bank import Bank, BankHandle
from kev.bank.shared import attach
from kev.bank.directory import Directory
from kev.bank.doc_key import document_key
from kev.loading import LoadedModel
from kev.ops import get_ops
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.v1 import bank_pb2 as pb
from redis_server import RedisServer
from service_support import wait_for
from tiny_stack import TINY_MODEL_ID, make_tiny_checkpoint, pack_tokens, start_bank

NODE = "test-node"
VOCAB = 300


def doc(n: int, tag: str) -> list[int]:
    g = torch.Generator().manual_seed(sum(map(ord, tag)) * 7919 + n)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def acquire(stub, ids, lease_ms: int = 0, timeout: float = 30, model: str = TINY_MODEL_ID) -> pb.AcquireResponse:
    return stub.Acquire(pb.AcquireRequest(model=model, token_ids_le_i32=pack_tokens(ids), lease_ms=lease_ms),
                        timeout=timeout)


def release(stub, resp: pb.AcquireResponse) -> bool:
    return stub.Release(pb.ReleaseRequest(handle=resp.handle, lease_id=resp.lease_id), timeout=10).released


def handle_of(resp: pb.AcquireResponse) -> BankHandle:
    return BankHandle(resp.handle.slot, resp.handle.generation)


def concurrently(fn, args_list):
    """Run fn(*args) for each args at (nearly) the same instant; results in order."""
    barrier = threading.Barrier(len(args_list))
    results = [None] * len(args_list)

    def run(i, args):
        barrier.wait()
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - returned for the assertion
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def redis_srv():
    server = RedisServer()
    server.start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def bank(ckpt, redis_srv, tmp_path_factory):
    proc = start_bank(ckpt, redis_srv.url, tmp_path_factory.mktemp("logs"))
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]
    assert proc.shm_files() == [], "the bank left its shared memory behind"


@pytest.fixture(scope="module")
def loaded(ckpt):
    return LoadedModel.load(ckpt)


def directory(redis_srv) -> Directory:
    return Directory(redis_srv.client(), TINY_MODEL_ID, NODE)


def counter(bank, name: str) -> float:
    return bank.metrics().get(name, 0.0)


def snapshot(bank, redis_srv):
    """What bad input must leave alone: bank occupancy, directory entries and pins, passes run."""
    s = bank.stub().Stats(pb.StatsRequest(), timeout=10)
    entries = sorted((e.doc_key, e.slot, e.generation, e.length, e.state, e.last_used_ms, e.pins)
                     for e in directory(redis_srv).entries())
    return (s.slots_used, s.blocks_used, s.pins_held, s.evictions, entries,
            counter(bank, "kev_bank_state_pass_documents_total"))


def test_health_and_reflection(bank):
    assert bank.health("") == health_pb2.HealthCheckResponse.SERVING
    assert bank.health("kev.v1.Bank") == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(bank.channel).get_services())
    assert {"kev.v1.Bank", "grpc.health.v1.Health"} <= services


def test_miss_then_hit(bank, redis_srv):
    stub, ids = bank.stub(), doc(40, "miss-hit")
    first = acquire(stub, ids)
    second = acquire(stub, ids)
    assert (first.cached, second.cached) == (False, True)
    assert handle_of(first) == handle_of(second)
    assert first.document_length == second.document_length == 40
    assert first.doc_key == second.doc_key == document_key(TINY_MODEL_ID, ids)
    assert first.lease_id != second.lease_id and first.lease_expires_unix_ms > time.time() * 1000
    (entry,) = [e for e in directory(redis_srv).entries() if e.doc_key == first.doc_key]
    assert (entry.slot, entry.generation, entry.pins) == (first.handle.slot, first.handle.generation, 2)
    assert release(stub, first) and release(stub, second)
    assert not release(stub, first)  # already released


def test_rows_on_a_new_document_are_answered_in_its_sweep(bank, loaded):
    """AcquireRequest.rows on an idle bank: the document's pass answers them (swept, the head's
    probabilities: bit for bit the two passes' in this process, float32 on the wire); the entry is
    stored as by any Acquire but not pinned (the caller reads nothing from the bank: no lease, no
    Release); on a hit the rows are ignored and the caller is pinned as usual."""
    from kev.request.answers import option_probabilities

    stub, ids = bank.stub(), doc(30, "sweep")
    rows = [doc(7, "row-a"), doc(12, "row-b")]
    picks = [[2, 4, 6], [0, 11]]  # [decide, option ends...]
    request = pb.AcquireRequest(model=TINY_MODEL_ID, token_ids_le_i32=pack_tokens(ids),
                                rows=[pb.SweepRow(token_ids_le_i32=pack_tokens(r), picks=p) for r, p in zip(rows, picks)])
    before = counter(bank, "kev_bank_sweeps_total")
    got = stub.Acquire(request, timeout=30)
    assert got.swept and not got.cached and counter(bank, "kev_bank_sweeps_total") == before + 1
    assert got.lease_id == "" and got.lease_expires_unix_ms == 0
    assert stub.Stats(pb.StatsRequest(), timeout=10).pins_held == 0
    passes = Passes(loaded.model, Bank.allocate(loaded.model.cfg, num_slots=2, num_blocks=8, block_size=64),
                    get_ops("torch"))
    h = passes.bank.alloc(len(ids))
    passes.state_pass([ids], [h])
    hidden = passes.row_pass(RowBatch.build(rows, [h, h], [len(ids)] * 2, picks))
    want = option_probabilities(loaded.head, hidden, [2, 1]).tolist()
    assert list(got.row_probabilities) == want
    again = stub.Acquire(request, timeout=30)
    assert again.cached and not again.swept and not again.row_probabilities and again.lease_id
    assert stub.Stats(pb.StatsRequest(), timeout=10).pins_held == 1
    assert release(stub, again)


def test_concurrent_acquires_of_one_document_pass_it_once(bank):
    stub, ids = bank.stub(), doc(90, "same-doc")
    before = counter(bank, "kev_bank_state_pass_documents_total")
    results = concurrently(lambda: acquire(stub, ids), [()] * 8)
    assert all(isinstance(r, pb.AcquireResponse) for r in results), results
    assert len({handle_of(r) for r in results}) == 1
    assert len({r.lease_id for r in results}) == 8  # one pin each
    assert not all(r.cached for r in results)
    assert counter(bank, "kev_bank_state_pass_documents_total") - before == 1
    assert all(release(stub, r) for r in results)


def test_concurrent_new_documents_are_each_passed_once(bank):
    stub = bank.stub()
    docs = [doc(n, "batch") for n in (3, 17, 64, 65, 130, 250)]
    passes = counter(bank, "kev_bank_state_passes_total")
    tokens = counter(bank, "kev_bank_state_pass_tokens_total")
    results = concurrently(lambda ids: acquire(stub, ids), [(d,) for d in docs])
    assert all(isinstance(r, pb.AcquireResponse) and not r.cached for r in results), results
    assert len({r.handle.slot for r in results}) == len(docs)
    assert 1 <= counter(bank, "kev_bank_state_passes_total") - passes <= len(docs)
    assert counter(bank, "kev_bank_state_pass_tokens_total") - tokens == sum(map(len, docs))
    assert all(release(stub, r) for r in results)


def _slot_state(pools, block_table, slot: int, length: int) -> list[torch.Tensor]:
    out = [p[slot] for p in (*pools.recurrent, *pools.conv)]
    pages = block_table[slot, : -(-length // pools.block_size)].long()
    out += [pool[pages].flatten(0, 1)[:length] for pool in (*pools.keys, *pools.values)]
    return out


def test_attached_process_reads_the_exact_states(bank, loaded):
    """This process maps the bank's memory: states and row passes bit-identical to in-process ones."""
    stub = bank.stub()
    docs = [doc(n, "attach") for n in (5, 70, 200)]
    held = [acquire(stub, d) for d in docs]
    attached = attach(stub.Attach(pb.AttachRequest(model=TINY_MODEL_ID), timeout=10))
    assert attached.model == TINY_MODEL_ID and attached.node == NODE
    model, ops = loaded.model, get_ops("torch")
    runner = Passes(model, attached, ops)
    rows = [[1, 2, 3, 4], [5, 6]]
    for ids, resp in zip(docs, held):
        h = handle_of(resp)
        attached.check(h)
        private = Bank.allocate(model.cfg, 1, 8, block_size=attached.block_size, max_doc_tokens=512)
        ph = private.alloc(len(ids))
        reference = Passes(model, private, ops)
        reference.state_pass([ids], [ph])
        got = _slot_state(attached.pools, attached.block_table, h.slot, len(ids))
        want = _slot_state(private.pools, private.block_table, ph.slot, len(ids))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{len(ids)}-token document differs"
        picks = [list(range(len(r))) for r in rows]
        out = runner.row_pass(RowBatch.build(rows, [h] * 2, [len(ids)] * 2, picks))
        ref = reference.row_pass(RowBatch.build(rows, [ph] * 2, [len(ids)] * 2, picks))
        assert torch.equal(out, ref)
    for resp in held:
        assert release(stub, resp)


def test_writes_in_place_reach_the_owners_pages(bank):
    """A write through the attached view is in the shared file and in the bank process's own
    mapping (read back through /proc/<pid>/mem): no copy anywhere."""
    stub = bank.stub()
    held = acquire(stub, doc(33, "in-place"))
    response = stub.Attach(pb.AttachRequest(), timeout=10)
    attached = attach(response)
    (desc,) = [d for d in response.pools if d.name == "layers.0.recurrent"]
    path = json.loads(desc.descriptor)["path"]
    state = attached.pools.recurrent[0][held.handle.slot]
    offset = state.storage_offset() * state.element_size()
    original = state.clone()
    pattern = torch.arange(state.numel(), dtype=torch.float32).view_as(state) + 0.5
    try:
        state.copy_(pattern)
        raw = pattern.numpy().tobytes()
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, len(raw), offset) == raw
        finally:
            os.close(fd)
        pid = bank.pid
        maps = [line.split() for line in open(f"/proc/{pid}/maps") if line.rstrip().endswith(path)]
        assert maps, "the bank process does not map its segment"
        start = int(maps[0][0].split("-")[0], 16) - int(maps[0][2], 16)  # mapping start - file offset
        try:
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(start + offset)
                assert mem.read(len(raw)) == raw
        except PermissionError:
            pytest.skip("cannot read the bank process's memory here (ptrace restricted)")
    finally:
        state.copy_(original)
        release(stub, held)


BAD = {
    "empty document": (dict(token_ids_le_i32=b""), "token_ids_le_i32"),
    "ragged bytes": (dict(token_ids_le_i32=b"\x01\x00\x00"), "token_ids_le_i32"),
    "over max length": (dict(token_ids_le_i32=pack_tokens([1] * 513)), "over the limit of 512"),
    "id over vocab": (dict(token_ids_le_i32=pack_tokens([1, VOCAB, 2])), "token id 300"),
    "negative id": (dict(token_ids_le_i32=pack_tokens([1, -1])), "token id -1"),
    "unknown model": (dict(model="kev-other", token_ids_le_i32=pack_tokens([1, 2])), "model"),
    "no model": (dict(model="", token_ids_le_i32=pack_tokens([1, 2])), "model"),
    "lease too long": (dict(token_ids_le_i32=pack_tokens([1, 2]), lease_ms=10**7), "lease_ms"),
    # an idle sweep's rows (AcquireRequest.rows): a bad one fails the call, the document is not read
    "empty row": (dict(token_ids_le_i32=pack_tokens([1, 2]), rows=[pb.SweepRow(picks=[0, 1])]),
                  "rows[0].token_ids_le_i32"),
    "row id over vocab": (dict(token_ids_le_i32=pack_tokens([1, 2]),
                               rows=[pb.SweepRow(token_ids_le_i32=pack_tokens([5, VOCAB]), picks=[0, 1])]),
                          "rows[0].token_ids_le_i32"),
    "row without an option": (dict(token_ids_le_i32=pack_tokens([1, 2]),
                                   rows=[pb.SweepRow(token_ids_le_i32=pack_tokens([5, 6]), picks=[0])]), "rows[0].picks"),
    "pick past its row": (dict(token_ids_le_i32=pack_tokens([1, 2]),
                               rows=[pb.SweepRow(token_ids_le_i32=pack_tokens([5, 6]), picks=[0, 1]),
                                     pb.SweepRow(token_ids_le_i32=pack_tokens([5, 6, 7]), picks=[1, 3])]),
                          "rows[1].picks"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_acquire_changes_nothing(bank, redis_srv, case):
    fields, needle = BAD[case]
    before = snapshot(bank, redis_srv)
    request = pb.AcquireRequest(**{"model": TINY_MODEL_ID, **fields})
    with pytest.raises(grpc.RpcError) as err:
        bank.stub().Acquire(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert snapshot(bank, redis_srv) == before


def test_bad_release_and_attach(bank):
    stub = bank.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Release(pb.ReleaseRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Attach(pb.AttachRequest(model="kev-other"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model" in err.value.details()
    assert not stub.Release(pb.ReleaseRequest(lease_id="no-such-lease"), timeout=10).released


def test_redis_outage_and_restart(bank, redis_srv):
    """Outage: UNAVAILABLE. Restart (empty Redis): the bank re-registers what it holds, unpinned
    (issue 27: a protective pin of a whole lease stalled a full bank; readers re-check their handles
    after their passes instead), and answers hits from the same slots again."""
    stub = bank.stub()
    ids = doc(50, "restart")
    held = acquire(stub, ids)
    resets = counter(bank, "kev_bank_directory_resets_total")

    redis_srv.kill()
    for request in (ids, doc(51, "restart")):
        with pytest.raises(grpc.RpcError) as err:
            acquire(stub, request)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        release(stub, held)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    redis_srv.restart()
    deadline = time.monotonic() + 10
    while not (entries := [e for e in directory(redis_srv).entries() if e.doc_key == held.doc_key]):
        assert time.monotonic() < deadline, "the bank did not re-register after the restart"
        time.sleep(0.05)
    (entry,) = entries
    assert (entry.slot, entry.generation, entry.length) == (held.handle.slot, held.handle.generation, 50)
    assert entry.pins == 0  # no protective pin: new documents may evict it at once
    assert counter(bank, "kev_bank_directory_resets_total") == resets + 1
    again = acquire(stub, ids)
    assert again.cached and handle_of(again) == handle_of(held)
    fresh = acquire(stub, doc(51, "restart"))
    assert not fresh.cached
    assert release(stub, again) and release(stub, fresh)
    assert not release(stub, held)  # its lease died with the old Redis


def test_eviction_lru_unpinned_only_and_crashed_holder(ckpt, redis_srv, tmp_path):
    """A 4-slot bank: the least recently used unpinned entry goes, pinned ones never (a full bank
    going idle frees the room of one entry, `_keep_room`); with every entry pinned a new document
    is refused and nothing leaks; a holder that never releases (crashed) stops protecting its
    entry once its lease runs out. Then a clean SIGTERM."""
    node = "small-node"
    small = start_bank(ckpt, redis_srv.url, tmp_path, memory_bytes=4 * 33280, node=node, metrics=False,
                       extra_args=("--full-wait-ms", "300"))
    try:
        stub = small.stub()
        assert stub.Stats(pb.StatsRequest(), timeout=10).slots_total == 4
        d = [doc(20 + i, f"evict{i}") for i in range(6)]
        keys = [document_key(TINY_MODEL_ID, x) for x in d]
        live = lambda: {e.doc_key for e in Directory(redis_srv.client(), TINY_MODEL_ID, node).entries()}  # noqa: E731
        evictions = lambda: stub.Stats(pb.StatsRequest(), timeout=10).evictions  # noqa: E731

        pinned0 = acquire(stub, d[0])  # the oldest entry, pinned throughout
        for i in (1, 2):
            assert release(stub, acquire(stub, d[i]))
        assert release(stub, acquire(stub, d[1]))  # d1 used again: LRU unpinned is now d2
        held3 = acquire(stub, d[3])  # the bank is full: idle, it frees room for one more
        assert not held3.cached
        wait_for(lambda: evictions() == 1, 5, "the room kept after the pass", every=0.01)
        assert live() == {keys[0], keys[1], keys[3]}

        crashed1 = acquire(stub, d[1], lease_ms=600)  # a holder that will never release
        held4 = acquire(stub, d[4])
        assert crashed1.cached and not held4.cached
        before = stub.Stats(pb.StatsRequest(), timeout=10)
        assert before.slots_used == 4 and before.evictions == 1  # every entry pinned: no room kept
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            acquire(stub, d[5])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert time.monotonic() - start >= 0.3, "refused before --full-wait-ms had passed"
        after = stub.Stats(pb.StatsRequest(), timeout=10)
        assert (after.slots_used, after.blocks_used, after.evictions) == (4, before.blocks_used, 1)
        assert live() == {keys[0], keys[1], keys[3], keys[4]}

        time.sleep(max(0.0, crashed1.lease_expires_unix_ms / 1000 - time.time()) + 0.1)
        held5 = acquire(stub, d[5])
        assert not held5.cached
        assert live() == {keys[0], keys[3], keys[4], keys[5]}  # the crashed holder's entry went
        again0 = acquire(stub, d[0])
        assert again0.cached and handle_of(again0) == handle_of(pinned0)
        for resp in (pinned0, held3, held4, held5, again0):
            assert release(stub, resp)
        assert not release(stub, crashed1)
        shm = small.shm_files()
        assert len(shm) == 1
    finally:
        rc = small.stop()
    assert rc == 0, small.log_text()[-3000:]
    assert not shm[0].exists(), "SIGTERM left the shared memory file"
    assert live() == set(), "the bank's directory namespace outlived it"


def test_a_full_bank_makes_a_new_document_wait_for_a_pin_to_go(ckpt, redis_srv, tmp_path):
    """Every entry pinned: a new document waits (no error) and is served once a holder releases;
    a waiting caller that gives up leaves nothing behind: its document is dropped, not passed,
    and no entry is evicted for it."""
    node = "full-node"
    small = start_bank(ckpt, redis_srv.url, tmp_path, memory_bytes=4 * 33280, node=node, metrics=False,
                       extra_args=("--full-wait-ms", "20000"))
    try:
        stub = small.stub()
        d = [doc(30 + i, f"full{i}") for i in range(6)]
        keys = [document_key(TINY_MODEL_ID, x) for x in d]
        live = lambda: {e.doc_key for e in Directory(redis_srv.client(), TINY_MODEL_ID, node).entries()}  # noqa: E731
        held = [acquire(stub, d[i]) for i in range(4)]  # all four slots pinned

        waiting = futures.ThreadPoolExecutor(1).submit(acquire, stub, d[4], 0, 30)
        time.sleep(0.5)
        assert not waiting.done(), "a new document was answered while every entry was pinned"
        assert release(stub, held[1])
        got = waiting.result(timeout=10)
        assert not got.cached and live() == {keys[0], keys[2], keys[3], keys[4]}  # d1 made room

        with pytest.raises(grpc.RpcError) as err:  # this caller gives up while it waits
            acquire(stub, d[5], timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.5)  # the bank notices (its 50 ms poll) and drops the job at a retry (10 ms)
        assert release(stub, held[2])
        time.sleep(0.5)
        assert live() == {keys[0], keys[2], keys[3], keys[4]}, "a document nobody waits for took a slot"
        stats = stub.Stats(pb.StatsRequest(), timeout=10)
        assert stats.slots_used == 4 and stats.evictions == 1
        for resp in (held[0], held[3], got):
            assert release(stub, resp)
    finally:
        rc = small.stop()
    assert rc == 0, small.log_text()[-3000:]


def acquirer_on_ladder(ladder):
    """An Acquirer whose passes follow the real `Passes` batching rules over a graph cache of
    `ladder` ("bank": the bank's default one; (tokens, seqs); None: no graphs), nothing captured
    and nothing run (no GPU here): for its `_take_batch`."""
    from types import SimpleNamespace

    from bank_service.acquire import Acquirer
    from bank_service.config import BankConfig
    from kev.exec.graphs import GraphCache, KeyLadder
    from kev.exec.passes import PassBuilder
    from kev.exec.plan import PassRole
    from kev.exec.static_pass import PassKind

    if ladder == "bank":  # the ladder the bank builds from its default settings
        config = BankConfig.from_env({"KEV_CHECKPOINT": "/ckpt", "KEV_REDIS_URL": "redis://localhost:6379/0",
                                      "KEV_BANK_MEMORY_BYTES": "1000000", "KEV_DEVICE": "cuda"}, [])
        states = PassBuilder(None, None, PassRole.STATES, config.graph_plan).ladders()[1]
        assert (states.max_tokens, states.max_seqs) == (config.max_pass_tokens, config.max_pass_documents)
    else:
        states = KeyLadder(PassKind.STATE, *ladder) if ladder else None
    passes = SimpleNamespace(graphs=GraphCache(states=states) if states else None, state_chunk_tokens=8192)
    for rule in ("state_keyed", "pieces_to_take", "piece_tokens"):
        setattr(passes, rule, getattr(Passes, rule).__get__(passes))
    metrics = SimpleNamespace(queue_depth=SimpleNamespace(set=lambda n: None))
    acq = Acquirer(passes, None, SimpleNamespace(model_id="m"), metrics, lease_s=30,
                   max_wait_s=0.0, max_pass_tokens=16384, max_pass_documents=64, epoch_check_s=1)
    return acq, passes, states


@pytest.mark.parametrize("lens,ladder,loaded,pieces", [
    ([48] * 70, "bank", False, [48] * 64),  # max_pass_documents (3,072 tokens: a key)
    ([48] * 20 + [100] * 10, (1152, 64), False, [48] * 20 + [64]),  # a 22nd document would leave the ladder;
    # 21 (1,060 tokens) pad to 1,152, so with more waiting the pass is cut to 1,024: the last one's first chunk
    ([1100] * 20, "bank", False, [1100] * 14 + [960]),  # the 15th document gives what fits: 16,360 tokens
    ([2200] * 8, "bank", False, [2200] * 7 + [960]),  # the bank's ladder covers its pass caps: only the caps stop a batch
    ([2200] * 8, (8192, 64), False, [2200] * 2 + [1728]),  # a ladder below the caps: 4 x 2,200 tokens would have
    # no key, and 3 pad to 7,168: cut to 6,144
    ([48] * 20, (16384, 8), False, [48] * 8),  # ... nor would a ninth document on a ladder of 8 documents
    ([2200] * 8, None, False, [2200] * 7 + [960]),  # no graphs (CPU): only the caps
    ([9000, 48, 48], (8192, 64), False, [8192]),  # a chunk a pass; with a companion, 8,240 tokens: no key
    ([9000, 20000, 48], "bank", False, [8192, 8192]),  # one chunk of each: the pass is full (16,384)
    ([5000, 48, 48], (4096, 64), False, [5000, 48, 48]),  # a pass that has no key from the start takes what the caps allow
    ([8000, 8010, 500], "bank", False, [8000, 8010, 320]),  # a piece ends on a whole delta-rule chunk: 374 fit, 320 go
    ([48] * 11, "bank", False, [48] * 11),  # all that waits, nothing arrived during the last pass: 528 in 640
    ([48] * 11, "bank", True, [48] * 10),  # loaded: more will come during this pass, so 480 in 512
], ids=["short", "fit-to-key", "split-at-cap", "long-bank-ladder", "long-small-ladder", "many-small-ladder",
        "long-no-graphs", "chunked", "two-long", "unkeyed-first", "aligned", "idle", "loaded"])
def test_state_pass_batch_stays_on_the_graphs(lens, ladder, loaded, pieces):
    """The worker's batch: up to the caps, the document that crosses the token cap giving what fits
    of it (whole chunks), never more than a chunk of one; never grown from a pass that runs in
    CUDA-graph keys (every chunk pass of it, `Passes.state_keyed`) into one that does not; with more
    work to follow, cut back to the key below when that pads a smaller share."""
    from bank_service.jobs import Job

    acq, passes, states = acquirer_on_ladder(ladder)
    for i, n in enumerate(lens):
        acq._queue.append(Job(f"d{i}", [1] * n, time.monotonic()))
    with acq._cv:
        batch = acq._take_batch(loaded)
    assert [p.end - p.start for p in batch] == pieces
    assert all(p.start == 0 for p in batch)  # every job's first piece
    assert len(acq._queue) == len(lens) - len(pieces)  # the pass's jobs leave the queue until it is done
    if states is not None:  # a batch started on the graphs stays on them
        assert passes.state_keyed(pieces) is passes.state_keyed([min(lens[0], 8192)])


def test_a_cut_back_never_holds_a_document_back_twice():
    """Behind a long document (a chunk a pass, always first in the queue) a short one would be cut
    off every pass to fit the key below (8,292 tokens pad to 10,240; 8,192 fill theirs): it is held
    back once, then goes in."""
    from bank_service.jobs import Job

    acq, _, _ = acquirer_on_ladder("bank")
    long, short = Job("long", [1] * 30000, time.monotonic()), Job("short", [1] * 100, time.monotonic())
    acq._queue.extend([long, short])
    taken = []
    for _ in range(3):
        with acq._cv:
            batch = acq._take_batch(loaded=True)
        taken.append([(p.job.doc_key, p.end - p.start) for p in batch])
        for p in batch:  # as after the pass: the long one goes back to the front for its next chunk
            p.job.done = p.end
        if long.done < len(long.tokens) and long not in acq._queue:
            acq._queue.appendleft(long)
        if short in [p.job for p in batch]:
            break
    assert taken == [[("long", 8192)], [("long", 8192), ("short", 100)]]


def test_new_states_are_done_on_the_device_before_anyone_hears_of_them():
    """The worker waits for its state pass to finish on the GPU before it registers the entries and
    answers the Acquires: a scorer reads them from its own process, on its own stream."""
    from types import SimpleNamespace

    from bank_service.acquire import Acquirer
    from bank_service.jobs import Job, Piece, Waiter
    from kev.bank.directory import Lease

    order = []
    passes = SimpleNamespace(state_pass=lambda docs, handles, starts: order.append("state_pass"),
                             synchronize=lambda: order.append("synchronize"))
    bank = SimpleNamespace(alloc=lambda n: BankHandle(len(order), 1), bind=lambda handle, fingerprint: None,
                           shortfall=lambda lens: (0, 0), entries_to_free=lambda lens: 0)

    def register_many(regs):
        order.extend("register" for _ in regs)
        return [Lease(f"lease-{r.doc_key}", r.doc_key, r.slot, r.generation, r.length, 0) if r.pin_lease_s else None
                for r in regs]

    directory = SimpleNamespace(model_id="m", epoch=lambda: "e", register_many=register_many)
    counter = SimpleNamespace(inc=lambda n=1: None, observe=lambda s: None)
    metrics = SimpleNamespace(state_pass_seconds=counter, state_passes=counter, state_pass_documents=counter,
                              state_pass_tokens=counter, state_pass_steps=SimpleNamespace(labels=lambda step: counter),
                              state_pass_cpu_seconds=counter)
    acq = Acquirer(passes, bank, directory, metrics, lease_s=30, max_wait_s=0.0, max_pass_tokens=16384,
                   max_pass_documents=64, epoch_check_s=1)
    acq._epoch = "e"
    waiters = [Waiter(30), Waiter(30)]
    jobs = [Job(f"d{i}", [1] * 8, time.monotonic(), [w]) for i, w in enumerate(waiters)]
    acq._process([Piece(job, 0, 8) for job in jobs], reconcile=False)
    assert order == ["state_pass", "synchronize", "register", "register"]
    assert all(w.done.is_set() and w.result is not None for w in waiters)
