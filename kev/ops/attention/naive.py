"""Paged prefix attention, one sequence at a time in plain torch: the maths the Triton kernel in
`paged_prefix.py` is checked against, and what `TorchOps` (the CPU path) runs.

A sequence continuing a stored prefix of P tokens attends to the prefix's keys/values (read from
its pages through the block table) and causally to its own L tokens; query position i sees
prefix + i + 1 keys. Scores in fp32, softmax, GQA by repeating each K/V head over its query group.
"""

from __future__ import annotations

import torch

from kev.ops.meta import PassMeta

QUERY_BLOCK = 256  # query rows per score matrix: keeps it small for 64k-token prefixes


def paged_attention_reference(q, k, v, meta: PassMeta, key_pages, value_pages) -> torch.Tensor:
    """Causal GQA attention of each packed sequence [s, e) over its stored prefix (the first `prefix`
    positions of its pages) and itself; q [T, Hq, D], k and v [T, Hkv, D], pages [blocks, BS, Hkv, D].
    Writes the sequence's own K/V into its pages when it has a write slot."""
    Hq, D = q.shape[1], q.shape[2]
    group = Hq // k.shape[1]
    BS = key_pages.shape[1]
    out = torch.empty_like(q)
    tables = meta.block_table.tolist()
    for n, s, e, read, write, prefix in meta.host.seqs():
        L = e - s
        pages = [p for p in tables[n][: (prefix + L + BS - 1) // BS]]
        if prefix > 0:
            idx = torch.tensor(pages[: (prefix + BS - 1) // BS], device=q.device)
            pk = key_pages[idx].flatten(0, 1)[:prefix].to(q.dtype)  # [prefix, Hkv, D]
            pv = value_pages[idx].flatten(0, 1)[:prefix].to(q.dtype)
            keys, values = torch.cat([pk, k[s:e]]), torch.cat([pv, v[s:e]])
        else:
            keys, values = k[s:e], v[s:e]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, P+L, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        # Query blocks keep the score matrix small for 64k-token documents.
        for b in range(0, L, QUERY_BLOCK):
            bl, visible = min(QUERY_BLOCK, L - b), prefix + min(b + QUERY_BLOCK, L)
            qb = q[s + b : s + b + bl].transpose(0, 1)  # [Hq, bl, D]
            scores = (qb @ keys[:, :visible].transpose(1, 2)).float() * D**-0.5  # [Hq, bl, visible]
            mask = torch.ones(bl, visible, dtype=torch.bool, device=q.device).tril(prefix + b)
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
            out[s + b : s + b + bl] = (probs @ values[:, :visible]).transpose(0, 1)
        if write >= 0:
            store_own(k[s:e], v[s:e], pages, prefix, key_pages, value_pages)
    return out


def store_own(k, v, pages: list[int], prefix: int, key_pages, value_pages) -> None:
    """One sequence's own K/V [L, Hkv, D] into its pages at positions prefix .. prefix + L - 1."""
    BS = key_pages.shape[1]
    pos = torch.arange(prefix, prefix + k.shape[0], device=k.device)
    page = torch.tensor(pages, device=k.device)[pos // BS]
    key_pages[page, pos % BS] = k.detach().to(key_pages.dtype)
    value_pages[page, pos % BS] = v.detach().to(value_pages.dtype)
