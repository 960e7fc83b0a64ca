"""`RowBatch`: question rows of many requests packed into one varlen pass (tokens end to end,
`cu_seqlens`, each row's document slot and stored length, the picked positions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kev.bank.bank import BankHandle
from kev.exec.transfer import host_int64, to_device
from kev.ops.meta import host_positions
from kev.ops.shapes import ShapeClass, classify


@dataclass(frozen=True, eq=False)
class RowBatch:
    """Rows of many requests packed into one pass."""

    tokens: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [N + 1] int64
    slots: torch.Tensor  # [N] int64: each row's document slot
    doc_lens: torch.Tensor  # [N] int64: tokens stored in that slot (the row's positions start there)
    picks: torch.Tensor  # [P] int64 packed positions of <decide> / </opt> tokens
    positions: torch.Tensor  # [T] int64 absolute position of every token
    row_lens: tuple[int, ...] = ()  # host copy of the row lengths (CUDA-graph keys); () when unknown
    host: tuple[Sequence[int], ...] = ()  # host ints of tokens, cu_seqlens, slots, doc_lens, positions, picks

    def host_fields(self) -> tuple[Sequence[int] | torch.Tensor, ...]:
        """tokens, cu_seqlens, slots, doc_lens, positions, picks: the host ints when the batch has
        them (a CUDA-graph key's fill builds its block from them without a torch op), else the tensors."""
        return self.host or (self.tokens, self.cu_seqlens, self.slots, self.doc_lens, self.positions, self.picks)

    @property
    def shape_class(self) -> ShapeClass:
        """The autotune class, from host ints (shapes): no device read."""
        return classify(self.tokens.shape[0], rows=True)

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
        h_tokens, h_cu, h_slots, h_lens, h_picks, h_positions = parts
        return cls(tokens, cu_seqlens, slots, lens_t, picks_t, positions, tuple(lens),
                   (h_tokens, h_cu, h_slots, h_lens, h_positions, h_picks))
