"""The runner turns decisions (which documents, which rows) into packed tensors and passes.

`state_pass` reads new documents into their bank slots (long ones in chunks that carry the
state in the slot itself); `row_pass` runs question rows continuing stored states and returns
the final hidden states at the picked positions. Neither touches Python-side request objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kev.bank.bank import Bank, BankHandle
from kev.model import Qwen35Model
from kev.ops import Ops, PassMeta
from kev.ops.autotune import ClassTuner, ShapeClass, classify
from kev.ops.meta import host_positions


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
        as_long = dict(dtype=torch.int64, device=device)
        return cls(torch.tensor(flat, **as_long), torch.tensor(cu, **as_long),
                   torch.tensor([h.slot for h in handles], **as_long), torch.tensor(list(doc_lens), **as_long),
                   torch.tensor(picks, **as_long), torch.tensor(host_positions(lens, list(doc_lens)), **as_long),
                   tuple(lens))


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
            slots = torch.tensor([handles[i].slot for i in live], dtype=torch.int64, device=self.device)
            read = slots if done > 0 else torch.full_like(slots, -1)
            cu = torch.tensor([0, *torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()],
                              dtype=torch.int64, device=self.device)
            positions = host_positions([len(c) for c in chunks], [done] * len(chunks))
            meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=slots,
                            prefix_lens=torch.full_like(slots, done), block_table=self.bank.block_table[slots],
                            positions=torch.tensor(positions, dtype=torch.int64, device=self.device))
            tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
            with self.tuned(classify(len(chunks), len(positions))):
                self.model(tokens, meta, self.bank.pools, self.ops,
                           picks=torch.zeros(0, dtype=torch.int64, device=self.device))
            done += self.state_chunk_tokens

    def row_meta(self, batch: RowBatch) -> PassMeta:
        return PassMeta(cu_seqlens=batch.cu_seqlens, read_slots=batch.slots,
                        write_slots=torch.full_like(batch.slots, -1), prefix_lens=batch.doc_lens,
                        block_table=self.bank.block_table[batch.slots], positions=batch.positions)

    @torch.no_grad()
    def row_pass(self, batch: RowBatch) -> torch.Tensor:
        """[P, d] final hidden states at `batch.picks`; the bank is only read."""
        with self.tuned(batch.shape_class):
            return self.model(batch.tokens, self.row_meta(batch), self.bank.pools, self.ops, picks=batch.picks)
