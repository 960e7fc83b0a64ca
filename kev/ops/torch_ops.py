"""`TorchOps`: the float32 reference implementation of the ops interface (the CPU engine path).

A loop over sequences with plain torch maths; per-sequence work keeps every answer independent
of what else shares the pass. Norms and activations are `kev.ops.fused.reference`. States are read from and written to the pools by slot index.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kev.ops.utils import channel_blocks
from kev.ops.delta_rule.chunk_torch import chunk_gated_delta_rule
from kev.ops.fused.reference import ReferenceElementwise, gated_output
from kev.ops.attention.naive import paged_attention_reference, store_own
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta

def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class TorchOps(ReferenceElementwise):
    """Norms and activations: exactly the reference maths (kev.ops.invariant activations)."""

    name = "torch"

    def causal_conv(self, x, weight, meta: PassMeta, conv_pool, split=None, out=None):
        W = weight.shape[1]
        y = torch.empty_like(x)
        for n, s, e, read, write, _ in meta.host.seqs():
            if read >= 0:
                start = conv_pool[read].to(x.dtype)  # [C, W-1]
            else:
                start = x.new_zeros(x.shape[1], W - 1)
            full = torch.cat([start, x[s:e].t()], dim=1)  # [C, W-1+L]
            if e > s:  # an empty sequence (a CUDA-graph bucket's padding) only carries its state over
                conv = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]  # [C, L]
                y[s:e] = F.silu(conv).t()
            if write >= 0:
                conv_pool[write] = full[:, full.shape[1] - (W - 1):].to(conv_pool.dtype).detach()
        return channel_blocks(y, split, out)

    def gated_delta_rule(self, q, k, v, gates: DeltaGates, meta: PassMeta, state_pool):
        HV, K = v.shape[1], q.shape[2]
        g, beta = gates.values()
        group = HV // q.shape[1]
        q = l2_normalize(q.float()).repeat_interleave(group, dim=1) * K**-0.5
        k = l2_normalize(k.float()).repeat_interleave(group, dim=1)
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for n, s, e, read, write, _ in meta.host.seqs():
            if read >= 0:
                start = state_pool[read]
            else:
                start = torch.zeros(state_pool.shape[1:], dtype=torch.float32, device=v.device)
            o, final = chunk_gated_delta_rule(q[s:e], k[s:e], v[s:e].float(), g[s:e], beta[s:e].float(), start)
            out[s:e] = o
            if write >= 0:
                state_pool[write] = final.detach()
        return out.to(v.dtype)

    def attention(self, q, k, v, meta: PassMeta, key_pages, value_pages, gate=None, out=None):
        return gated_output(paged_attention_reference(q, k, v, meta, key_pages, value_pages), gate, out)

    def store_kv(self, k, v, meta: PassMeta, key_pages, value_pages, group=1):
        tables = meta.block_table.tolist()
        for n, s, e, _, write, prefix in meta.host.seqs():
            if write >= 0:
                store_own(k[s:e], v[s:e], tables[n], prefix, key_pages, value_pages)
