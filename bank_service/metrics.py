"""Prometheus metrics of the bank service, on their own registry (served on KEV_METRICS_PORT)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, start_http_server

from kev.bank.bank import BankStats


class BankMetrics:
    def __init__(self, stats: Callable[[], BankStats]):
        self.registry = r = CollectorRegistry()
        ProcessCollector(namespace="kev_bank", registry=r)  # the process's CPU seconds (all threads)
        g = {
            "slots_used": "Bank slots holding a document (or being filled)",
            "slots_total": "Bank slots",
            "blocks_used": "Paged K/V blocks in use",
            "blocks_total": "Paged K/V blocks",
        }
        for name, doc in g.items():
            gauge = Gauge(f"kev_bank_{name}", doc, registry=r)
            gauge.set_function(lambda name=name: getattr(stats(), name))
        self.state_passes = Counter("kev_bank_state_passes", "State passes run (one per batch)", registry=r)
        self.state_pass_documents = Counter("kev_bank_state_pass_documents", "Documents state-passed", registry=r)
        self.state_pass_tokens = Counter("kev_bank_state_pass_tokens", "Document tokens state-passed", registry=r)
        self.split_documents = Counter("kev_bank_split_documents",
                                       "State-pass pieces that left their document for a later pass", registry=r)
        # A state pass's wall time by step: launch (fill + replay queued), device_wait (until the GPU
        # is done), directory (the worker's Redis work around the pass: epoch check, evictions,
        # registrations; not in the pass's own seconds); and the worker's CPU time in launches
        # (launch minus it: blocked, e.g. on the GIL).
        self.state_pass_steps = Counter("kev_bank_state_pass_step_seconds", "State pass time by step", ["step"],
                                        registry=r)
        self.state_pass_cpu_seconds = Counter("kev_bank_state_pass_cpu_seconds", "State worker CPU time in launches",
                                              registry=r)
        self.state_pass_seconds = Histogram(
            "kev_bank_state_pass_seconds", "Wall time of one state pass", registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self.sweeps = Counter("kev_bank_sweeps", "State passes that answered their caller's rows too (idle sweeps)",
                              registry=r)
        self.sweep_rows = Counter("kev_bank_sweep_rows", "Question rows answered in idle sweeps", registry=r)
        self.acquires = Counter("kev_bank_acquires", "Acquire calls by result", ["result"], registry=r)
        self.acquire_seconds = Histogram(
            "kev_bank_acquire_seconds", "Acquire latency (hits and state passes)", ["cached"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10))
        self.evictions = Counter("kev_bank_evictions", "Entries evicted to make room", registry=r)
        self.space_waits = Counter("kev_bank_space_waits",
                                   "Times a new document found every entry pinned and waited for space", registry=r)
        self.directory_resets = Counter("kev_bank_directory_resets",
                                        "Times the directory lost its data and the bank re-registered", registry=r)
        self.queue_depth = Gauge("kev_bank_queue_depth", "New documents waiting for a state pass", registry=r)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=addr, registry=self.registry)
