"""`python -m scorer_service [--flags]`: load the model, attach to the bank, serve until SIGTERM.

Start-up: settings (logged) -> model -> gRPC server listening (health "" SERVING, kev.v1.Scorer
NOT_SERVING) -> metrics -> attach to the bank (retried until it answers) -> one warm-up request
through the whole path -> kev.v1.Scorer SERVING. SIGTERM/SIGINT: kev.v1.Scorer NOT_SERVING,
new RPCs refused, queued requests finished within the grace period, pins released, exit 0.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import torch

from kev.loading import LoadedModel
from kev.request.doc_cache import DocumentCache
from kev.serving.interpreter import freeze_startup_heap, set_switch_interval
from kev.serving.errors import DeadlineExceeded, Exhausted, ServiceError, Unavailable
from kev.serving.grpc_server import ListenError
from kev.serving.settings import log_settings
from kev.ops import get_ops
from kev.exec.plan import PassRole
from kev.exec.passes import PassBuilder
from kev.exec.memory import MemoryPlanError, check_memory_plan, memory_plan
from kev.model.checkpoint import read_config
from scorer_service.bank_link import BankLink
from scorer_service.batcher import RowBatcher
from scorer_service.config import ConfigError, ScorerConfig
from scorer_service.metrics import ScorerMetrics
from scorer_service.server import ScorerService, build_server

log = logging.getLogger("scorer_service")

GRACE_S = 50.0  # under Kubernetes' default 60 s (preStop sleeps 10 s first)


WARM_UP_TRIES = 3  # a warm-up request that fails this often in a row, with the bank answering, ends the start-up


class StartupFailed(Exception):
    """The bank answers but the warm-up request keeps failing on the scorer's own path: a fault to
    report (exit 1, the error in the log), not a bank to wait for."""


def attach_until_ready(service: ScorerService, stop: threading.Event) -> bool:
    """Attach and warm up, retried while the bank is not there yet (UNAVAILABLE, a deadline, a full
    bank), until it answers or a stop signal. Any other error of the warm-up request (a failed row
    pass, the bank's INTERNAL) is retried WARM_UP_TRIES times, then raises StartupFailed: retried
    for good, a broken scorer would only look like a bank still starting (as f6adb2a's did)."""
    waited, failures = 0.0, 0
    while not stop.is_set():
        try:
            service.link.attachment()
            service.warm_up()
            return True
        except (Unavailable, DeadlineExceeded, Exhausted) as e:
            failures = 0
            if waited % 10 < 0.5:
                log.warning("bank not attachable yet (%s); retrying", e)
        except ServiceError as e:
            failures += 1
            log.error("start-up warm-up request failed (%d of %d): %s", failures, WARM_UP_TRIES, e)
            if failures >= WARM_UP_TRIES:
                raise StartupFailed(f"the warm-up request failed {failures} times: {e}") from e
        stop.wait(0.5)
        waited += 0.5
    return False


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ScorerConfig.from_env(argv=argv)
    except ConfigError as e:
        log.error("bad settings: %s", e)
        return 2
    log_settings(log, config)
    set_switch_interval(config.switch_interval_ms)
    start = time.perf_counter()
    # Memory plan (kev/exec/memory.py): row-pass workspace + graphs against the GPU's free memory,
    # before anything is allocated. weights_shared: they are the bank's, mapped (KEV_SHARE_WEIGHTS);
    # a bank that shares none makes the attachment read a copy here, which this plan does not count.
    try:
        check_memory_plan(memory_plan(read_config(config.checkpoint), PassRole.ROWS, config.graph_plan,
                                      weights_shared=True, max_doc_tokens=config.max_document_tokens,
                                      dtype=torch.float32 if config.device == "cpu" else torch.bfloat16),
                          config.device)
    except MemoryPlanError as e:
        log.error("%s", e)
        return 2
    # No weights here: the first attachment maps the bank's (or reads them, if the bank shares none).
    log.info("start-up: loading %s (tokenizer, head; weights come with the bank) on %s", config.checkpoint,
             config.device)
    loaded = LoadedModel.load(config.checkpoint, config.adapter, device=config.device, limits=config.limits,
                              weights=False)
    log.info("model %s loaded in %.1f s; ops backend %s", loaded.model_id, time.perf_counter() - start,
             config.ops_backend)
    metrics = ScorerMetrics()
    if config.document_cache_tokens:
        loaded.builder.documents = DocumentCache(config.document_cache_tokens)
        metrics.watch_document_cache(loaded.builder.documents)
    # One builder per process: on CUDA it owns the class tuner and the graphs' counters (kev/exec/passes.py).
    ops = get_ops(config.ops_backend, gathered_max_prefix_tokens=config.gathered_max_prefix_tokens)
    # each attachment brings its model; the head runs inside the row graphs (kev/request/answers.py)
    builder = PassBuilder(None, ops, PassRole.ROWS, config.graph_plan, head=loaded.head,
                          head_width=config.limits.max_options)
    metrics.watch_graphs(lambda: builder.graph_stats)
    link = BankLink(config, loaded, builder, metrics)
    batcher = RowBatcher(link, loaded.head, metrics, max_rows_per_pass=config.max_rows_per_pass,
                         max_tokens_per_pass=config.max_tokens_per_pass, max_wait_ms=config.max_wait_ms,
                         max_queue=config.max_queue, cut_back=config.row_cut_back)
    service = ScorerService(config, loaded, link, batcher, metrics)
    server = build_server(service)  # health "" SERVING, kev.v1.Scorer NOT_SERVING
    try:
        server.start(config.listen)
    except ListenError as e:
        log.error("%s", e)
        return 2
    log.info("listening on %s", config.listen)
    metrics.serve(config.metrics_port, link.refresh_occupancy, addr=config.metrics_addr)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("start-up: attaching to the bank at %s", config.bank_addr)
    failed = False
    try:
        ready = attach_until_ready(service, stop)
    except StartupFailed as e:
        log.error("start-up failed: %s", e)
        ready, failed = False, True
    if ready:
        frozen = freeze_startup_heap()  # full GC scans skip the start-up heap from here (kev/serving/interpreter.py)
        # Logged before health says SERVING: whoever waits on health (kev.stack) then finds the line.
        log.info("serving (ready after %.1f s; %d start-up objects frozen out of GC scans)",
                 time.perf_counter() - start, frozen)
        log.info("start-up: ready in %.1f s", time.perf_counter() - start)
        server.set_serving(True)
        stop.wait()

    log.info("draining")
    server.set_serving(False)
    service.draining = True
    server.stop(GRACE_S)
    batcher.stop()
    metrics.close()
    log.info("stopped; pins still held: %d", link.pins_held)
    link.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
