"""`RowBatch`: question rows of many requests packed into one varlen pass (tokens end to end,
`cu_seqlens`, each row's document slot and stored length, the picked positions)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kev.bank.bank import BankHandle
from kev.exec.transfer import host_int64, to_device
from kev.ops.meta import host_positions
from kev.ops.shapes import ShapeClass, classify


class RowBatch:
    """Rows of many requests packed into one pass.

    `build` keeps the host ints and copies them to the device only when a device field is first
    read: an eager pass reads them, a CUDA-graph key's fill needs only the host ints (`host_fields`),
    and every torch call on the scorer's launch path may wait for the GIL (kev/exec/static_pass.py)."""

    def __init__(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor, doc_lens: torch.Tensor,
                 picks: torch.Tensor, positions: torch.Tensor, row_lens: tuple[int, ...] = (),
                 host: tuple[Sequence[int], ...] = ()):
        # tokens [T], cu_seqlens [N + 1], slots [N] (each row's document slot), doc_lens [N] (tokens
        # stored in that slot: the row's positions start there), picks [P] (packed positions of
        # <decide> / </opt> tokens), positions [T]: int64 tensors
        self._device = (tokens, cu_seqlens, slots, doc_lens, picks, positions)
        self.row_lens = row_lens  # host copy of the row lengths (CUDA-graph keys); () when unknown
        self.host = host  # host ints of tokens, cu_seqlens, slots, doc_lens, positions, picks
        self._to: torch.device | None = None

    def _field(self, i: int) -> torch.Tensor:
        if self._to is not None:  # built from host ints: one copy of them all, at the first read
            tokens, cu, slots, doc_lens, positions, picks = self.host
            parts = (tokens, cu, slots, doc_lens, picks, positions)
            block = to_device(host_int64(v for part in parts for v in part), self._to)
            self._device, self._to = tuple(block.split([len(p) for p in parts])), None
        return self._device[i]

    tokens = property(lambda self: self._field(0))
    cu_seqlens = property(lambda self: self._field(1))
    slots = property(lambda self: self._field(2))
    doc_lens = property(lambda self: self._field(3))
    picks = property(lambda self: self._field(4))
    positions = property(lambda self: self._field(5))

    def host_fields(self) -> tuple[Sequence[int] | torch.Tensor, ...]:
        """tokens, cu_seqlens, slots, doc_lens, positions, picks: the host ints when the batch has
        them (a CUDA-graph key's fill builds its block from them without a torch op), else the tensors."""
        return self.host or (self.tokens, self.cu_seqlens, self.slots, self.doc_lens, self.positions, self.picks)

    @property
    def num_tokens(self) -> int:
        return sum(self.row_lens) if self.row_lens else self.tokens.shape[0]

    @property
    def shape_class(self) -> ShapeClass:
        """The autotune class, from host ints (shapes): no device read."""
        return classify(self.num_tokens, rows=True)

    @classmethod
    def build(cls, rows: Sequence[Sequence[int]], handles: Sequence[BankHandle], doc_lens: Sequence[int],
              picks_per_row: Sequence[Sequence[int]], device="cpu") -> "RowBatch":
        lens = [len(r) for r in rows]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        picks = [cu[i] + p for i, ps in enumerate(picks_per_row) for p in ps]
        flat = [t for r in rows for t in r]
        batch = cls(*(None,) * 6, tuple(lens),
                    (flat, cu, [h.slot for h in handles], list(doc_lens), host_positions(lens, list(doc_lens)), picks))
        batch._to = torch.device(device)
        return batch
