"""CUDA graphs for row passes and short state passes, bucketed by (sequences, tokens each, picks).

`GraphCache` is what `kev.exec.passes.Passes` consults: the bucket a pass fits (`Buckets`; a sweep's
`SweepKey` is a state bucket and a row bucket packed back to back), and the run of a bucketed pass:
padded into the bucket's static buffers (`kev.exec.static_pass`), its graph replayed, or the same
padded pass run eagerly until the graph exists (same kernels, same autotune class, so the answer
never depends on whether a graph existed). A pass that fits no bucket (too many rows, long
documents, chunks carried in a slot) is `Passes`' own eager path.

The stored-state length is not a bucket dimension: the indexed kernels read each row's prefix
length at run time, so one graph serves rows over 40-token and 60k-token documents alike.

Capture policy (`CapturePolicy`), never a stall on a busy server:
- WARMUP_ONLY: graphs only from `capture(keys)` at start-up (after `kev.exec.warm_up.warm_up`).
- WHEN_IDLE: a bucket used `min_uses` times without a graph is queued (as are the buckets given to
  `queue(keys)`); the server calls `capture_pending()` when its queue is empty.
- ON_FIRST_USE: capture at the first use (benchmarks, tests).
Capture runs the pass once eagerly on a side stream (compiles; autotunes only if the class was
never warmed), then captures it; nothing inside the capture syncs with the host or autotunes.
At most `max_graphs` graphs are kept (least recently used dropped); all share one memory pool,
which is safe because replays never overlap and outputs are copied out right after each replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kev.bank.bank import BankHandle
from kev.ops.attention.paged_prefix import query_block
from kev.exec.batch import RowBatch
from kev.ops.meta import PhasedMeta
from kev.exec.static_pass import PICKS_PER_ROW, GraphKey, PassKind, StaticPass, SweepKey, joined_indices


if TYPE_CHECKING:
    from kev.exec.passes import Passes

AnyKey = GraphKey | SweepKey  # a single pass's bucket, or one sweep's


class CapturePolicy(enum.Enum):
    WARMUP_ONLY = "warmup_only"
    WHEN_IDLE = "when_idle"
    ON_FIRST_USE = "on_first_use"


def largest_first(keys: Iterable[AnyKey]) -> list[AnyKey]:
    """Start-up buckets in capture order, the most rows (then tokens) first. The gathered variant's
    row buffers are sized by the first pass that needs them and replaced by a larger one's, the old
    kept (a captured graph points into it): captured smallest first, 20 row buckets over longdoc's
    61,440-token prefixes would keep ~160 GB of outgrown K/V page buffers, largest first one ~24 GB."""
    def size(key):
        parts = (key.state, key.rows) if isinstance(key, SweepKey) else (key,)
        return sum(p.num_slots for p in parts), sum(p.num_tokens for p in parts)

    return sorted(keys, key=size, reverse=True)


def _bucket(value: int, sizes: Sequence[int]) -> int | None:
    return next((s for s in sizes if s >= value), None)


@dataclass(frozen=True)
class Buckets:
    """Bucket sizes. A state bucket (D documents x L tokens each) exists only while D x L <=
    `max_state_tokens` (the bank's default `--max-pass-tokens`): its static buffers, activations and
    padding compute stay bounded, and a pass the bank builds under that cap usually fits one
    (bank_service/acquire.py keeps a pass inside a bucket when it can)."""

    # Every count up to 8: one request's rows (1-8 questions) run unpadded when it is alone, the
    # latency case (five-long's 5 rows in a 6 bucket were 32 of a new request's 2,432 tokens).
    # Steps of 8 rows above 32: a busy scorer's passes take whatever rows are waiting (78-83 on
    # average at six-short x 64 clients), and the GPU is the bottleneck there: 83 rows in a 96
    # bucket were 16% padding (a 96 bucket for 75 rows, 22%, before the steps went below 1/4).
    rows: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120,
                             128)
    row_tokens: tuple[int, ...] = (16, 32, 48, 64, 96, 128)
    picks: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
    docs: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    # 32 and 48 for short documents (six-short's 48 tokens padded to 64 were a quarter of its state passes);
    # 2208 for five-long's 2,200 (padded to 2,304 they were 4.5% of its state passes' tokens, to
    # 2,240 1.8%: a five-long load is bound by prefill). A bucket need not be whole K/V pages: the
    # padding is a sequence of its own that writes nowhere.
    doc_tokens: tuple[int, ...] = (32, 48, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2208, 2304, 2560, 3072, 4096)
    max_state_tokens: int = 16384

    def row_key(self, num_rows: int, max_len: int, num_picks: int) -> GraphKey | None:
        R, L = _bucket(num_rows, self.rows), _bucket(max_len, self.row_tokens)
        if R is None or L is None:
            return None
        # At least PICKS_PER_ROW picks a row, so passes of the same rows and length share one key
        # whatever their questions' option counts: keyed by their own picks, 32 rows of 3-4 picks
        # (128) missed the 32-row graph captured for 160 (256) and ran eagerly, 20 of 116 passes at
        # six-short x 32 clients. Padded picks cost only a gather.
        P = _bucket(max(num_picks, PICKS_PER_ROW * R), self.picks)
        return None if P is None else GraphKey(PassKind.ROWS, R, L, P)

    def state_key(self, num_docs: int, max_len: int) -> GraphKey | None:
        D, L = _bucket(num_docs, self.docs), _bucket(max_len, self.doc_tokens)
        if D is None or L is None or D * L > self.max_state_tokens:
            return None
        return GraphKey(PassKind.STATE, D, L)


@dataclass
class GraphStats:
    replays: int = 0
    eager_bucketed: int = 0  # bucketed passes run eagerly (no graph yet)
    unbucketed: int = 0  # passes that fit no bucket (Passes' eager path)
    captures: int = 0
    evictions: int = 0
    row_tokens: int = 0  # real row tokens run in row buckets (a sweep's rows included)
    padding_tokens: int = 0  # the padding those buckets added (kev_scorer_graph_padding_tokens)
    capture_errors: list[str] = field(default_factory=list)


class _Entry:
    def __init__(self, static: StaticPass, rows: StaticPass | None = None):
        self.static = static  # a SweepKey's: its documents (STATE layout)
        self.rows = rows  # a SweepKey's rows (ROWS layout); None for a single pass
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None


class GraphCache:
    """A process's CUDA graphs for one bank's passes: buckets, their static buffers and graphs, the
    capture policy. Methods that run or capture take the `Passes` whose model, bank and ops they use."""

    def __init__(self, buckets: Buckets = Buckets(), policy: CapturePolicy = CapturePolicy.WHEN_IDLE,
                 max_graphs: int = 32, max_entries: int = 64, min_uses: int = 2, stats: GraphStats | None = None):
        self.buckets, self.policy = buckets, policy
        self.max_graphs, self.max_entries, self.min_uses = max_graphs, max_entries, min_uses
        self.stats = stats if stats is not None else GraphStats()  # shared: a process's counts over re-attaches
        self._entries: OrderedDict[AnyKey, _Entry] = OrderedDict()
        self._uses: Counter[AnyKey] = Counter()
        self._pending: list[AnyKey] = []
        self.failed: set[AnyKey] = set()
        self._pool = None

    # ---- which bucket a pass fits ----------------------------------------------------------------

    def row_key(self, batch: RowBatch) -> GraphKey | None:
        if not batch.row_lens:  # row lengths unknown on the host: no bucket
            return None
        return self.buckets.row_key(len(batch.row_lens), max(batch.row_lens), batch.picks.shape[0])

    def state_bucket(self, num_docs: int, max_len: int, chunk_tokens: int) -> GraphKey | None:
        """The bucket a state pass of `num_docs` new documents (the longest `max_len` tokens) runs
        in, or None: it runs eagerly (too many tokens, or a document longer than a chunk)."""
        if num_docs < 1 or max_len > chunk_tokens:
            return None
        return self.buckets.state_key(num_docs, max_len)

    def sweep_key(self, state: GraphKey | None, rows: GraphKey | None) -> SweepKey | None:
        """The sweep's bucket, or None: run the two passes (each graphed if it can be). Until the
        sweep has a graph of its own, a state graph and a row graph that both exist run instead (two
        replays beat one eager sweep); the sweep's uses still count toward its capture."""
        if state is None or rows is None:
            return None
        key = SweepKey(state, rows)
        if not self._has_graph(key) and self.policy is not CapturePolicy.ON_FIRST_USE \
                and self._has_graph(state) and self._has_graph(rows):
            self._count_use(key)
            return None
        return key

    def _has_graph(self, key: AnyKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.graph is not None

    # ---- bucketed passes -----------------------------------------------------------------------

    def run_rows(self, passes: Passes, key: GraphKey, batch: RowBatch) -> torch.Tensor:
        """`batch` in `key`'s bucket: [P, d] hidden states at the real picks."""
        entry = self._entry(passes, key)
        P = entry.static.fill_rows(*batch.host_fields(), passes.bank.block_table)
        self._count_padding(key, batch)
        return self._run(passes, key, entry)[:P].clone()

    def run_state(self, passes: Passes, key: GraphKey, documents: Sequence[Sequence[int]],
                  handles: Sequence[BankHandle]) -> None:
        """New documents (one chunk each, handles checked by the caller) in `key`'s bucket."""
        entry = self._entry(passes, key)
        entry.static.fill_state(documents, [h.slot for h in handles], passes.bank.block_table)
        self._run(passes, key, entry)

    def run_sweep(self, passes: Passes, key: SweepKey, documents: Sequence[Sequence[int]],
                  handles: Sequence[BankHandle], batch: RowBatch) -> torch.Tensor:
        """One sweep in `key`'s bucket: the documents' layout, then the rows'."""
        entry = self._entry(passes, key)
        table = passes.bank.block_table
        entry.static.fill_state(documents, [h.slot for h in handles], table)
        P = entry.rows.fill_rows(*batch.host_fields(), table)
        self._count_padding(key.rows, batch)
        return self._run(passes, key, entry)[:P].clone()

    def _count_padding(self, key: GraphKey, batch: RowBatch) -> None:
        """Row tokens and the padding `key`'s bucket adds to them (host ints only)."""
        real = sum(batch.row_lens)
        self.stats.row_tokens += real
        self.stats.padding_tokens += max(key.num_tokens - real, 0)

    # ---- capture -------------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, passes: Passes, keys: Iterable[AnyKey]) -> None:
        """Capture graphs for `keys` now (start-up, after `warm_up`), on synthetic fills: rows of L
        tokens from nothing, or documents written nowhere."""
        for key in largest_first(keys):
            entry = self._entry(passes, key)
            self._fill_synthetic(passes, entry)
            self._capture(passes, key, entry)

    def queue(self, keys: Iterable[AnyKey]) -> None:
        """Queue `keys` for `capture_pending` (a start-up list that must not be captured by the
        calling thread). No GPU work here: the buffers are made by the capturing thread."""
        for key in largest_first(keys):
            if key not in self._pending:
                self._pending.append(key)

    def capture_pending(self, passes: Passes, limit: int = 1) -> int:
        """Capture up to `limit` queued buckets (WHEN_IDLE: call when the server is idle). Buckets
        queued by use still hold their last real pass, so the warm-up run is representative;
        buckets from `queue` get the synthetic fill of `capture`."""
        done = 0
        while self._pending and done < limit:
            key = self._pending.pop(0)
            entry = self._entries.get(key)
            if entry is None:  # from `queue`: never run yet
                entry = self._entry(passes, key)
                self._fill_synthetic(passes, entry)
            if entry.graph is None and key not in self.failed:
                with torch.no_grad():
                    self._try_capture(passes, key, entry)
                done += 1
        return done

    @property
    def pending(self) -> list[AnyKey]:
        return list(self._pending)

    def graphs(self) -> list[AnyKey]:
        return [k for k, e in self._entries.items() if e.graph is not None]

    # ---- internals -----------------------------------------------------------------------------

    def _static(self, passes: Passes, key: GraphKey) -> StaticPass:
        cfg = passes.model.cfg
        attn_block = query_block(cfg.num_attention_heads // cfg.num_key_value_heads)
        static = StaticPass(key, passes.bank.block_table.shape[1], attn_block, passes.device)
        passes.ops.pin(static.meta, static.indices())
        return static

    def _entry(self, passes: Passes, key: AnyKey) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            if isinstance(key, SweepKey):
                entry = _Entry(self._static(passes, key.state), self._static(passes, key.rows))
            else:
                entry = _Entry(self._static(passes, key))
            self._entries[key] = entry
            while len(self._entries) > self.max_entries:
                self._evict(next(iter(self._entries)))
        self._entries.move_to_end(key)
        return entry

    def _forward(self, passes: Passes, entry: _Entry) -> torch.Tensor:
        s, r = entry.static, passes
        if entry.rows is None:
            return r.model(s.tokens, s.meta, r.bank.pools, r.ops, picks=s.picks)
        rows, Td = entry.rows, s.key.num_tokens  # one sweep: the documents' tokens, then the rows'
        meta = PhasedMeta((s.meta, rows.meta), (Td, rows.key.num_tokens))
        r.ops.pin(meta.joined, joined_indices(s, rows))  # built on the device, in the graph, as its cu_seqlens
        return r.model(torch.cat([s.tokens, rows.tokens]), meta, r.bank.pools, r.ops, picks=rows.picks + Td,
                       mixer_scope=r.phase_scope)

    def _count_use(self, key: AnyKey) -> None:
        """A use of a bucket without a graph: WHEN_IDLE queues it for capture at `min_uses`."""
        self._uses[key] += 1
        if (self.policy is CapturePolicy.WHEN_IDLE and self._uses[key] >= self.min_uses
                and key not in self._pending and key not in self.failed):
            self._pending.append(key)

    def _run(self, passes: Passes, key: AnyKey, entry: _Entry) -> torch.Tensor:
        if entry.graph is None and key not in self.failed:
            self._count_use(key)
            if self.policy is CapturePolicy.ON_FIRST_USE:
                self._try_capture(passes, key, entry)
        if entry.graph is not None:
            entry.graph.replay()
            self.stats.replays += 1
            return entry.out
        self.stats.eager_bucketed += 1
        with passes.tuned(key.shape_class):
            return self._forward(passes, entry)

    def _try_capture(self, passes: Passes, key: AnyKey, entry: _Entry) -> None:
        """A lazy capture that fails leaves the bucket eager for good (and says why in stats)."""
        try:
            self._capture(passes, key, entry)
        except Exception as e:  # noqa: BLE001 - serving goes on eagerly; the error is kept
            self.failed.add(key)
            self.stats.capture_errors.append(f"{key}: {e!r}")

    def _capture(self, passes: Passes, key: AnyKey, entry: _Entry) -> None:
        with passes.tuned(key.shape_class):
            entry.graph, entry.out = self._record(passes, entry)
        self.stats.captures += 1
        self._uses.pop(key, None)
        while len(self.graphs()) > self.max_graphs:
            self._evict(next(k for k, e in self._entries.items() if e.graph is not None))

    def _record(self, passes: Passes, entry: _Entry) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm the pass up on a side stream (compiles; autotunes only an unwarmed class), then
        capture it into the shared pool. Returns (graph, its static output)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(passes, entry)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads (a scorer re-attaching, mapping a new bank's memory)
        # may make CUDA calls while its pass thread captures; none of them touches this stream.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(passes, entry)
        return graph, out

    def _evict(self, key: AnyKey) -> None:
        entry = self._entries.pop(key)
        if entry.graph is not None:
            entry.graph.reset()
            self.stats.evictions += 1
        if key in self._pending:
            self._pending.remove(key)

    def _fill_synthetic(self, passes: Passes, entry: _Entry) -> None:
        for s in (entry.static, entry.rows):
            if s is not None:
                self._fill_synthetic_static(passes, s)

    def _fill_synthetic_static(self, passes: Passes, s: StaticPass) -> None:
        key, device, table = s.key, passes.device, passes.bank.block_table
        if key.kind is PassKind.ROWS:
            R, L = key.seqs, key.seq_len
            cu = torch.arange(R + 1, dtype=torch.int64, device=device) * L
            slots = torch.full((R,), -1, dtype=torch.int64, device=device)
            s.fill_rows(torch.zeros(R * L, dtype=torch.int64, device=device), cu, slots, torch.zeros_like(slots),
                        torch.arange(L, dtype=torch.int64, device=device).repeat(R),
                        torch.arange(min(key.picks, R * L), dtype=torch.int64, device=device), table)
        else:
            s.fill_state([[0] * key.seq_len] * key.seqs, [-1] * key.seqs, table)
