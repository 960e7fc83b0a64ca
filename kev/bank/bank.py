"""The state bank: preallocated pools, a free list of slots, a free list of K/V pages.

Like a paged-attention block manager: memory is carved once, a document gets one slot (its
DeltaNet states) and as many K/V pages as its length needs, and everything is addressed by index.
A `BankHandle` carries the slot's generation; freeing a slot bumps it, so a handle that outlived
its entry can never read the slot's next tenant.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kev.bank.layout import StatePools
from kev.model.config import ModelConfig


class BankFull(RuntimeError):
    """No free slot or not enough free K/V pages; the caller evicts and retries, or rejects."""


class StaleHandle(LookupError):
    """The handle's generation does not match its slot's: the entry was evicted."""


@dataclass(frozen=True, order=True)
class BankHandle:
    slot: int
    generation: int


@dataclass(frozen=True)
class BankStats:
    slots_total: int
    slots_used: int
    blocks_total: int
    blocks_used: int
    bytes_total: int


class Bank:
    """`block_table` and `generations` may be given preallocated (shared memory that other
    processes map, kev.bank.shared): the block table [slots, max_blocks] int32 is reset to -1;
    the generations tensor [slots] int64 (CPU) seeds each slot's generation and mirrors every
    bump, so a reader in another process can check a handle without asking this allocator."""

    def __init__(self, cfg: ModelConfig, pools: StatePools, max_doc_tokens: int = 65536, *,
                 block_table: torch.Tensor | None = None, generations: torch.Tensor | None = None,
                 fingerprints: torch.Tensor | None = None):
        self.cfg = cfg
        self.pools = pools
        self.block_size = pools.block_size
        self.max_blocks_per_slot = -(-max_doc_tokens // self.block_size)
        device = pools.conv[0].device if pools.conv else pools.keys[0].device
        S = pools.num_slots
        # Host copies are the allocator's truth; the device block table is what kernels read.
        if block_table is None:
            block_table = torch.full((S, self.max_blocks_per_slot), -1, dtype=torch.int32, device=device)
        elif block_table.shape != (S, self.max_blocks_per_slot) or block_table.dtype != torch.int32:
            raise ValueError(f"block_table must be [{S}, {self.max_blocks_per_slot}] int32, "
                             f"got {list(block_table.shape)} {block_table.dtype}")
        else:
            block_table.fill_(-1)
        self.block_table = block_table
        if generations is not None and (generations.shape != (S,) or generations.dtype != torch.int64
                                        or generations.device.type != "cpu"):
            raise ValueError(f"generations must be [{S}] int64 on the CPU, "
                             f"got {list(generations.shape)} {generations.dtype} {generations.device}")
        self._shared_generations = generations
        # Shared [slots] int64 beside the generations: the fingerprint of the document key each live
        # slot holds (0: none), written by `bind` before the entry is registered (issue 27).
        if fingerprints is not None and (fingerprints.shape != (S,) or fingerprints.dtype != torch.int64):
            raise ValueError(f"fingerprints must be [{S}] int64")
        self.fingerprints = fingerprints
        if fingerprints is not None:
            fingerprints.zero_()
        self.lengths = [0] * S
        self.generations = generations.tolist() if generations is not None else [0] * S
        self._pages: list[list[int]] = [[] for _ in range(S)]
        self._free_slots = list(range(S - 1, -1, -1))
        self._free_blocks = list(range(pools.num_blocks - 1, -1, -1))
        self._used = [False] * S
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, num_blocks: int, *, block_size: int = 64,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_doc_tokens: int = 65536) -> "Bank":
        return cls(cfg, StatePools.allocate(cfg, num_slots, num_blocks, block_size, dtype, device), max_doc_tokens)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, memory_bytes: int, *, avg_doc_tokens: int = 1024,
                    block_size: int = 64, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", max_doc_tokens: int = 65536) -> "Bank":
        """Split `memory_bytes` so that documents of `avg_doc_tokens` fill slots and pages together."""
        num_slots, num_blocks = cls.budget_split(cfg, memory_bytes, avg_doc_tokens=avg_doc_tokens,
                                                 block_size=block_size, dtype=dtype, max_doc_tokens=max_doc_tokens)
        return cls.allocate(cfg, num_slots, num_blocks, block_size=block_size, dtype=dtype, device=device,
                            max_doc_tokens=max_doc_tokens)

    @staticmethod
    def budget_split(cfg: ModelConfig, memory_bytes: int, *, avg_doc_tokens: int = 1024, block_size: int = 64,
                     dtype: torch.dtype = torch.float32, max_doc_tokens: int = 65536) -> tuple[int, int]:
        """(num_slots, num_blocks) for `from_budget`; always room for one document of `max_doc_tokens`."""
        per_slot = StatePools.bytes_per_slot(cfg, dtype)
        per_block = StatePools.bytes_per_block(cfg, block_size, dtype)
        blocks_per_doc = -(-avg_doc_tokens // block_size)
        num_slots = max(1, memory_bytes // (per_slot + blocks_per_doc * per_block))
        num_blocks = max(-(-max_doc_tokens // block_size), (memory_bytes - num_slots * per_slot) // max(per_block, 1))
        return num_slots, num_blocks

    def alloc(self, doc_tokens: int) -> BankHandle:
        """A slot and ceil(doc_tokens / block_size) pages for a document about to be state-passed."""
        need = -(-doc_tokens // self.block_size) if self.pools.keys else 0
        if need > self.max_blocks_per_slot:
            raise ValueError(f"document of {doc_tokens} tokens exceeds the bank's max of "
                             f"{self.max_blocks_per_slot * self.block_size}")
        with self._lock:
            if not self._free_slots:
                raise BankFull("no free bank slot")
            if need > len(self._free_blocks):
                raise BankFull(f"need {need} K/V pages, {len(self._free_blocks)} free")
            slot = self._free_slots.pop()
            pages = [self._free_blocks.pop() for _ in range(need)]
            self._pages[slot] = pages
            self._used[slot] = True
            self.lengths[slot] = doc_tokens
            if pages:
                self.block_table[slot, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            return BankHandle(slot, self.generations[slot])

    def shortfall(self, doc_lens: Sequence[int]) -> tuple[int, int]:
        """(slots, K/V pages) missing for documents of `doc_lens` tokens to be allocated now; (0, 0):
        they all fit."""
        need = sum(-(-n // self.block_size) for n in doc_lens) if self.pools.keys else 0
        with self._lock:
            return max(0, len(doc_lens) - len(self._free_slots)), max(0, need - len(self._free_blocks))

    def entries_to_free(self, doc_lens: Sequence[int]) -> int:
        """How many entries to evict at once so documents of `doc_lens` tokens fit: the missing
        slots, or the missing pages at the held entries' mean pages, whichever is more (0: they
        fit). One guess for one eviction call: a long document at a bank of short entries would
        otherwise free them one call at a time."""
        slots, pages = self.shortfall(doc_lens)
        if not pages:
            return slots
        return max(slots, -(-pages // self._mean_entry_pages()))

    def _mean_entry_pages(self) -> int:
        with self._lock:
            held = len(self._used) - len(self._free_slots)
            pages = self.pools.num_blocks - len(self._free_blocks)
        return max(1, round(pages / held) if held else 1)

    def mean_entry_tokens(self) -> int:
        """The held entries' mean size in tokens of whole pages (one page with none held)."""
        return self._mean_entry_pages() * self.block_size

    def free(self, handle: BankHandle) -> None:
        with self._lock:
            self._check(handle)
            slot = handle.slot
            # The generation moves first: a reader in another process sees the handle dead before
            # the slot's pages change.
            self.generations[slot] += 1
            if self._shared_generations is not None:
                self._shared_generations[slot] = self.generations[slot]
            if self.fingerprints is not None:
                self.fingerprints[slot] = 0
            self._free_blocks.extend(reversed(self._pages[slot]))
            self._pages[slot] = []
            self.block_table[slot] = -1
            self.lengths[slot] = 0
            self._used[slot] = False
            self._free_slots.append(slot)

    def bind(self, handle: BankHandle, fingerprint: int) -> None:
        """Records which document (kev.bank.doc_key.key_fingerprint) the live slot holds."""
        with self._lock:
            self._check(handle)
            if self.fingerprints is not None:
                self.fingerprints[handle.slot] = fingerprint

    def check(self, handle: BankHandle) -> None:
        with self._lock:
            self._check(handle)

    def _check(self, handle: BankHandle) -> None:
        if not (0 <= handle.slot < len(self._used)) or not self._used[handle.slot] \
                or self.generations[handle.slot] != handle.generation:
            raise StaleHandle(f"bank handle {handle} is not live")

    def length(self, handle: BankHandle) -> int:
        self.check(handle)
        return self.lengths[handle.slot]

    def live_handles(self) -> list[BankHandle]:
        with self._lock:
            return [BankHandle(s, self.generations[s]) for s, u in enumerate(self._used) if u]

    def stats(self) -> BankStats:
        with self._lock:
            return BankStats(
                slots_total=len(self._used),
                slots_used=sum(self._used),
                blocks_total=self.pools.num_blocks,
                blocks_used=self.pools.num_blocks - len(self._free_blocks),
                bytes_total=sum(t.numel() * t.element_size() for t in self.pools.tensors()),
            )
