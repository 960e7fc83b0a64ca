"""Static-shape passes for CUDA graphs: one key's index buffers, and the fill that packs a real
pass into them without changing any real sequence's result.

A key (`GraphKey`) fixes T tokens and C chunk-list entries (chunks of CHUNK tokens; C sequences
too). A pass is packed as it is: its n sequences end to end, no padding between them (the eager
layout, `RowBatch` / `Passes._chunk_pass`). Then come the padding sequences, tokens [T_real, T)
in pieces of at most CHUNK tokens (`padding_lens`), which read nothing and write nowhere, and the
rest of the C sequences are empty. The pass fits when T_real <= T, n < C and its chunks plus the
padding's are at most C (`GraphKey.fits`); every real sequence has a chunk, so the padding pieces
always have sequences to go in. Why pieces: the scan walks each sequence's chunks one after
another, so one padding sequence of a few hundred tokens would be the longest sequence of a pass
of short ones and set the length of its state kernel (11 x 48-token documents in a 640-token key:
two chunks walked where the documents need one).

The chunk lists are filled with each pass (`packed_chunk_lists`): the real sequences' chunks, then the
padding's, then no-op entries of the last sequence (chunks past its end: every kernel masks all
their rows; paged attention walks no keys for them). Entry positions equal the offsets plus
the chunk index, as the scan's `h` and fla's `chunk_fwd_o` read them. Every index tensor a pass
reads (tokens, positions, cu_seqlens, slots, prefix lengths, block table, picks and the decision
head's layout of them, chunk lists) is a
slice of one device block allocated once here and refilled by one host-built copy, so nothing is
derived from a buffer that changes between replays and nothing syncs with the host.

Real results are bit-identical between a graph replay and an eager run of the same key (same
kernels, same shapes, same autotune class). Against an eager pass of the unpadded batch, the
token-mixing kernels agree exactly (a sequence's chunks start at its own first token wherever it
sits); the GEMMs and norms see another row count M and may pick other cuBLAS / reduction kernels
(measured on the GPU: tests/exec/test_graphs_gpu.py).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from kev.exec.transfer import copy_in
from kev.ops.meta import PassMeta
from kev.ops.shapes import ShapeClass, classify

CHUNK = 64  # the conv / delta-rule chunk (kev.ops.delta_rule.indexed_scan.CHUNK)


class PassKind(enum.Enum):
    ROWS = "rows"  # question rows: read their document's slot, write nothing, return hidden states at picks
    STATE = "state"  # documents (or their next chunks): write their slots, return nothing


@dataclass(frozen=True)
class GraphKey:
    kind: PassKind
    tokens: int  # T: tokens of the padded pass
    chunks: int  # C: chunk-list entries (CHUNK tokens each), and sequences (real ones < C)

    @property
    def num_tokens(self) -> int:
        return self.tokens

    @property
    def num_slots(self) -> int:
        """Sequences in the padded pass: real, padding (at most a chunk each), then empty."""
        return self.chunks

    @property
    def picks(self) -> int:
        """Picks capacity: every token of a row pass may be one; none for a state pass."""
        return self.tokens if self.kind is PassKind.ROWS else 0

    def fits(self, lens: Sequence[int]) -> bool:
        """Whether sequences of `lens` tokens pack into this key."""
        return sum(lens) <= self.tokens and entries_needed(lens, self.tokens) <= self.chunks

    @property
    def shape_class(self) -> ShapeClass:
        """The key's autotune class; a graph and its eager warm-up both use it."""
        return classify(self.tokens, rows=self.kind is PassKind.ROWS)

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.tokens}t/{self.chunks}c"


@dataclass(frozen=True)
class SweepKey:
    """One sweep over the weights (`Passes.sweep`): new documents in a STATE key's layout, then
    rows in a ROWS key's, packed back to back."""

    state: GraphKey
    rows: GraphKey

    @property
    def shape_class(self) -> ShapeClass:
        """The documents' class (the token-wise work); each phase's mixers run in their own."""
        return self.state.shape_class

    def __str__(self) -> str:
        return f"sweep({self.state}, {self.rows})"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padding_lens(padding: int) -> list[int]:
    """The padding sequences that fill a pass up to its key's tokens: CHUNK tokens each, the last
    the rest (none for no padding). One chunk each, so no padding sequence is longer than a chunk."""
    return [CHUNK] * (padding // CHUNK) + ([padding % CHUNK] if padding % CHUNK else [])


def chunks_needed(lens: Sequence[int], tokens: int, block: int = CHUNK) -> int:
    """Chunk-list entries of sequences of `lens` padded to `tokens` by the padding sequences."""
    return sum(cdiv(n, block) for n in (*lens, *padding_lens(tokens - sum(lens))))


def entries_needed(lens: Sequence[int], tokens: int) -> int:
    """The least C of a key of `tokens` tokens that holds sequences of `lens`: their chunks and the
    padding's, and a sequence slot each plus one (the fit test, once)."""
    return max(chunks_needed(lens, tokens), len(lens) + 1)


def packed_chunk_lists(lens: Sequence[int], tokens: int, slots: int, block: int, entries: int
                       ) -> tuple[list[int], list[int]]:
    """The chunk list of sequences of `lens` tokens, then the padding sequences up to `tokens`, then
    empty sequences; the last of the `slots` sequences' entries run on past its end to fill
    `entries` (no-ops): (sequence, chunk) pairs flattened, and the chunk offsets ([slots + 1]).
    Python ints: it runs in front of every replay, where each torch op would give the GIL up
    (`StaticPass`)."""
    seqs = [*lens, *padding_lens(tokens - sum(lens))]
    per = [cdiv(n, block) for n in seqs] + [0] * (slots - len(seqs))
    used = sum(per)
    if used > entries or len(seqs) > slots:
        raise ValueError(f"{len(lens)} sequences of {sum(lens)} tokens in {tokens} need more than {entries} entries "
                         f"or {slots} sequences")
    per[-1] += entries - used  # the no-ops, past the last sequence's end
    pairs = [v for seq, count in enumerate(per) for chunk in range(count) for v in (seq, chunk)]
    return pairs, list(accumulate(per, initial=0))


# A fill runs in front of every replay, on the request's path: its ints go into the block at C speed
# (a 2,304-token state key's fill took 0.2 ms on the CI VM item by item, mostly `extend` of ranges
# and lists), ranges as slices of one counting array.
_COUNTING = array("q", range(1 << 16))


def _extend(out: array, values) -> None:
    """out += values: a list at C speed, a range as a slice of `_COUNTING`, anything else item by item."""
    global _COUNTING
    if isinstance(values, list):
        out.fromlist(values)
    elif isinstance(values, range) and values.step == 1 and 0 <= values.start <= values.stop:
        if values.stop > len(_COUNTING):
            _COUNTING = array("q", range(max(values.stop, 2 * len(_COUNTING))))
        out.extend(_COUNTING[values.start:values.stop])
    else:
        out.extend(values)


def _repeat(out: array, value: int, count: int) -> None:
    """out += [value] * count, at C speed."""
    if count > 0:
        out.extend(array("q", (value,)) * count)


def _ints(values) -> Sequence[int]:
    """Host ints of a tensor (a device one is read back: start-up and tests only) or a sequence."""
    return values.tolist() if isinstance(values, torch.Tensor) else values


class StaticPass:
    """One key's buffers, its `PassMeta`, and the fills from a real pass.

    A fill runs in front of every replay, on the thread that feeds the GPU among dozens of request
    threads. Each torch op gives the GIL up and may wait up to the switch interval to take it back
    (kev/serving/interpreter.py), so the block is built in Python ints and reaches the device in
    three ops (one buffer view, one pinned copy, one copy), then the block-table gather."""

    def __init__(self, key: GraphKey, table_width: int, attn_block: int, device):
        self.key = key
        N, T, P = key.num_slots, key.num_tokens, key.picks
        self.attn_block = attn_block
        # Attention's query blocks divide CHUNK, so a sequence's blocks are at most CHUNK / block per chunk.
        self.attn_entries = key.chunks * (CHUNK // attn_block)
        self._sizes = (T, T, N + 1, N, N, N, P, P, P, P, 2 * key.chunks, N + 1, 2 * self.attn_entries)
        self._ints = self._block([], (), (), (), -1, ()).to(device)  # an empty pass: all padding
        (self.tokens, self.positions, self.cu_seqlens, self.write_slots, self.read_slots, self.prefix_lens,
         self.picks, self.head_owner, self.head_row, self.head_col, chunks, self.chunk_offsets,
         attn_chunks) = self._ints.split(self._sizes)
        self.chunks, self.attn_chunks = chunks.view(-1, 2), {attn_block: attn_chunks.view(-1, 2)}
        self.block_table = torch.zeros((N, table_width), dtype=torch.int32, device=device)
        self.meta = PassMeta(cu_seqlens=self.cu_seqlens, read_slots=self.read_slots, write_slots=self.write_slots,
                             prefix_lens=self.prefix_lens, block_table=self.block_table, positions=self.positions,
                             shape_class=key.shape_class)

    def indices(self):
        """The static `PassIndices` to pin into `TritonOps` for `self.meta`."""
        from kev.ops.triton_ops import PassIndices

        return PassIndices(chunks=self.chunks, chunk_offsets=self.chunk_offsets, attn_chunks=dict(self.attn_chunks))

    def fits(self, lens: Sequence[int]) -> bool:
        return self.key.fits(lens)

    def _block(self, lens: Sequence[int], tokens: Iterable[Sequence[int]], positions: Iterable[Sequence[int]],
               read: Iterable[int] | int, write: Iterable[int] | int, prefix: Iterable[int],
               picks: Sequence[int] = (), head: Sequence[Sequence[int]] = ((), (), ())) -> torch.Tensor:
        """One pass as a host int64 block laid out as the device one (`_sizes`): the n real
        sequences (`tokens` and `positions` in parts, end to end), then the padding sequences to
        T (token 0 at their own positions 0..), then empty ones (cu_seqlens at T); slots -1 after
        the real ones. `read` / `write` may be one int for every sequence. Padding picks read
        token 0 (a real position; their outputs are dropped). `head`: the real picks' decision-
        head layout (`kev.request.head.pick_layout`); padding picks take 0s (outside every softmax)."""
        key = self.key
        T, N, n, Tr = key.num_tokens, key.num_slots, len(lens), sum(lens)
        padding = padding_lens(T - Tr)  # more sequences than the key has: packed_chunk_lists says so below
        out = array("q")
        for part in tokens:
            _extend(out, part)
        _repeat(out, 0, T - Tr)
        for part in positions:
            _extend(out, part)
        for piece in padding:
            _extend(out, range(piece))
        out.extend(accumulate((*lens, *padding), initial=0))
        _repeat(out, T, N - n - len(padding))
        for per_seq, none in ((write, -1), (read, -1), (prefix, 0)):
            if isinstance(per_seq, int):
                _repeat(out, per_seq, n)
            else:
                _extend(out, per_seq)
            _repeat(out, none, N - n)
        if key.picks:
            for part in (picks, *head):
                _extend(out, part)
                _repeat(out, 0, key.picks - len(part))
        pairs, offsets = packed_chunk_lists(lens, T, N, CHUNK, key.chunks)
        out.fromlist(pairs)
        out.fromlist(offsets)
        out.fromlist(packed_chunk_lists(lens, T, N, self.attn_block, self.attn_entries)[0])
        if len(out) != sum(self._sizes):
            raise ValueError(f"a fill of {len(out)} ints for a block of {sum(self._sizes)} (key {key}): "
                             "a field has the wrong length")
        return torch.frombuffer(out, dtype=torch.int64)

    def fill_rows(self, tokens, cu_seqlens, slots, doc_lens, positions, picks, bank_table: torch.Tensor,
                  head: Sequence[Sequence[int]] = ((), (), ())) -> int:
        """Place a packed row batch (it `fits`: the caller chose the key from host ints) into the
        buffers: the block built in Python, one copy in, then the rows' block-table rows gathered
        on the device; no sync. The fields are host ints (`RowBatch.host_fields`); tensors are
        read back first (start-up, tests); `head`: the picks' decision-head layout, if the pass
        runs the head. Returns P, the real picks."""
        assert self.key.kind is PassKind.ROWS
        cu, picks = _ints(cu_seqlens), _ints(picks)
        if any(len(part) not in (0, len(picks)) for part in head):
            raise ValueError(f"a head layout of {[len(p) for p in head]} entries for {len(picks)} picks")
        lens = [b - a for a, b in zip(cu, cu[1:])]
        copy_in(self._ints, self._block(lens, [_ints(tokens)], [_ints(positions)], _ints(slots), -1, _ints(doc_lens),
                                        picks, head))
        n = len(lens)
        torch.index_select(bank_table, 0, self.read_slots[:n].clamp(min=0), out=self.block_table[:n])
        return len(picks)

    def fill_state(self, chunks: Sequence[Sequence[int]], slots: Sequence[int], bank_table: torch.Tensor,
                   starts: Sequence[int] | None = None) -> None:
        """Place document chunks (they `fit`) into the buffers: chunk n goes to slot n's tokens
        [starts[n], starts[n] + len) (0: a new document, which reads nothing; else it continues
        the state in its slot). The block built in Python, one copy in, then the block-table rows
        of the written slots."""
        assert self.key.kind is PassKind.STATE
        starts = [0] * len(chunks) if starts is None else list(starts)
        lens = [len(c) for c in chunks]
        positions = [range(s, s + n) for s, n in zip(starts, lens)]
        read = [slot if start > 0 else -1 for slot, start in zip(slots, starts)]
        copy_in(self._ints, self._block(lens, chunks, positions, read, list(slots), starts))
        n = len(lens)
        if n:
            torch.index_select(bank_table, 0, self.write_slots[:n].clamp(min=0), out=self.block_table[:n])


def joined_indices(first: StaticPass, then: StaticPass):
    """The `PassIndices` of a sweep's `PhasedMeta.joined` (`first`'s sequences, then `then`'s): the
    two chunk lists back to back, `then`'s sequences and chunks counted after `first`'s. The delta
    rule's per-chunk steps read it; attention stays phased (no attention chunks). Device ops on the
    two keys' buffers, no host tensor: built at each pass, inside the graph when captured, since
    both lists change with every fill."""
    from kev.ops.triton_ops import PassIndices

    shifted = then.chunks.clone()
    shifted[:, 0] += first.key.num_slots
    NT = first.chunks.shape[0]
    return PassIndices(chunks=torch.cat([first.chunks, shifted]),
                       chunk_offsets=torch.cat([first.chunk_offsets, then.chunk_offsets[1:] + NT]), attn_chunks={})
