"""Static-shape passes for CUDA graphs: one key's index buffers, and the fill that packs a real
pass into them without changing any real sequence's result.

A key (`GraphKey`) fixes T tokens and C chunk-list entries (chunks of CHUNK tokens; C sequences
too). A pass is packed as it is: its n sequences end to end, no padding between them (the eager
layout, `RowBatch` / `Passes._chunk_pass`). Then sequences n .. C-2 are empty and sequence C-1 is
the padding sequence, tokens [T_real, T), which reads nothing and writes nowhere. The pass fits
when T_real <= T, n < C and its chunks plus the padding sequence's are at most C (`GraphKey.fits`).

The chunk lists are filled with each pass (`packed_chunks`): the real sequences' chunks, then the
padding sequence's, then no-op entries (chunks past the padding sequence's end: every kernel masks
all their rows; paged attention walks no keys for them). Entry positions equal the offsets plus
the chunk index, as the scan's `h` and fla's `chunk_fwd_o` read them. Every index tensor a pass
reads (tokens, positions, cu_seqlens, slots, prefix lengths, block table, picks, chunk lists) is a
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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kev.exec.transfer import copy_in, host_int64
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
        """Sequences in the padded pass: real, empty, and the padding sequence last."""
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


def chunks_needed(lens: Sequence[int], tokens: int, block: int = CHUNK) -> int:
    """Chunk-list entries of sequences of `lens` padded to `tokens` by one padding sequence."""
    return sum(cdiv(n, block) for n in lens) + cdiv(tokens - sum(lens), block)


def entries_needed(lens: Sequence[int], tokens: int) -> int:
    """The least C of a key of `tokens` tokens that holds sequences of `lens`: their chunks and the
    padding sequence's, and a sequence slot each plus the padding sequence's (the fit test, once)."""
    return max(chunks_needed(lens, tokens), len(lens) + 1)


def packed_chunks(lens: Sequence[int], tokens: int, slots: int, block: int, entries: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk list ([entries, 2] (sequence, chunk)) and chunk offsets ([slots + 1]) of sequences
    of `lens` tokens, then empty sequences, then the padding sequence (index slots - 1) up to
    `tokens`, whose entries run on past its end to fill `entries` (no-ops). Host int64, a few
    tensor ops: it runs in front of every replay."""
    seq_lens = torch.zeros(slots, dtype=torch.int64)
    seq_lens[: len(lens)] = torch.tensor(list(lens), dtype=torch.int64)
    per = (seq_lens + block - 1) // block
    used = int(per.sum())
    need = cdiv(tokens - sum(lens), block)
    if used + need > entries:
        raise ValueError(f"{len(lens)} sequences of {sum(lens)} tokens in {tokens} need more than {entries} entries")
    per[-1] = entries - used  # the padding sequence's chunks, then the no-ops
    offsets = torch.zeros(slots + 1, dtype=torch.int64)
    torch.cumsum(per, 0, out=offsets[1:])
    seq = torch.repeat_interleave(torch.arange(slots), per, output_size=entries)
    return torch.stack([seq, torch.arange(entries) - offsets[seq]], 1), offsets


class StaticPass:
    """One key's buffers, its `PassMeta`, and the fills from a real pass."""

    def __init__(self, key: GraphKey, table_width: int, attn_block: int, device):
        self.key = key
        N, T, P = key.num_slots, key.num_tokens, key.picks
        self.attn_block = attn_block
        # Attention's query blocks divide CHUNK, so a sequence's blocks are at most CHUNK / block per chunk.
        self.attn_entries = key.chunks * (CHUNK // attn_block)
        self._sizes = (T, T, N + 1, N, N, N, P, 2 * key.chunks, N + 1, 2 * self.attn_entries)
        self._template = self._host_template()
        self._ints = self._template.to(device)
        (self.tokens, self.positions, self.cu_seqlens, self.write_slots, self.read_slots, self.prefix_lens,
         self.picks, chunks, self.chunk_offsets, attn_chunks) = self._ints.split(self._sizes)
        self.chunks, self.attn_chunks = chunks.view(-1, 2), {attn_block: attn_chunks.view(-1, 2)}
        self.block_table = torch.zeros((N, table_width), dtype=torch.int32, device=device)
        self.meta = PassMeta(cu_seqlens=self.cu_seqlens, read_slots=self.read_slots, write_slots=self.write_slots,
                             prefix_lens=self.prefix_lens, block_table=self.block_table, positions=self.positions,
                             shape_class=key.shape_class)

    def _host_template(self) -> torch.Tensor:
        """The block of an empty pass: every token in the padding sequence."""
        key = self.key
        block = torch.zeros(sum(self._sizes), dtype=torch.int64)
        self._fill_host(block, [], [], [], [], [], [])
        return block

    def indices(self):
        """The static `PassIndices` to pin into `TritonOps` for `self.meta`."""
        from kev.ops.triton_ops import PassIndices

        return PassIndices(chunks=self.chunks, chunk_offsets=self.chunk_offsets, attn_chunks=dict(self.attn_chunks))

    def fits(self, lens: Sequence[int]) -> bool:
        return self.key.fits(lens)

    def _fill_host(self, block: torch.Tensor, lens: Sequence[int], tokens, positions, read, write, prefix,
                   picks=None) -> None:
        """Write one pass into a host `block` laid out as the device one (`_sizes`)."""
        key = self.key
        T, N, Tr = key.num_tokens, key.num_slots, sum(lens)
        (h_tokens, h_positions, h_cu, h_write, h_read, h_prefix, h_picks, h_chunks, h_offsets,
         h_attn) = block.split(self._sizes)
        n = len(lens)
        if n:
            h_tokens[:Tr] = tokens
            h_positions[:Tr] = positions
        h_tokens[Tr:] = 0
        h_positions[Tr:] = torch.arange(T - Tr)  # the padding sequence's own positions
        cu = [0]
        for ln in lens:
            cu.append(cu[-1] + ln)
        h_cu[: n + 1] = torch.tensor(cu)
        h_cu[n + 1 : N] = Tr  # empty sequences, then the padding sequence's start
        h_cu[N] = T
        for dst, src in ((h_read, read), (h_write, write), (h_prefix, prefix)):
            dst.fill_(0 if dst is h_prefix else -1)
            if n:
                dst[:n] = src
        if key.picks:
            h_picks.zero_()  # padding picks read token 0 (a real position, its output dropped)
            if picks is not None and len(picks):
                h_picks[: len(picks)] = picks
        c, o = packed_chunks(lens, T, N, CHUNK, key.chunks)
        h_chunks.copy_(c.view(-1))
        h_offsets.copy_(o)
        h_attn.copy_(packed_chunks(lens, T, N, self.attn_block, self.attn_entries)[0].view(-1))

    def fill_rows(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                  doc_lens: torch.Tensor, positions: torch.Tensor, picks: torch.Tensor,
                  bank_table: torch.Tensor) -> int:
        """Place a packed row batch (it `fits`: the caller chose the key from host ints) into the
        buffers: built on the host, one copy in, then the rows' block-table rows gathered on the
        device; no sync. The batch's fields are host tensors (`RowBatch.host_fields`); device
        ones are copied back first (start-up, tests). Returns P, the real picks."""
        assert self.key.kind is PassKind.ROWS
        tokens, cu_seqlens, slots, doc_lens, positions, picks = (
            t.cpu() for t in (tokens, cu_seqlens, slots, doc_lens, positions, picks))
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        host = self._template.clone()
        self._fill_host(host, lens, tokens, positions, slots, -1, doc_lens, picks)
        copy_in(self._ints, host)
        n = len(lens)
        torch.index_select(bank_table, 0, self.read_slots[:n].clamp(min=0), out=self.block_table[:n])
        return picks.shape[0]

    def fill_state(self, chunks: Sequence[Sequence[int]], slots: Sequence[int], bank_table: torch.Tensor,
                   starts: Sequence[int] | None = None) -> None:
        """Place document chunks (they `fit`) into the buffers: chunk n goes to slot n's tokens
        [starts[n], starts[n] + len) (0: a new document, which reads nothing; else it continues
        the state in its slot). The block built on the host, one copy in, then the block-table
        rows of the written slots."""
        assert self.key.kind is PassKind.STATE
        starts = [0] * len(chunks) if starts is None else list(starts)
        lens = [len(c) for c in chunks]
        flat = torch.cat([host_int64(c) for c in chunks]) if chunks else host_int64([])
        # token i of chunk n sits at starts[n] + i: one arange shifted per chunk (no Python loop over tokens)
        first = torch.tensor([0, *lens[:-1]], dtype=torch.int64).cumsum(0) if lens else host_int64([])
        shift = torch.repeat_interleave(host_int64(starts) - first, host_int64(lens), output_size=len(flat))
        positions = torch.arange(len(flat)) + shift
        host = self._template.clone()
        read = [s if start > 0 else -1 for s, start in zip(slots, starts)]
        self._fill_host(host, lens, flat, positions, host_int64(read), host_int64(slots), host_int64(starts))
        copy_in(self._ints, host)
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
