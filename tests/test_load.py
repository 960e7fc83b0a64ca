"""The load generator (bench/load.py) on the CPU stack, its exact-length workloads, and the naive
baseline (bench/load_baseline.py) against the in-process engine.

CI-sized: the tiny random checkpoint (tiny_stack), the embedded stack on CPU, 8 clients for 3 s of
six-short at its real lengths (48-token new documents, 6 rows of 32 tokens: cheap on the tiny
model). Any error fails the run. The GPU comparison is bench/load_compare.py.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health

from kev import api
from kev.prompts import validate_and_build
from kev.stack import Stack, free_port
from kev.v1 import scorer_pb2 as pb
from kev.wire import response_from_proto
from test_scorer_service import engine_answers
from tiny_checkpoints import hide_fla
from tiny_stack import make_tiny_checkpoint

try:  # `python -m pytest` from the repo root has it on sys.path; a bare `pytest` may not
    import bench  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import load  # noqa: E402
from bench.load_baseline import BaselineBatcher, BaselineScorer, BaselineService, build_server  # noqa: E402
from bench.load_workloads import WORKLOADS, RequestStream, TextMaker, load_builder  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "kev-tiny")


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_have_exact_token_lengths(checkpoint, name):
    model_id, tokenizer, builder = load_builder(checkpoint)
    workload = WORKLOADS[name]
    stream = RequestStream(TextMaker(tokenizer, builder), model_id, workload, seed=3)
    items = [stream.next() for _ in range(12)] + stream.sample(2)
    for item in items:
        prepared = validate_and_build(item.request, builder)  # the server's own rendering
        assert len(prepared.document_ids) == item.doc_tokens
        assert item.doc_tokens in workload.doc_tokens or workload.doc_range[0] <= item.doc_tokens <= workload.doc_range[1]
        lo, hi = workload.questions
        assert lo <= len(prepared.rows) <= hi
        lengths = [len(r.prompt.ids) for r in prepared.rows]
        assert all(workload.row_tokens[0] <= n <= workload.row_tokens[1] for n in lengths), lengths
        assert sum(lengths) == item.row_tokens
    kinds = {q.type for item in items for q in item.request.questions.values()}
    assert kinds == set(api.QuestionType) or name == "longdoc"  # longdoc: 1-3 questions, few requests here
    if workload.repeat_share:
        assert any(item.repeat for item in items)


def test_load_generator_on_the_cpu_stack(checkpoint, tmp_path):
    metrics_port = free_port()
    stack = Stack(checkpoint, bank_memory_bytes=4 << 20, max_document_tokens=512,
                  bank_flags=["--avg-doc-tokens", "64"], scorer_env={"KEV_METRICS_PORT": str(metrics_port)})
    out = tmp_path / "load.json"
    with stack:
        rc = load.main(["--addr", stack.scorer_addr, "--checkpoint", str(checkpoint), "--workload", "six-short",
                        "--clients", "8", "--duration", "3", "--warmup-s", "0.5",
                        "--metrics-url", f"http://127.0.0.1:{metrics_port}/metrics", "--out", str(out)])
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["errors"] == {} and run["error_count"] == 0 and rc == 0
    for key in ("commit", "gpu", "packages", "command"):
        assert data[key], key
    assert run["clients"] == 8 and run["workload"] == "six-short"
    assert run["ok"] == run["requests"] >= 8 and run["requests_per_s"] > 0
    assert 0 < run["p50_ms"] <= run["p90_ms"] <= run["p99_ms"] <= run["max_ms"]
    assert run["doc_tokens_mean"] == 48 and run["questions_mean"] == 6
    assert run["bank_hit_ratio"] == 0 and run["scorer_bank_hit_ratio"] == 0  # a new document every request
    assert run["row_passes"] > 0 and 1 <= run["rows_per_pass"] <= 96
    assert run["row_tokens_per_pass"] == pytest.approx(32 * run["rows_per_pass"])


def test_baseline_answers_match_the_engine(checkpoint):
    model_id, tokenizer, builder = load_builder(checkpoint)
    stream = RequestStream(TextMaker(tokenizer, builder), model_id, WORKLOADS["mixed"].scaled(0.25), seed=5)
    items = stream.sample(8)
    with hide_fla() as calls:  # transformers' torch paths: fla's Triton kernels cannot run on a CPU
        scorer = BaselineScorer(checkpoint)
        batcher = BaselineBatcher(scorer)
        server = build_server(BaselineService(scorer, batcher), health.HealthServicer(), threads=16)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_unary("/kev.v1.Scorer/ScoreQuestions", request_serializer=None,
                                           response_deserializer=pb.ScoreQuestionsResponse.FromString)
                with ThreadPoolExecutor(8) as pool:  # concurrent: several requests share a padded forward
                    replies = list(pool.map(lambda item: call(item.payload, timeout=120), items))
        finally:
            server.stop(0)
            batcher.stop()
    assert calls["torch_chunk_gated_delta_rule"], "transformers did not run its torch reference"
    got = [response_from_proto(r, item.request) for r, item in zip(replies, items)]
    want = engine_answers(checkpoint, [item.request for item in items])
    for g, w in zip(got, want):
        assert g.usage.document_tokens == w.usage.document_tokens and g.usage.cached_state_tokens == 0
        for name, answer in w.answers.items():
            assert probabilities(g.answers[name]) == pytest.approx(probabilities(answer), abs=1e-4, rel=0), name


def probabilities(answer: api.Answer) -> list[float]:
    if isinstance(answer, api.NoulAnswer):
        return [answer.p_yes]
    if isinstance(answer, api.ChoiceAnswer):
        return list(answer.probabilities.values())
    return list(answer.probabilities)
