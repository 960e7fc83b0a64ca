"""`TritonOps`: the GPU ops, reading and writing the bank pools in place by slot index.

Same semantics as `TorchOps` (the fp32 reference): conv from `conv_pool[read_slots]`, the gated
delta rule from `state_pool[read_slots]`, attention over the paged prefix through the block table;
final states / own K/V go to `write_slots` (negative: no write). No state of any kind is gathered
or copied: the kernels take slot indices and strides (`kev.ops.conv.indexed_conv`,
`kev.ops.delta_rule.indexed_scan`, `kev.ops.attention.paged_prefix`).

Contract (as in the bank's use): a sequence may read and write the same slot (a long document
continuing in place), and any number of sequences may read one slot, but a slot written in a
pass is read by no *other* sequence of that pass (TorchOps would see the write, the kernels may not).

The model's norms and activations run as fused Triton kernels (`kev.ops.fused`): one read and
one write per tensor instead of a chain of fp32 elementwise passes.

Chunk indices (fla's varlen helpers; they sync with the host) are prepared once per `PassMeta`
and shared by every layer of the pass (cached by the meta object's identity). For CUDA graphs,
call `prepare(meta)` for each bucket before capture and keep that meta and its buffers static.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

from kev.ops.attention.paged_prefix import paged_prefix_attention, paged_store, query_block, split_mode
from kev.ops.conv.indexed_conv import CONV_CHUNK, indexed_causal_conv
from kev.ops.delta_rule.indexed_scan import CHUNK, indexed_chunk_gated_delta_rule
from kev.ops.fused import activations, norms
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta

assert CONV_CHUNK == CHUNK, "conv and scan share one chunk_indices"


@dataclass(frozen=True, eq=False)
class PassIndices:
    """Device index tensors derived from a pass's cu_seqlens (shared by all layers)."""

    chunks: torch.Tensor  # [NT, 2] (sequence, chunk) for chunks of CHUNK tokens
    chunk_offsets: torch.Tensor  # [N + 1] first chunk of each sequence
    attn_chunks: dict[int, torch.Tensor]  # query block size -> [NTq, 2]

    def attention_chunks(self, cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
        if block not in self.attn_chunks:
            self.attn_chunks[block] = prepare_chunk_indices(cu_seqlens, block)
        return self.attn_chunks[block]


def split_attention(meta: PassMeta, num_tokens: int) -> bool:
    """Paged attention's split mode for a pass of one request's rows (kev.ops.attention.paged_prefix),
    chosen by the pass's class: the one it is tuned under, so the split kernels' configs are warmed."""
    return split_mode(meta.pass_class(num_tokens))


class TritonOps:
    name = "triton"

    # The elementwise steps as fused kernels (kev.ops.fused; reference: kev.ops.fused.reference).
    rms_norm = staticmethod(norms.rms_norm)
    add_rms_norm = staticmethod(norms.add_rms_norm)
    rms_norm_rope = staticmethod(norms.rms_norm_rope)
    gated_rms_norm = staticmethod(norms.gated_rms_norm)
    silu_mul = staticmethod(activations.silu_mul)

    def __init__(self) -> None:
        self._indices: weakref.WeakKeyDictionary[PassMeta, PassIndices] = weakref.WeakKeyDictionary()

    def prepare(self, meta: PassMeta) -> PassIndices:
        """Chunk indices for `meta` (one host sync on first use, then cached for the pass)."""
        idx = self._indices.get(meta)
        if idx is None:
            cu = meta.cu_seqlens
            idx = PassIndices(chunks=prepare_chunk_indices(cu, CHUNK), chunk_offsets=prepare_chunk_offsets(cu, CHUNK),
                              attn_chunks={})
            self._indices[meta] = idx
        return idx

    def pin(self, meta: PassMeta, indices: PassIndices) -> None:
        """Use `indices` for `meta` from now on (a CUDA-graph bucket's static chunk lists, whose
        `cu_seqlens` changes in place between replays: never derive them from it)."""
        self._indices[meta] = indices

    def causal_conv(self, x, weight, meta: PassMeta, conv_pool, split=None, out=None):
        return indexed_causal_conv(x=x, weight=weight, cu_seqlens=meta.cu_seqlens, conv_pool=conv_pool,
                                   read_slots=meta.read_slots, write_slots=meta.write_slots,
                                   chunk_indices=self.prepare(meta).chunks, split=split, out=out)

    def gated_delta_rule(self, q, k, v, gates: DeltaGates, meta: PassMeta, state_pool):
        idx = self.prepare(meta)
        return indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=meta.cu_seqlens,
                                              state_pool=state_pool, read_slots=meta.read_slots,
                                              write_slots=meta.write_slots, chunk_indices=idx.chunks,
                                              chunk_offsets=idx.chunk_offsets, phases=meta.phases)

    def attention(self, q, k, v, meta: PassMeta, key_pages, value_pages, gate=None, out=None):
        chunks = self.prepare(meta).attention_chunks(meta.cu_seqlens, query_block(q.shape[1] // k.shape[1]))
        return paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                                      key_pages=key_pages, value_pages=value_pages, block_table=meta.block_table,
                                      write_slots=meta.write_slots, chunk_indices=chunks,
                                      split=split_attention(meta, q.shape[0]), gate=gate, out=out)

    def store_kv(self, k, v, meta: PassMeta, key_pages, value_pages, group: int):
        chunks = self.prepare(meta).attention_chunks(meta.cu_seqlens, query_block(group))
        paged_store(k, v, meta.cu_seqlens, meta.prefix_lens, key_pages, value_pages, meta.block_table,
                    meta.write_slots, chunk_indices=chunks, group=group)
