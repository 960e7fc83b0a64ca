"""The runner turns decisions (which documents, which rows) into packed tensors and passes.

`state_pass` reads new documents into their bank slots (long ones in chunks that carry the
state in the slot itself); `row_pass` runs question rows continuing stored states and returns
the final hidden states at the picked positions; `state_and_row_pass` does both in one sweep over
the weights (documents, then rows that may read them, phase by phase inside every layer). None
touches Python-side request objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kev.bank.bank import Bank, BankHandle
from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model
from kev.ops import Ops, PassMeta
from kev.ops.shapes import ShapeClass, classify
from kev.ops.autotune import ClassTuner
from kev.ops.meta import PhasedMeta, host_positions
from kev.exec.transfer import host_int64, to_device

# Safety factor of `state_pass_peak_bytes` over its itemised estimate: kernel temporaries not listed,
# allocation rounding, tensors freed a little later than the listing assumes.
PEAK_SLACK = 1.5


def state_pass_peak_bytes(cfg: ModelConfig, tokens: int, sequences: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bound on the device memory one state pass of `tokens` packed tokens (`sequences` documents)
    allocates above the weights and the bank (the runner's own chunking makes this the whole story
    for any document length: a long document runs `state_chunk_tokens` at a time, its state riding
    in its slot, so nothing grows with the document).

    Itemised per token (activation dtype e bytes, fp32 4 bytes), the largest of the three layer
    kinds while it runs, plus the residual stream around it:
    - residual stream: x, its norm and the previous block's output: 3 d e
    - DeltaNet: the fused projection output (conv_dim + value_dim + 2 HV) e, the conv output
      conv_dim e, g (fp32) and beta, l2-normalised q and k 2 H K e, v made contiguous, fla's
      chunk-local cumsum (fp32), WY w, u and A (HV K + HV V + HV 64) e, v_new, o (HV V e each);
      plus the state at every chunk start, HV K V e per 64-token chunk
    - attention: the fused q/gate, k, v output (2 Hq D + 2 Hkv D) e, q and k after norm/RoPE,
      o and the gated o
    - MLP: gate/up 2 F e, silu(gate) * up F e, the down projection d e
    - positions, token ids, RoPE tables
    times `PEAK_SLACK`. Kev-4B at 8,192 tokens: ~126 KB per token, the DeltaNet layer, 1.55 GB bound."""
    e = torch.empty((), dtype=dtype).element_size()
    d, F = cfg.hidden_size, cfg.intermediate_size
    H, K = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    chunk = 64  # the delta rule's chunk (kev.ops.delta_rule.indexed_scan.CHUNK)
    residual = 3 * d * e
    deltanet = ((cfg.conv_dim + cfg.linear_value_dim + 2 * HV) * e + cfg.conv_dim * e + HV * (4 + e)
                + 2 * H * K * e + HV * V * e + HV * 4 + (HV * K + HV * V + HV * chunk) * e + 2 * HV * V * e)
    attention = (2 * Hq * D + 2 * Hkv * D) * e + (Hq * D + Hkv * D) * e + 2 * Hq * D * e
    mlp = 3 * F * e + d * e
    index = 2 * 8 + cfg.rotary_dim * (2 * e + 12)
    per_token = residual + max(deltanet, attention, mlp) + index
    chunk_states = (tokens // chunk + sequences) * HV * K * V * e if cfg.deltanet_layers else 0
    return int(PEAK_SLACK * (tokens * per_token + chunk_states))


@dataclass(frozen=True, eq=False)
class RowBatch:
    """Rows of many requests packed into one pass."""

    tokens: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N + 1] int64
    slots: torch.Tensor  # [N] int64: each row's document slot
    doc_lens: torch.Tensor  # [N] int64: tokens stored in that slot (the row's positions start there)
    picks: torch.Tensor  # [P] int64 packed positions of <decide> / </opt> tokens
    positions: torch.Tensor  # [T] int64 absolute position of every token
    row_lens: tuple[int, ...] = ()  # host copy of the row lengths (CUDA-graph buckets); () when unknown
    host: tuple[torch.Tensor, ...] = ()  # CPU copies of tokens, cu_seqlens, slots, doc_lens, positions, picks

    def host_fields(self) -> tuple[torch.Tensor, ...]:
        """tokens, cu_seqlens, slots, doc_lens, positions, picks: the host copies when the batch
        has them (a CUDA-graph bucket's fill builds its block on the host), else the tensors."""
        return self.host or (self.tokens, self.cu_seqlens, self.slots, self.doc_lens, self.positions, self.picks)

    @property
    def shape_class(self) -> ShapeClass:
        """The autotune class, from host ints (shapes): no device read."""
        return classify(self.slots.shape[0], self.tokens.shape[0])

    @classmethod
    def build(cls, rows: Sequence[Sequence[int]], handles: Sequence[BankHandle], doc_lens: Sequence[int],
              picks_per_row: Sequence[Sequence[int]], device="cpu") -> "RowBatch":
        lens = [len(r) for r in rows]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        picks = [cu[i] + p for i, ps in enumerate(picks_per_row) for p in ps]
        flat = [t for r in rows for t in r]
        parts = (flat, cu, [h.slot for h in handles], list(doc_lens), picks, host_positions(lens, list(doc_lens)))
        # One host block, one copy that does not wait for the GPU (kev/exec/transfer.py); the fields are views.
        host = host_int64(v for part in parts for v in part)
        sizes = [len(p) for p in parts]
        tokens, cu_seqlens, slots, lens_t, picks_t, positions = to_device(host, device).split(sizes)
        h_tokens, h_cu, h_slots, h_lens, h_picks, h_positions = host.split(sizes)
        return cls(tokens, cu_seqlens, slots, lens_t, picks_t, positions, tuple(lens),
                   (h_tokens, h_cu, h_slots, h_lens, h_positions, h_picks))


class Runner:
    """Runs passes against a bank: an owning `Bank`, or any object with the same `pools`,
    `block_table` and `check` (a scorer's attached view of another process's bank).
    With a `tuner`, every pass runs with its shape class's autotune caches (kev.ops.autotune)."""

    def __init__(self, model: Qwen35Model, bank: Bank, ops: Ops, state_chunk_tokens: int = 8192,
                 tuner: ClassTuner | None = None):
        self.model, self.bank, self.ops = model, bank, ops
        self.state_chunk_tokens = state_chunk_tokens
        self.tuner = tuner
        self.device = bank.block_table.device

    def tuned(self, cls: ShapeClass):
        """Context: `cls`'s autotune caches (nothing without a tuner)."""
        return self.tuner.use(cls) if self.tuner is not None else nullcontext()

    @torch.no_grad()
    def state_pass(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle]) -> None:
        """Write each document's final states into its (already allocated) slot, in place."""
        for h in handles:
            self.bank.check(h)
        done = 0
        longest = max((len(d) for d in documents), default=0)
        while done < longest:
            # Every document still going contributes its next chunk; the state rides in its slot.
            live = [i for i, d in enumerate(documents) if len(d) > done]
            chunks = [documents[i][done : done + self.state_chunk_tokens] for i in live]
            tokens, meta = self._chunk_pass([handles[i].slot for i in live], chunks, done)
            with self.tuned(classify(len(chunks), tokens.shape[0])):
                self.model(tokens, meta, self.bank.pools, self.ops,
                           picks=torch.zeros(0, dtype=torch.int64, device=self.device))
            done += self.state_chunk_tokens

    def _chunk_pass(self, slots: Sequence[int], chunks: Sequence[Sequence[int]], done: int):
        """(tokens, meta) of one state pass: chunk n continues slot n's first `done` tokens (0: new)."""
        lens = [len(c) for c in chunks]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        parts = ([t for c in chunks for t in c], cu, list(slots), host_positions(lens, [done] * len(lens)))
        # One host block, one copy that does not wait for the GPU (kev/exec/transfer.py); the fields are views.
        block = to_device(host_int64(v for part in parts for v in part), self.device)
        tokens, cu_t, slot_t, positions = block.split([len(p) for p in parts])
        meta = PassMeta(cu_seqlens=cu_t, read_slots=slot_t if done > 0 else torch.full_like(slot_t, -1),
                        write_slots=slot_t, prefix_lens=torch.full_like(slot_t, done),
                        block_table=self.bank.block_table[slot_t], positions=positions)
        return tokens, meta

    def fits_one_sweep(self, documents: Sequence[Sequence[int]]) -> bool:
        """Whether `state_and_row_pass` runs these documents and rows as one sweep (every document
        new and at most one chunk long)."""
        return bool(documents) and all(0 < len(d) <= self.state_chunk_tokens for d in documents)

    def phase_scope(self, meta: PassMeta, num_tokens: int):
        """A phase's token mixing runs with its own class's autotune caches."""
        return self.tuned(meta.pass_class(num_tokens))

    @torch.no_grad()
    def state_and_row_pass(self, documents: Sequence[Sequence[int]], handles: Sequence[BankHandle],
                           batch: RowBatch) -> torch.Tensor:
        """`state_pass(documents, handles)` then `row_pass(batch)` (whose rows may read those slots)
        in one sweep over the weights: per layer the documents' token mixing, then the rows'.
        Documents longer than a chunk (or none) take the two passes."""
        if not self.fits_one_sweep(documents):
            self.state_pass(documents, handles)
            return self.row_pass(batch)
        for h in handles:
            self.bank.check(h)
        doc_tokens, doc_meta = self._chunk_pass([h.slot for h in handles], documents, 0)
        Td = doc_tokens.shape[0]
        meta = PhasedMeta((doc_meta, self.row_meta(batch)), (Td, batch.tokens.shape[0]))
        with self.tuned(classify(len(documents), Td)):
            return self.model(torch.cat([doc_tokens, batch.tokens]), meta, self.bank.pools, self.ops,
                              picks=batch.picks + Td, mixer_scope=self.phase_scope)

    def state_pass_peak_bytes(self, doc_lens: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> int:
        """Bound on what `state_pass` of documents of `doc_lens` tokens allocates above weights and
        bank: its largest pass is the first, every document's first chunk."""
        first = [min(n, self.state_chunk_tokens) for n in doc_lens if n > 0]
        return state_pass_peak_bytes(self.model.cfg, sum(first), len(first), dtype) if first else 0

    def row_meta(self, batch: RowBatch) -> PassMeta:
        return PassMeta(cu_seqlens=batch.cu_seqlens, read_slots=batch.slots,
                        write_slots=torch.full_like(batch.slots, -1), prefix_lens=batch.doc_lens,
                        block_table=self.bank.block_table[batch.slots], positions=batch.positions)

    @torch.no_grad()
    def row_pass(self, batch: RowBatch) -> torch.Tensor:
        """[P, d] final hidden states at `batch.picks`; the bank is only read."""
        with self.tuned(batch.shape_class):
            return self.model(batch.tokens, self.row_meta(batch), self.bank.pools, self.ops, picks=batch.picks)
