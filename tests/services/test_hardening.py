"""Issue 27 hardening on the real CPU stack (tiny model, real Redis, bank and scorer processes):
deadlines, fair admission, bounded memory on big input, directory integrity.

One small stack per module; each test leaves it as it found it (no pin held)."""

from __future__ import annotations

import grpc
import pytest

from kev.request import api
from kev.rpc.client import KevClient
from kev.serving.processes import free_port
from kev.rpc.wire import request_to_proto, response_from_proto
from kev.v1 import scorer_pb2_grpc
from service_support import (  # noqa: F401
    PLAIN, assert_same, directory, engine_answers, make_documents, make_requests, stack_for, wait_for,
)


@pytest.fixture(scope="module")
def stack(checkpoint):
    metrics_port = free_port()
    # A 1 MiB bank (~30 slots): the Redis test fills it.
    with stack_for(checkpoint, bank_memory_bytes=1 << 20, scorer_env={"KEV_METRICS_PORT": str(metrics_port)}) as s:
        s.test_metrics_port = metrics_port
        yield s


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.scorer_addr) as channel:
        yield scorer_pb2_grpc.ScorerStub(channel)


def no_pins_left(stack) -> None:
    wait_for(lambda: directory(stack).pins_held() == 0, 10, "pins released")


# ---------------------------------------------------------------------------------------------
# 1. deadlines


def test_a_call_without_deadline_answers_a_new_document(stack, stub, checkpoint):
    """No deadline means the server's default budget (KEV_DEFAULT_DEADLINE_S), never an instant
    DEADLINE_EXCEEDED from a ~9.2e18 s time_remaining() passed on to Bank.Acquire."""
    requests = make_requests(2, make_documents(2, seed=2701), seed=2702, cycle=True)
    want = engine_answers(checkpoint, requests)
    got = response_from_proto(stub.ScoreQuestions(request_to_proto(requests[0])), requests[0])  # no timeout
    assert_same(got, want[0])
    assert got.usage.cached_state_tokens == 0  # a new document: the bank ran its state pass
    client = KevClient(stack.scorer_addr, checkpoint)
    try:
        assert_same(client.score(requests[1], timeout=None), want[1])
    finally:
        client.close()
    no_pins_left(stack)


# ---------------------------------------------------------------------------------------------
# 2. fair admission

BIG_QUESTIONS = 10_000
SMALL_P99_BOUND_S = 3.0  # 2 shared CPU cores; alone a small request takes ~20-50 ms


def test_one_huge_request_does_not_starve_the_others(stack, checkpoint):
    """With one 10,000-question request in flight, 30 small requests from 6 other clients all
    succeed (bit-identical to the engine), their p99 under SMALL_P99_BOUND_S; the big one is
    answered in full."""
    import threading
    import time

    from kev.v1 import scorer_pb2 as pb

    big = pb.ScoreQuestionsRequest(document_text="the customer is angry about a late refund", questions={
        f"q{i}": pb.Question(type=pb.Question.NOUL, instructions=f"is it {PLAIN[i % len(PLAIN)]} {i % 97}")
        for i in range(BIG_QUESTIONS)})
    small = make_requests(30, make_documents(10, seed=2711), seed=2712, cycle=True, max_questions=3)
    want = engine_answers(checkpoint, small)
    for r in small[:10]:  # states in the bank: the small requests measure row admission, not state passes
        with grpc.insecure_channel(stack.scorer_addr) as ch:
            scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(request_to_proto(r), timeout=60)
    result, errors, latencies = {}, [], []

    def send_big() -> None:
        with grpc.insecure_channel(stack.scorer_addr) as ch:
            result["big"] = scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(big, timeout=300)

    def client(k: int) -> None:
        with grpc.insecure_channel(stack.scorer_addr) as ch:
            s = scorer_pb2_grpc.ScorerStub(ch)
            for i in range(k, 30, 6):
                t0 = time.perf_counter()
                try:
                    got = response_from_proto(s.ScoreQuestions(request_to_proto(small[i]), timeout=60), small[i])
                    latencies.append(time.perf_counter() - t0)
                    assert_same(got, want[i])
                except Exception as e:  # noqa: BLE001 - collected, asserted below
                    errors.append(e)

    big_thread = threading.Thread(target=send_big)
    big_thread.start()
    wait_for(lambda: stack_depth(stack) > 1000, 60, "the big request's rows queued", every=0.02)
    clients = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    still_running = big_thread.is_alive()
    big_thread.join()
    assert not errors, errors[:3]
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"small requests beside a {BIG_QUESTIONS}-question one: p50 {latencies[len(latencies) // 2]:.3f} s, "
          f"p99 {p99:.3f} s; big request still running when they finished: {still_running}")
    assert still_running, "the big request finished before the small ones: the test measured nothing"
    assert p99 < SMALL_P99_BOUND_S
    assert len(result["big"].answers) == BIG_QUESTIONS
    no_pins_left(stack)


def stack_depth(stack) -> float:
    """The scorer's kev_scorer_queue_depth (rows waiting)."""
    from bench.load import scrape

    return scrape(f"http://127.0.0.1:{stack.test_metrics_port}/metrics").get("kev_scorer_queue_depth", 0.0)


def test_question_cap_is_invalid_argument(stub):
    from kev.v1 import scorer_pb2 as pb

    over = pb.ScoreQuestionsRequest(document_text="the customer", questions={
        f"q{i}": pb.Question(type=pb.Question.NOUL, instructions="is it") for i in range(BIG_QUESTIONS + 1)})
    with pytest.raises(grpc.RpcError) as err:
        stub.ScoreQuestions(over, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("questions: 10001 questions is over the limit of 10000")


# ---------------------------------------------------------------------------------------------
# 3. bounded memory on big input

BIG_DOC_BYTES = 15 << 20
RSS_GROWTH_BOUND = 500 << 20
CLIENT_BOUND_S = 3.0


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def test_four_15_mib_documents_are_refused_fast_with_bounded_memory(stack, stub):
    """4 concurrent 15 MiB documents: each INVALID_ARGUMENT before tokenising, within 1 s of the
    scorer holding it (its own latency histogram); the scorer's peak RSS (VmHWM) grows < 500 MB; a
    small request meanwhile is answered.

    End to end the client also pays for sending 60 MiB over loopback gRPC, which on CI's two busy
    cores took 0.7-1.1 s; that bound is looser (CLIENT_BOUND_S), still well under the 6.7 s one
    such document takes to tokenise alone on this project's 2-core machine."""
    import threading
    import time

    from kev.v1 import scorer_pb2 as pb

    from bench.load import scrape

    refused_within_1s = f'kev_scorer_requests_seconds_bucket{{code="INVALID_ARGUMENT",le="1.0"}}'
    metrics_url = f"http://127.0.0.1:{stack.test_metrics_port}/metrics"
    pid = stack.scorers[0].pid
    stub.ScoreQuestions(pb.ScoreQuestionsRequest(document_text="hello", questions={
        "q": pb.Question(type=pb.Question.NOUL, instructions="is it")}), timeout=60)
    hwm_before = _status_kib(pid, "VmHWM") << 10
    fast_before = scrape(metrics_url).get(refused_within_1s, 0.0)
    word = "customer refund late "
    texts = [(word * (BIG_DOC_BYTES // len(word) + 1))[:BIG_DOC_BYTES - i] for i in range(4)]
    results = []

    def send(text: str, json: bool) -> None:
        field = {"document_json": '{"a": "' + text + '"}'} if json else {"document_text": text}
        msg = pb.ScoreQuestionsRequest(**field, questions={"q": pb.Question(type=pb.Question.NOUL, instructions="is it")})
        with grpc.insecure_channel(stack.scorer_addr, options=[("grpc.max_send_message_length", -1)]) as ch:
            s = scorer_pb2_grpc.ScorerStub(ch)
            t0 = time.perf_counter()
            try:
                s.ScoreQuestions(msg, timeout=60)
                results.append(("OK", time.perf_counter() - t0, ""))
            except grpc.RpcError as e:
                results.append((e.code().name, time.perf_counter() - t0, e.details()))

    threads = [threading.Thread(target=send, args=(t, i == 3)) for i, t in enumerate(texts)]
    for t in threads:
        t.start()
    small_t0 = time.perf_counter()
    stub.ScoreQuestions(pb.ScoreQuestionsRequest(document_text="the refund", questions={
        "q": pb.Question(type=pb.Question.NOUL, instructions="is it late")}), timeout=60)
    small_s = time.perf_counter() - small_t0
    for t in threads:
        t.join()
    growth = (_status_kib(pid, "VmHWM") << 10) - hwm_before
    print(f"4 x 15 MiB: {[(c, round(s, 3)) for c, s, _ in results]}, small request {small_s:.3f} s, "
          f"scorer peak RSS growth {growth >> 20} MiB")
    assert len(results) == 4
    for code, seconds, details in results:
        assert code == "INVALID_ARGUMENT", details
        assert details.startswith("document: document ") and "before" in details, details
        assert seconds < CLIENT_BOUND_S
    assert scrape(metrics_url).get(refused_within_1s, 0.0) - fast_before == 4  # the scorer's own time
    assert growth < RSS_GROWTH_BOUND
    no_pins_left(stack)


def test_truncation_cuts_a_huge_document_before_tokenising(stub):
    from kev.v1 import scorer_pb2 as pb

    msg = pb.ScoreQuestionsRequest(document_text="refund " * (1 << 20), truncate_document=True,
                                   questions={"q": pb.Question(type=pb.Question.NOUL, instructions="is it")})
    reply = stub.ScoreQuestions(msg, timeout=60)
    assert reply.usage.truncated and reply.usage.document_tokens == 512


# ---------------------------------------------------------------------------------------------
# 6. directory integrity


def test_a_forged_directory_entry_never_answers_from_another_document(stack, stub, checkpoint):
    """Rewriting document A's entry to point at document B's slot and generation: the scorer sees
    B's key fingerprint in the shared bank, drops the entry and answers A from A's own state (or
    fails clearly); never with B's answers."""
    from kev.bank.doc_key import document_key
    from kev.loading import LoadedModel
    from kev.request.prompts import Limits, validate_and_build

    docs = ["the customer is angry about a late refund", "the invoice was paid early by legal"]
    question = make_requests(1, ["x"], seed=2761)[0].questions
    reqs = [api.ScoreRequest(d, question) for d in docs]
    want = engine_answers(checkpoint, reqs)
    assert want[0].answers != want[1].answers
    for r in reqs:  # both states in the bank
        response_from_proto(stub.ScoreQuestions(request_to_proto(r), timeout=60), r)
    loaded = LoadedModel.load(checkpoint, limits=Limits(max_document_tokens=512))
    keys = [document_key(loaded.model_id, validate_and_build(r, loaded.builder).document_ids) for r in reqs]
    d = directory(stack)
    entries = {e.doc_key: e for e in d.entries()}
    a, b = entries[keys[0]], entries[keys[1]]
    d.client.hset(d.prefix + "e:" + a.doc_key, mapping={"slot": b.slot, "generation": b.generation})

    try:
        got = response_from_proto(stub.ScoreQuestions(request_to_proto(reqs[0]), timeout=60), reqs[0])
    except grpc.RpcError as e:  # allowed: a clear error naming the mismatch
        assert "another document" in e.details(), e.details()
    else:
        assert got.answers == want[0].answers
    fixed = {e.doc_key: e for e in d.entries()}.get(a.doc_key)
    assert fixed is None or (fixed.slot, fixed.generation) == (a.slot, a.generation)
    assert "holds another document" in stack.scorers[0].log_text()
    got = response_from_proto(stub.ScoreQuestions(request_to_proto(reqs[0]), timeout=60), reqs[0])
    assert got.answers == want[0].answers  # repaired
    no_pins_left(stack)


# ---------------------------------------------------------------------------------------------
# 5. Redis loss

REDIS_RECOVERY_BOUND_S = 1.0


def test_new_document_within_a_second_of_redis_coming_back_empty(stack, stub, checkpoint):
    """The bank full of entries, Redis restarts empty: the bank re-registers them unpinned, so a new
    document is answered within 1 s of Redis answering again (it used to wait ~30 s for protective
    pins of a whole lease)."""
    import time

    from service_support import bank_stats

    docs = make_documents(80, seed=2751)
    fill = make_requests(80, docs, seed=2752, cycle=True, max_questions=1)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda r: stub.ScoreQuestions(request_to_proto(r), timeout=60), fill))
    stats = bank_stats(stack)
    assert stats.slots_used == stats.slots_total or stats.blocks_used > stats.blocks_total - 8, stats
    no_pins_left(stack)
    new = make_requests(1, make_documents(1, seed=2753), seed=2754)[0]
    want = engine_answers(checkpoint, [new])[0]
    stack.restart_redis()
    t0 = time.monotonic()
    codes = []
    while True:
        try:
            got = response_from_proto(stub.ScoreQuestions(request_to_proto(new), timeout=5), new)
            break
        except grpc.RpcError as e:
            codes.append(e.code().name)
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 10, codes
            time.sleep(0.02)
    elapsed = time.monotonic() - t0
    print(f"new document answered {elapsed:.3f} s after Redis came back empty (errors before: {codes})")
    assert_same(got, want)
    assert got.usage.cached_state_tokens == 0
    assert elapsed < REDIS_RECOVERY_BOUND_S
    no_pins_left(stack)
