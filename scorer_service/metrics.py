"""Prometheus metrics of one scorer process (served on KEV_METRICS_PORT; 0 = no endpoint).

    kev_scorer_requests_seconds{code}        histogram  ScoreQuestions latency by gRPC status code
    kev_scorer_request_phase_seconds_total{phase} counter  answered requests' time by phase: prepare (parse,
                                                        tokenise, build rows), acquire (the document's handle:
                                                        directory, bank), rows (queued, passes, answers), release
    kev_scorer_queue_depth                   gauge      rows waiting for a row pass (the autoscaler's signal)
    kev_scorer_rows_per_pass                 histogram  rows in each row pass
    kev_scorer_tokens_per_pass               histogram  row tokens in each row pass
    kev_scorer_row_pass_seconds              histogram  wall time of each row pass, launch to answers (with the head;
                                                        two passes may overlap: see scorer_service/batcher.py)
    kev_scorer_row_worker_seconds_total{phase} counter  the row worker's time by phase: launch (pack the rows,
                                                        replay, queue the head), device_wait (blocked on the GPU
                                                        for a pass's answers), answers (host: answers to jobs)
    kev_scorer_row_launch_seconds_total{step} counter   the launch phase by step: check (handles), pack (the row
                                                        batch), pass (fill + replay, with the head when it is in
                                                        the graph, and the copy out started), head (the eager
                                                        head's launch: only for passes without a graph)
    kev_scorer_row_launch_cpu_seconds_total  counter    the row worker's CPU time in launches (launch minus
                                                        this: blocked, on the GIL or in a blocking call)
    kev_scorer_bank_lookups_total{result}    counter    document handles: hit (state in the bank) / miss
    kev_scorer_bank_hit_ratio                gauge      hits / (hits + misses) since start
    kev_scorer_idle_sweeps_total             counter    requests the bank answered in their new document's sweep
                                                        (sent while this scorer was idle; no row pass here)
    kev_scorer_directory_skips_total         counter    idle requests whose document went to the bank with no
                                                        directory look-up (not in the document cache: taken for new)
    kev_scorer_rows_passed_over_total        counter    rows cut from a row pass to the next (KEV_ROW_CUT_BACK)
    kev_scorer_document_cache_lookups_total{result} counter  documents found (hit) or tokenized (miss) in the
                                                        tokenized-document cache (KEV_DOCUMENT_CACHE_TOKENS)
    kev_scorer_document_cache_tokens         gauge      tokens the cache holds now
    kev_scorer_bank_occupancy{resource}      gauge      used / total of the bank's slots and K/V blocks
    kev_scorer_pins_held                     gauge      directory leases this process holds now
    kev_scorer_wrong_entries_total           counter    directory entries found pointing at another document's
                                                        slot (fingerprint mismatch; dropped, never answered from)
    kev_scorer_lease_renewals_total{result}  counter    lease renewals: ok / expired (the pin was gone: its entry
                                                        could be evicted under the request) / failed (no Redis)
    kev_scorer_graph_*                       counter    CUDA-graph passes by path, captures, real and
                                                        padding tokens (kev/serving/graph_metrics.py)

A private registry per instance keeps two scorers in one test process apart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kev.serving.graph_metrics import GraphCollector

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ScorerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # the process's CPU seconds (all threads): near 1 core of Python, the GIL is the ceiling
        ProcessCollector(namespace="kev_scorer", registry=r)
        self.request_seconds = Histogram("kev_scorer_requests_seconds", "ScoreQuestions latency", ["code"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.request_phase_seconds = Counter("kev_scorer_request_phase_seconds",
                                             "Answered requests' time by phase", ["phase"], registry=r)
        self.queue_depth = Gauge("kev_scorer_queue_depth", "Rows waiting for a row pass", registry=r)
        self.rows_per_pass = Histogram("kev_scorer_rows_per_pass", "Rows per row pass", buckets=_ROW_BUCKETS,
                                       registry=r)
        self.tokens_per_pass = Histogram("kev_scorer_tokens_per_pass", "Row tokens per row pass",
                                         buckets=_TOKEN_BUCKETS, registry=r)
        self.pass_seconds = Histogram("kev_scorer_row_pass_seconds", "Row pass wall time",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.worker_seconds = Counter("kev_scorer_row_worker_seconds", "Row worker time by phase", ["phase"],
                                      registry=r)
        self.launch_seconds = Counter("kev_scorer_row_launch_seconds", "Row pass launch time by step", ["step"],
                                      registry=r)
        self.launch_cpu_seconds = Counter("kev_scorer_row_launch_cpu_seconds", "Row worker CPU time in launches",
                                          registry=r)
        self.bank_lookups = Counter("kev_scorer_bank_lookups", "Document handles by result", ["result"],
                                    registry=r)
        self.idle_sweeps = Counter("kev_scorer_idle_sweeps", "Requests answered in their new document's sweep "
                                   "by the bank", registry=r)
        self.directory_skips = Counter("kev_scorer_directory_skips", "Idle requests whose document went to "
                                       "the bank unlooked-up (taken for new)", registry=r)
        self.rows_passed_over = Counter("kev_scorer_rows_passed_over", "Rows cut from a pass to the next "
                                        "one (KEV_ROW_CUT_BACK)", registry=r)
        self.bank_hit_ratio = Gauge("kev_scorer_bank_hit_ratio", "Share of documents found in the bank",
                                    registry=r)
        self.bank_occupancy = Gauge("kev_scorer_bank_occupancy", "Used share of the bank", ["resource"],
                                    registry=r)
        self.pins_held = Gauge("kev_scorer_pins_held", "Directory leases held by this scorer", registry=r)
        self.wrong_entries = Counter("kev_scorer_wrong_entries", "Directory entries pointing at another "
                                     "document's slot (dropped; never answered from)", registry=r)
        self.lease_renewals = Counter("kev_scorer_lease_renewals", "Lease renewals by result", ["result"],
                                      registry=r)
        self._hits = self._misses = 0
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    def lookup(self, hit: bool) -> None:
        self.bank_lookups.labels(result="hit" if hit else "miss").inc()
        with self._lock:
            if hit:
                self._hits += 1
            else:
                self._misses += 1
            self.bank_hit_ratio.set(self._hits / (self._hits + self._misses))

    def row_pass(self, rows: int, tokens: int, seconds: float) -> None:
        self.rows_per_pass.observe(rows)
        self.tokens_per_pass.observe(tokens)
        self.pass_seconds.observe(seconds)

    def row_pass_phase(self, phase: str, seconds: float) -> None:
        self.worker_seconds.labels(phase=phase).inc(seconds)

    def row_launch(self, steps: dict[str, float], cpu_seconds: float) -> None:
        for step, seconds in steps.items():
            self.launch_seconds.labels(step=step).inc(seconds)
        self.launch_cpu_seconds.inc(cpu_seconds)

    def watch_graphs(self, stats: Callable[[], object | None]) -> None:
        """Export the process's CUDA-graph counters (`kev.exec.graphs.GraphStats`, read at scrape time;
        None on CPU: nothing exported). The passes count them; nothing here touches a pass."""
        self.registry.register(GraphCollector("kev_scorer", stats))

    def watch_document_cache(self, cache) -> None:
        """Export the document cache's lookups and size (`kev.request.doc_cache.DocumentCache`, read
        at scrape time)."""
        self.registry.register(_DocumentCacheCollector(cache))

    def set_occupancy(self, slots_used: int, slots_total: int, blocks_used: int, blocks_total: int) -> None:
        self.bank_occupancy.labels(resource="slots").set(slots_used / max(slots_total, 1))
        self.bank_occupancy.labels(resource="blocks").set(blocks_used / max(blocks_total, 1))

    def serve(self, port: int, poll_stats: Callable[[], None] | None = None, every_s: float = 5.0,
              addr: str = "0.0.0.0") -> None:
        """Starts the HTTP endpoint on `addr` (port 0: none) and a thread refreshing the bank occupancy."""
        if port == 0:
            return
        start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics on %s:%d/metrics", addr, port)
        if poll_stats is not None:
            self._poller = threading.Thread(target=self._poll, args=(poll_stats, every_s), name="kev-stats",
                                            daemon=True)
            self._poller.start()

    def _poll(self, poll_stats: Callable[[], None], every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                poll_stats()
            except Exception as e:  # noqa: BLE001 - a metrics refresh must never stop serving
                log.debug("bank stats refresh failed: %s", e)

    def close(self) -> None:
        self._stop.set()


class _DocumentCacheCollector:
    def __init__(self, cache):
        self.cache = cache

    def describe(self):
        return []

    def collect(self):
        lookups = CounterMetricFamily("kev_scorer_document_cache_lookups", "Documents looked up in the "
                                      "tokenized-document cache, by result", labels=["result"])
        lookups.add_metric(["hit"], self.cache.hits)
        lookups.add_metric(["miss"], self.cache.misses)
        yield lookups
        yield GaugeMetricFamily("kev_scorer_document_cache_tokens", "Tokens held in the tokenized-document cache",
                                value=self.cache.tokens)
