"""The `kev.v1.Bank` gRPC service: requests in, typed calls to the Acquirer out; no tensors here.

`BankService(config).start()` serves gRPC health at once (overall status SERVING while the process
lives), loads the model, carves the shared bank, warms up, connects the directory, and only then
marks `kev.v1.Bank` SERVING. `stop()` drains: NOT_SERVING, in-flight RPCs finish (grace), the
worker stops, the directory namespace is dropped and the shared-memory file unlinked. A bank
killed outright leaves no file either: its reaper process unlinks it, and the next bank reclaims
what a dead instance left (kev/bank/shared.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid

import numpy as np
import torch

from kev.bank.shared import SharedBank, reclaim_stale_segments
from kev.bank.shared_weights import SharedWeights
from kev.bank.directory import Directory, DirectoryUnavailable, connect
from kev.loading import LoadedModel
from kev.serving.interpreter import freeze_startup_heap, set_switch_interval
from kev.ops import get_ops
from kev.exec.passes import PassBuilder, Passes
from kev.exec.memory import check_memory_plan, memory_plan
from kev.model.checkpoint import read_config
from kev.serving.graph_metrics import GraphCollector
from kev.request.prompts import Limits
from kev.serving.errors import InvalidArgument, ServiceError, Unavailable, abort
from kev.serving.grpc_server import GrpcServer
from kev.serving.security import ServerSecurity
from kev.v1 import bank_pb2 as pb
from kev.v1 import bank_pb2_grpc

from bank_service.acquire import Acquirer
from bank_service.jobs import SweepLimits, SweepRows
from bank_service.config import BankConfig
from bank_service.metrics import BankMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Bank"].full_name  # "kev.v1.Bank"
MAX_WAIT_S = 600.0  # an Acquire without a deadline still gives up eventually


def parse_tokens(raw: bytes, max_tokens: int, vocab_size: int) -> list[int]:
    """AcquireRequest.token_ids_le_i32 -> token ids, or INVALID_ARGUMENT naming the field."""
    field = "token_ids_le_i32"
    if not raw:
        raise InvalidArgument(f"{field}: the document is empty")
    if len(raw) % 4:
        raise InvalidArgument(f"{field}: {len(raw)} bytes is not a whole number of int32 token ids")
    if len(raw) // 4 > max_tokens:
        raise InvalidArgument(f"{field}: document of {len(raw) // 4} tokens is over the limit of {max_tokens}")
    ids = np.frombuffer(raw, dtype="<i4")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InvalidArgument(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids.tolist()


def parse_rows(rows, vocab_size: int) -> SweepRows:
    """AcquireRequest.rows -> `SweepRows`, or INVALID_ARGUMENT naming the field: every row non-empty,
    its tokens in the vocabulary, its picks a <decide> and at least one option end inside it."""
    ids, picks = [], []
    for i, row in enumerate(rows):
        field = f"rows[{i}]"
        raw = row.token_ids_le_i32
        if not raw or len(raw) % 4:
            raise InvalidArgument(f"{field}.token_ids_le_i32: {len(raw)} bytes is not a non-empty row of int32 token ids")
        tokens = np.frombuffer(raw, dtype="<i4")
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size:
            raise InvalidArgument(f"{field}.token_ids_le_i32: a token id is outside the vocabulary [0, {vocab_size})")
        if len(row.picks) < 2 or max(row.picks) >= len(tokens):
            raise InvalidArgument(f"{field}.picks: needs a <decide> and at least one option end, each inside "
                                  f"the row's {len(tokens)} tokens, got {list(row.picks)}")
        ids.append(tokens.tolist())
        picks.append(list(row.picks))
    return SweepRows(ids, picks)


class BankServicer(bank_pb2_grpc.BankServicer):
    def __init__(self, service: "BankService"):
        self.service = service

    def _ready(self, context) -> "BankService":
        if not self.service.ready.is_set():
            abort(context, Unavailable("the bank is starting"))
        return self.service

    def Acquire(self, request: pb.AcquireRequest, context) -> pb.AcquireResponse:
        s = self._ready(context)
        cfg = s.config
        try:
            if request.model != s.model_id:
                raise InvalidArgument(f"model: {request.model!r} is not served here (this bank serves {s.model_id!r})")
            tokens = parse_tokens(request.token_ids_le_i32, cfg.max_document_tokens, s.vocab_size)
            rows = parse_rows(request.rows, s.vocab_size) if request.rows else None
            lease_s = request.lease_ms / 1000 if request.lease_ms else cfg.lease_seconds
            if lease_s > cfg.max_lease_seconds:
                raise InvalidArgument(f"lease_ms: {request.lease_ms} is over the limit of {cfg.max_lease_seconds * 1000:.0f}")
            remaining = context.time_remaining()
            timeout = MAX_WAIT_S if remaining is None else min(remaining, MAX_WAIT_S)
            got = s.acquirer.acquire(tokens, lease_s, timeout, context.is_active, rows=rows)
        except ServiceError as e:
            s.metrics.acquires.labels(result=e.label).inc()
            abort(context, e)
        s.metrics.acquires.labels(result="hit" if got.cached else "miss").inc()
        pin = got.lease  # None for a swept caller: no lease to hold or release
        return pb.AcquireResponse(
            handle=pb.Handle(slot=got.handle.slot, generation=got.handle.generation),
            document_length=got.length, cached=got.cached, lease_id=pin.lease_id if pin else "",
            lease_expires_unix_ms=pin.expires_at_ms if pin else 0, doc_key=got.doc_key,
            swept=got.probabilities is not None, row_probabilities=got.probabilities or ())

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        s = self._ready(context)
        if not request.lease_id:
            abort(context, InvalidArgument("lease_id: required"))
        try:
            return pb.ReleaseResponse(released=s.acquirer.release(request.lease_id))
        except ServiceError as e:
            abort(context, e)

    def Attach(self, request: pb.AttachRequest, context) -> pb.AttachResponse:
        s = self._ready(context)
        if request.model and request.model != s.model_id:
            abort(context, InvalidArgument(f"model: {request.model!r} is not served here "
                                           f"(this bank serves {s.model_id!r})"))
        weights = s.weights.descriptors() if s.weights is not None else None
        return s.shared.attach_response(s.model_id, s.config.node, weights)

    def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        s = self._ready(context)
        bank = s.shared.bank.stats()
        try:
            pins = s.directory.pins_held()
        except DirectoryUnavailable as e:
            abort(context, Unavailable(str(e)))
        a = s.acquirer
        return pb.StatsResponse(
            slots_used=bank.slots_used, slots_total=bank.slots_total, blocks_used=bank.blocks_used,
            blocks_total=bank.blocks_total, pins_held=pins, hits=a.hits, misses=a.misses, evictions=a.evictions,
            node=s.config.node, instance=s.instance)


class BankService:
    def __init__(self, config: BankConfig):
        self.config = config
        self.instance = f"{int(time.time()):x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ready = threading.Event()
        self.server: GrpcServer | None = None
        self.port = 0
        self.shared: SharedBank | None = None
        self.weights: SharedWeights | None = None  # the model's weights, mapped by the scorers (KEV_SHARE_WEIGHTS)
        self.acquirer: Acquirer | None = None

    def start(self, stop: threading.Event | None = None) -> bool:
        """Serve; returns False if `stop` was set before the bank became ready."""
        cfg, stop = self.config, stop or threading.Event()
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        set_switch_interval(cfg.switch_interval_ms)
        security = ServerSecurity(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca, cfg.auth_token_file)
        self.server = GrpcServer([SERVICE_NAME], workers=cfg.grpc_workers, thread_name_prefix="bank-rpc",
                                 reflect=cfg.reflection == "on", credentials=security.credentials(),
                                 interceptors=security.interceptors())
        bank_pb2_grpc.add_BankServicer_to_server(BankServicer(self), self.server.server)
        self.port = self.server.start(cfg.listen)  # health "" SERVING, kev.v1.Bank NOT_SERVING until ready
        log.info("listening on %s (port %d), instance %s", cfg.listen, self.port, self.instance)

        t0 = time.perf_counter()
        # Memory plan (kev/exec/memory.py): weights + bank + workspaces + graphs against the GPU's
        # free memory, before any weight is read; MemoryPlanError names every part when it cannot fit.
        check_memory_plan(memory_plan(read_config(cfg.checkpoint), cfg.pass_role, cfg.graph_plan, who="bank",
                                      bank_bytes=cfg.memory_bytes, max_doc_tokens=cfg.max_document_tokens,
                                      block_size=cfg.block_size, dtype=torch.float32 if cfg.device == "cpu"
                                      else torch.bfloat16), cfg.device)
        log.info("start-up: loading weights from %s on %s", cfg.checkpoint, cfg.device)
        # Shared weights are read into host memory and moved into the shared segment tensor by
        # tensor: the device never holds two copies, even while loading (kev/bank/shared_weights.py).
        loaded = LoadedModel.load(cfg.checkpoint, cfg.adapter, device=cfg.device,
                                  limits=Limits(max_document_tokens=cfg.max_document_tokens),
                                  host_staging=cfg.share_weights and cfg.device != "cpu")
        self.model_id, self.vocab_size = loaded.model_id, loaded.model.cfg.vocab_size
        log.info("weights loaded in %.1f s", time.perf_counter() - t0)
        dtype = next(loaded.model.parameters()).dtype
        reclaim_stale_segments(cfg.shm_dir)  # files of bank instances that died (kev/bank/shared.py)
        if cfg.share_weights:
            self.weights = SharedWeights.create(loaded.model, device=cfg.device, instance=self.instance,
                                                shm_dir=cfg.shm_dir)
        self.shared = SharedBank.create(
            loaded.model.cfg, cfg.memory_bytes, instance=self.instance, dtype=dtype, device=cfg.device,
            block_size=cfg.block_size, avg_doc_tokens=cfg.avg_doc_tokens, max_doc_tokens=cfg.max_document_tokens,
            shm_dir=cfg.shm_dir)
        bank = self.shared.bank
        ops = get_ops(cfg.ops_backend)
        # On CUDA: class-tuned, warmed, every state-pass key captured (kev/exec/passes.py); on CPU a Passes.
        passes = PassBuilder(loaded.model, ops, cfg.pass_role, cfg.graph_plan).build(bank)
        self._warm_up(passes, bank)
        st = bank.stats()
        log.info("model %s loaded on %s (%s, ops %s) in %.1f s; bank: %d slots, %d blocks of %d tokens, %d bytes, %s",
                 self.model_id, cfg.device, dtype, ops.name, time.perf_counter() - t0, st.slots_total,
                 st.blocks_total, cfg.block_size, st.bytes_total, self.shared.segment_paths or "CUDA IPC")

        self.metrics = BankMetrics(bank.stats)
        self.metrics.registry.register(GraphCollector("kev_bank", lambda: passes.graphs.stats if passes.graphs else None))
        self.directory = Directory(connect(cfg.redis_url), self.model_id, cfg.node)
        sweeps = SweepLimits(cfg.sweep_rows, cfg.sweep_row_tokens, loaded.head) if cfg.sweeps else None
        self.acquirer = Acquirer(passes, bank, self.directory, self.metrics, sweeps=sweeps, lease_s=cfg.lease_seconds,
                                 max_wait_s=cfg.max_wait_ms / 1000, full_wait_s=cfg.full_wait_ms / 1000,
                                 max_pass_tokens=cfg.max_pass_tokens,
                                 max_pass_documents=cfg.max_pass_documents, epoch_check_s=cfg.epoch_check_s)
        while True:  # Redis may come up after the bank
            try:
                self.acquirer.start()
                break
            except DirectoryUnavailable as e:
                log.warning("directory unavailable at start-up, retrying: %s", e)
                if stop.wait(1.0):
                    return False
        self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        frozen = freeze_startup_heap()  # full GC scans skip the start-up heap from here (kev/serving/interpreter.py)
        # Logged before health says SERVING: whoever waits on health (kev.stack) then finds the line.
        log.info("serving %s as node %s (metrics port %s; %d start-up objects frozen out of GC scans)",
                 SERVICE_NAME, cfg.node, cfg.metrics_port or "off", frozen)
        log.info("start-up: ready in %.1f s", time.perf_counter() - t0)
        self.ready.set()
        self.server.set_serving(True)
        return True

    def _warm_up(self, passes: Passes, bank) -> None:
        """One short state pass with the real dtypes, into a slot freed again at once."""
        handle = bank.alloc(8)
        try:
            passes.state_pass([[0] * 8], [handle])
        finally:
            bank.free(handle)

    def stop(self) -> None:
        """Drain and release everything; safe to call at any point of start()."""
        log.info("shutting down")
        if self.server is not None:
            self.server.set_serving(False)
            self.server.stop(self.config.grace_s)
        if self.acquirer is not None:
            self.acquirer.stop()
        if self.ready.is_set():
            try:
                self.directory.drop_all_for_node(self.config.node)
            except DirectoryUnavailable as e:
                log.warning("could not drop the directory namespace: %s", e)
        if self.shared is not None:
            self.shared.close()
        if self.weights is not None:
            self.weights.close()
        log.info("stopped")
