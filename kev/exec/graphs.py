"""CUDA graphs for row and state passes, keyed on the packed pass's tokens and chunk-list entries.

`GraphCache` is what `kev.exec.passes.Passes` consults: the key a pass fits (`KeyLadder`; a
sweep's `SweepKey` is a state key and a row key back to back), and the run of a keyed pass: packed
into the key's static buffers (`kev.exec.static_pass`: the sequences end to end, one padding
sequence to T tokens), its graph replayed, or the same padded pass run eagerly while the graph does
not exist (same kernels, same autotune class, so the answer never depends on whether it existed).
A pass beyond the ladder's caps is `Passes`' own eager path.

The stored-state length is not a key dimension: the indexed kernels read each row's prefix length
at run time, so one graph serves rows over 40-token and 60k-token documents alike. Nor is any
per-sequence length: a key pads only the pass's total tokens (`token_ladder`) and its chunk-list
entries (`CHUNK_STEPS`), which the per-chunk kernels' grids need static.

Capture: services capture every key of their ladders at start-up (`capture`, after
`kev.exec.warm_up.warm_up`), so after warm-up no pass within the caps runs eagerly whatever the
traffic. A sweep (a new document and its rows in one pass: the in-process engine's, the bank's
idle sweeps) has ladder x ladder keys: it runs as the state graph's replay and the row graph's
until it is captured when idle (`capture_pending`), once its uses would have saved what its capture
costs (`uses_to_capture`: each use saves about one pass's fixed cost, measured at start-up by
`calibrate`; the capture holds the thread about as long as its two keys' captures did). At most
`max_sweeps` sweep graphs are kept.
Capture runs the pass once eagerly on a side stream (compiles; autotunes only if the class was
never warmed), then captures it; nothing inside the capture syncs with the host or autotunes.
All graphs share one memory pool (replays never overlap) and one output buffer (each row pass's
picks are copied out right after its replay, in stream order).
"""

from __future__ import annotations

import enum
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

import torch

from kev.bank.bank import BankHandle
from kev.exec.batch import RowBatch
from kev.exec.static_pass import CHUNK, GraphKey, PassKind, StaticPass, SweepKey, cdiv, entries_needed, joined_indices
from kev.ops.attention.paged_prefix import query_block
from kev.ops.meta import PhasedMeta

if TYPE_CHECKING:
    from kev.exec.passes import Passes

AnyKey = GraphKey | SweepKey

# Chunk-list sizes: steps of 1.5x / 1.33x (1, 2, 3, 4, 6, 8, 12, ...), so the no-op entries the
# per-chunk kernels compute in full stay within a third of the real ones.
CHUNK_STEPS = tuple(sorted({1 << k for k in range(14)} | {3 << k for k in range(13)}))
MIN_SEQ_TOKENS = 8  # a key's sequence room assumes this mean length at most; shorter passes take a larger key
# State ladders from here up: a half step between two steps, with only its smallest chunk list (room
# for a document or a few). A pass of one long document (an idle bank's sweep) pads at most an
# eighth instead of a quarter, for one key more per step (16 at the default cap of 16,384 tokens).
HALF_STEPS_FROM = 1024


def token_ladder(max_tokens: int) -> tuple[int, ...]:
    """Padded pass sizes up to `max_tokens` (which is always one): 16-token steps to 128, then four
    steps an octave (160, 192, 224, 256, 320, ...): at most a quarter of padding, a tenth on average."""
    steps = list(range(16, 129, 16))
    base = 128
    while steps[-1] < max_tokens:
        steps.extend(base + base * i // 4 for i in range(1, 5))
        base *= 2
    return tuple(sorted({s for s in steps if s < max_tokens} | {max_tokens}))


class CapturePolicy(enum.Enum):
    START_UP = "start_up"  # every key captured by `capture` before serving; sweeps when idle
    ON_FIRST_USE = "on_first_use"  # capture at the first use (benchmarks, tests)


@dataclass(frozen=True)
class KeyLadder:
    """The keys of one kind of pass: T from `token_ladder(max_tokens)`, and per T the chunk-list
    sizes from just enough for one sequence filling T to room for `max_seqs` sequences (of at least
    MIN_SEQ_TOKENS tokens on average; the top T holds `max_seqs` of any length). A state ladder
    also has its `half_steps`, each with only the smallest chunk list."""

    kind: PassKind
    max_tokens: int
    max_seqs: int

    @cached_property
    def half_steps(self) -> frozenset[int]:
        if self.kind is not PassKind.STATE:
            return frozenset()
        steps = token_ladder(self.max_tokens)
        return frozenset((a + b) // 32 * 16 for a, b in zip(steps, steps[1:]) if a >= HALF_STEPS_FROM) - set(steps)

    @cached_property
    def tokens(self) -> tuple[int, ...]:
        return tuple(sorted({*token_ladder(self.max_tokens), *self.half_steps}))

    def chunk_sizes(self, tokens: int) -> tuple[int, ...]:
        least = cdiv(tokens, CHUNK) + 1  # one sequence filling T, and one spare (the no-ops' own when T is full)
        if tokens in self.half_steps:
            return (next(c for c in CHUNK_STEPS if c >= least),)
        # the top of the ladder holds every pass within the caps, however short its sequences
        room = self.max_seqs if tokens >= self.max_tokens else min(self.max_seqs, max(1, tokens // MIN_SEQ_TOKENS))
        most = least + room
        top = next(c for c in CHUNK_STEPS if c >= most)
        return tuple(c for c in CHUNK_STEPS if c >= least and c <= top) or (top,)

    def keys(self) -> list[GraphKey]:
        return [GraphKey(self.kind, T, C) for T in self.tokens for C in self.chunk_sizes(T)]

    def best_prefix(self, lens: Sequence[int]) -> int:
        """How many leading sequences of `lens` to run now when the rest can wait for the next pass
        (a full pass with more waiting): `best_cut` with whole sequences only."""
        return len(self.best_cut(lens))

    def best_cut(self, lens: Sequence[int], align: int | None = None) -> list[int]:
        """The lengths of a pass of sequences of `lens` to run now when what is cut can wait for the
        next pass: all of them, or the most that fit the whole ladder step below theirs or a half step
        between (state ladders), whichever pads a smaller share (a pass spilling just past a step
        pads up to a quarter of it). Cut back, the trailing sequences go and, with `align`, the last
        one kept may be cut short to a multiple of it (a sequence that continues in a later pass: the
        bank's document pieces); without, only whole sequences stay (rows)."""
        lens = list(lens)
        full = self.key_for(lens)
        if full is None:
            return lens
        below = [T for T in self.tokens if T < full.tokens]
        whole = [T for T in below if T not in self.half_steps]
        if not whole:
            return lens
        best, kept_best, tokens_best = lens, sum(lens), full.tokens
        for step in reversed([T for T in below if T >= whole[-1]]):  # larger first: it wins a tie
            if sum(lens) <= step:  # the pass fits the step's tokens but none of its chunk lists
                continue
            out = self._fill(lens, step, align)
            cut = self.key_for(out) if out else None
            if cut is not None and sum(out) * tokens_best > kept_best * cut.tokens:
                best, kept_best, tokens_best = out, sum(out), cut.tokens
        return best

    @staticmethod
    def _fill(lens: list[int], step: int, align: int | None) -> list[int]:
        """The leading sequences of `lens` that fit `step` tokens, the last one cut to a multiple of
        `align` (when given) to fill it."""
        kept, out = 0, []
        for n in lens:
            if kept + n > step:
                part = (step - kept) // align * align if align else 0
                if part > 0:
                    out.append(part)
                break
            out.append(n)
            kept += n
        return out

    def key_for(self, lens: Sequence[int]) -> GraphKey | None:
        """The smallest key a pass of sequences of `lens` tokens fits, or None (beyond the caps)."""
        total, n = sum(lens), len(lens)
        if n == 0 or n > self.max_seqs or total > self.max_tokens:
            return None
        for T in self.tokens:
            if T < total:
                continue
            need = entries_needed(lens, T)  # GraphKey.fits, computed once for every C of this T
            for C in self.chunk_sizes(T):
                if C >= need:
                    return GraphKey(self.kind, T, C)
        return None


@dataclass
class GraphStats:
    replays: int = 0
    # (the metric labels keep the names "eager_bucketed" and "unbucketed" for dashboards' sake)
    eager_bucketed: int = 0  # keyed passes run eagerly (no graph yet: only before capture, or sweeps)
    unbucketed: int = 0  # passes beyond the ladders' caps (Passes' eager path)
    captures: int = 0
    evictions: int = 0
    row_tokens: int = 0  # real row tokens run in row keys (a sweep's rows included)
    padding_tokens: int = 0  # the padding those keys added (kev_scorer_graph_padding_tokens)
    state_tokens: int = 0  # real document tokens run in state keys
    state_padding_tokens: int = 0
    capture_errors: list[str] = field(default_factory=list)

    @property
    def eager(self) -> int:
        return self.eager_bucketed + self.unbucketed


class _Entry:
    def __init__(self, static: StaticPass, rows: StaticPass | None = None):
        self.static = static  # a SweepKey's: its documents (STATE layout)
        self.rows = rows  # a SweepKey's rows (ROWS layout); None for a single pass
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None  # a row key's decision-head output, with a head


class PickHead(Protocol):
    """What a row graph runs after the model when the cache has a head (kev.request.head.DecisionHead)."""

    def pick_probabilities(self, hidden: torch.Tensor, owner: torch.Tensor, table_row: torch.Tensor,
                           table_col: torch.Tensor, width: int) -> torch.Tensor: ...


class GraphCache:
    """A process's CUDA graphs for one bank's passes: key ladders, static buffers and graphs.
    Methods that run or capture take the `Passes` whose model, bank and ops they use."""

    def __init__(self, rows: KeyLadder | None = None, states: KeyLadder | None = None,
                 policy: CapturePolicy = CapturePolicy.START_UP, max_sweeps: int = 16, min_uses: int = 2,
                 stats: GraphStats | None = None, head: PickHead | None = None, head_width: int = 0):
        self.rows, self.states = rows, states
        # With a head, every row key's graph ends in it (`run_row_probabilities`): a launch is then
        # the fill, one replay and one copy out, where the head's own ~30 ops would each wait for
        # the GIL among the request threads. `head_width`: the most options a question may have.
        self.head, self.head_width = head, head_width
        self.policy, self.max_sweeps, self.min_uses = policy, max_sweeps, min_uses
        self.stats = stats if stats is not None else GraphStats()  # shared: a process's counts over re-attaches
        self._entries: OrderedDict[AnyKey, _Entry] = OrderedDict()
        self._uses: Counter[AnyKey] = Counter()
        self._pending: list[AnyKey] = []  # captured when idle (`capture_pending`) or at first use
        self._capture_s: dict[AnyKey, float] = {}  # host seconds each capture held its thread
        self.fixed_s: float | None = None  # one pass's fixed cost on this device (`calibrate`)
        self.failed: set[AnyKey] = set()
        self._pool = None
        self._out: torch.Tensor | None = None  # every row graph's picks land here
        self._probs: torch.Tensor | None = None  # and their head's probabilities here

    def all_keys(self) -> list[GraphKey]:
        """Every key of the ladders, largest first (the capture order: see `capture`)."""
        keys = [k for ladder in (self.states, self.rows) if ladder is not None for k in ladder.keys()]
        return sorted(keys, key=lambda k: (k.tokens, k.chunks), reverse=True)

    # ---- which key a pass fits ----------------------------------------------------------------

    def row_key(self, batch: RowBatch) -> GraphKey | None:
        if self.rows is None or not batch.row_lens:  # row lengths unknown on the host: no key
            return None
        return self.rows.key_for(batch.row_lens)

    def state_key(self, lens: Sequence[int]) -> GraphKey | None:
        return self.states.key_for(lens) if self.states is not None else None

    def sweep_key(self, state: GraphKey | None, rows: GraphKey | None) -> SweepKey | None:
        """The sweep's key, or None: run the two passes (each graphed). Until the sweep has a graph
        of its own the state graph and the row graph run instead (two replays beat one eager sweep);
        its uses count toward its capture when idle."""
        if state is None or rows is None:
            return None
        key = SweepKey(state, rows)
        if self.policy is CapturePolicy.ON_FIRST_USE or self._has_graph(key):
            return key
        if any(k in self._pending for k in (state, rows)):
            return None  # the two passes capture their queued keys at first use (`_prepare`)
        if self._has_graph(state) and self._has_graph(rows):
            self._count_use(key)
            return None
        return key

    def _has_graph(self, key: AnyKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.graph is not None

    # ---- keyed passes -----------------------------------------------------------------------

    def run_rows(self, passes: Passes, key: GraphKey, batch: RowBatch) -> torch.Tensor:
        """`batch` in `key`'s buffers: [P, d] hidden states at the real picks."""
        entry = self._prepare(passes, key)
        P = entry.static.fill_rows(*batch.host_fields(), passes.bank.block_table)
        self._count_rows(key, batch)
        return self._run(passes, key, entry)[0][:P].clone()

    def run_row_probabilities(self, passes: Passes, key: GraphKey, batch: RowBatch,
                              layout: Sequence[Sequence[int]]) -> torch.Tensor:
        """`batch` in `key`'s buffers, the head in the pass: [P] fp32 per real pick (`layout`:
        `kev.request.head.pick_layout` of its rows). A view of the shared output, valid until the
        next row pass: copy it out (to the host) before launching another."""
        entry = self._prepare(passes, key)
        P = entry.static.fill_rows(*batch.host_fields(), passes.bank.block_table, layout)
        self._count_rows(key, batch)
        return self._run(passes, key, entry)[1][:P]

    def run_state(self, passes: Passes, key: GraphKey, chunks: Sequence[Sequence[int]], slots: Sequence[int],
                  starts: Sequence[int] | None = None) -> None:
        """Document chunks (handles checked by the caller) in `key`'s buffers."""
        entry = self._prepare(passes, key)
        entry.static.fill_state(chunks, slots, passes.bank.block_table, starts)
        self._count_state(key, chunks)
        self._run(passes, key, entry)

    def run_sweep(self, passes: Passes, key: SweepKey, documents: Sequence[Sequence[int]],
                  handles: Sequence[BankHandle], batch: RowBatch) -> torch.Tensor:
        """One sweep in `key`'s buffers: the documents' layout, then the rows'."""
        entry = self._prepare(passes, key)
        table = passes.bank.block_table
        entry.static.fill_state(documents, [h.slot for h in handles], table)
        P = entry.rows.fill_rows(*batch.host_fields(), table)
        self._count_state(key.state, documents)
        self._count_rows(key.rows, batch)
        return self._run(passes, key, entry)[0][:P].clone()

    def _count_rows(self, key: GraphKey, batch: RowBatch) -> None:
        real = sum(batch.row_lens)
        self.stats.row_tokens += real
        self.stats.padding_tokens += key.tokens - real

    def _count_state(self, key: GraphKey, chunks: Sequence[Sequence[int]]) -> None:
        real = sum(len(c) for c in chunks)
        self.stats.state_tokens += real
        self.stats.state_padding_tokens += key.tokens - real

    # ---- capture -------------------------------------------------------------------------------

    @torch.no_grad()
    def capture(self, passes: Passes, keys: Iterable[AnyKey]) -> None:
        """Capture graphs for `keys` now (start-up, after `warm_up`), on synthetic fills: one
        sequence of T tokens from nothing, written nowhere. Largest first: the shared pool grows
        to the largest pass once and the smaller ones fit in it."""
        for key in keys:
            entry = self._entry(passes, key)
            self._fill_synthetic(passes, entry)
            self._capture(passes, key, entry)

    def calibrate(self) -> float | None:
        """One pass's fixed cost on this device (the weights read, ~700 kernels): the replay time of
        the smallest key captured (a synthetic fill, which writes nowhere, is what its buffers hold
        after a capture: call right after `capture`). What running a sweep as one graph instead of
        two replays saves a use (`uses_to_capture`). None when nothing is captured."""
        keys = [k for k in self.graphs() if isinstance(k, GraphKey)]
        if not keys:
            return None
        graph = self._entries[min(keys, key=lambda k: (k.tokens, k.chunks))].graph
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        self.fixed_s = start.elapsed_time(end) / 3 / 1e3
        return self.fixed_s

    def uses_to_capture(self, key: SweepKey) -> int:
        """After how many uses an idle capture of sweep `key` pays for itself: each use as one graph
        instead of two replays saves about one pass's fixed cost (`fixed_s`), and the capture holds
        the thread (a request that comes meanwhile waits) about as long as its two keys' captures
        took. A key used rarely is never captured, so varied traffic does not stall on captures nor
        churn the `max_sweeps` kept. Without those timings (not calibrated): `min_uses`."""
        costs = [self._capture_s.get(k) for k in (key.state, key.rows)]
        if not self.fixed_s or any(c is None for c in costs):
            return self.min_uses
        return max(self.min_uses, math.ceil(sum(costs) / self.fixed_s))

    def queue(self, keys: Iterable[AnyKey]) -> None:
        """Queue `keys` for `capture_pending` (a list the calling thread must not capture itself),
        each captured by then or at its first use. No GPU work here: the buffers are made by the
        capturing thread."""
        for key in keys:
            if key not in self._pending:
                self._pending.append(key)

    def capture_pending(self, passes: Passes, limit: int = 1) -> int:
        """Capture up to `limit` queued keys (call when the server is idle)."""
        done = 0
        while self._pending and done < limit:
            key = self._pending.pop(0)
            entry = self._entry(passes, key)
            if entry.graph is None and key not in self.failed:
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
            sweeps = [k for k in self._entries if isinstance(k, SweepKey)]
            for old in sweeps[: max(0, len(sweeps) - self.max_sweeps)]:
                self._evict(old)
        self._entries.move_to_end(key)
        return entry

    def _forward(self, passes: Passes, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keyed pass: (its output: [picks, d] for rows, nothing useful for a state pass; the
        head's [picks] probabilities for a row key when the cache has a head, else None)."""
        s, r = entry.static, passes
        if entry.rows is None:
            out = r.model(s.tokens, s.meta, r.bank.pools, r.ops, picks=s.picks)
            if self.head is None or s.key.kind is not PassKind.ROWS:
                return out, None
            return out, self.head.pick_probabilities(out, s.head_owner, s.head_row, s.head_col, self.head_width)
        rows, Td = entry.rows, s.key.num_tokens  # one sweep: the documents' tokens, then the rows'
        meta = PhasedMeta((s.meta, rows.meta), (Td, rows.key.num_tokens))
        r.ops.pin(meta.joined, joined_indices(s, rows))  # built on the device, in the graph, as its cu_seqlens
        return r.model(torch.cat([s.tokens, rows.tokens]), meta, r.bank.pools, r.ops, picks=rows.picks + Td,
                       mixer_scope=r.phase_scope), None

    def _count_use(self, key: SweepKey) -> None:
        """A sweep run as two replays: queued for capture when idle at `uses_to_capture`."""
        self._uses[key] += 1
        if self._uses[key] >= self.uses_to_capture(key) and key not in self._pending and key not in self.failed:
            self._pending.append(key)

    def _prepare(self, passes: Passes, key: AnyKey) -> _Entry:
        """`key`'s entry, its graph captured first if this use should capture it: under
        ON_FIRST_USE, or a key queued by a re-attach (captured at its first use, a stall of about
        two passes, once: a loaded server is never idle, and it would run eagerly for good)."""
        entry = self._entry(passes, key)
        if entry.graph is None and key not in self.failed:
            queued = isinstance(key, GraphKey) and key in self._pending
            if self.policy is CapturePolicy.ON_FIRST_USE or queued:
                if key in self._pending:
                    self._pending.remove(key)
                self._try_capture(passes, key, entry)
            elif isinstance(key, SweepKey):
                self._count_use(key)
        return entry

    def _run(self, passes: Passes, key: AnyKey, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor | None]:
        if entry.graph is not None:
            entry.graph.replay()
            self.stats.replays += 1
            return entry.out, entry.probs
        self.stats.eager_bucketed += 1
        with passes.tuned(key.shape_class):
            return self._forward(passes, entry)

    @torch.no_grad()
    def _try_capture(self, passes: Passes, key: AnyKey, entry: _Entry) -> None:
        """A lazy capture (on a synthetic fill: see `_record`) that fails leaves the key eager for
        good (and says why in stats)."""
        try:
            self._fill_synthetic(passes, entry)
            self._capture(passes, key, entry)
        except Exception as e:  # noqa: BLE001 - serving goes on eagerly; the error is kept
            self.failed.add(key)
            self.stats.capture_errors.append(f"{key}: {e!r}")

    def _capture(self, passes: Passes, key: AnyKey, entry: _Entry) -> None:
        start = time.perf_counter()
        with passes.tuned(key.shape_class):
            entry.graph, entry.out, entry.probs = self._record(passes, entry)
        self._capture_s[key] = time.perf_counter() - start
        self.stats.captures += 1
        self._uses.pop(key, None)

    def _record(self, passes: Passes, entry: _Entry
                ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]:
        """Warm the pass up on a side stream (compiles; autotunes only an unwarmed class), then
        capture it into the shared pool. Returns (graph, its output and its head's: views of the
        shared buffers).
        The warm-up runs what the buffers hold, so they must hold a synthetic fill that writes
        nowhere: a real pass run twice would apply a continuing chunk twice, and a pass kept
        from earlier may write slots that now belong to other documents."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm, warm_probs = self._forward(passes, entry)
        torch.cuda.current_stream().wait_stream(side)
        picks = warm.shape[0]
        most = max(picks, self.rows.max_tokens if self.rows is not None else 0)  # every row key's picks
        if picks and (self._out is None or self._out.shape[0] < picks):
            self._out = torch.empty((most, warm.shape[1]), dtype=warm.dtype, device=warm.device)
        if warm_probs is not None and (self._probs is None or self._probs.shape[0] < picks):
            self._probs = torch.empty(most, dtype=warm_probs.dtype, device=warm_probs.device)
        out = self._out[:picks] if picks else warm
        probs = self._probs[:picks] if warm_probs is not None else None
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads (a scorer re-attaching, mapping a new bank's memory)
        # may make CUDA calls while its pass thread captures; none of them touches this stream.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            result, result_probs = self._forward(passes, entry)
            if picks:
                out.copy_(result)
            if probs is not None:
                probs.copy_(result_probs)
        return graph, (out if picks else result), probs

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
        key, table = s.key, passes.bank.block_table
        T = key.tokens
        if key.kind is PassKind.ROWS:
            cpu = dict(dtype=torch.int64)
            s.fill_rows(torch.zeros(T, **cpu), torch.tensor([0, T]), torch.tensor([-1]), torch.zeros(1, **cpu),
                        torch.arange(T), torch.arange(min(key.picks, T)), table)
        else:
            s.fill_state([[0] * T], [-1], table)
