"""Issue 26 on the bench side: the varied workloads' length distributions, the load figures
against the matmul ceiling (tokens/s, ceiling fraction, eager passes) and a load test whose
services start with their defaults. CPU only, no stack: the tiny test checkpoint, a fake scorer
for the token accounting and a fake stack for what the driver passes."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import grpc
import pytest

from kev.request import api
from kev.request.prompts import validate_and_build
from kev.v1 import scorer_pb2 as pb

from bench import load, load_compare
from bench.common import kev4b_config
from bench.load_workloads import WORKLOADS, RequestStream, TextMaker, load_builder

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def maker(checkpoint):
    model_id, tokenizer, builder = load_builder(checkpoint)
    return model_id, TextMaker(tokenizer, builder)


def measured(stream: RequestStream, n: int) -> list[tuple]:
    """n requests of the stream: (item, document tokens, row lengths by kind) as the server's prompt
    builder renders them, checked against what the generator says it made."""
    out = []
    for _ in range(n):
        item = stream.next()
        prepared = validate_and_build(item.request, stream.maker.builder)
        rows = [(q.type, len(r.prompt.ids)) for q, r in zip(item.request.questions.values(), prepared.rows)]
        assert len(prepared.document_ids) == item.doc_tokens and sum(n for _, n in rows) == item.row_tokens
        out.append((item, item.doc_tokens, rows))
    return out


def test_every_kind_reaches_12_and_128_row_tokens(maker):
    _, m = maker
    for kind in api.QuestionType:
        assert m.min_row_tokens(kind) <= 12  # 9: <q>, one word, two one-word options, <decide>
        for tokens in (12, 128):
            q = m.question(random.Random(tokens), kind, tokens)
            assert len(m.builder.row_tokens(q).ids) == tokens
    # a long choice row carries option descriptions, not only instructions
    long_choice = m.question(random.Random(3), api.QuestionType.CHOICE, 128)
    assert max(len((c.description or "").split()) for c in long_choice.options) > 2


def test_varied_spreads_documents_rows_questions_and_repeats(maker):
    model_id, m = maker
    w = WORKLOADS["varied"]
    stream = RequestStream(m, model_id, w, seed=7)
    assert all(floor == 12 for floor in (max(w.row_tokens[0], f) for f in stream.row_floor.values()))
    got = measured(stream, 300)
    docs = [d for item, d, _ in got if not item.repeat]
    rows = [n for *_, r in got for _, n in r]
    assert 32 <= min(docs) and max(docs) <= 4096 and 12 <= min(rows) and max(rows) <= 128
    # log-uniform: about 2/7 of documents are <= 128 tokens and 2/7 >= 1,024; rows likewise (ln 2 / ln 10.7)
    assert 0.2 < sum(d <= 128 for d in docs) / len(docs) < 0.4 and 0.2 < sum(d >= 1024 for d in docs) / len(docs) < 0.4
    assert 0.2 < sum(n <= 24 for n in rows) / len(rows) < 0.4 and 0.2 < sum(n >= 64 for n in rows) / len(rows) < 0.4
    assert 40 < statistics.mean(rows) < 60 and statistics.pstdev(rows) > 20  # mean ~49, not pinned at one value
    for kind in api.QuestionType:  # every kind spans the range
        lengths = [n for *_, r in got for k, n in r if k is kind]
        assert min(lengths) <= 14 and max(lengths) >= 110, kind
    assert {len(r) for *_, r in got} == set(range(1, 9))
    assert all({k for k, _ in r} == set(api.QuestionType) for *_, r in got if len(r) >= 3)
    repeats = [item for item, *_ in got if item.repeat]
    assert 0.24 <= len(repeats) / len(got) <= 0.36
    seen = set()
    for item, *_ in got:  # a repeat sends a document this stream sent before, word for word
        assert (item.request.document in seen) == item.repeat
        seen.add(item.request.document)


@pytest.mark.parametrize("name, doc, questions, n", [("six-short-varied", 48, 6, 100), ("five-long-varied", 2200, 5, 20)])
def test_short_and_long_varied_keep_their_documents_and_vary_their_rows(maker, name, doc, questions, n):
    model_id, m = maker
    got = measured(RequestStream(m, model_id, WORKLOADS[name], seed=1), n)
    rows = [n for *_, r in got for _, n in r]
    assert {d for _, d, _ in got} == {doc} and {len(r) for *_, r in got} == {questions}
    assert not any(item.repeat for item, *_ in got)
    assert 16 <= min(rows) and max(rows) <= 64 and 30 < statistics.mean(rows) < 40  # around 32 (log-uniform: 34.6)
    assert sum(len({n for _, n in r}) > 1 for *_, r in got) >= 0.9 * len(got)  # rows of one request differ


def test_ceiling_fraction_is_tokens_times_two_params_over_the_matmul_rate(checkpoint):
    params = kev4b_config().non_embedding_params()
    assert 3e9 < params < 5e9  # Kev-4B without its 0.64 B embedding
    # 10,000 tokens/s on a 4e9-parameter model is 80 TFLOP/s: a tenth of an 800 TFLOPS GPU
    assert load.ceiling_fraction(10_000, 4_000_000_000, 800.0) == pytest.approx(0.1)
    assert load.ceiling_fraction(25_000, params, 700.0) == pytest.approx(25_000 * 2 * params / 700e12)
    assert load.ceiling_fraction(10_000, params, None) is None and load.ceiling_fraction(10_000, None, 800.0) is None
    from kev.model.checkpoint import read_config

    # the served model's parameters, not Kev-4B's
    assert load.served_params(checkpoint) == read_config(checkpoint).non_embedding_params() < 10**6


def test_eager_passes_count_every_path_but_replay(monkeypatch):
    metrics = {
        "scorer": {'kev_scorer_graph_passes_total{path="replay"}': 90.0,
                   'kev_scorer_graph_passes_total{path="eager_bucketed"}': 2.0,
                   'kev_scorer_graph_passes_total{path="unbucketed"}': 1.0, "kev_scorer_graph_captures_total": 30.0},
        "bank": {'kev_bank_graph_passes_total{path="replay"}': 40.0, 'kev_bank_graph_passes_total{path="eager"}': 4.0},
        "cpu": {"kev_scorer_rows_per_pass_count": 10.0},  # no CUDA graphs: no such counter
    }
    monkeypatch.setattr(load, "scrape", lambda url: metrics[url])
    assert load.eager_passes({"scorer": "scorer", "bank": "bank"}) == (7, {"scorer": 3, "bank": 4})
    assert load.eager_passes({"scorer": "scorer", "bank": "cpu"}) == (None, {"scorer": 3, "bank": None})
    assert load.eager_passes({}) == (None, {})


def usage_server(cached: bool):
    """A Scorer that answers six-short's six questions with a fixed usage: a 48-token document (from
    the bank when `cached`) and 192 row tokens."""
    from kev.serving.grpc_server import GrpcServer

    def score(raw, context):
        answers = {f"q{j}": pb.Answer(noul=pb.NoulAnswer(p_yes=0.5)) for j in range(6)}
        usage = pb.Usage(input_tokens=240, document_tokens=48, cached_state_tokens=48 if cached else 0)
        return pb.ScoreQuestionsResponse(answers=answers, usage=usage)

    server = GrpcServer(["kev.v1.Scorer"], workers=8, thread_name_prefix="usage-rpc")
    handler = grpc.unary_unary_rpc_method_handler(score, request_deserializer=None,
                                                  response_serializer=pb.ScoreQuestionsResponse.SerializeToString)
    server.add_handlers([grpc.method_handlers_generic_handler("kev.v1.Scorer", {"ScoreQuestions": handler})])
    return server, f"127.0.0.1:{server.start('127.0.0.1:0')}"


@pytest.mark.parametrize("cached, per_request", [(False, 240), (True, 192)])
def test_tokens_per_s_counts_rows_and_only_state_passed_documents(maker, cached, per_request):
    model_id, m = maker
    server, addr = usage_server(cached)
    try:
        clocks = {"sm_mhz": 1755.0, "power_w": 699.0, "samples": 48}
        run = load.run_load(addr, RequestStream(m, model_id, WORKLOADS["six-short"], seed=2), 2, duration_s=None,
                            max_requests=20, non_embedding_params=10**9,
                            matmul={"matmul_tflops": 500.0, "matmul_tflops_sustained": 400.0,
                                    "matmul_sustained_gpu": clocks})
    finally:
        server.stop(0)
    assert run["ok"] == 20 and run["tokens_per_s"] == pytest.approx(per_request * run["requests_per_s"])
    assert run["matmul_tflops"] == 500.0
    assert run["ceiling_fraction"] == pytest.approx(run["tokens_per_s"] * 2e9 / 500e12)
    # beside it, the rate at the power limit and the share against that (bench.common.matmul_rates)
    assert run["matmul_tflops_sustained"] == 400.0
    assert run["ceiling_fraction_sustained"] == pytest.approx(run["tokens_per_s"] * 2e9 / 400e12)
    assert run["matmul_sustained_gpu"] == clocks
    assert run["eager_passes_after_warmup"] is None  # no metrics endpoints given


def test_nvidia_smi_samples_give_medians():
    from bench.common import smi_medians

    text = "1980, 512.31\n1755, 699.80\n1830, 698.10\n[N/A], [N/A]\n17"  # an unreadable line, a cut one
    assert smi_medians(text) == {"sm_mhz": 1830.0, "power_w": 698.1, "samples": 3}
    assert smi_medians("") is None and smi_medians("[N/A], [N/A]") is None


def test_a_run_without_a_matmul_measurement_has_null_sustained_figures():
    assert load.matmul_figures(None, 1000.0, 10**9) == {
        "matmul_tflops": None, "ceiling_fraction": None,
        "matmul_tflops_sustained": None, "ceiling_fraction_sustained": None, "matmul_sustained_gpu": None}
    # a rate given on the command line (`--matmul-tflops 500`): the burst figures only
    given = load.matmul_figures({"matmul_tflops": 500.0}, 1000.0, 10**9)
    assert given["ceiling_fraction"] == pytest.approx(1000.0 * 2e9 / 500e12)
    assert given["matmul_tflops_sustained"] is None and given["ceiling_fraction_sustained"] is None


def test_the_gpu_sampler_gives_nothing_without_nvidia_smi(monkeypatch, tmp_path):
    from bench.common import GpuSampler

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no nvidia-smi, as on this machine and CI
    with GpuSampler() as sampler:
        pass
    assert sampler.medians is None


class Stopped(Exception):
    pass


def start_driver(monkeypatch, tmp_path, checkpoint, *flags) -> tuple[dict, dict]:
    """bench.load_compare's main on CPU up to the stack's start: (the Stack's settings, the results
    file it wrote before starting it)."""
    made = []

    class FakeStack:
        def __init__(self, checkpoint, **kw):
            made.append(kw)

        def start(self):
            raise Stopped

    monkeypatch.setattr(load_compare, "Stack", FakeStack)
    monkeypatch.setattr(load_compare.signal, "signal", lambda *a: None)  # main's SIGTERM handler: not in pytest
    with pytest.raises(Stopped):
        load_compare.main(["--device", "cpu", "--workload", "varied", "--checkpoint", str(checkpoint),
                           "--out-dir", str(tmp_path), *flags])
    return made[-1], json.loads((tmp_path / "load_varied.json").read_text())


def test_the_load_test_starts_the_services_with_their_defaults(monkeypatch, tmp_path, checkpoint):
    stack, results = start_driver(monkeypatch, tmp_path, checkpoint)
    # the harness's settings only: no start-up plan, no layout fitted to the workload
    assert set(stack["scorer_env"]) == {"KEV_METRICS_PORT"} and set(stack["bank_env"]) == {"KEV_METRICS_PORT"}
    assert stack["bank_flags"] == [] and stack["scorer_flags"] == []
    assert results["default_startup"] is True and "service_overrides" not in results
    for script in ("load_check.sh", "load_ab.sh"):  # the device drivers add none either
        text = (ROOT / "bench/device" / script).read_text()
        assert not any(s in text for s in ("KEV_GRAPH", "KEV_CUDA_GRAPHS", "KEV_WARM", "graph-rows", "graph-docs", "warm-classes", "avg-doc"))

    stack, results = start_driver(monkeypatch, tmp_path, checkpoint, "--scorer-env", "KEV_WARM_CLASSES=none",
                                  "--bank-flag=--max-wait-ms=1")
    assert stack["scorer_env"]["KEV_WARM_CLASSES"] == "none" and stack["bank_flags"] == ["--max-wait-ms=1"]
    assert results["default_startup"] is False
    assert results["service_overrides"] == {"scorer_env": {"KEV_WARM_CLASSES": "none"}, "bank_flags": ["--max-wait-ms=1"]}


def test_gpu_memory_peak_sums_gpus_and_is_none_without_nvidia_smi(tmp_path):
    """The load run's `peak_gpu_memory_gb` (the whole pod): nvidia-smi's MB summed over the GPUs,
    the most seen while the block ran; None where nvidia-smi does not run (this machine). The GPU
    machine's own nvidia-smi is the real one; here a script stands in for it."""
    from bench.load_compare import GpuMemoryPeak

    with GpuMemoryPeak(command=str(tmp_path / "no-such-nvidia-smi")) as peak:
        pass
    assert peak.gb is None
    counter = tmp_path / "n"
    counter.write_text("0")
    fake = tmp_path / "nvidia-smi"
    # the count is replaced atomically (mv), so neither the script nor the test reads a half-written file
    fake.write_text(f"#!/bin/sh\nn=$(cat {counter}); echo $((n + 1)) > {counter}.tmp && mv {counter}.tmp {counter}\n"
                    f"if [ $n -lt 3 ]; then echo 1000; echo 2000; else echo 500; echo 500; fi\n")
    fake.chmod(0o755)
    with GpuMemoryPeak(every_s=0.01, command=str(fake)) as peak:
        import time
        while int(counter.read_text()) < 5:
            time.sleep(0.01)
    assert peak.peak_mb == 3000 and peak.gb == round(3000 * 2**20 / 1e9, 2)


def test_result_files_name_the_model_beside_kev_4b():
    """Kev-4B keeps the plain names (the figures' history); another size is in its own files."""
    from bench.load_compare import result_stem

    assert result_stem("kev-4b", "varied") == "load_varied"
    assert result_stem("kev-27b", "six-short") == "load_27b_six-short"
    assert result_stem("kev-0.8b", "five-long") == "load_0.8b_five-long"
