"""The load generator (bench/load.py) on the CPU stack, its exact-length workloads, and the naive
baseline (bench/load_baseline.py) against the in-process engine.

CI-sized: the tiny random checkpoint (tiny_stack), the embedded stack on CPU, 8 clients for 3 s of
six-short at its real lengths (48-token new documents, 6 rows of 32 tokens: cheap on the tiny
model). Any error fails the run. The GPU comparison is bench/load_compare.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from kev.request import api
from kev.request.prompts import validate_and_build
from kev.serving.processes import free_port
from kev.stack import Stack
from kev.v1 import scorer_pb2 as pb
from kev.rpc.wire import response_from_proto
from service_support import engine_answers
from tiny_checkpoints import hide_fla

from bench import load
from bench.load_baseline import BaselineBatcher, BaselineScorer, BaselineService, build_server
from bench.load_workloads import WORKLOADS, RequestStream, TextMaker, load_builder

ROOT = Path(__file__).resolve().parents[2]


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
    metrics_port, bank_metrics_port = free_port(), free_port()
    stack = Stack(checkpoint, bank_memory_bytes=4 << 20, max_document_tokens=512,
                  bank_flags=["--avg-doc-tokens", "64"], scorer_env={"KEV_METRICS_PORT": str(metrics_port)},
                  bank_env={"KEV_METRICS_PORT": str(bank_metrics_port)})
    out = tmp_path / "load.json"
    with stack:
        rc = load.main(["--addr", stack.scorer_addr, "--checkpoint", str(checkpoint), "--workload", "six-short",
                        "--clients", "8", "--duration", "3", "--warmup-s", "0.5",
                        "--metrics-url", f"http://127.0.0.1:{metrics_port}/metrics",
                        "--bank-metrics-url", f"http://127.0.0.1:{bank_metrics_port}/metrics", "--out", str(out)])
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
    assert run["row_pass_ms"] > 0 and 0 < run["row_worker_busy"] <= 1.1  # a pass may straddle the window's ends
    steps = run["row_launch_share"]  # the launch phase by step, and its CPU time
    assert set(steps) == {"check", "pack", "pass", "head", "cpu"} and min(steps.values()) >= 0
    launch = sum(v for k, v in steps.items() if k != "cpu")
    assert launch == pytest.approx(run["row_worker_share"]["launch"], rel=0.02)
    assert steps["pass"] > 0 and 0 < steps["cpu"] <= launch * 1.02  # one thread's CPU time within its wall time
    assert sum(run["row_passes_by_path"].values()) == 0  # no CUDA graphs on a CPU: the counters are not exported
    assert run["row_padding_share"] is None and run["state_padding_share"] is None  # likewise (NaN: JSON null)
    assert run["state_passes"] > 0 and 1 <= run["documents_per_state_pass"] <= 8  # 8 clients, a new document each
    assert run["state_pass_ms"] > 0 and 0 < run["state_worker_busy"] <= 1.1
    bank = run["state_worker_share"]
    assert bank["launch"] + bank["device_wait"] == pytest.approx(run["state_worker_busy"], rel=0.02)
    assert bank["launch"] > 0 and 0 < bank["cpu"] <= bank["launch"] * 1.02
    assert 0 < bank["directory"] < 1  # the epoch check, evictions and registrations around the passes
    assert run["new_document_acquire_ms"] >= run["state_pass_ms"] * 0.5  # an Acquire waits for its pass
    phases = run["request_phase_ms"]  # inside the scorer, per answered request
    assert set(phases) == {"prepare", "acquire", "rows", "release"} and min(phases.values()) > 0
    assert phases["acquire"] >= run["new_document_acquire_ms"] * 0.5 and phases["rows"] >= run["row_pass_ms"] * 0.5
    assert sum(phases.values()) <= run["mean_ms"] * 1.05  # the client's time holds the scorer's
    for service in ("scorer", "bank"):  # both processes worked on the CPU model, within this machine's cores
        assert 0.05 < run[f"{service}_cpu_cores"] <= (os.cpu_count() or 1) * 1.1, service
    # New documents every request: 48 document + 6 x 32 row tokens each. No GPU: no matmul rate, no
    # ceiling, no CUDA-graph counters (the services export none on a CPU).
    assert run["tokens_per_s"] == pytest.approx(240 * run["requests_per_s"])
    assert run["matmul_tflops"] is None and run["ceiling_fraction"] is None
    assert run["eager_passes_after_warmup"] is None and run["eager_passes_by_service"] == {"scorer": None, "bank": None}


def test_services_profile_themselves_when_the_window_opens(checkpoint, tmp_path, monkeypatch):
    """bench/device/load_profile.sh's mechanism on the CPU stack: with the profile site on the
    services' PYTHONPATH and LOAD_PROFILE_DIR set, each service records itself from the moment the
    load generator opens its window, for the time asked, and writes its summary under its own name.
    What it is for, the CUDA kernels of every thread, exists only on a GPU."""
    folder = tmp_path / "profiles"
    monkeypatch.setenv("LOAD_PROFILE_DIR", str(folder))
    monkeypatch.setenv("LOAD_PROFILE_FOR_S", "0.5")
    site = {"PYTHONPATH": f"{ROOT / 'bench/device/profile_site'}:{ROOT}"}
    stack = Stack(checkpoint, bank_memory_bytes=4 << 20, max_document_tokens=512,
                  bank_flags=["--avg-doc-tokens", "64"], scorer_env=site, bank_env=site)
    with stack:
        assert not folder.exists(), "a profile must wait for the window"
        load.run_load(stack.scorer_addr, six_short_stream(checkpoint), 2, duration_s=1.5, warmup_s=0.2)
        deadline = time.monotonic() + 30
        while len(list(folder.glob("profile_*.json"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    profiles = {json.loads(p.read_text())["service"]: json.loads(p.read_text()) for p in folder.glob("profile_*.json")}
    assert set(profiles) == {"bank_service", "scorer_service"}
    for prof in profiles.values():
        assert 0.5 <= prof["window_s"] < 5 and prof["kernels"] == []  # no GPU


def test_baseline_answers_match_the_engine(checkpoint):
    model_id, tokenizer, builder = load_builder(checkpoint)
    stream = RequestStream(TextMaker(tokenizer, builder), model_id, WORKLOADS["mixed"].scaled(0.25), seed=5)
    items = stream.sample(8)
    with hide_fla() as calls:  # transformers' torch paths: fla's Triton kernels cannot run on a CPU
        scorer = BaselineScorer(checkpoint)
        batcher = BaselineBatcher(scorer)
        server = build_server(BaselineService(scorer, batcher), threads=16)
        port = server.start("127.0.0.1:0")
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
            got_p, want_p = api.option_probabilities(g.answers[name]), api.option_probabilities(answer)
            assert got_p == pytest.approx(want_p, abs=1e-4, rel=0), name


def failing_server(delay_s: float = 0.0):
    """A Scorer whose ScoreQuestions waits `delay_s`, then fails: FAILED_PRECONDITION on odd calls, INTERNAL else."""
    import threading as _threading
    import time as _time

    from kev.serving.grpc_server import GrpcServer

    calls = [0]
    lock = _threading.Lock()

    def score(raw, context):
        _time.sleep(delay_s)
        with lock:
            calls[0] += 1
            odd = calls[0] % 2
        if odd:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "document longer than the gathered buffer")
        context.abort(grpc.StatusCode.INTERNAL, "row pass failed: boom")

    server = GrpcServer(["kev.v1.Scorer"], workers=16, thread_name_prefix="failing-rpc")
    handler = grpc.unary_unary_rpc_method_handler(score, request_deserializer=None,
                                                  response_serializer=pb.ScoreQuestionsResponse.SerializeToString)
    server.add_handlers([grpc.method_handlers_generic_handler("kev.v1.Scorer", {"ScoreQuestions": handler})])
    port = server.start("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


def six_short_stream(checkpoint):
    model_id, tokenizer, builder = load_builder(checkpoint)
    return RequestStream(TextMaker(tokenizer, builder), model_id, WORKLOADS["six-short"], seed=1)


def test_errors_are_counted_by_status_with_their_first_message(checkpoint, capsys):
    server, addr = failing_server()
    try:
        run = load.run_load(addr, six_short_stream(checkpoint), 2, duration_s=None, max_requests=10, label="fail")
    finally:
        server.stop(0)
    assert run["ok"] == 0 and run["error_count"] == run["requests"] == 10
    assert set(run["errors"]) == {"FAILED_PRECONDITION", "INTERNAL"} and sum(run["errors"].values()) == 10
    assert run["error_messages"] == {"FAILED_PRECONDITION": "document longer than the gathered buffer",
                                     "INTERNAL": "row pass failed: boom"}
    line = capsys.readouterr().err.strip().splitlines()[-1]  # the final progress line names them too
    assert "FAILED_PRECONDITION x" in line and "boom" in line


def test_the_window_opens_once_every_client_has_a_reply_and_counts_answers_inside_it(checkpoint):
    """Replies take 0.4 s: a window opened at once would measure the pipeline filling. It opens when
    all 4 clients have had their first reply and, 2 s long, holds the 4-5 answers each client gets
    inside it (a closed loop: 10 per second), not the requests answered after it closed."""
    server, addr = failing_server(delay_s=0.4)
    try:
        run = load.run_load(addr, six_short_stream(checkpoint), 4, duration_s=2.0, warmup_s=0.0, label="window")
    finally:
        server.stop(0)
    assert run["window_opened_after_s"] >= 0.38
    assert run["elapsed_s"] == 2.0 and 16 <= run["requests"] <= 20 and run["error_count"] == run["requests"]


def test_an_interrupt_stops_the_clients_before_the_channels_close(checkpoint, monkeypatch):
    """SIGTERM in bench/load_compare.py is a SystemExit in the main thread while clients are calling:
    it must propagate, and no client thread may die on the closed channel."""
    import threading as _threading

    died = []
    monkeypatch.setattr(_threading, "excepthook", lambda args: died.append(args))
    scrapes = [0]

    def scrape(url):
        scrapes[0] += 1
        if scrapes[0] == 1:
            import time as _time

            _time.sleep(0.3)  # the clients are mid-call
            raise SystemExit(143)
        return None

    monkeypatch.setattr(load, "scrape", scrape)
    server, addr = failing_server(delay_s=0.2)
    try:
        with pytest.raises(SystemExit):
            load.run_load(addr, six_short_stream(checkpoint), 8, duration_s=30, metrics_url="http://unused")
    finally:
        server.stop(0)
    assert not [t for t in _threading.enumerate() if t.name.startswith("load-")], "client threads left running"
    assert died == [], [f"{a.thread.name}: {a.exc_value!r}" for a in died]


def test_baseline_pads_to_few_shapes():
    from bench.load_baseline import PAD_ROWS, padded_rows

    assert [padded_rows(n) for n in (1, 3, 5, 17, 25, 49, 300, 384, 513, 700)] == \
        [1, 4, 8, 24, 32, 64, 384, 384, 640, 768]
    assert all(b / a <= 2 for a, b in zip(PAD_ROWS, PAD_ROWS[1:]))


def test_baseline_warm_up_caps_forwards_that_run_out_of_memory():
    """Beside an idle stack the baseline's widest warm-up forwards may not fit: each width stops at
    its first shape out of memory and forwards are capped below the smallest such shape."""
    scorer = BaselineScorer.__new__(BaselineScorer)  # only the model call is under test, not loading
    scorer.device, scorer.length_multiple = torch.device("cpu"), 16
    seen = []

    def model(input_ids, use_cache):
        seen.append(tuple(input_ids.shape))
        if input_ids.numel() > 40_000:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    scorer.model = model
    ran, cap = scorer.warm([80, 2232], max_rows=64, max_batch_tokens=786432)
    assert ran == [(r, 80) for r in (1, 2, 4, 8, 16, 24, 32, 48, 64)] + [(r, 2240) for r in (1, 2, 4, 8, 16)]
    assert (24, 2240) in seen and (32, 2240) not in seen  # the width's larger shapes are not tried
    assert cap == 16 * 2240
    assert scorer.warm([80], max_rows=8, max_batch_tokens=786432) == ([(r, 80) for r in (1, 2, 4, 8)], 786432)
    # From one request's rows (five-long's 5: bucket 8) up; the smallest is tried whatever its size.
    seen.clear()
    assert scorer.warm([2232], max_rows=320, max_batch_tokens=786432, min_rows=5) == ([(8, 2240), (16, 2240)], 16 * 2240)
    assert seen[0] == (8, 2240) and (4, 2240) not in seen
    with pytest.raises(ValueError, match="min_rows"):
        scorer.warm([80], max_rows=8, max_batch_tokens=786432, min_rows=9)


def test_baseline_batcher_splits_a_batch_that_runs_out_of_memory_and_caps_later_batches():
    """Halves are retried outside the except block (no exception in flight, so the failed forward's
    frames are gone), every request is answered, and later batches are taken under the new cap."""
    import sys
    from types import SimpleNamespace

    from bench.load_baseline import BaselineBatcher, Pending

    calls = []

    class Scorer:  # 1,000 padded tokens a request; a forward of more than 2 requests runs out of memory
        device = torch.device("cpu")

        def padded_tokens(self, prepared):
            return 1000 * len(prepared)

        def answer(self, prepared):
            calls.append((len(prepared), sys.exc_info()[0]))
            if len(prepared) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return [{"q": p.rows} for p in prepared]

    def jobs(n):
        return [Pending(SimpleNamespace(rows=(i,))) for i in range(n)]

    batcher = BaselineBatcher(Scorer(), max_requests=64, max_batch_tokens=10_000)
    try:
        first = jobs(8)
        batcher._run(first)  # the worker thread idles meanwhile: its queue is empty
        assert [j.answers for j in first] == [{"q": (i,)} for i in range(8)]
        assert calls == [(8, None), (4, None), (2, None), (2, None), (4, None), (2, None), (2, None)]
        assert batcher.max_batch_tokens == 3999  # below the smallest batch that ran out of memory

        calls.clear()
        later = jobs(8)
        with batcher._cond:  # all at once: the worker takes its batches under the cap
            batcher._queue.extend(later)
            batcher._cond.notify()
        for j in later:
            assert j.done.wait(10)
        assert [j.error for j in later] == [None] * 8 and [j.answers for j in later] == [{"q": (i,)} for i in range(8)]
        assert max(n for n, _ in calls) == 3 and all(exc is None for _, exc in calls)
    finally:
        batcher.stop()


def test_baseline_warm_shapes_and_the_start_up_breakdown():
    from bench.load_compare import baseline_warm_shapes
    from bench.load_report import startup_breakdown

    six, five = WORKLOADS["six-short"], WORKLOADS["five-long"]
    # widths: document + row; rows: one request's questions up to 64 requests' at the sweep's widest
    assert baseline_warm_shapes([six, five], [1, 8, 64]) == ([80, 2232], 384, 5)
    assert baseline_warm_shapes([five], [1, 8]) == ([2232], 40, 5)
    assert baseline_warm_shapes([WORKLOADS["mixed"]], [64]) == ([48, 96, 528, 576], 384, 1)
    assert baseline_warm_shapes([WORKLOADS["six-short-varied"]], [64])[0] == [64, 112]  # varied rows: both ends
    assert baseline_warm_shapes([WORKLOADS["varied"]], [64]) == ([44, 160, 4108, 4224], 512, 1)
    log_text = "\n".join([
        "2026-11-29 11:40:00,000 INFO bank_service: config {}",
        "2026-11-29 11:40:31,500 INFO bank_service.server: weights loaded in 31.5 s",
        "2026-11-29 11:41:10,000 INFO kev.exec.passes: autotune classes ['rows_small'] warmed in 38.2 s",
        "2026-11-29 11:41:20,000 INFO kev.exec.passes: captured 11 CUDA graphs in 9.9 s: [...]",
        "2026-11-29 11:41:21,000 INFO bank_service.server: serving kev.v1.Bank as node stack (metrics port off)",
    ])
    assert startup_breakdown(log_text) == {"weights_s": 31.5, "class_warm_up_s": 38.2, "graph_capture_s": 9.9,
                                           "graphs": 11, "ready_s": 81.0}
    assert startup_breakdown("nothing")["ready_s"] is None


def test_each_system_runs_its_own_sweep_or_the_common_one():
    from types import SimpleNamespace

    from bench.load_compare import sweep_of

    args = SimpleNamespace(sweep=[1, 8, 64], clients=64, baseline_sweep=None, gathered_sweep=[64])
    assert sweep_of("kev", args) == [1, 8, 64] and sweep_of("baseline", args) == [1, 8, 64]
    assert sweep_of("gathered", args) == [64]
    assert sweep_of("kev", SimpleNamespace(sweep=None, clients=8)) == [8]


def test_speedup_compares_runs_at_the_same_client_count():
    """A baseline cut before its x64 run: no headline ratio (its headline falls back to x8), and
    the per-client ratios only where both systems ran."""
    from bench.load_report import report

    def runs(*pairs):
        return [{"clients": c, "requests_per_s": r} for c, r in pairs]

    results = {"kev": {"five-long": {"sample": [], "runs": runs((1, 15.6), (8, 26.4), (64, 27.6)), "done": True}},
               "baseline": {"five-long": {"sample": [], "runs": runs((1, 2.3), (8, 2.6))}}}
    args = SimpleNamespace(device="cuda", scale=1.0, clients=64)
    env = {k: "x" for k in ("commit", "gpu", "packages", "python", "host", "command", "triton_compile_cache",
                            "gpu_sharing")}
    env.update(commit="abc1234", gpu="H200")  # distinct, so that a swapped pair would show
    out = report("five-long", results, ["kev", "baseline"], {}, args, env, Path("ckpt"), {})
    assert out["clients"] == 64 and out["baseline"]["clients"] == 8 and out["baseline"]["partial"]
    assert (out["baseline"]["commit"], out["baseline"]["gpu"]) == (env["commit"], env["gpu"])
    assert "speedup_vs_baseline" not in out
    assert out["speedup_by_clients"] == pytest.approx({"1": 15.6 / 2.3, "8": 26.4 / 2.6})
    results["baseline"]["five-long"]["runs"].append({"clients": 64, "requests_per_s": 2.76})
    out = report("five-long", results, ["kev", "baseline"], {}, args, env, Path("ckpt"), {})
    assert out["speedup_vs_baseline"] == pytest.approx(10.0) and out["speedup_by_clients"]["64"] == pytest.approx(10.0)


def test_a_file_cut_during_start_up_keeps_the_calls_matmul_rates():
    """The matmul rates are measured before the stack starts: a call cut during start-up (no run
    yet) still writes them; once kev has run, its run's own fields stand."""
    from bench.load_report import report

    args = SimpleNamespace(device="cuda", scale=1.0, clients=64)
    env = {k: "x" for k in ("commit", "gpu", "packages", "python", "host", "command", "triton_compile_cache",
                            "gpu_sharing")}
    matmul = {"matmul_tflops": 794.0, "matmul_tflops_sustained": 682.5,
              "matmul_sustained_gpu": {"sm_mhz": 1365.0, "power_w": 698.0, "samples": 53}}
    out = report("six-short", {}, ["kev"], {}, args, env, Path("ckpt"), {}, matmul)
    assert not out["complete"] and out["requests_per_s"] is None and out["sweep"] == []
    assert {k: out[k] for k in matmul} == matmul
    assert out["ceiling_fraction"] is None  # nothing served: no fraction
    assert report("six-short", {}, ["kev"], {}, args, env, Path("ckpt"), {})["matmul_tflops"] is None
    run = {"clients": 64, "requests_per_s": 250.0, "matmul_tflops": 790.0, "matmul_tflops_sustained": 680.0,
           "matmul_sustained_gpu": {"sm_mhz": 1350.0}}
    results = {"kev": {"six-short": {"sample": [], "runs": [run], "done": True}}}
    out = report("six-short", results, ["kev"], {}, args, env, Path("ckpt"), {}, matmul)
    assert (out["matmul_tflops"], out["matmul_tflops_sustained"], out["matmul_sustained_gpu"]) == \
        (790.0, 680.0, {"sm_mhz": 1350.0})


def test_two_calls_merge_into_one_results_file(tmp_path):
    """bench/load_merge.py: kev and the baseline from the first file, the gathered scorer and its
    identity check from the second (the gathered scorer runs only on a GPU: synthetic files)."""
    import importlib.util
    import json

    from bench import load_merge

    def run(clients, rps):
        return {"clients": clients, "requests_per_s": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": {}}

    same = {"workload": "five-long", "commit": "abc1234", "gpu": "H200", "gpu_sharing": "mps", "device": "cuda",
            "scale": 1.0}
    first = {**same, **run(64, 27.0), "sweep": [run(1, 17.0), run(64, 27.0)], "missing": [], "complete": True,
             "baseline": {**run(64, 3.0), "sweep": [run(64, 3.0)]}, "gathered": {"skipped": "not requested"},
             "speedup_vs_baseline": 9.0, "startup": {"stack": 1}, "command": "first"}
    second = {**same, **run(64, 26.0), "sweep": [run(64, 26.0)], "missing": [], "complete": True,
              "baseline": {"skipped": "not requested"}, "gathered": {**run(64, 25.0), "sweep": [run(64, 25.0)]},
              "gathered_bit_identical": {"identical": True}, "startup": {"stack": 2}, "command": "second"}
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    png = tmp_path / "merged.png"
    assert load_merge.main([str(a), str(b), "--out", str(out), "--png", str(png)]) == 0
    assert png.exists() or importlib.util.find_spec("matplotlib") is None  # the plot needs the bench extra
    merged = json.loads(out.read_text())
    assert merged["requests_per_s"] == 27.0 and merged["speedup_vs_baseline"] == 9.0
    assert merged["baseline"]["requests_per_s"] == 3.0 and merged["gathered"]["requests_per_s"] == 25.0
    for system in ("baseline", "gathered"):  # filled in from the files' common commit and GPU
        assert (merged[system]["commit"], merged[system]["gpu"]) == ("abc1234", "H200")
    assert merged["gathered_bit_identical"] == {"identical": True} and merged["gathered_run_kev"]["requests_per_s"] == 26.0
    assert (merged["command"], merged["gathered_command"]) == ("first", "second") and merged["complete"]
    assert [r["clients"] for r in load_merge.kev_series(merged)] == [1, 64]  # the fuller sweep is plotted
    merged["gathered_run_kev"]["sweep"] = [run(n, 20.0) for n in (1, 8, 32, 64)]
    assert [r["clients"] for r in load_merge.kev_series(merged)] == [1, 8, 32, 64]
    with pytest.raises(ValueError, match="commit differs"):
        load_merge.merge(first, {**second, "commit": "other"})
    with pytest.raises(ValueError, match="no complete gathered run"):
        load_merge.merge(first, first)


def test_an_identity_call_merges_into_the_load_calls_file(tmp_path):
    """bench/load_merge.py --identity: the load call's figures whole, the identity check (and the
    gathered scorer the load call lacked) from a second call, whose commit may differ only outside
    what the services run (checked with git on this repository's own history)."""
    import json
    import subprocess

    from bench import load_merge

    def commit(ref):
        return subprocess.run(["git", "rev-parse", "--short", ref], capture_output=True, text=True,
                              cwd=Path(load_merge.__file__).resolve().parents[1]).stdout.strip()

    def run(clients, rps):
        return {"clients": clients, "requests_per_s": rps, "p50_ms": 1.0, "p99_ms": 2.0, "errors": {}}

    # d2526f5 changed bench/load_compare.py alone after 6b0e211; a7efafd changed the services
    harness_only, served_change = ("6b0e211", "d2526f5"), ("99a77cb", "a7efafd")
    if not all(commit(c) for c in (*harness_only, *served_change)):
        pytest.skip("not a clone with this repository's history")
    same = {"workload": "varied", "gpu": "H200", "gpu_sharing": "mps", "device": "cuda", "scale": 1.0,
            "model": "kev-27b"}
    load_run = {**same, "commit": harness_only[0], **run(64, 12.0), "sweep": [run(64, 12.0)],
                "missing": ["gathered"], "complete": False, "gathered": {"missing": True},
                "gathered_bit_identical": {"identical": False}, "command": "load"}
    identity_run = {**same, "commit": harness_only[1], **run(1, 5.0), "sweep": [run(1, 5.0)], "missing": [],
                    "complete": True, "gathered": {**run(1, 4.0), "sweep": [run(1, 4.0)]},
                    "gathered_bit_identical": {"identical": True}, "command": "identity"}
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(load_run))
    b.write_text(json.dumps(identity_run))
    assert load_merge.main([str(a), str(b), "--identity", "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["requests_per_s"] == 12.0 and merged["commit"] == "6b0e211" and merged["complete"]
    assert merged["gathered_bit_identical"] == {"identical": True}
    assert merged["load_call_gathered_bit_identical"] == {"identical": False}  # kept, not hidden
    assert merged["gathered"]["requests_per_s"] == 4.0 and merged["identity_run"]["commit"] == "d2526f5"
    assert merged["identity_run"]["kev"]["requests_per_s"] == 5.0 and merged["identity_run"]["command"] == "identity"
    with pytest.raises(ValueError, match="services' code differs"):
        load_merge.merge_identity({**load_run, "commit": served_change[0]}, {**identity_run, "commit": served_change[1]})
    with pytest.raises(ValueError, match="model differs"):
        load_merge.merge_identity(load_run, {**identity_run, "model": "kev-4b"})
    with pytest.raises(ValueError, match="no complete gathered run"):
        load_merge.merge_identity(load_run, load_run)


def test_padding_share_is_the_windows_padding_over_its_keyed_tokens():
    real, pad = 'kev_bank_graph_real_tokens_total{kind="state"}', 'kev_bank_graph_padding_tokens_total{kind="state"}'
    before, after = {real: 100.0, pad: 10.0}, {real: 1000.0, pad: 110.0}
    assert load.padding_share(lambda n: after.get(n, 0.0) - before.get(n, 0.0), "bank", "state") == 0.1
    assert load.padding_share(lambda n: 0.0, "scorer", "rows") != load.padding_share(lambda n: 0.0, "scorer", "rows")


def test_the_results_name_the_kev_size_they_ran():
    from types import SimpleNamespace

    from bench.load_report import model_label

    assert model_label(SimpleNamespace(device="cuda", model="kev-27b")) == "Kev-27B shapes, random bf16 weights"
    assert model_label(SimpleNamespace(device="cuda", model="kev-4b")) == "Kev-4B shapes, random bf16 weights"
    assert model_label(SimpleNamespace(device="cpu", model="kev-27b")) == "tiny random fp32 (CPU)"


def test_the_prepare_benchmark_runs(tmp_path):
    """bench/prepare.py on a few requests: every workload measured, the repeats' figures positive."""
    from bench import prepare
    from bench.random_checkpoint import write_random_checkpoint

    out = prepare.measure(str(write_random_checkpoint(tmp_path / "tiny", "tiny")), n_requests=4, reps=1)
    assert set(out) == set(prepare.WORKLOADS_MEASURED)
    for figures in out.values():
        assert figures["repeat_cached_ms"] > 0 and figures["repeat_no_cache_ms"] > 0 and figures["doc_tokens_mean"] > 1


def test_an_interrupt_while_the_baseline_starts_stops_its_process(tmp_path, monkeypatch):
    """A SIGTERM (a SystemExit in the main thread) while the baseline warms up must stop its
    process: it runs in a session of its own, where the `timeout`'s signal never reaches it."""
    import os
    import types

    from bench import load_compare

    started = []

    class Spy(load_compare.Proc):
        def start(self):
            super().start()
            started.append((self, self.popen.pid))

    sleep = load_compare.time.sleep

    def interrupt(seconds):  # the first wait between health checks (Popen.wait's own waits sleep)
        monkeypatch.setattr(load_compare.time, "sleep", sleep)
        raise SystemExit(143)

    monkeypatch.setattr(load_compare, "Proc", Spy)
    monkeypatch.setattr(load_compare.time, "sleep", interrupt)
    args = types.SimpleNamespace(device="cpu", baseline_max_batch_tokens=4096, max_document_tokens=4096,
                                 torch_threads=1, baseline_warm_widths=[48], baseline_warm_rows=8,
                                 baseline_warm_min_rows=1)
    with pytest.raises(SystemExit):
        load_compare.start_baseline(tmp_path / "no-checkpoint", args, tmp_path)
    (proc, pid), = started
    assert proc.popen is None, "the baseline was not stopped"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
