"""`PassMeta`: what every op needs to know about the sequences packed into one pass.

One pass packs N sequences back to back (`cu_seqlens`, no padding). A sequence either starts
from nothing (a new document), or continues a state stored in bank slot `read_slots[n]` (a
question row, or the next chunk of a long document). Its final state is written to
`write_slots[n]`, or nowhere when that index is negative (rows never write). `prefix_lens[n]`
tokens of the sequence's document are already in the bank, so its positions start there and
attention sees them through `block_table[n]` (the K/V pages of the slot).

`PhasedMeta` packs several such passes into one sweep over the weights: the token-wise work
(projections, norms, MLP) runs once over all tokens, the token mixing phase by phase, so a later
phase reads what an earlier one wrote in the same layer (new documents, then rows over them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kev.ops.shapes import ShapeClass


@dataclass(frozen=True, eq=False)
class PassMeta:
    cu_seqlens: torch.Tensor  # [N + 1] int64
    read_slots: torch.Tensor  # [N] int64, -1 = zero initial state
    write_slots: torch.Tensor  # [N] int64, -1 = do not store the final state
    prefix_lens: torch.Tensor  # [N] int64, tokens already stored for the sequence's document
    block_table: torch.Tensor  # [N, max_blocks] int32, K/V pages of the sequence's slot (-1 unused)
    positions: torch.Tensor | None = None  # [T] int64; given by builders so a pass needs no host sync
    # The pass's autotune class (`kev.ops.shapes.classify`), set by builders that know the pass's
    # kind (a CUDA-graph key's, by its padded size). None: guessed from the shapes (`classify_seqs`).
    shape_class: ShapeClass | None = None
    # A joined meta (`PhasedMeta.joined`): the sequence counts of its phases, in order; the delta
    # rule's state passes run phase by phase. Empty: one phase.
    phases: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.read_slots.shape[0]

    def pass_class(self, num_tokens: int) -> ShapeClass:
        """The autotune class of this pass of `num_tokens` tokens (host ints only, no device read):
        the one its runner tunes under, so a kernel choice by class stays inside warmed caches."""
        from kev.ops.shapes import classify_seqs

        return self.shape_class if self.shape_class is not None else classify_seqs(self.num_seqs, num_tokens)

    @cached_property
    def host(self) -> "HostMeta":
        """Python ints for reference loops; one host sync, only on paths that may sync."""
        return HostMeta(
            cu_seqlens=self.cu_seqlens.tolist(),
            read_slots=self.read_slots.tolist(),
            write_slots=self.write_slots.tolist(),
            prefix_lens=self.prefix_lens.tolist(),
        )

    def token_positions(self) -> torch.Tensor:
        """[T] absolute position of every packed token: its document prefix plus its index in the sequence."""
        if self.positions is not None:
            return self.positions
        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=lens.device), lens)
        start = self.cu_seqlens[:-1][seq_of_token]
        idx = torch.arange(seq_of_token.shape[0], device=lens.device)
        return idx - start + self.prefix_lens[seq_of_token]


@dataclass(frozen=True, eq=False)
class PhasedMeta:
    """One sweep, token mixing in phases: phase i owns packed tokens [sum(lengths[:i]), sum(lengths[:i+1])).

    In every layer each mixer runs phase 0's sequences, then phase 1's, ...; so a phase may read a
    slot an earlier phase writes (its documents' states, conv tails and K/V pages, just computed).
    Inside one phase the `PassMeta` contract holds (a slot written is read by no other sequence).
    The tokens a pass returns (the model's `picks`) lie in the last phase: the earlier phases are
    documents, whose last attention layer only stores its K/V."""

    phases: tuple[PassMeta, ...]
    lengths: tuple[int, ...]  # host ints: tokens of each phase

    def __post_init__(self) -> None:
        if len(self.phases) != len(self.lengths) or not self.phases:
            raise ValueError(f"{len(self.phases)} phases but {len(self.lengths)} lengths")
        if any(m.positions is None for m in self.phases):
            raise ValueError("phased passes need each phase's positions (built with the batch: no host sync)")

    def spans(self) -> list[tuple[int, int, PassMeta]]:
        """(first token, end token, meta) of each phase."""
        out, start = [], 0
        for n, meta in zip(self.lengths, self.phases):
            out.append((start, start + n, meta))
            start += n
        return out

    def token_positions(self) -> torch.Tensor:
        return torch.cat([m.positions for m in self.phases])

    @cached_property
    def joined(self) -> PassMeta:
        """All phases' sequences as one pass (token offsets shifted by the phases before), in the
        first phase's autotune class, with `phases` set: the steps of a mixer that read no state
        (the delta rule's per-chunk work) run once over it. Device ops only, no host sync."""
        starts = [start for start, _, _ in self.spans()]
        cu = torch.cat([self.phases[0].cu_seqlens[:1]]
                       + [m.cu_seqlens[1:] + start for m, start in zip(self.phases, starts)])
        first = self.phases[0]
        cat = lambda name: torch.cat([getattr(m, name) for m in self.phases])  # noqa: E731
        return PassMeta(cu_seqlens=cu, read_slots=cat("read_slots"), write_slots=cat("write_slots"),
                        prefix_lens=cat("prefix_lens"), block_table=cat("block_table"), positions=cat("positions"),
                        shape_class=first.pass_class(self.lengths[0]),
                        phases=tuple(m.num_seqs for m in self.phases))


def as_phases(meta: "PassMeta | PhasedMeta", num_tokens: int) -> list[tuple[int, int, PassMeta]]:
    """The phases of a pass: a plain `PassMeta` is one phase over all `num_tokens` tokens."""
    return meta.spans() if isinstance(meta, PhasedMeta) else [(0, num_tokens, meta)]


@dataclass(frozen=True)
class HostMeta:
    cu_seqlens: list[int]
    read_slots: list[int]
    write_slots: list[int]
    prefix_lens: list[int]

    def seqs(self):
        """(n, start, end, read_slot, write_slot, prefix_len) per sequence."""
        for n in range(len(self.read_slots)):
            yield (n, self.cu_seqlens[n], self.cu_seqlens[n + 1], self.read_slots[n], self.write_slots[n],
                   self.prefix_lens[n])


def host_positions(seq_lens: list[int], prefix_lens: list[int]) -> list[int]:
    """The same positions as `PassMeta.token_positions`, computed on the host while building a batch."""
    return [p + t for n, p in zip(seq_lens, prefix_lens) for t in range(n)]
