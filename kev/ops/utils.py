"""Helpers every kernel package shares: output buffers, the kernels' own autotune buckets, the
autotune hooks that keep a benchmark run from changing the bank, and the read of a chunk-list entry."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def chunk_entry(chunk_indices, cu_seqlens, i_ct):
    """(sequence, chunk within it, its first token, its length) of chunk-list entry i_ct (fla's
    `prepare_chunk_indices` layout: [NT, 2] pairs), int64."""
    i_n = tl.load(chunk_indices + i_ct * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_ct * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    return i_n, i_t, bos, tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos


def output_like(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A kernel's output buffer: `out` (checked: x's shape and dtype, contiguous, so the kernel's
    contiguous store fits it), or a new contiguous tensor like x."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous {tuple(x.shape)} {x.dtype}")
    return out


def channel_blocks(y: torch.Tensor, split: int | None, out=None):
    """`causal_conv`'s return for ops whose output is one [T, C] tensor: itself (split None), or
    its channels [0, split) and [split, C) as two views (only the GPU kernels need them contiguous);
    with `out` (as `causal_conv` returns it), y copied there."""
    blocks = y if split is None else (y[:, :split], y[:, split:])
    if out is None:
        return blocks
    for dst, src in zip((out,) if split is None else out, (blocks,) if split is None else blocks):
        output_like(src, dst).copy_(src)  # checked as the kernels check theirs
    return out


def shape_class(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """(sequence-count bucket, mean-length bucket): the autotune cache splits by these, so a
    tiny first call does not decide the config of wide passes (docs/design.md, autotune by shape class)."""
    return max(num_seqs - 1, 0).bit_length(), max(-(-num_tokens // max(num_seqs, 1)) - 1, 0).bit_length()


def preserve_written_slots(pool_arg: str, slots_arg: str):
    """Autotune (pre_hook, post_hook) that put back the slots a benchmark run overwrote.

    A sequence may read and write the same slot (a long document continuing in place); every
    benchmark run would otherwise start from the previous run's final state. Only the N written
    slots are saved (never the pool); a negative index saves and restores slot 0 unchanged."""

    def pre_hook(nargs, reset_only=False):
        if not reset_only:
            idx = nargs[slots_arg].clamp(min=0)
            nargs["_kev_saved_slots"] = (idx, nargs[pool_arg].index_select(0, idx))

    def post_hook(nargs, exception):
        idx, saved = nargs.pop("_kev_saved_slots")
        nargs[pool_arg].index_copy_(0, idx, saved)

    return pre_hook, post_hook
