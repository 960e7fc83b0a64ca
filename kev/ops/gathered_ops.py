"""`GatheredOps`: the gathered row path, kept as the benchmark baseline and as a test oracle.

Per layer and state kind, one `index_select` copies the rows' stored states into preallocated row
buffers (recurrent states [N, HV, K, V], conv states [N, C, W-1], K/V pages [N * P, BS, Hkv, D]);
then the very same kernels as `TritonOps` run with read indices arange(N) (and a block table that
points into the page buffer). Writes (state passes) still go to the bank by `write_slots`.
Everything else is identical, so indexed and gathered results must match bit for bit.

The page buffer holds P = ceil(max prefix / BS) pages per row. P comes from `max_prefix_tokens`
when given, else from the pass's host metadata (one host sync per pass).

CUDA-graph keys (`kev.exec.static_pass`, metas given to `pin`) change their index tensors in place
between replays, so nothing may be derived from them once and kept: for a pinned meta the gather
plan (source slots, source pages) is recomputed on the device at every call, inside the graph
when captured, and P must come from `max_prefix_tokens` (a key serves any prefix length; the
host cannot look). A row whose prefix is longer than `max_prefix_tokens` cannot be gathered: a
pass that is not graphed raises `PrefixTooLong`; a graphed one cannot check without a host sync, so
the server must refuse such documents first (the scorer caps its document limit at
KEV_GATHERED_MAX_PREFIX_TOKENS). A row buffer outgrown by a larger pass is kept alive, never
freed: graphs captured earlier still read and write its memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kev.ops.attention.paged_prefix import paged_prefix_attention, query_block
from kev.ops.conv.indexed_conv import indexed_causal_conv
from kev.ops.delta_rule.indexed_scan import indexed_chunk_gated_delta_rule
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.triton_ops import TritonOps, split_attention


@dataclass(frozen=True, eq=False)
class GatherIndices:
    """Per-pass gather plan (shared by every layer)."""

    rows: torch.Tensor  # [N] int64 source slot of each row (negative reads clamped to 0)
    row_slots: torch.Tensor  # [N] int64 read index into the row buffer: n, or -1 where read_slots is -1
    page_plans: dict[int, tuple[torch.Tensor, torch.Tensor]]  # block size -> (pages [N * P] int64, table [N, P] int32)


class PrefixTooLong(ValueError):
    """A row's stored prefix is longer than the gathered page buffer holds (`max_prefix_tokens`)."""


class GatheredOps(TritonOps):
    name = "gathered"

    def __init__(self, max_prefix_tokens: int | None = None) -> None:
        super().__init__()
        if max_prefix_tokens is not None and max_prefix_tokens < 1:
            raise ValueError(f"max_prefix_tokens must be >= 1, got {max_prefix_tokens}")
        self.max_prefix_tokens = max_prefix_tokens
        self._plans: weakref.WeakKeyDictionary[PassMeta, GatherIndices] = weakref.WeakKeyDictionary()
        self._pinned: weakref.WeakSet[PassMeta] = weakref.WeakSet()  # CUDA-graph keys' metas
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []  # replaced buffers, kept alive for the graphs that hold them
        self._tables: dict[tuple, torch.Tensor] = {}  # (N, P, device) -> arange(N * P).view(N, P) int32

    def pin(self, meta: PassMeta, indices) -> None:
        """As `TritonOps.pin`; the meta's gather plan is then recomputed at every call."""
        super().pin(meta, indices)
        self._pinned.add(meta)

    def buffer(self, kind: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A preallocated [rows, *like.shape[1:]] row buffer (grown, never shrunk or freed; reused
        by every layer and every pass)."""
        key = (kind, tuple(like.shape[1:]), like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            if buf is not None:
                self._outgrown.append(buf)  # a captured graph may point into it
            buf = torch.empty((max(rows, 1), *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:rows]

    def plan(self, meta: PassMeta) -> GatherIndices:
        """Source slots of the rows: once per pass, or at every call for a pinned (CUDA-graph key) meta."""
        plan = self._plans.get(meta)
        if plan is None or meta in self._pinned:
            read = meta.read_slots
            arange = torch.arange(meta.num_seqs, device=read.device)
            plan = GatherIndices(rows=read.clamp(min=0), row_slots=torch.where(read >= 0, arange, -1), page_plans={})
            self._plans[meta] = plan
        return plan

    def pages_per_row(self, meta: PassMeta, block_size: int) -> int:
        """P: from `max_prefix_tokens` (required for a pinned meta), else the pass's longest prefix.
        A pass that is not graphed is checked against `max_prefix_tokens` (`PrefixTooLong`)."""
        pinned = meta in self._pinned
        if pinned and self.max_prefix_tokens is None:
            raise ValueError("GatheredOps on a CUDA-graph key needs max_prefix_tokens: a key serves "
                             "any prefix length and its page plan cannot be sized from the host")
        longest = None if pinned else max(meta.host.prefix_lens, default=0)
        if longest is not None and self.max_prefix_tokens is not None and longest > self.max_prefix_tokens:
            raise PrefixTooLong(f"a row continues a {longest}-token prefix; the gathered page buffer holds "
                                f"{self.max_prefix_tokens} tokens a row (max_prefix_tokens)")
        tokens = self.max_prefix_tokens if self.max_prefix_tokens is not None else longest
        P = max(1, -(-tokens // block_size))
        if P > meta.block_table.shape[1]:
            raise ValueError(f"a prefix of {tokens} tokens needs {P} pages; block_table is "
                             f"{tuple(meta.block_table.shape)}")
        return P

    def page_plan(self, meta: PassMeta, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(source pages [N * P], block table [N, P] into the page buffer) for P pages per row."""
        plans = self.plan(meta).page_plans
        if block_size not in plans:
            N, P = meta.num_seqs, self.pages_per_row(meta, block_size)
            device = meta.block_table.device
            table = self._tables.get((N, P, device))
            if table is None:
                table = self._tables[(N, P, device)] = torch.arange(N * P, dtype=torch.int32,
                                                                    device=device).view(N, P)
            plans[block_size] = (meta.block_table[:, :P].clamp(min=0).reshape(-1).long(), table)
        return plans[block_size]

    def causal_conv(self, x, weight, meta: PassMeta, conv_pool, split=None, out=None):
        plan = self.plan(meta)
        rows = torch.index_select(conv_pool, 0, plan.rows, out=self.buffer("conv", meta.num_seqs, conv_pool))
        return indexed_causal_conv(x=x, weight=weight, cu_seqlens=meta.cu_seqlens, conv_pool=rows,
                                   read_slots=plan.row_slots, write_slots=meta.write_slots, out_pool=conv_pool,
                                   chunk_indices=self.prepare(meta).chunks, split=split, out=out)

    def gated_delta_rule(self, q, k, v, gates: DeltaGates, meta: PassMeta, state_pool):
        plan, idx = self.plan(meta), self.prepare(meta)
        buffer = self.buffer("recurrent", meta.num_seqs, state_pool)

        def start_states(n0: int, n1: int):  # gathered right before the phase's state pass: it sees
            # what the phases before it wrote (a joined meta's rows read their new document's state)
            torch.index_select(state_pool, 0, plan.rows[n0:n1], out=buffer[n0:n1])
            return buffer, plan.row_slots[n0:n1]

        return indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=meta.cu_seqlens,
                                              state_pool=state_pool, read_slots=meta.read_slots,
                                              write_slots=meta.write_slots, out_pool=state_pool,
                                              chunk_indices=idx.chunks, chunk_offsets=idx.chunk_offsets,
                                              phases=meta.phases, start_states=start_states)

    def attention(self, q, k, v, meta: PassMeta, key_pages, value_pages, gate=None, out=None):
        pages, row_table = self.page_plan(meta, key_pages.shape[1])
        n = pages.shape[0]
        kbuf = torch.index_select(key_pages, 0, pages, out=self.buffer("keys", n, key_pages))
        vbuf = torch.index_select(value_pages, 0, pages, out=self.buffer("values", n, value_pages))
        chunks = self.prepare(meta).attention_chunks(meta.cu_seqlens, query_block(q.shape[1] // k.shape[1]))
        return paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                                      key_pages=kbuf, value_pages=vbuf, block_table=row_table,
                                      write_slots=meta.write_slots, out_key_pages=key_pages,
                                      out_value_pages=value_pages, write_table=meta.block_table,
                                      chunk_indices=chunks, split=split_attention(meta, q.shape[0]), gate=gate,
                                      out=out)
