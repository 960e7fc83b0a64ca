"""Static-shape passes for CUDA graphs: one bucket's index buffers, and the layouts that pad a
real pass into them without changing any real sequence's result.

A bucket (`GraphKey`) fixes R sequences of at most L tokens (R x L tokens in all) and a picks
capacity. Every index tensor a pass reads (tokens, positions, cu_seqlens, slots, prefix lengths,
block table, picks) is a slice of buffers allocated once here; the chunk lists the kernels need
are static too and pinned into `TritonOps` (`pin`), so nothing is derived from a buffer that
changes between replays and nothing syncs with the host.

Two layouts (`PassKind`):
- ROWS: row n sits at tokens [n L, n L + len_n) and is padded at its end to L tokens; rows
  n >= N are whole padding rows that read nothing (slot -1, prefix 0). `cu_seqlens` is static
  (n L). The kernels are causal, so tokens after a row's last real token do not change its real
  tokens (the chunk-local solves and the attention tiles only ever combine a real row with later
  rows through exact zeros); picks only read real positions; rows never write the bank.
- STATE: documents are written to the bank, so none may be padded: pair n is document n
  (tokens [n L, n L + len_n)) followed by its own padding sequence up to (n + 1) L that writes
  nothing; pairs n >= D hold an empty document and a padding sequence. The chunk lists are
  filled with the documents (`pair_chunks`): a document's chunks and its padding sequence's
  together are ceil(L / block) + 1 at most, so each pair gets that many entries, the spare one
  a chunk past a sequence's end (a no-op in every kernel: all its rows masked). A static
  superset (every sequence counted at L tokens) had twice the chunks of a one-document bucket,
  and fla's per-chunk kernels compute a no-op chunk in full: ~0.75 ms of a five-long sweep.

Real results are bit-identical between a graph replay and an eager run of the same bucket (same
kernels, same shapes, same autotune class). Against an eager pass of the unpadded batch, the
token-mixing kernels agree exactly; the GEMMs and norms see another row count M and may pick
other cuBLAS / reduction kernels (measured on the GPU: tests/exec/test_graphs_gpu.py).
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kev.ops.shapes import ShapeClass, classify
from kev.ops.meta import PassMeta
from kev.exec.transfer import copy_in, host_int64

CHUNK = 64  # the conv / delta-rule chunk (kev.ops.delta_rule.indexed_scan.CHUNK)


class PassKind(enum.Enum):
    ROWS = "rows"
    STATE = "state"


@dataclass(frozen=True)
class SweepKey:
    """A bucket of one sweep over the weights (`Passes.sweep`): new documents in a
    STATE bucket's layout, then rows in a ROWS bucket's, packed back to back."""

    state: GraphKey
    rows: GraphKey

    @property
    def shape_class(self) -> ShapeClass:
        """The documents' class (the token-wise work); each phase's mixers run in their own."""
        return self.state.shape_class


# The picks capacity every row bucket holds at least, a row: <decide> and four </opt>
# (`Buckets.row_key`; a start-up bucket written RxL).
PICKS_PER_ROW = 5


@dataclass(frozen=True)
class GraphKey:
    kind: PassKind
    seqs: int  # R: real sequences at most
    seq_len: int  # L: tokens per sequence at most
    picks: int = 0  # picks capacity (rows)

    @property
    def num_tokens(self) -> int:
        return self.seqs * self.seq_len

    @property
    def num_slots(self) -> int:
        """Sequences in the padded pass (a document and its padding sequence are two)."""
        return self.seqs if self.kind is PassKind.ROWS else 2 * self.seqs

    @property
    def shape_class(self) -> ShapeClass:
        """The bucket's autotune class; a graph and its eager fallback both use it."""
        return classify(self.seqs, self.num_tokens)


def static_chunks(num_seqs: int, seq_len: int, block: int, device) -> torch.Tensor:
    """[num_seqs * ceil(L / block), 2] (sequence, chunk) pairs: every sequence counted at L tokens."""
    per = -(-seq_len // block)
    n = torch.arange(num_seqs, dtype=torch.int64, device=device).repeat_interleave(per)
    t = torch.arange(per, dtype=torch.int64, device=device).repeat(num_seqs)
    return torch.stack([n, t], 1)


def pair_chunks(lens: Sequence[int], seq_len: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The STATE layout's chunk list and chunk offsets for documents of `lens` tokens (R ints, 0 for
    an empty pair) in a bucket of L = `seq_len` tokens a pair: ([R * (nb + 1), 2] (sequence, chunk)
    pairs, [2R + 1] each sequence's first entry), host int64, nb = ceil(L / block).

    Pair n holds entries [n (nb + 1), (n + 1)(nb + 1)): the document's a = ceil(len / block)
    chunks, its padding sequence's b = ceil((L - len) / block), and, when a + b = nb, one no-op:
    the document's chunk a (past its end, inside the pair) or, for a document that fills every
    block (then b = 0), the empty padding sequence's chunk 0. Entry positions equal the offsets
    plus the chunk index, as the scan's `h` and fla's `chunk_fwd_o` read them. Python ints into an
    array buffer: it runs on the host in front of every new document's graph, where a dozen small
    torch ops took ~0.25 ms."""
    nb = -(-seq_len // block)
    per = nb + 1
    chunks, offsets = array("q"), array("q")
    for n, ln in enumerate(int(x) for x in lens):
        a, b = -(-ln // block), -(-(seq_len - ln) // block)
        doc, pad = 2 * n, 2 * n + 1
        chunks.extend(v for t in range(a) for v in (doc, t))
        chunks.extend(v for t in range(b) for v in (pad, t))
        if a + b < per:
            chunks.extend((doc, a) if a < nb else (pad, b))
        offsets.extend((n * per, n * per + a))
    offsets.append(len(offsets) // 2 * per)
    return torch.frombuffer(chunks, dtype=torch.int64).view(-1, 2), torch.frombuffer(offsets, dtype=torch.int64)


class StaticPass:
    """One bucket's buffers, its `PassMeta`, and the fills from a real pass."""

    def __init__(self, key: GraphKey, table_width: int, attn_block: int, device):
        self.key = key
        N, T, L, P = key.num_slots, key.num_tokens, key.seq_len, key.picks
        self.attn_block = attn_block
        # The chunk lists: static for ROWS (every row counted at L), filled with the documents for
        # STATE (`pair_chunks`; the template holds empty pairs).
        if key.kind is PassKind.ROWS:
            chunks, offsets = static_chunks(N, L, CHUNK, "cpu"), torch.arange(N + 1) * -(-L // CHUNK)
            attn_chunks = static_chunks(N, L, attn_block, "cpu")
        else:
            empty = [0] * key.seqs
            chunks, offsets = pair_chunks(empty, L, CHUNK)
            attn_chunks, _ = pair_chunks(empty, L, attn_block)
        # Every int64 index buffer is a view of one block, so a fill is one host-built block and
        # one copy (a new five-long request's fills were ~20 small device ops in front of its graph).
        self._sizes = (T, T, N + 1, N, N, N, P, chunks.numel(), N + 1, attn_chunks.numel())
        self._template = torch.cat([torch.zeros(2 * T, dtype=torch.int64), torch.arange(N + 1) * L,
                                    torch.full((2 * N,), -1), torch.zeros(N + P, dtype=torch.int64),
                                    chunks.view(-1), offsets, attn_chunks.view(-1)])
        self._ints = self._template.to(device)
        (self.tokens, self.positions, self.cu_seqlens, self.write_slots, self.read_slots, self.prefix_lens,
         self.picks, chunks, self.chunk_offsets, attn_chunks) = self._ints.split(self._sizes)
        self.chunks, self.attn_chunks = chunks.view(-1, 2), {attn_block: attn_chunks.view(-1, 2)}
        self.block_table = torch.zeros((N, table_width), dtype=torch.int32, device=device)
        self.meta = PassMeta(cu_seqlens=self.cu_seqlens, read_slots=self.read_slots, write_slots=self.write_slots,
                             prefix_lens=self.prefix_lens, block_table=self.block_table, positions=self.positions,
                             shape_class=key.shape_class)  # a STATE bucket's N counts padding sequences

    def indices(self):
        """The static `PassIndices` to pin into `TritonOps` for `self.meta`."""
        from kev.ops.triton_ops import PassIndices

        return PassIndices(chunks=self.chunks, chunk_offsets=self.chunk_offsets, attn_chunks=dict(self.attn_chunks))

    def _host_block(self) -> tuple[torch.Tensor, ...]:
        """A fresh host copy of the index block (padding values in place) and its fields' views:
        tokens, positions, cu_seqlens, write_slots, read_slots, prefix_lens, picks, chunks,
        chunk_offsets, attention chunks."""
        host = self._template.clone()
        return (host, *host.split(self._sizes))

    def fill_rows(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  doc_lens: torch.Tensor, positions: torch.Tensor, picks: torch.Tensor,
                  bank_table: torch.Tensor) -> int:
        """Place a packed row batch (every row <= L tokens, N <= R rows, P <= picks capacity: the
        caller checked with host ints) into the ROWS layout: built on the host, one copy in, then
        the rows' block-table rows gathered on the device; no sync. The batch's fields are host
        tensors (`RowBatch.host_fields`); device ones are copied back first (start-up, tests).
        Returns P. Padding tokens are token 0 at position 0; padding picks read token 0 of row 0
        (a real position, its output dropped)."""
        key = self.key
        assert key.kind is PassKind.ROWS
        tokens, cu_seqlens, slots, doc_lens, positions, picks = (
            t.cpu() for t in (tokens, cu_seqlens, slots, doc_lens, positions, picks))
        N, T, P, L = slots.shape[0], tokens.shape[0], picks.shape[0], key.seq_len
        host, h_tokens, h_positions, _, _, h_read, h_prefix, h_picks, *_ = self._host_block()
        row = torch.repeat_interleave(torch.arange(N), cu_seqlens[1:] - cu_seqlens[:-1], output_size=T)
        dst = row * L + (torch.arange(T) - cu_seqlens[row])  # [T] each token's place in the bucket
        h_tokens[dst] = tokens
        h_positions[dst] = positions
        h_read[:N] = slots
        h_prefix[:N] = doc_lens
        h_picks[:P] = dst[picks]
        copy_in(self._ints, host)
        torch.index_select(bank_table, 0, self.read_slots[:N].clamp(min=0), out=self.block_table[:N])
        return P

    def fill_state(self, documents: Sequence[Sequence[int]], slots: Sequence[int], bank_table: torch.Tensor) -> None:
        """Place new documents (each <= L tokens, D <= R) into the STATE layout: the block built
        on the host, one copy in, then the block-table rows of the written slots."""
        key = self.key
        assert key.kind is PassKind.STATE
        N, L, R, D = key.num_slots, key.seq_len, key.seqs, len(documents)
        # Host tensor ops, not Python lists: a 2,208-token bucket's list took 0.35 ms of a new request.
        host, tokens, positions, cu, write, _, _, _, chunks, offsets, attn_chunks = self._host_block()
        lens = torch.zeros(R, dtype=torch.int64)
        for n, doc in enumerate(documents):
            tokens[n * L : n * L + len(doc)] = host_int64(doc)
            lens[n] = len(doc)
        # pair n: the document's positions 0 .. len - 1, then its padding sequence's 0 .. L - len - 1
        t = torch.arange(L)
        positions.view(R, L).copy_(t - torch.where(t >= lens[:, None], lens[:, None], 0))
        starts = torch.arange(R) * L
        cu[1::2], cu[2::2] = starts + lens, starts + L
        write[0 : 2 * D : 2] = host_int64(slots[:D])
        doc_lens = lens.tolist()
        c, o = pair_chunks(doc_lens, L, CHUNK)
        chunks.copy_(c.view(-1))
        offsets.copy_(o)
        attn_chunks.copy_(pair_chunks(doc_lens, L, self.attn_block)[0].view(-1))
        copy_in(self._ints, host)
        self.block_table[0 : 2 * D : 2] = bank_table[self.write_slots[0 : 2 * D : 2].clamp(min=0)]


def joined_indices(first: StaticPass, then: StaticPass):
    """The `PassIndices` of a sweep's `PhasedMeta.joined` (`first`'s sequences, then `then`'s): the
    two chunk lists back to back, `then`'s sequences and chunks counted after `first`'s. The delta
    rule's per-chunk steps read it; attention stays phased (no attention chunks). Device ops on the
    two buckets' buffers, no host tensor: built at each pass, inside the graph when captured, since
    a STATE bucket's lists change with every fill."""
    from kev.ops.triton_ops import PassIndices

    shifted = then.chunks.clone()
    shifted[:, 0] += first.key.num_slots
    NT = first.chunks.shape[0]
    return PassIndices(chunks=torch.cat([first.chunks, shifted]),
                       chunk_offsets=torch.cat([first.chunk_offsets, then.chunk_offsets[1:] + NT]), attn_chunks={})
