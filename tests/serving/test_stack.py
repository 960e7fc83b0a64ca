"""The embedded stack (kev.stack), the `kev` CLI, and fault tests on real processes.

Faults: a scorer killed mid-request (its lease expires, its entry becomes evictable and is
evicted), Redis restarted (the service recovers, never a wrong answer), the bank stopped or
crashed and restarted (the scorer answers UNAVAILABLE, then recovers without a restart of its own).
Every successful answer is compared bit for bit with the in-process engine's.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import grpc
import pytest

from kev.request import api
from kev.rpc import cli
from kev.bank.doc_key import document_key
from kev.serving.processes import StackError
from kev.stack import Stack
from kev.v1 import scorer_pb2_grpc
from kev.rpc.wire import request_to_proto
from service_support import (  # noqa: F401
    assert_same, bank_stats, directory, engine_answers, make_documents,
    make_engine, make_question, make_requests, score, stack_for, wait_for,
)
from tiny_stack import TINY_MODEL_ID

LEASE_S = 2.0


@pytest.fixture(scope="module")
def corpus(checkpoint):
    requests = make_requests(48, make_documents(48, seed=21), seed=22, cycle=True)
    return requests, engine_answers(checkpoint, requests)


def fault_stack(checkpoint, **kw) -> Stack:
    # ~30 slots (1 MiB), short leases: expiry and eviction are quick to observe.
    return stack_for(checkpoint, bank_memory_bytes=1 << 20, lease_seconds=LEASE_S, **kw)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# the stack and the CLI


def test_stack_starts_serves_cli_and_stops_cleanly(checkpoint, tmp_path, capsys):
    stack = stack_for(checkpoint)
    with stack:
        pids = [p.popen.pid for p in (stack.redis, stack.bank, *stack.scorers)]
        workdir = stack.dir
        assert cli.main(["models", "--addr", stack.scorer_addr]) == 0
        models = json.loads(capsys.readouterr().out)["models"]
        assert models[0]["id"] == TINY_MODEL_ID and models[0]["is_default"]

        request = {"document": {"customer": "ann", "order": ["phone", "broken screen"]},
                   "questions": {"urgent": {"type": "noul", "instructions": "is it urgent", "true": "very"},
                                 "team": {"type": "choice", "instructions": "which team",
                                          "options": {"billing": "money", "support": None}},
                                 "anger": {"type": "score", "instructions": "how angry",
                                           "levels": ["calm", "angry"]}}}
        path = tmp_path / "request.json"
        path.write_text(json.dumps(request))
        assert cli.main(["score", str(path), "--addr", stack.scorer_addr]) == 0
        reply = json.loads(capsys.readouterr().out)
        assert set(reply["answers"]) == {"urgent", "team", "anger"}
        assert reply["answers"]["team"]["choice"]["choice"] in ("billing", "support")
        assert reply["usage"]["document_tokens"] > 0 and reply["model"] == TINY_MODEL_ID

        assert cli.main(["bank-stats", "--bank-addr", stack.bank_addr]) == 0
        stats = json.loads(capsys.readouterr().out)
        assert stats["slots_used"] >= 1 and stats["pins_held"] == 0

        path.write_text(json.dumps({**request, "questions": {"x": {"type": "bogus", "instructions": "?"}}}))
        assert cli.main(["score", str(path), "--addr", stack.scorer_addr]) == 2
        path.write_text(json.dumps({**request, "questions": {}}))
        assert cli.main(["score", str(path), "--addr", stack.scorer_addr]) == 1
        assert "INVALID_ARGUMENT: questions:" in capsys.readouterr().err
    assert not any(pid_alive(pid) for pid in pids)
    assert not workdir.exists()  # sockets, logs and the bank's shared-memory file are gone


def test_stack_without_redis_server_says_so(checkpoint, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StackError, match="redis-server not found"):
        Stack(checkpoint).start()


def test_a_start_up_cut_short_says_where_each_service_was(checkpoint):
    """A time limit's SIGTERM while the services start (load_compare turns it into SystemExit) stops
    the stack and prints each service's log tail first: the services' logs go with the stack's
    folder, and a start-up that hangs would otherwise leave no word of why."""
    import signal
    import subprocess
    import sys

    code = ("import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
            f"from kev.stack import Stack; Stack({str(checkpoint)!r}).start()")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    time.sleep(3.0)  # the bank is loading; the scorer waits for it
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "--- bank log tail (start-up interrupted) ---" in err and "--- scorer" in err, err[-2000:]


# ---------------------------------------------------------------------------------------------
# faults


@pytest.mark.slow  # ~30 s; the chaos test's SIGKILLed scorer and pins back at 0 run in CI
def test_long_request_renews_and_killed_scorer_lease_expires(checkpoint, corpus):
    requests, want = corpus
    with fault_stack(checkpoint) as stack:
        victim = stack.add_scorer(env={"KEV_MAX_ROWS_PER_PASS": "1"})  # one row per pass: a slow request
        engine = make_engine(checkpoint)
        rng = random.Random(3)
        slow = api.ScoreRequest("a document only the victim sees", {f"q{i}": make_question(rng) for i in range(2000)})
        key = document_key(TINY_MODEL_ID, engine.loaded.builder.document_tokens(slow.document)[0])
        d = directory(stack)
        with grpc.insecure_channel(victim) as channel:
            future = scorer_pb2_grpc.ScorerStub(channel).ScoreQuestions.future(request_to_proto(slow), timeout=60)
            wait_for(lambda: any(e.doc_key == key and e.pins for e in d.entries()), 20, "the victim's pin")
            time.sleep(LEASE_S * 1.5)  # the request outlives its first lease: the scorer renews it
            assert not future.done()
            assert [e.pins for e in d.entries() if e.doc_key == key] == [1]
            stack.kill_scorer(1)
            with pytest.raises(grpc.RpcError) as err:
                future.result()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [e.pins for e in d.entries() if e.doc_key == key] == [1]  # still leased...
        wait_for(lambda: [e.pins for e in d.entries() if e.doc_key == key] == [0], LEASE_S + 3, "lease expiry")
        # ...and now evictable: new documents through the surviving scorer push it out of the bank.
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            for r, w in zip(requests, want):
                assert_same(score(stub, r), w)
        assert key not in {e.doc_key for e in d.entries()}
        assert bank_stats(stack).evictions > 0 and d.pins_held() == 0


def _hammer(stack: Stack, requests, want, stop: threading.Event, outcomes: list, threads: int = 8):
    """Clients sending requests until `stop`, recording (time, code, details); a success that is
    not the engine's answer is recorded as "WRONG ANSWER" (and fails the test's outcome check)."""

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            while not stop.is_set():
                i = rng.randrange(len(requests))
                try:
                    got = score(stub, requests[i], timeout=30)
                except grpc.RpcError as e:
                    outcomes.append((time.monotonic(), e.code(), e.details()))
                    time.sleep(0.05)
                    continue
                try:
                    assert_same(got, want[i])
                    outcomes.append((time.monotonic(), grpc.StatusCode.OK, ""))
                except AssertionError as e:
                    outcomes.append((time.monotonic(), "WRONG ANSWER", f"request {i}: {e}"))

    workers = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    return workers


def _all_ok_soon(stack: Stack, requests, want, within_s: float = 20.0) -> None:
    """Recovery: within `within_s`, a full round of requests succeeds with the engine's answers."""
    deadline = time.monotonic() + within_s
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        stub = scorer_pb2_grpc.ScorerStub(channel)
        while True:
            try:
                for r, w in zip(requests, want):
                    assert_same(score(stub, r, timeout=30), w)
                return
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def _expect_unavailable(stack: Stack, request, *phrases: str) -> None:
    with grpc.insecure_channel(stack.scorer_addr) as channel, pytest.raises(grpc.RpcError) as err:
        scorer_pb2_grpc.ScorerStub(channel).ScoreQuestions(request_to_proto(request), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert any(p in err.value.details() for p in phrases), err.value.details()


@pytest.mark.slow  # ~18 s; test_chaos.py and test_hardening.py restart Redis in CI
def test_redis_down_and_restarted(checkpoint, corpus):
    requests, want = corpus
    with fault_stack(checkpoint) as stack:
        scorer_pid = stack.scorers[0].popen.pid
        _all_ok_soon(stack, requests[:16], want[:16])
        stack.kill_redis()  # down: UNAVAILABLE naming Redis
        _expect_unavailable(stack, requests[0], "Redis")
        stack.start_redis()
        _all_ok_soon(stack, requests, want)
        # A restart under load: errors are UNAVAILABLE only, answers are never wrong.
        stop, outcomes = threading.Event(), []
        workers = _hammer(stack, requests, want, stop, outcomes)
        time.sleep(1.0)
        stack.restart_redis()
        time.sleep(3.0)
        stop.set()
        for w in workers:
            w.join(60)
        assert not any(w.is_alive() for w in workers)
        # Besides UNAVAILABLE: right after the restart the bank re-registers its entries with a
        # protective pin of one lease (readers from before may still be mid-pass), so for that
        # long a full bank has no evictable entry for a new document.
        bad = [o for o in outcomes if o[1] not in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
               and not (o[1] == grpc.StatusCode.RESOURCE_EXHAUSTED and "every entry pinned" in o[2])]
        assert not bad, bad[:5]
        _all_ok_soon(stack, requests, want)
        wait_for(lambda: directory(stack).pins_held() == 0, 10, "no pins left")
        assert stack.scorers[0].popen.pid == scorer_pid


@pytest.mark.slow  # ~35 s each; tests/services/test_chaos.py restarts a SIGKILLed bank under load in CI
@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "crashed"])
def test_bank_restart(checkpoint, corpus, crash):
    requests, want = corpus
    with fault_stack(checkpoint) as stack:
        scorer_pid = stack.scorers[0].popen.pid
        _all_ok_soon(stack, requests[:16], want[:16])
        stop, outcomes = threading.Event(), []
        workers = _hammer(stack, requests, want, stop, outcomes, threads=4)
        time.sleep(0.5)
        stack.stop_bank(kill=crash)
        # A document the bank never saw needs a state pass: UNAVAILABLE while the bank is down.
        _expect_unavailable(stack, api.ScoreRequest("a brand new document", requests[-1].questions), "bank")
        stack.start_bank()
        _all_ok_soon(stack, requests, want)
        stop.set()
        for w in workers:
            w.join(60)
        assert {code for _, code, _ in outcomes} <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
        assert stack.scorers[0].popen.pid == scorer_pid and stack.scorers[0].alive  # recovered on its own
        assert stack.scorers[0].log_tail(1 << 20).count("attached bank instance") == 2  # re-attached once
        wait_for(lambda: directory(stack).pins_held() == 0, 10, "no pins left")
