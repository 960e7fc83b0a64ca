"""The scorer service end to end: real redis-server, bank and scorer processes (kev.stack.Stack).

Every answer must equal, bit for bit, what the in-process `kev.engine.Engine` answers for the same
request: on CPU both run the same model code with batch-invariant kernels, so neither the bank's
state-pass batching nor the scorer's row batching (rows of many requests, a request split over
passes) may change a single bit.

Helpers shared with the other end-to-end tests are in tests/service_support.py; the tiny checkpoint
fixture (`checkpoint`) is in tests/conftest.py.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kev.request import api
from kev.serving.processes import free_port
from kev.stack import Stack
from kev.v1 import scorer_pb2, scorer_pb2_grpc
from kev.rpc.wire import request_to_proto
from tiny_stack import TINY_MODEL_ID
from service_support import (
    MAX_DOC_TOKENS, _text, assert_same, bank_stats, directory, engine_answers, make_documents,
    make_question, make_requests, score, stack_for, wait_for,
)


# ---------------------------------------------------------------------------------------------
# fixtures


def start_while(stack: Stack, compute):
    """Starts `stack` in the background while `compute()` (the engine reference) runs here;
    returns its result with the stack up (stopped again if either fails)."""
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(stack.start)
        try:
            result = compute()
        except BaseException:
            started.exception()
            stack.stop()
            raise
    try:
        started.result()
    except BaseException:
        stack.stop()
        raise
    return result


@pytest.fixture(scope="module")
def served(checkpoint):
    """(stack, requests, the engine's responses). Small passes, so that requests are split over
    several passes and passes mix requests."""
    stack = stack_for(checkpoint, scorer_env={"KEV_MAX_ROWS_PER_PASS": "7", "KEV_MAX_TOKENS_PER_PASS": "256",
                                              "KEV_MAX_WAIT_MS": "5", "KEV_METRICS_PORT": str(free_port())})
    docs = make_documents(40)
    requests = make_requests(80, docs)
    # A request with more rows than a pass holds, and a truncated document.
    rng = random.Random(9)
    requests.append(api.ScoreRequest(docs[0], {f"many{j}": make_question(rng) for j in range(40)}))
    requests.append(api.ScoreRequest(_text(rng, 700), {"t": make_question(rng)}, truncate_document=True))
    want = start_while(stack, lambda: engine_answers(checkpoint, requests))
    with stack:
        yield stack, requests, want


def scorer_metric(stack: Stack, name: str) -> float:
    from bench.load import scrape

    port = stack.scorer_env["KEV_METRICS_PORT"]
    return scrape(f"http://127.0.0.1:{port}/metrics").get(name, 0.0)


# ---------------------------------------------------------------------------------------------
# tests


def test_answers_equal_in_process_engine(served):
    stack, requests, want = served
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        # Sequential first (each request alone: a new document's rows go with its Acquire, and the
        # idle bank answers them in the document's sweep), then concurrent (rows of many requests per pass).
        for r, w in zip(requests[:20], want[:20]):
            assert_same(score(stub, r), w)
        assert scorer_metric(stack, "kev_scorer_idle_sweeps_total") > 0
        assert scorer_metric(stack, "kev_scorer_pins_held") == 0  # a swept request holds none, releases none
        # each new document went to the bank with no directory look-up first (taken for new, unseen)
        assert scorer_metric(stack, "kev_scorer_directory_skips_total") >= len({repr(r.document) for r in requests[:20]})
        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda r: score(stub, r), requests))
    for g, w in zip(got, want):
        assert_same(g, w)
    assert got[-1].usage.truncated and got[-1].usage.document_tokens == MAX_DOC_TOKENS
    # A repeated document's state comes from the bank.
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        again = score(scorer_pb2_grpc.ScorerStub(channel), requests[0])
    assert again.usage.cached_state_tokens == again.usage.document_tokens
    assert directory(stack).pins_held() == 0
    # ... and its ids from the scorer's tokenized-document cache (bit for bit: the answers above)
    assert scorer_metric(stack, 'kev_scorer_document_cache_lookups_total{result="hit"}') >= 1


def server_time(client) -> float:
    """Redis's clock (MONITOR stamps each command with it): a watcher thread that reads the stream
    late cannot move a command across a window's edge."""
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_a_cached_request_asks_redis_twice(served):
    """A document the directory holds costs its request two Redis calls: the look-up, whose script
    pins it and returns the epoch the scorer checks its bank by, and the release; no epoch read of
    its own. Counted with MONITOR, scripts' own commands aside, against the services' background
    reads (the bank's epoch checks) over as long with no request."""
    stack, requests, want = served
    client = directory(stack).client
    seen, stop = [], threading.Event()

    def record():
        with client.monitor() as monitor:
            while not stop.is_set():
                c = monitor.next_command()
                if c.get("client_type") != "lua":  # a script's own commands come from "lua"
                    seen.append((c["time"], c["command"].split()[0].upper()))  # Redis's clock, not the watcher's

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        assert_same(score(stub, requests[0]), want[0])  # stored (again) if it was evicted
        time.sleep(0.5)  # its registration, if it took a pass, done
        start = server_time(client)
        for _ in range(20):
            got = score(stub, requests[0])
            assert got.usage.cached_state_tokens == got.usage.document_tokens
        middle = server_time(client)
        time.sleep(middle - start)  # as long with no request
        end = server_time(client)
    deadline = time.monotonic() + 10
    while not any(t >= end for t, _ in seen) and time.monotonic() < deadline:  # the watcher past the window
        client.ping()
        time.sleep(0.05)
    stop.set()
    client.ping()  # one more command, so the watcher wakes and stops
    watcher.join(5)
    assert any(t >= end for t, _ in seen), "the watcher never read past the window"

    def count(command, t0, t1):
        return sum(1 for t, c in seen if c == command and t0 <= t < t1)

    busy_gets, idle_gets = count("GET", start, middle), count("GET", middle, end)
    # the bank's own scripts (registering or evicting after a pass of the first request, on a slow
    # machine late) may fall in the window: a few, never the 20 a third call per request would add
    scripts = count("EVALSHA", start, middle) + count("EVAL", start, middle)
    assert 2 * 20 <= scripts <= 2 * 20 + 3, scripts
    assert busy_gets <= idle_gets + 2, (busy_gets, idle_gets)


def test_scorers_map_the_banks_weights(served):
    """One copy of the weights (issue 28): the bank shares them, and each scorer process maps the
    bank's weights file and reads its parameters from it (the engine comparison above holds its own
    weights: answers are the same)."""
    import json
    from pathlib import Path

    from kev.v1 import bank_pb2, bank_pb2_grpc

    stack, _, _ = served
    with grpc.insecure_channel(stack.bank_addr) as channel:
        resp = bank_pb2_grpc.BankStub(channel).Attach(bank_pb2.AttachRequest(model=TINY_MODEL_ID), timeout=10)
    assert resp.weights_shared and resp.weights
    path = json.loads(resp.weights[0].descriptor)["path"]
    assert Path(path).name.endswith("-weights") and {json.loads(d.descriptor)["path"] for d in resp.weights} == {path}
    scorer = stack.scorers[0]
    smaps = Path(f"/proc/{scorer.pid}/smaps").read_text().split("\n")
    start = next(i for i, line in enumerate(smaps) if line.endswith(path))
    rss_kb = next(int(line.split()[1]) for line in smaps[start + 1:] if line.startswith("Rss:"))
    assert rss_kb > 0, "the scorer maps the weights file but never read it"
    assert "mapped the weights of bank instance" in Path(scorer.log_path).read_text()


def test_second_scorer_gives_identical_answers(served):
    stack, requests, want = served
    second = stack.add_scorer(env={"KEV_METRICS_PORT": "0"})  # the first holds the fixture's port
    try:
        # Idle, documents it has not seen go to the bank unlooked-up; the bank holds them (the first
        # scorer's): it pins them and answers at once, and the rows run here, on the stored states.
        with grpc.insecure_channel(second) as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            for r, w in zip(requests[:5], want[:5]):
                got = score(stub, r)
                assert_same(got, w)
                assert got.usage.cached_state_tokens == got.usage.document_tokens
        for addr in (stack.scorer_addr, second):
            with grpc.insecure_channel(addr) as channel:
                stub = scorer_pb2_grpc.ScorerStub(channel)
                with ThreadPoolExecutor(8) as pool:
                    got = list(pool.map(lambda r: score(stub, r), requests[:60]))
            for g, w in zip(got, want[:60]):
                assert_same(g, w)
    finally:
        stack.scorers.pop().stop()
        stack.scorer_addrs.pop()
    assert directory(stack).pins_held() == 0


def test_list_models_health_and_reflection(served):
    stack = served[0]
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.scorer_addr) as channel:
        models = scorer_pb2_grpc.ScorerStub(channel).ListModels(scorer_pb2.ListModelsRequest(), timeout=10).models
        assert [(m.id, m.max_document_tokens, m.is_default) for m in models] == [(TINY_MODEL_ID, MAX_DOC_TOKENS, True)]
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kev.v1.Scorer"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"kev.v1.Scorer", "grpc.health.v1.Health"} <= names


def test_deadline_and_cancellation_release_pins(served):
    stack, requests, _ = served
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        big = requests[-2]  # 40 rows: several passes
        with pytest.raises(grpc.RpcError) as err:
            stub.ScoreQuestions(request_to_proto(big), timeout=0.005)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        futures = [stub.ScoreQuestions.future(request_to_proto(r)) for r in requests[:30]]
        time.sleep(0.05)
        for f in futures:
            f.cancel()
    wait_for(lambda: directory(stack).pins_held() == 0, 10, "pins released after cancellations")


@pytest.mark.slow  # 30 s of load by design; tests/bench/test_load.py and the chaos test drive load in CI
def test_64_clients_for_30_seconds(checkpoint):
    """Zero errors, every answer the engine's, no pins left, bank occupancy within its budget.
    ~37 s on the 2-core CPU machine (30 s of load + start-up); not marked `slow` (under 40 s)."""
    # More distinct documents than the bank has slots (~126): entries are evicted under load.
    requests = make_requests(200, make_documents(200, seed=5), seed=6, cycle=True)
    errors, done, stop = [], [0], threading.Event()
    lock = threading.Lock()
    stack = stack_for(checkpoint, scorer_env={"KEV_MAX_WAIT_MS": "3"})
    want = start_while(stack, lambda: engine_answers(checkpoint, requests))
    with stack:
        total = bank_stats(stack)

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with grpc.insecure_channel(stack.scorer_addr) as channel:
                stub = scorer_pb2_grpc.ScorerStub(channel)
                while not stop.is_set():
                    i = rng.randrange(len(requests))
                    try:
                        assert_same(score(stub, requests[i]), want[i])
                    except BaseException as e:  # noqa: BLE001 - collected and reported below
                        with lock:
                            errors.append(f"request {i}: {e!r}")
                    with lock:
                        done[0] += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(64)]
        start = time.monotonic()
        for t in threads:
            t.start()
        occupancy = []
        while time.monotonic() - start < 30:
            s = bank_stats(stack)
            occupancy.append((s.slots_used, s.blocks_used))
            time.sleep(1)
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        assert not errors, f"{len(errors)} errors of {done[0]}: {errors[:5]}"
        assert done[0] > 64 and elapsed >= 30
        wait_for(lambda: directory(stack).pins_held() == 0, 10, "no pins left")
        final = bank_stats(stack)
        assert final.pins_held == 0 and final.evictions > 0
        assert all(s <= total.slots_total and b <= total.blocks_total for s, b in occupancy)
        print(f"\n64 clients: {done[0]} requests in {elapsed:.1f} s ({done[0] / elapsed:.1f}/s), "
              f"bank hits {final.hits} misses {final.misses} evictions {final.evictions}, "
              f"max slots used {max(s for s, _ in occupancy)}/{total.slots_total}")


def test_start_up_waits_for_the_bank_but_not_for_a_broken_warm_up():
    """`attach_until_ready`: UNAVAILABLE (no bank yet) is waited out until the stop signal; a warm-up
    request that fails on the scorer's own path ends the start-up after WARM_UP_TRIES, with the
    error (the process then exits 1), instead of looking like a bank still starting."""
    import threading
    from types import SimpleNamespace

    from kev.serving.errors import ServiceError, Unavailable
    from scorer_service.__main__ import WARM_UP_TRIES, StartupFailed, attach_until_ready

    calls = []

    def service(error):
        def warm_up():
            calls.append(error)
            raise error
        return SimpleNamespace(link=SimpleNamespace(attachment=lambda: None), warm_up=warm_up)

    stop = threading.Event()
    threading.Timer(1.2, stop.set).start()
    assert attach_until_ready(service(Unavailable("bank unreachable")), stop) is False  # stopped while waiting
    assert len(calls) >= 2
    calls.clear()
    with pytest.raises(StartupFailed, match="row pass failed: boom"):
        attach_until_ready(service(ServiceError("row pass failed: boom")), threading.Event())
    assert len(calls) == WARM_UP_TRIES
