"""`Passes`: the one object a process runs its passes through, and `PassBuilder`, which makes it.

    passes.state_pass(documents, handles)       # new documents' final states into their slots
    passes.row_pass(batch)                      # rows continuing stored states -> [P, d] at the picks
    passes.sweep(documents, handles, batch)     # both in one sweep over the weights

Each call picks how it runs, inside (as nano-vllm's `ModelRunner.run_model` does):
- with a `GraphCache` (CUDA, the indexed TritonOps): a pass within the ladders' caps is packed into
  its key's static buffers (padded only in total tokens and chunk entries) and replayed from its
  CUDA graph, or run eagerly in the same padded shape while the graph does not exist (same kernels,
  same autotune class: the answer never depends on which);
- otherwise, or beyond the caps, eagerly on the packed tensors (`_eager_*` below).
Every eager pass runs under its shape class's autotune caches when the process has a `ClassTuner`.

State passes read long documents in chunks of `state_chunk_tokens` whose state rides in the
document's own slot (each chunk pass keyed like any other); a sweep takes new documents of at most one chunk and the rows that may read
them, documents first inside every layer (`PhasedMeta`).

`PassBuilder` is made once per process. On CUDA with TritonOps it owns the process's `ClassTuner`,
warms every class its role uses once (`kev.exec.warm_up`), and gives each `Passes` a graph cache
with every key of its role's ladders captured (or, on a re-attach, queued: the thread that
re-attaches serves a request and must not capture while the row worker runs a pass; each queued
key is then captured at its first use, or by `capture_when_idle`).

    builder = PassBuilder(model, ops, PassRole.ROWS, GraphPlan(...))   # once per process
    passes = builder.build(bank)                    # start-up: warm, capture every key
    passes = builder.build(new_bank, capture=False) # re-attach: queue them instead
    if queue_empty and passes.idle_work: passes.capture_when_idle()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from kev.bank.bank import Bank, BankHandle
from kev.exec.batch import RowBatch
from kev.exec.graphs import GraphCache, GraphStats, KeyLadder, PickHead
from kev.exec.memory import state_pass_peak_bytes
from kev.exec.plan import GraphPlan, PassRole
from kev.exec.static_pass import CHUNK, GraphKey, PassKind
from kev.exec.transfer import host_int64, to_device
from kev.exec.warm_up import warm_up
from kev.model.qwen35 import Qwen35Model
from kev.ops import Ops, PassMeta
from kev.ops.autotune import ClassTuner, serving_tuner
from kev.ops.meta import PhasedMeta, host_positions
from kev.ops.shapes import ShapeClass, classify
from kev.ops.triton_ops import TritonOps

log = logging.getLogger(__name__)


class Passes:
    """Passes against a bank: an owning `Bank`, or any object with the same `pools`, `block_table`
    and `check` (a scorer's attached view of another process's bank)."""

    def __init__(self, model: Qwen35Model, bank: Bank, ops: Ops, state_chunk_tokens: int = 8192,
                 tuner: ClassTuner | None = None, graphs: GraphCache | None = None):
        if graphs is not None and not isinstance(ops, TritonOps):
            raise ValueError(f"CUDA graphs need the indexed TritonOps, got {type(ops).__name__}")
        self.model, self.bank, self.ops = model, bank, ops
        self.state_chunk_tokens = state_chunk_tokens
        self.tuner, self.graphs = tuner, graphs
        self.device = bank.block_table.device

    def with_graphs(self, graphs: GraphCache | None) -> "Passes":
        """The same passes (model, bank, ops, tuner) with another graph cache (None: always eager)."""
        return Passes(self.model, self.bank, self.ops, self.state_chunk_tokens, self.tuner, graphs)

    # ---- the three passes ----------------------------------------------------------------------

    @torch.no_grad()
    def state_pass(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle],
                   starts: Sequence[int] | None = None) -> None:
        """Write each document's states into its (already allocated) slot, in place. `starts`: where
        each of `documents` begins in its slot's document (default 0: a new document); a part
        starting later continues the states an earlier pass left in the slot (the bank splits a
        document across passes: bank_service/acquire.py). A part that does not end its document
        ends on a whole number of delta-rule chunks (`piece_tokens`)."""
        for h in handles:
            self.bank.check(h)
        starts = [0] * len(documents) if starts is None else list(starts)
        if len(starts) != len(documents):
            raise ValueError(f"{len(starts)} starts for {len(documents)} documents")
        done = 0
        longest = max((len(d) for d in documents), default=0)
        while done < longest:
            # Every document still going contributes its next chunk; the state rides in its slot.
            live = [i for i, d in enumerate(documents) if len(d) > done]
            chunks = [documents[i][done : done + self.state_chunk_tokens] for i in live]
            slots = [handles[i].slot for i in live]
            at = [starts[i] + done for i in live]
            key = self.graphs.state_key([len(c) for c in chunks]) if self.graphs is not None else None
            if key is not None:
                self.graphs.run_state(self, key, chunks, slots, at)
            else:
                self._count_unbucketed()
                self._eager_chunk(chunks, slots, at)
            done += self.state_chunk_tokens

    @torch.no_grad()
    def row_pass(self, batch: RowBatch) -> torch.Tensor:
        """[P, d] final hidden states at `batch.picks`; the bank is only read."""
        key = self.graphs.row_key(batch) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run_rows(self, key, batch)
        self._count_unbucketed()
        return self._eager_rows(batch)

    @torch.no_grad()
    def row_probabilities(self, batch: RowBatch, layout: Sequence[Sequence[int]], widest: int) -> torch.Tensor | None:
        """The row pass with the decision head in its CUDA graph: [P] fp32, each option pick's
        probability within its question (`layout`: `kev.request.head.pick_layout` of the rows;
        `widest`: their most options). None when the pass runs no such graph (no head in the
        cache, a question wider than its table, or a pass beyond the ladder): then `row_pass` and
        the head. The result is a view of the graphs' shared output: copy it out before the next
        row pass."""
        graphs = self.graphs
        if graphs is None or graphs.head is None or widest > graphs.head_width:
            return None
        key = graphs.row_key(batch)
        return None if key is None else graphs.run_row_probabilities(self, key, batch, layout)

    @torch.no_grad()
    def sweep(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle], batch: RowBatch) -> torch.Tensor:
        """`state_pass(documents, handles)` then `row_pass(batch)` (whose rows may read those slots)
        in one sweep over the weights: per layer the documents' token mixing, then the rows'.
        Documents longer than a chunk (or none) take the two passes; so does a sweep whose key
        has no graph yet while its state and row keys both have one (two replays beat one eager
        sweep; its uses still count toward its capture)."""
        if not self.fits_one_sweep(documents):
            self.state_pass(documents, handles)
            return self.row_pass(batch)
        if self.graphs is None:
            for h in handles:
                self.bank.check(h)
            return self._eager_sweep(documents, handles, batch)
        key = self.graphs.sweep_key(self._state_key(documents), self.graphs.row_key(batch))
        if key is None:
            self.state_pass(documents, handles)
            return self.row_pass(batch)
        for h in handles:
            self.bank.check(h)
        return self.graphs.run_sweep(self, key, documents, handles, batch)

    def synchronize(self) -> None:
        """Returns once every pass launched so far is done on the device. Graph replays and kernels
        return before the GPU has run them; the bank calls this before it tells anyone a new state is
        there, because a scorer reads it from another process, on its own stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # ---- graphs --------------------------------------------------------------------------------

    def state_keyed(self, lens: Sequence[int]) -> bool | None:
        """Whether a state pass of new documents of `lens` tokens runs in CUDA-graph keys (every
        chunk pass of it within the ladder's caps); None: no graphs here."""
        if self.graphs is None or self.graphs.states is None:
            return None
        chunk = self.state_chunk_tokens
        return all(self.graphs.state_key([min(n - done, chunk) for n in lens if n > done]) is not None
                   for done in range(0, max(lens, default=0), chunk))

    def piece_tokens(self, left: int, room: int) -> int:
        """How much of a document with `left` tokens still to read goes into a state pass with `room`
        tokens free: all of it, or the most that fits of its next chunk (`state_chunk_tokens`), cut
        back to a whole number of delta-rule chunks (`CHUNK`) so the document's chunks fall where one
        pass would put them and its pages fill from their start. 0: not even one chunk fits."""
        n = min(left, room, self.state_chunk_tokens)
        return n if n == left else n - n % CHUNK

    def rows_to_take(self, row_lens: Sequence[int]) -> int:
        """Of a full row pass with more rows waiting, how many leading rows to run now
        (`KeyLadder.best_prefix`: the rest go in the next pass rather than pad this one)."""
        if self.graphs is None or self.graphs.rows is None:
            return len(row_lens)
        return self.graphs.rows.best_prefix(row_lens)

    def pieces_to_take(self, piece_lens: Sequence[int]) -> list[int]:
        """The same for a state pass of document pieces (each within one chunk) when more work will
        follow it: `KeyLadder.best_cut`, the last piece kept cut short at whole delta-rule chunks
        (`piece_tokens`); the lengths to run now, a prefix of `piece_lens` but for that last one."""
        if self.graphs is None or self.graphs.states is None or max(piece_lens, default=0) > self.state_chunk_tokens:
            return list(piece_lens)
        return self.graphs.states.best_cut(piece_lens, CHUNK)

    @property
    def idle_work(self) -> bool:
        """Whether a graph waits to be captured (`capture_when_idle`)."""
        return self.graphs is not None and bool(self.graphs.pending)

    def capture_when_idle(self, limit: int = 1) -> int:
        """Captures up to `limit` queued graphs; returns how many were tried. Call it only from the
        thread that runs this process's passes, and only when its queue is empty: a capture takes
        about two passes' time."""
        return self.graphs.capture_pending(self, limit) if self.graphs is not None else 0

    def _state_key(self, documents: Sequence[Sequence[int]]) -> GraphKey | None:
        lens = [len(d) for d in documents]
        if self.graphs is None or not lens or min(lens) == 0:
            return None
        return self.graphs.state_key(lens)

    def _count_unbucketed(self) -> None:
        if self.graphs is not None:
            self.graphs.stats.unbucketed += 1

    # ---- eager passes on the packed tensors ------------------------------------------------------

    def tuned(self, cls: ShapeClass):
        """Context: `cls`'s autotune caches (nothing without a tuner)."""
        return self.tuner.use(cls) if self.tuner is not None else nullcontext()

    def phase_scope(self, meta: PassMeta, num_tokens: int):
        """A phase's token mixing runs with its own class's autotune caches."""
        return self.tuned(meta.pass_class(num_tokens))

    def fits_one_sweep(self, documents: Sequence[Sequence[int]]) -> bool:
        """Whether `sweep` runs these documents and rows as one sweep (every document new and at
        most one chunk long)."""
        return bool(documents) and all(0 < len(d) <= self.state_chunk_tokens for d in documents)

    def row_meta(self, batch: RowBatch) -> PassMeta:
        return PassMeta(cu_seqlens=batch.cu_seqlens, read_slots=batch.slots,
                        write_slots=torch.full_like(batch.slots, -1), prefix_lens=batch.doc_lens,
                        block_table=self.bank.block_table[batch.slots], positions=batch.positions,
                        shape_class=batch.shape_class)

    def _eager_rows(self, batch: RowBatch) -> torch.Tensor:
        with self.tuned(batch.shape_class):
            return self.model(batch.tokens, self.row_meta(batch), self.bank.pools, self.ops, picks=batch.picks)

    def _eager_chunk(self, chunks: Sequence[Sequence[int]], slots: Sequence[int], starts: Sequence[int]) -> None:
        tokens, meta = self._chunk_pass(slots, chunks, starts)
        with self.tuned(meta.shape_class):
            self.model(tokens, meta, self.bank.pools, self.ops, picks=torch.zeros(0, dtype=torch.int64, device=self.device))

    def _eager_sweep(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle],
                     batch: RowBatch) -> torch.Tensor:
        doc_tokens, doc_meta = self._chunk_pass([h.slot for h in handles], documents, [0] * len(documents))
        Td = doc_tokens.shape[0]
        meta = PhasedMeta((doc_meta, self.row_meta(batch)), (Td, batch.tokens.shape[0]))
        with self.tuned(doc_meta.shape_class):
            return self.model(torch.cat([doc_tokens, batch.tokens]), meta, self.bank.pools, self.ops,
                              picks=batch.picks + Td, mixer_scope=self.phase_scope)

    def _chunk_pass(self, slots: Sequence[int], chunks: Sequence[Sequence[int]], starts: Sequence[int]):
        """(tokens, meta) of one state pass: chunk n continues slot n's first `starts[n]` tokens (0: new)."""
        lens = [len(c) for c in chunks]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        read = [slot if start > 0 else -1 for slot, start in zip(slots, starts)]
        parts = ([t for c in chunks for t in c], cu, list(slots), read, list(starts), host_positions(lens, list(starts)))
        # One host block, one copy that does not wait for the GPU (kev/exec/transfer.py); the fields are views.
        block = to_device(host_int64(v for part in parts for v in part), self.device)
        tokens, cu_t, slot_t, read_t, prefix_t, positions = block.split([len(p) for p in parts])
        meta = PassMeta(cu_seqlens=cu_t, read_slots=read_t, write_slots=slot_t, prefix_lens=prefix_t,
                        block_table=self.bank.block_table[slot_t], positions=positions,
                        shape_class=classify(sum(lens), rows=False))
        return tokens, meta

    def state_pass_peak_bytes(self, doc_lens: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> int:
        """Bound on what `state_pass` of documents of `doc_lens` tokens allocates above weights and
        bank: its largest pass is the first, every document's first chunk."""
        first = [min(n, self.state_chunk_tokens) for n in doc_lens if n > 0]
        return state_pass_peak_bytes(self.model.cfg, sum(first), len(first), dtype) if first else 0


class PassBuilder:
    """Makes a process's `Passes` for each bank it runs against. One per process: it owns the
    process's `ClassTuner` (CUDA), warms every class once, and keeps one `GraphStats` for the
    process's graphs over re-attaches."""

    def __init__(self, model: Qwen35Model | None, ops: Ops, role: PassRole, plan: GraphPlan = GraphPlan(),
                 state_chunk_tokens: int = 8192, head: PickHead | None = None, head_width: int = 0):
        self.model, self.ops, self.role, self.plan = model, ops, role, plan
        self.head, self.head_width = head, head_width  # the row graphs' decision head (GraphCache)
        self.state_chunk_tokens = state_chunk_tokens
        self.tuner: ClassTuner | None = None  # made by the first CUDA build
        self.graph_stats: GraphStats | None = None  # likewise
        self.warmed: list[ShapeClass] = []
        self._warm_done = False  # `warmed` may stay empty (a plan that warms nothing)
        self._lock = threading.Lock()  # a re-attach may race another

    @property
    def warm_classes(self) -> list[ShapeClass]:
        """The plan's `warm` when set; else the classes of this role's graph keys (ShapeClass
        order, once each). With CUDA graphs off, the classes those keys would have."""
        if self.plan.warm is not None:
            return [c for c in ShapeClass if c in self.plan.warm]
        used = {k.shape_class for ladder in self.ladders() if ladder is not None for k in ladder.keys()}
        return [c for c in ShapeClass if c in used]

    def build(self, bank, *, capture: bool = True, model: Qwen35Model | None = None) -> Passes:
        """Passes against `bank` (a `Bank` or an attached view), with `model` (default: the
        builder's; a scorer passes the model bound to this bank's shared weights). On CUDA with
        TritonOps: warm the classes (first build only), then capture every key now (`capture`) or
        queue them."""
        model = model if model is not None else self.model
        if model is None:
            raise ValueError("PassBuilder.build needs a model (the builder was made without one)")
        if bank.block_table.device.type != "cuda" or not _indexed(self.ops):
            if bank.block_table.device.type == "cuda":
                log.info("%s ops on CUDA: no class tuning and no CUDA graphs", self.ops.name)
            return Passes(model, bank, self.ops, self.state_chunk_tokens)
        with self._lock:
            if self.tuner is None:
                self.tuner, self.graph_stats = serving_tuner(), GraphStats()
            passes = Passes(model, bank, self.ops, self.state_chunk_tokens, tuner=self.tuner)
            if not self._warm_done:
                start = time.perf_counter()
                self.warmed, self._warm_done = warm_up(passes, self.warm_classes), True
                log.info("autotune classes %s warmed in %.1f s", [c.value for c in self.warmed],
                         time.perf_counter() - start)
            if not self.plan.cuda_graphs:
                return passes
            graphs = GraphCache(*self.ladders(), stats=self.graph_stats, head=self.head, head_width=self.head_width)
            passes = passes.with_graphs(graphs)
            keys = graphs.all_keys()
            if capture:
                start = time.perf_counter()
                log.info("start-up: graphs captured 0/%d", len(keys))
                for k, key in enumerate(keys, 1):
                    graphs.capture(passes, [key])
                    if k % 25 == 0 or k == len(keys):  # a start-up progress line now and then
                        log.info("start-up: graphs captured %d/%d (%.1f s)", k, len(keys), time.perf_counter() - start)
                log.info("captured %d CUDA graphs in %.1f s (largest %s)", len(keys), time.perf_counter() - start,
                         keys[0] if keys else None)
                if graphs.rows is not None and graphs.states is not None and graphs.calibrate() is not None:
                    log.info("a pass's fixed cost here: %.2f ms (the smallest key's replay); a sweep is "
                             "captured when idle once its uses would have saved what its capture costs",
                             graphs.fixed_s * 1e3)
            else:
                graphs.queue(keys)
                log.info("queued %d CUDA graphs: each is captured at its first use or when idle", len(keys))
            return passes

    def ladders(self) -> tuple[KeyLadder | None, KeyLadder | None]:
        """(rows, states): the key ladders of this role, from the plan's per-pass caps."""
        plan = self.plan
        rows = KeyLadder(PassKind.ROWS, plan.row_tokens, plan.row_seqs) if self.role.rows else None
        states = KeyLadder(PassKind.STATE, plan.state_tokens, plan.state_seqs) if self.role.states else None
        return rows, states


def _indexed(ops: Ops) -> bool:
    """Whether `ops` are the bank-indexed Triton ops that class tuning and CUDA graphs need."""
    return isinstance(ops, TritonOps)
