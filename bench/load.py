"""Load generator: N concurrent gRPC clients against a running `kev.v1.Scorer` (issue 7).

Each client is a thread that sends the next request of the workload (bench/load_workloads.py,
pre-serialized bytes, the affinity header set) as soon as its previous one is answered: a closed
loop, so the offered load is the client count. Measured per run, after an optional warm-up:

- requests/s: requests answered in the window / its length (with a request count: those sent in
  it / (last answer - window start)); the window opens after the warm-up, once every client has
  had a reply
- latency p50/p90/p99/mean/max: the RPC alone, client side (request building excluded)
- errors by gRPC status (any non-OK; an OK reply missing an answer counts as `MISSING_ANSWER`),
  and the first error message of each status (`error_messages`), both in the progress line too
- bank hit ratio: share of answered requests whose `usage.cached_state_tokens` > 0; and, when the
  scorer's Prometheus endpoint is given (`--metrics-url`), the scorer's own hit ratio, rows and row
  tokens per row pass from the difference of two scrapes around the window
- tokens/s (`tokens_per_s`): real tokens served per second of the window, none of them padding:
  every answered row's tokens, and the document's tokens when it was state-passed for the request,
  as its response says (`usage.input_tokens - usage.cached_state_tokens`: a document whose state
  came from the bank adds none, a repeat the bank had evicted is state-passed again and counts)
- `matmul_tflops`: the GPU's bf16 matmul rate, measured in a child process before the load (the
  client keeps no CUDA context; null without a GPU), and `ceiling_fraction` = tokens/s x 2 x
  non-embedding parameters (of the served checkpoint's config) / that rate: the share of the
  matmul ceiling the served tokens reach (docs/design.md section 4). That rate is a ~30 ms burst;
  `matmul_tflops_sustained` is the rate after seconds of back-to-back GEMMs at the power limit, as
  a loaded GPU runs, and `ceiling_fraction_sustained` the same share against it; the SM clock and
  power while it was measured are in `matmul_sustained_gpu` (bench.common.matmul_rates)
- `eager_passes_after_warmup`: passes the bank and the scorers ran other than as a CUDA-graph
  replay since they started serving (`kev_scorer_graph_passes_total` / `kev_bank_graph_passes_total`,
  every `path` but `replay`; start-up captures are not counted), read at the end of the run; per
  service in `eager_passes_by_service`; null unless every service exports the counter (CPU: none does)
- a live one-line progress display on stderr (one line every 5 s when stderr is not a terminal)

    python -m bench.load --addr 127.0.0.1:50051 --checkpoint CKPT --workload six-short --clients 64 \\
        --duration 20 --metrics-url http://127.0.0.1:9090/metrics --out run.json [--sweep 1,8,32,64 --plot run.png]

`--checkpoint` is the served checkpoint directory: its tokenizer makes the exact lengths.
bench/load_compare.py runs this against the project, its gathered variant and a naive baseline.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.load_workloads import WORKLOADS, RequestStream, TextMaker, load_builder
from kev.bank.doc_key import AFFINITY_HEADER
from kev.serving.interpreter import freeze_startup_heap
from kev.v1 import scorer_pb2 as pb

SCORE_METHOD = "/kev.v1.Scorer/ScoreQuestions"
CLIENTS_PER_CHANNEL = 16  # HTTP/2 connections are shared by this many clients
PACKAGES = ("torch", "triton", "fla-core", "transformers", "grpcio", "protobuf", "tokenizers", "safetensors",
            "redis", "prometheus-client", "numpy")


@dataclass(frozen=True)
class Outcome:
    start: float  # perf_counter at send
    latency_s: float
    code: str  # gRPC status name, or MISSING_ANSWER
    message: str  # the status details of an error ("" when OK)
    cached: bool
    doc_tokens: int
    questions: int
    sent_in_window: bool  # claimed after the window opened (what a request limit counts)
    served_tokens: int = 0  # row tokens, plus the document's when it was state-passed (module docstring)


# ---------------------------------------------------------------------------------------------
# one run


def run_load(addr: str, stream: RequestStream, clients: int, *, duration_s: float | None = 20.0,
             max_requests: int | None = None, warmup_s: float = 0.0, timeout_s: float = 120.0,
             metrics_url: str | None = None, bank_metrics_url: str | None = None,
             service_metrics_urls: Mapping[str, str] | None = None, matmul: Mapping | None = None,
             non_embedding_params: int | None = None, label: str = "") -> dict:
    """Runs `clients` closed-loop clients; returns the run's figures (see the module docstring).

    `service_metrics_urls` (name -> Prometheus URL) are the services whose eager passes count
    (default: the scorer's and the bank's URLs given). `matmul` (`measure_matmul`'s dict, or one with
    only `matmul_tflops`) and `non_embedding_params` make `ceiling_fraction` (null without either);
    a sustained rate in `matmul` adds `ceiling_fraction_sustained` and the clock while it was measured.

    The window opens once `warmup_s` has passed AND every client has had a reply (the pipeline is
    full: a five-long x 64 run's first replies take 2.5 s, and a window opened before them measured
    the fill). With `duration_s` alone it lasts that long and counts the requests answered inside
    it (requests/s = those / `duration_s`; the scrapes are taken at its two ends). With
    `max_requests` it holds the first that many requests sent in it, each awaited (requests/s =
    those / (last answer - window start)); with both, whichever ends first (counted as with
    `max_requests`). Shutdown order: the clients stop claiming, are joined, and only then are the
    channels closed; an interrupt (Ctrl-C, or SIGTERM turned into SystemExit by
    bench/load_compare.py) sets the stop flag and closes the channels at once, which cancels
    in-flight calls, and a client that finds its channel closed then just leaves."""
    if duration_s is None and max_requests is None:
        raise ValueError("give a duration or a request count")
    channels = [grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20),
                                                     ("grpc.max_receive_message_length", 64 << 20)])
                for _ in range(math.ceil(clients / CLIENTS_PER_CHANNEL))]
    calls = [ch.unary_unary(SCORE_METHOD, request_serializer=None,  # payloads are serialized already
                            response_deserializer=pb.ScoreQuestionsResponse.FromString) for ch in channels]
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    sent = [0]
    begin = time.perf_counter()
    window = Window(begin + warmup_s, clients)
    stop = threading.Event()

    def claim() -> bool | None:
        """None: this client stops; else whether the request it may send is inside the window.
        Under the lock the window opens with (`open_window`), so a claim is either before the
        window or counted in it, never both: the request limit holds exactly."""
        with lock:
            now = time.perf_counter()
            if stop.is_set() or (window.end is not None and now >= window.end):
                return None
            if window.start is None:
                return False
            sent[0] += 1
            return None if max_requests is not None and sent[0] > max_requests else True

    def open_window() -> None:
        with lock:
            window.open(duration_s)
        if folder := os.environ.get("LOAD_PROFILE_DIR"):  # the services' profiles start (load_profile.sh)
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "go").touch()

    def client(i: int) -> None:
        call = calls[i % len(calls)]
        while True:
            item = stream.next()  # built before the claim: a request counted in the window is sent at once
            if (in_window := claim()) is None:
                return
            start = time.perf_counter()
            message = ""
            try:
                reply = call(item.payload, timeout=timeout_s, metadata=((AFFINITY_HEADER, item.affinity),))
                code = "OK" if len(reply.answers) == item.questions else "MISSING_ANSWER"
                if code != "OK":
                    message = f"{len(reply.answers)} answers for {item.questions} questions"
                cached = reply.usage.cached_state_tokens > 0
                served = reply.usage.input_tokens - reply.usage.cached_state_tokens
            except grpc.RpcError as e:
                code, message, cached, served = e.code().name, e.details() or "", False, 0
            except ValueError as e:  # "Cannot invoke RPC on closed channel!": only once an interrupt closed it
                if stop.is_set() and "closed channel" in str(e):
                    return
                raise
            latency = time.perf_counter() - start
            window.replied(i)
            if not stop.is_set():
                with lock:
                    outcomes.append(Outcome(start, latency, code, message, cached, item.doc_tokens, item.questions,
                                            in_window, served))

    stream.prepare()
    threads = [threading.Thread(target=client, args=(i,), name=f"load-{i}", daemon=True) for i in range(clients)]
    freeze_startup_heap()  # a full GC of this process would add its pause to every call in flight (kev/serving/interpreter.py)
    for t in threads:
        t.start()
    progress = Progress(label or f"{stream.workload.name} x{clients}", outcomes, lock, window)
    progress.start()
    timed = max_requests is None  # a duration alone: answers inside the window count
    try:
        window.wait_full(threads)
        time.sleep(max(0.0, window.not_before - time.perf_counter()))
        open_window()
        before, bank_before = scrape(metrics_url), scrape(bank_metrics_url)
        if timed:
            time.sleep(max(0.0, window.end - time.perf_counter()))
            after, bank_after = scrape(metrics_url), scrape(bank_metrics_url)
        for t in threads:
            t.join()
    except BaseException:  # KeyboardInterrupt, or SystemExit from a SIGTERM handler
        stop.set()
        for ch in channels:  # cancels the in-flight calls, so the clients leave now
            ch.close()
        for t in threads:
            t.join(timeout=5.0)
        raise
    finally:
        progress.stop()
    for ch in channels:  # every client has returned: nothing can call a closed channel
        ch.close()
    if not timed:
        after, bank_after = scrape(metrics_url), scrape(bank_metrics_url)
    if service_metrics_urls is None:
        service_metrics_urls = {k: u for k, u in (("scorer", metrics_url), ("bank", bank_metrics_url)) if u}
    eager, eager_by_service = eager_passes(service_metrics_urls)
    result = summarize(outcomes, window.start, window.end if timed else None)
    result.update(workload=stream.workload.name, clients=clients, warmup_s=warmup_s,
                  window_opened_after_s=round(window.start - begin, 3),
                  duration_limit_s=duration_s, request_limit=max_requests,
                  **matmul_figures(matmul, result["tokens_per_s"], non_embedding_params),
                  eager_passes_after_warmup=eager, eager_passes_by_service=eager_by_service,
                  **scorer_figures(before, after, result["elapsed_s"]),
                  **bank_figures(bank_before, bank_after, result["elapsed_s"]))
    return result


class Window:
    """The measurement window of a run: it opens after `not_before` once every client has had a
    reply (`replied`), and closes `duration` later (None: when the clients stop)."""

    def __init__(self, not_before: float, clients: int):
        self.not_before, self.start, self.end = not_before, None, None
        self._waiting = set(range(clients))
        self._full = threading.Event()
        self._lock = threading.Lock()
        if not self._waiting:
            self._full.set()

    def replied(self, client: int) -> None:
        if self._waiting:
            with self._lock:
                self._waiting.discard(client)
                if not self._waiting:
                    self._full.set()

    def wait_full(self, threads: list[threading.Thread]) -> None:
        """Until every client has had a reply, or no client is left running (one died)."""
        while not self._full.wait(0.1) and any(t.is_alive() for t in threads):
            pass

    @property
    def unanswered(self) -> int:
        """Clients that have not had a reply yet."""
        return len(self._waiting)

    def open(self, duration_s: float | None) -> None:
        """Opens now; it closes `duration_s` later (None: when the clients stop)."""
        now = time.perf_counter()
        self.end = None if duration_s is None else now + duration_s
        self.start = now


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 1])."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def summarize(outcomes: list[Outcome], window_start: float, window_end: float | None = None) -> dict:
    """The run's figures from the requests the window holds: with `window_end`, those answered
    in [window_start, window_end), per second of the window; without, those sent in the window
    (`sent_in_window`), per second from `window_start` until the last answer."""
    if window_end is None:
        outcomes = [o for o in outcomes if o.sent_in_window]
        elapsed = max((o.start + o.latency_s for o in outcomes), default=window_start) - window_start
    else:
        outcomes = [o for o in outcomes if window_start <= o.start + o.latency_s < window_end]
        elapsed = window_end - window_start
    ok = [o for o in outcomes if o.code == "OK"]
    errors = Counter(o.code for o in outcomes if o.code != "OK")
    messages: dict[str, str] = {}
    for o in sorted(outcomes, key=lambda o: o.start):
        if o.code != "OK":
            messages.setdefault(o.code, o.message)
    lat = sorted(o.latency_s * 1e3 for o in ok)
    nan_if_empty = lambda xs, f: f(xs) if xs else math.nan  # noqa: E731
    return {
        "requests": len(outcomes), "ok": len(ok), "errors": dict(errors), "error_count": sum(errors.values()),
        "error_messages": messages,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "tokens_per_s": sum(o.served_tokens for o in ok) / elapsed if elapsed > 0 else 0.0,
        "p50_ms": percentile(lat, 0.50), "p90_ms": percentile(lat, 0.90), "p99_ms": percentile(lat, 0.99),
        "mean_ms": nan_if_empty(lat, lambda x: sum(x) / len(x)), "max_ms": nan_if_empty(lat, max),
        "bank_hit_ratio": nan_if_empty(ok, lambda x: sum(o.cached for o in x) / len(x)),
        "doc_tokens_mean": nan_if_empty(ok, lambda x: sum(o.doc_tokens for o in x) / len(x)),
        "questions_mean": nan_if_empty(ok, lambda x: sum(o.questions for o in x) / len(x)),
    }


# ---------------------------------------------------------------------------------------------
# the matmul ceiling


def matmul_figures(matmul: Mapping | None, tokens_per_s: float, non_embedding_params: int | None) -> dict:
    """The burst and sustained matmul rates, the ceiling fraction against each, and the SM clock and
    power while the sustained one was measured (`measure_matmul`); null where not measured."""
    matmul = matmul or {}
    burst, sustained = matmul.get("matmul_tflops"), matmul.get("matmul_tflops_sustained")
    return {"matmul_tflops": burst,
            "ceiling_fraction": ceiling_fraction(tokens_per_s, non_embedding_params, burst),
            "matmul_tflops_sustained": sustained,
            "ceiling_fraction_sustained": ceiling_fraction(tokens_per_s, non_embedding_params, sustained),
            "matmul_sustained_gpu": matmul.get("matmul_sustained_gpu")}


def ceiling_fraction(tokens_per_s: float, non_embedding_params: int | None, tflops: float | None) -> float | None:
    """tokens/s x 2 x non-embedding parameters / the measured matmul rate (None without both)."""
    if non_embedding_params is None or not tflops:
        return None
    return tokens_per_s * 2 * non_embedding_params / (tflops * 1e12)


def served_params(checkpoint: str | os.PathLike) -> int:
    """Non-embedding parameters of the served checkpoint's backbone (its config.json)."""
    from kev.model.checkpoint import read_config

    return read_config(checkpoint).non_embedding_params()


def measure_matmul() -> dict | None:
    """bench.common.matmul_rates in a child process, so this client never holds a CUDA context
    beside the services: {"matmul_tflops": the burst rate `ceiling_fraction` divides by,
    "matmul_tflops_sustained": the rate at the power limit, with the SM clock and power then};
    None without a GPU, or (with a warning) when the measurement fails."""
    import torch

    if not torch.cuda.is_available():
        return None
    code = "import json; from bench.common import matmul_rates; print(json.dumps(matmul_rates()))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    if run.returncode != 0:
        print(f"matmul rate not measured (rc {run.returncode}): {run.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads(run.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the scorer's Prometheus metrics


def scrape(url: str | None) -> dict[str, float] | None:
    """Prometheus text exposition -> {'name{labels}': value}; None without a URL."""
    if not url:
        return None
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


_GRAPH_PASSES = re.compile(r'kev_(?:scorer|bank)_graph_passes_total\{(?:.*,)?path="([^"]*)"')


def eager_passes(urls: Mapping[str, str]) -> tuple[int | None, dict[str, int | None]]:
    """(sum, per service) of the passes each service ran other than as a CUDA-graph replay (every
    `path` label of its `kev_*_graph_passes_total` but `replay`). A service that exports no such
    counter (no CUDA graphs: CPU) is None, and so is the sum: it would leave that service out."""
    by_service: dict[str, int | None] = {}
    for name, url in urls.items():
        paths = {m.group(1): v for key, v in (scrape(url) or {}).items() if (m := _GRAPH_PASSES.match(key))}
        by_service[name] = int(sum(v for path, v in paths.items() if path != "replay")) if paths else None
    values = list(by_service.values())
    return (None if not values or None in values else sum(values)), by_service


def scorer_figures(before: dict | None, after: dict | None, window_s: float = math.nan) -> dict:
    """Over the window: row passes, rows and row tokens per pass, the scorer's hit ratio, the mean
    wall time of a row pass (launch to answers; two may overlap), an answered request's time by
    phase in the scorer (`request_phase_ms`), the share of the window the row
    worker was busy (near 1: the row worker is the bottleneck) and per phase (`row_worker_share`:
    device_wait near 1 means the GPU is), the launch phase by step (`row_launch_share`: its
    `cpu` well under the steps' sum means the launches were blocked, on the GIL or in a blocking
    call), and row passes by CUDA-graph path."""
    if before is None or after is None:
        return {}
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    passes = delta("kev_scorer_rows_per_pass_count")
    hits = delta('kev_scorer_bank_lookups_total{result="hit"}')
    misses = delta('kev_scorer_bank_lookups_total{result="miss"}')
    pass_s = delta("kev_scorer_row_pass_seconds_sum")
    phases = {p: delta(f'kev_scorer_row_worker_seconds_total{{phase="{p}"}}') for p in ("launch", "device_wait", "answers")}
    steps = {s: delta(f'kev_scorer_row_launch_seconds_total{{step="{s}"}}') for s in ("check", "pack", "pass", "head")}
    steps["cpu"] = delta("kev_scorer_row_launch_cpu_seconds_total")
    answered = delta('kev_scorer_requests_seconds_count{code="OK"}')
    return {
        # an answered request's mean milliseconds by phase, inside the scorer (the client's latency
        # less their sum: gRPC, (de)serialising, the server's thread pool)
        "request_phase_ms": {p: delta(f'kev_scorer_request_phase_seconds_total{{phase="{p}"}}') / answered * 1e3
                             if answered else math.nan for p in ("prepare", "acquire", "rows", "release")},
        "row_passes": int(passes),
        "rows_per_pass": delta("kev_scorer_rows_per_pass_sum") / passes if passes else math.nan,
        "row_tokens_per_pass": delta("kev_scorer_tokens_per_pass_sum") / passes if passes else math.nan,
        "scorer_bank_hit_ratio": hits / (hits + misses) if hits + misses else math.nan,
        "row_pass_ms": pass_s / passes * 1e3 if passes else math.nan,
        "row_worker_busy": sum(phases.values()) / window_s if window_s > 0 else math.nan,
        "row_worker_share": {p: s / window_s if window_s > 0 else math.nan for p, s in phases.items()},
        "row_launch_share": {s: t / window_s if window_s > 0 else math.nan for s, t in steps.items()},
        "row_passes_by_path": {path: int(delta(f'kev_scorer_graph_passes_total{{path="{path}"}}'))
                               for path in ("replay", "eager_bucketed", "unbucketed")},
        "row_padding_share": padding_share(delta, "scorer", "rows"),
        "scorer_cpu_cores": cpu_cores(delta, "scorer", window_s),
    }


def cpu_cores(delta, service: str, window_s: float) -> float:
    """A service process's CPU seconds per second of the window, every thread together (Python's
    and native ones): one core of mostly Python threads means the GIL is what they wait for."""
    return delta(f"kev_{service}_process_cpu_seconds_total") / window_s if window_s > 0 else math.nan


def padding_share(delta, service: str, kind: str) -> float:
    """The share of a service's keyed passes' tokens that were padding over the window (the CUDA-graph
    keys' tokens ladder; NaN without CUDA graphs: nothing exported)."""
    real = delta(f'kev_{service}_graph_real_tokens_total{{kind="{kind}"}}')
    pad = delta(f'kev_{service}_graph_padding_tokens_total{{kind="{kind}"}}')
    return pad / (real + pad) if real + pad else math.nan


def bank_figures(before: dict | None, after: dict | None, window_s: float = math.nan) -> dict:
    """The bank's side of the window: state passes, documents per pass, the mean wall time of a
    state pass and the share of the window its state-pass worker spent in passes (by step in
    `state_worker_share`: launch, device_wait, the launches' cpu, and the worker's directory time
    around its passes: the epoch check, evictions, registrations), and the mean Acquire latency
    of new documents (queueing for a pass included)."""
    if before is None or after is None:
        return {}
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    passes, pass_s = delta("kev_bank_state_passes_total"), delta("kev_bank_state_pass_seconds_sum")
    steps = {s: delta(f'kev_bank_state_pass_step_seconds_total{{step="{s}"}}')
             for s in ("launch", "device_wait", "directory")}
    steps["cpu"] = delta("kev_bank_state_pass_cpu_seconds_total")
    acquires = delta('kev_bank_acquire_seconds_count{cached="false"}')
    return {
        "state_passes": int(passes),
        "documents_per_state_pass": delta("kev_bank_state_pass_documents_total") / passes if passes else math.nan,
        "state_pass_ms": pass_s / passes * 1e3 if passes else math.nan,
        "state_worker_busy": pass_s / window_s if window_s > 0 else math.nan,
        "state_worker_share": {s: t / window_s if window_s > 0 else math.nan for s, t in steps.items()},
        "state_padding_share": padding_share(delta, "bank", "state"),
        "bank_cpu_cores": cpu_cores(delta, "bank", window_s),
        "new_document_acquire_ms": (delta('kev_bank_acquire_seconds_sum{cached="false"}') / acquires * 1e3
                                    if acquires else math.nan),
    }


# ---------------------------------------------------------------------------------------------
# progress display


class Progress:
    """One status line on stderr, rewritten twice a second (a plain line every 5 s off a terminal)."""

    def __init__(self, label: str, outcomes: list[Outcome], lock: threading.Lock, window: Window):
        self.label, self.outcomes, self.lock, self.window = label, outcomes, lock, window
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        sys.stderr.write(self.line() + "\n")
        sys.stderr.flush()

    def line(self) -> str:
        now, start = time.perf_counter(), self.window.start
        if start is None:
            left = self.window.unanswered
            return (f"[{self.label}] warming up, {max(0.0, self.window.not_before - now):4.1f} s left"
                    + (f", {left} clients without a reply yet" if left else ""))
        with self.lock:
            done = [o for o in self.outcomes if start <= o.start + o.latency_s < (self.window.end or math.inf)]
        ok = sorted(o.latency_s * 1e3 for o in done if o.code == "OK")
        err = len(done) - len(ok)
        rate = len(ok) / max(min(now, self.window.end or now) - start, 1e-9)
        line = (f"[{self.label}] {now - start:6.1f} s  {len(ok):7d} ok  {err:4d} err  "
                f"{rate:8.1f} req/s  p50 {percentile(ok, 0.5):8.1f} ms  p99 {percentile(ok, 0.99):8.1f} ms")
        return line + (f"  errors {error_summary(done)}" if err else "")

    def _run(self) -> None:
        every = 0.5 if self.tty else 5.0
        while not self._stop.wait(every):
            sys.stderr.write(("\r" + self.line() + "\033[K") if self.tty else self.line() + "\n")
            sys.stderr.flush()
        if self.tty:
            sys.stderr.write("\r")


def error_summary(outcomes: list[Outcome], width: int = 160) -> str:
    """'UNAVAILABLE x12 (first: "..."), INTERNAL x3 (first: "...")': counts by status, first messages."""
    counts = Counter(o.code for o in outcomes if o.code != "OK")
    first: dict[str, str] = {}
    for o in outcomes:
        if o.code != "OK":
            first.setdefault(o.code, o.message)
    return ", ".join(f"{code} x{n} (first: {first[code][:width]!r})" for code, n in counts.most_common())


# ---------------------------------------------------------------------------------------------
# environment and the command line


def environment() -> dict:
    """Commit, device, Python and package versions, for the results file."""
    commit = os.environ.get("KEV_COMMIT")  # the device machine gets a copy of the tree without .git
    if not commit:
        commit = git("rev-parse", "--short", "HEAD") or "unknown"
        commit += "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"
    except ImportError:
        gpu = "unknown"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"commit": commit, "gpu": gpu, "host": platform.node(),
            "python": platform.python_version(), "packages": versions,
            # bench/device/load_check.sh: whether Triton's compile cache came from an earlier call (start-up
            # times only: autotuning and every measured pass are the same either way)
            "triton_compile_cache": os.environ.get("KEV_COMPILE_CACHE", "this process's own"),
            # bench/device/load_check.sh: the services' kernels time-sliced (CUDA's default for two processes)
            # or run at once as clients of an MPS daemon (KEV_MPS=1)
            "gpu_sharing": os.environ.get("KEV_GPU_SHARING", "not recorded (set by bench/device/load_check.sh)"),
            "command": " ".join([os.path.basename(sys.executable), *sys.orig_argv[1:]])}


def git(*args: str) -> str:
    """A git command's output in this checkout; "" where there is no git or no repository."""
    try:
        run = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    except OSError:
        return ""
    return run.stdout.strip() if run.returncode == 0 else ""


def json_safe(value):
    """NaN and infinities (figures of an empty run) as null: strict JSON readers reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def parse_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be positive integers, got {text!r}")
    return counts


def add_run_args(p: argparse.ArgumentParser) -> None:
    """Flags shared with bench/load_compare.py."""
    p.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    p.add_argument("--sweep", type=parse_counts, default=None, help="client counts run in turn, e.g. 1,8,32,64")
    p.add_argument("--duration", type=float, default=20.0, help="seconds per run (default 20)")
    p.add_argument("--requests", type=int, default=None, help="stop a run after this many requests")
    p.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured load before each run (at least; the window also waits for every client's first reply)")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request deadline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="document lengths x this (CPU runs)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--addr", required=True, help="scorer address host:port")
    p.add_argument("--checkpoint", required=True, help="the served checkpoint (for its tokenizer)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="six-short")
    p.add_argument("--metrics-url", default=None, help="the scorer's Prometheus endpoint, http://host:port/metrics")
    p.add_argument("--bank-metrics-url", default=None, help="the bank's Prometheus endpoint (state-pass figures)")
    p.add_argument("--matmul-tflops", default="auto",
                   help="the GPU's bf16 matmul TFLOPS for ceiling_fraction: 'auto' (measured here in a child process "
                        "before the load, null without a GPU; measure with the services idle), 'none' or a number")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--plot", default=None, help="PNG of requests/s and p99 against clients (with --sweep)")
    add_run_args(p)
    args = p.parse_args(argv)

    if args.matmul_tflops == "auto":
        matmul = measure_matmul()
    else:
        matmul = None if args.matmul_tflops == "none" else {"matmul_tflops": float(args.matmul_tflops)}
    model_id, tokenizer, builder = load_builder(args.checkpoint)
    stream = RequestStream(TextMaker(tokenizer, builder), model_id, WORKLOADS[args.workload].scaled(args.scale),
                           args.seed)
    runs = [run_load(args.addr, stream, n, duration_s=args.duration, max_requests=args.requests,
                     warmup_s=args.warmup_s, timeout_s=args.timeout_s, metrics_url=args.metrics_url,
                     bank_metrics_url=args.bank_metrics_url, matmul=matmul,
                     non_embedding_params=served_params(args.checkpoint))
            for n in (args.sweep or [args.clients])]
    out = {**environment(), "workload": args.workload, "scale": args.scale, "runs": runs}
    if args.out:
        from bench.common import write_json

        write_json(args.out, json_safe(out))
    if args.plot:
        from bench.load_plots import plot_sweeps

        plot_sweeps({"kev": runs}, args.plot, title=args.workload)
    for r in runs:
        if r["error_count"]:
            print(f"x{r['clients']}: {r['error_count']} errors {r['errors']}; first messages {r['error_messages']}",
                  file=sys.stderr)
    errors = sum(r["error_count"] for r in runs)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
