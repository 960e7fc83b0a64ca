"""Varlen causal depthwise convolution + silu that starts from the bank's conv states by slot index.

A pass packs N sequences back to back (`cu_seqlens`). Sequence n continues the conv state in
`conv_pool[read_slots[n]]` (its previous W-1 inputs; zeros when the index is negative) and, when
`write_slots[n] >= 0`, leaves its own last W-1 inputs in `out_pool[write_slots[n]]`. Nothing is
gathered or copied: the kernel reads and writes the pools in place through their strides, so a
pool that is a strided view of a larger buffer (shared memory, CUDA IPC) works as it is.

The grid runs over (channel block, chunk of BT tokens of one sequence); a program walks its chunk
in steps of BS tokens (a small register tile: no spills). The first W-1 outputs of a sequence,
the only ones whose window reaches into the start state, are computed by a separate head step of
its chunk-0 program, which also does the final-state write, after a barrier: a sequence may read and write the same slot (a long document continuing in its slot).
Two *different* sequences of one pass must not read and write the same slot.

The output may be split by channel into two contiguous blocks (`split`): channels [0, split) as
[T, split], the rest as [T, C - split], back to back in one buffer. The model splits q,k from v
this way: fla's WY recompute needs v contiguous, and a column view of one [T, C] output cost a
copy of v per DeltaNet layer (0.7 ms of a 35.8 ms busy row pass on the H200, 1.8% of the GPU time).

Reference: `naive.causal_conv_reference` (and `TorchOps.causal_conv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.index import prepare_chunk_indices

from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import chunk_entry, preserve_written_slots, shape_class

CONV_CHUNK = 64  # tokens per program: the same chunking as the delta rule, so one chunk_indices serves both

# BS tokens per inner step keep the register tile small: a [64, BC] fp32 tile per tap spilled
# (255 registers, 1.2 KB of stack at BC 128) and ran ~10x slower than the memory traffic allows.
# The tile steps load every input row once per tap (W loads of [BS, BC], each with its own pointers
# and masks): 34 SASS instructions an output element at BC 64, BS 64 (sm_90), enough that Nsight
# Compute found the kernel issue-bound beside its DRAM traffic (66% SM, 68% DRAM, H100, session 36)
# and 11% slower in the power-limited pass than alone. ROLL configs (kernel size 4 only) walk the
# chunk four rows a step and carry the window's three earlier rows in registers: each input row is
# loaded once, 21-23 instructions an element (compiled for sm_90 on the CPU; not timed yet). Every
# config computes each output element with the same maths in the same order (the taps accumulated
# from zero, tap 0 first, then silu): all are bit-identical.
CONV_CONFIGS = [
    triton.Config({"BC": BC, "BS": BS}, num_warps=num_warps)
    for BC, BS, num_warps in [(128, 32, 4), (256, 16, 4), (256, 32, 8), (64, 64, 4), (512, 16, 8), (128, 16, 2)]
] + [
    triton.Config({"BC": BC, "BS": 1, "ROLL": True}, num_warps=num_warps)  # BS unused
    for BC, num_warps in [(256, 1), (512, 2), (1024, 4), (512, 4)]  # 8 inputs (16 bytes) a thread a row, then 4
]
CONV_CONFIGS_ALL = CONV_CONFIGS  # every config, also under the interpreter (tests run them by name)
if triton.knobs.runtime.interpret:  # the autotuner cannot benchmark without a GPU: pin one config
    CONV_CONFIGS = CONV_CONFIGS[:1]


def _rolling_needs_four_taps(configs, named_args, **kwargs):
    """ROLL configs hold a window of exactly three earlier rows: kernel size 4 (Qwen3.5's) only."""
    return [c for c in configs if kwargs["W"] == 4 or not c.kwargs.get("ROLL", False)]


@triton.jit
def _tile_rows(p_x, weight, p_head, p_tail, o_c, m_c, m_head, m_tail, t0, n_tok, n_head, SPLIT, C,
               stride_x_t, stride_x_c, stride_w_c, stride_w_w, W: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):
    """The chunk's outputs in steps of BS rows, each tap's inputs loaded as one [BS, BC] tile. Rows
    before the sequence's start read as zeros; the outputs that read them (s < n_head) are the head
    step's and are not stored here."""
    for s0 in range(0, n_tok, BS):
        o_s = s0 + tl.arange(0, BS)  # [BS] token inside the chunk
        m_s = o_s < n_tok
        b_y = tl.zeros([BS, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            b_w = tl.load(weight + o_c * stride_w_c + j * stride_w_w, mask=m_c, other=0.0).to(tl.float32)  # [BC]
            o_p = o_s - (W - 1) + j  # [BS] input token inside the chunk (< 0: the previous chunk)
            m_x = m_s & (t0 + o_p >= 0)
            b_x = tl.load(p_x + o_p[:, None] * stride_x_t + o_c[None, :] * stride_x_c,
                          mask=m_x[:, None] & m_c[None, :], other=0.0).to(tl.float32)  # [BS, BC]
            b_y += b_x * b_w[None, :]
        b_y = b_y / (1.0 + tl.exp(-b_y))  # silu
        m_y = m_s & (o_s >= n_head)
        b_y = b_y.to(p_head.dtype.element_ty)
        tl.store(p_head[None, :] + o_s[:, None] * SPLIT, b_y, mask=m_y[:, None] & m_head[None, :])
        tl.store(p_tail[None, :] + o_s[:, None] * (C - SPLIT), b_y, mask=m_y[:, None] & m_tail[None, :])


@triton.jit
def _tap_sum(b_a, b_b, b_c, b_d, b_w0, b_w1, b_w2, b_w3):
    """silu of one output row from its four input rows, oldest first: `_tile_rows`' sum in its order
    (from zero, tap 0 first) and its silu, so the same bits."""
    b_y = tl.zeros_like(b_w0)
    b_y += b_a * b_w0
    b_y += b_b * b_w1
    b_y += b_c * b_w2
    b_y += b_d * b_w3
    return b_y / (1.0 + tl.exp(-b_y))  # silu


@triton.jit
def _rolling_rows(p_x, weight, p_head, p_tail, o_c, m_c, m_head, m_tail, t0, n_tok, n_head, SPLIT, C,
                  stride_x_t, stride_x_c, stride_w_c, stride_w_w, W: tl.constexpr):
    """The chunk's outputs four rows a step (ROLL configs): each input row is loaded once, the
    window's three rows before a step carried in registers. Rows before the sequence's start read as
    zeros, as in `_tile_rows`; rows past the chunk's end are neither read nor stored. A chunk with no
    rows (a CUDA-graph key's no-op entries, far past the pass's last token) reads nothing at all."""
    tl.static_assert(W == 4, "the rolling window holds the three rows before the current one")
    DT: tl.constexpr = p_head.dtype.element_ty
    b_w0 = tl.load(weight + o_c * stride_w_c, mask=m_c, other=0.0).to(tl.float32)
    b_w1 = tl.load(weight + o_c * stride_w_c + stride_w_w, mask=m_c, other=0.0).to(tl.float32)
    b_w2 = tl.load(weight + o_c * stride_w_c + 2 * stride_w_w, mask=m_c, other=0.0).to(tl.float32)
    b_w3 = tl.load(weight + o_c * stride_w_c + 3 * stride_w_w, mask=m_c, other=0.0).to(tl.float32)
    p_row = p_x + o_c * stride_x_c  # [BC] the chunk's first row
    # the window before the chunk, only where the chunk has rows: a no-op entry's "previous rows" lie
    # past the pass's end (a081b28's preload faulted the bank's first graph capture, e76b9e0 on an H100)
    m_w = m_c & (n_tok > 0)
    b_x3 = tl.load(p_row - 3 * stride_x_t, mask=m_w & (t0 >= 3), other=0.0).to(tl.float32)
    b_x2 = tl.load(p_row - 2 * stride_x_t, mask=m_w & (t0 >= 2), other=0.0).to(tl.float32)
    b_x1 = tl.load(p_row - stride_x_t, mask=m_w & (t0 >= 1), other=0.0).to(tl.float32)
    for s in range(0, n_tok, 4):
        b_a = tl.load(p_row + s * stride_x_t, mask=m_c, other=0.0).to(tl.float32)  # s < n_tok
        b_b = tl.load(p_row + (s + 1) * stride_x_t, mask=m_c & (s + 1 < n_tok), other=0.0).to(tl.float32)
        b_c = tl.load(p_row + (s + 2) * stride_x_t, mask=m_c & (s + 2 < n_tok), other=0.0).to(tl.float32)
        b_d = tl.load(p_row + (s + 3) * stride_x_t, mask=m_c & (s + 3 < n_tok), other=0.0).to(tl.float32)
        b_y = _tap_sum(b_x3, b_x2, b_x1, b_a, b_w0, b_w1, b_w2, b_w3).to(DT)
        tl.store(p_head + s * SPLIT, b_y, mask=m_head & (s >= n_head))
        tl.store(p_tail + s * (C - SPLIT), b_y, mask=m_tail & (s >= n_head))
        b_y = _tap_sum(b_x2, b_x1, b_a, b_b, b_w0, b_w1, b_w2, b_w3).to(DT)
        keep = (s + 1 >= n_head) & (s + 1 < n_tok)
        tl.store(p_head + (s + 1) * SPLIT, b_y, mask=m_head & keep)
        tl.store(p_tail + (s + 1) * (C - SPLIT), b_y, mask=m_tail & keep)
        b_y = _tap_sum(b_x1, b_a, b_b, b_c, b_w0, b_w1, b_w2, b_w3).to(DT)
        keep = (s + 2 >= n_head) & (s + 2 < n_tok)
        tl.store(p_head + (s + 2) * SPLIT, b_y, mask=m_head & keep)
        tl.store(p_tail + (s + 2) * (C - SPLIT), b_y, mask=m_tail & keep)
        b_y = _tap_sum(b_a, b_b, b_c, b_d, b_w0, b_w1, b_w2, b_w3).to(DT)
        keep = (s + 3 >= n_head) & (s + 3 < n_tok)
        tl.store(p_head + (s + 3) * SPLIT, b_y, mask=m_head & keep)
        tl.store(p_tail + (s + 3) * (C - SPLIT), b_y, mask=m_tail & keep)
        b_x3, b_x2, b_x1 = b_b, b_c, b_d


@triton.jit(do_not_specialize=["N_CLASS", "T_CLASS"])
def indexed_conv_fwd_kernel(
    x,  # [T, C] any strides
    weight,  # [C, W]
    y,  # output: [T, SPLIT] then [T, C - SPLIT], each contiguous, back to back (SPLIT = C: one [T, C])
    conv_pool,  # [S, C, W-1] read by read_slots
    out_pool,  # [S', C, W-1] written by write_slots
    read_slots,  # [N]
    write_slots,  # [N]
    cu_seqlens,  # [N + 1]
    chunk_indices,  # [NT, 2] (sequence, chunk within it)
    C,
    SPLIT,  # channels of the output's first block
    TAIL_BASE,  # where the second block starts, counted from y (T x SPLIT in a new output);
    # specialised: % 16 lets the tail store vectorise
    stride_x_t, stride_x_c,
    stride_w_c, stride_w_w,
    stride_p_s, stride_p_c, stride_p_w,
    stride_q_s, stride_q_c, stride_q_w,
    N_CLASS, T_CLASS,  # shape-class autotune keys only (unused in the body)
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W - 1
    BT: tl.constexpr,  # tokens per chunk (one program)
    BS: tl.constexpr,  # tokens per inner step
    BC: tl.constexpr,
    ROLL: tl.constexpr = False,  # four rows a step, the window's earlier rows in registers (W == 4)
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_c, i_ct = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, L = chunk_entry(chunk_indices, cu_seqlens, i_ct)

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    t0 = i_t * BT  # first token of the chunk inside the sequence
    n_tok = tl.minimum(L - t0, BT).to(tl.int32)  # tokens of this chunk
    p_x = x + (bos + t0) * stride_x_t  # chunk base; tile offsets below stay int32
    # The chunk's first row in each output block. Each block is stored with its own scalar row
    # stride, masked to its channels: a per-channel stride vector (one store) defeats the store
    # vectorisation and cost the conv 1.2-1.3x on the H200.
    m_head, m_tail = m_c & (o_c < SPLIT), m_c & (o_c >= SPLIT)
    p_head = y + (bos + t0) * SPLIT + o_c  # [BC]
    p_tail = y + TAIL_BASE + (bos + t0) * (C - SPLIT) + (o_c - SPLIT)  # [BC]
    # The sequence's first W-1 outputs also read its start state: the head step below owns them.
    n_head = tl.where(i_t == 0, W - 1, 0)

    if ROLL:
        _rolling_rows(p_x, weight, p_head, p_tail, o_c, m_c, m_head, m_tail, t0, n_tok, n_head, SPLIT, C,
                      stride_x_t, stride_x_c, stride_w_c, stride_w_w, W)
    else:
        _tile_rows(p_x, weight, p_head, p_tail, o_c, m_c, m_head, m_tail, t0, n_tok, n_head, SPLIT, C,
                   stride_x_t, stride_x_c, stride_w_c, stride_w_w, W, BS, BC)

    b_read = tl.load(read_slots + i_n).to(tl.int64)
    p_start = conv_pool + tl.maximum(b_read, 0) * stride_p_s + o_c * stride_p_c  # [BC]
    if i_t == 0:
        # head: the first W-1 outputs, whose window reaches into the start state, a row at a time (a
        # [W-1, BC] fp32 tile per tap held 220 registers at 4 channels a thread). An input is the
        # sum of the sequence's input and the start state's, one of them zero, as in the tile it
        # replaced; every config runs this same code, so all give the same bits.
        for r in tl.static_range(W - 1):
            b_y = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(W):
                b_w = tl.load(weight + o_c * stride_w_c + j * stride_w_w, mask=m_c, other=0.0).to(tl.float32)  # [BC]
                pos = r - (W - 1) + j  # (constexpr) input position inside the sequence; < 0: the start state
                if pos >= 0:
                    b_in = tl.load(p_x + pos * stride_x_t + o_c * stride_x_c, mask=m_c & (r < L),
                                   other=0.0).to(tl.float32) + 0.0
                else:
                    b_in = 0.0 + tl.load(p_start + (pos + W - 1) * stride_p_w, mask=m_c & (r < L) & (b_read >= 0),
                                         other=0.0).to(tl.float32)
                b_y += b_in * b_w
            b_y = b_y / (1.0 + tl.exp(-b_y))  # silu
            b_y = b_y.to(y.dtype.element_ty)
            tl.store(p_head + r * SPLIT, b_y, mask=m_head & (r < L))
            tl.store(p_tail + r * (C - SPLIT), b_y, mask=m_tail & (r < L))

        # the sequence's last W-1 inputs; with L < W-1 part of them is still the start state
        o_w = tl.arange(0, WP)
        b_write = tl.load(write_slots + i_n).to(tl.int64)
        f_pos = L - (W - 1) + o_w  # [WP]
        m_w = (o_w < W - 1) & (b_write >= 0)
        p_fx = x + (bos + f_pos)[:, None] * stride_x_t + o_c[None, :] * stride_x_c
        b_f = tl.load(p_fx, mask=(m_w & (f_pos >= 0))[:, None] & m_c[None, :], other=0.0)  # [WP, BC]
        p_fs = p_start[None, :] + (f_pos + W - 1)[:, None] * stride_p_w
        m_fs = m_w & (f_pos < 0) & (b_read >= 0)
        b_f += tl.load(p_fs, mask=m_fs[:, None] & m_c[None, :], other=0.0).to(b_f.dtype)
        tl.debug_barrier()  # every read of the start state is done before the (maybe same) slot is written
        p_q = out_pool + tl.maximum(b_write, 0) * stride_q_s + o_c[None, :] * stride_q_c + o_w[:, None] * stride_q_w
        tl.store(p_q, b_f.to(out_pool.dtype.element_ty), mask=m_w[:, None] & m_c[None, :])


_tuned_conv_kernel = triton.autotune(configs=CONV_CONFIGS, key=["C", "N_CLASS", "T_CLASS"],
                                     prune_configs_by={"early_config_prune": _rolling_needs_four_taps},
                                     **dict(zip(("pre_hook", "post_hook"), preserve_written_slots(
                                         "out_pool", "write_slots"))))(indexed_conv_fwd_kernel)


def indexed_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_pool: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    out_pool: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    config: triton.Config | None = None,
    split: int | None = None,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(causal depthwise conv(x)) per sequence, starting from bank conv states by index.

    x:             [T, C] packed inputs, any dtype and strides (a column slice of a fused projection is fine)
    weight:        [C, W] conv taps (kernel size W >= 2)
    cu_seqlens:    [N + 1] int sequence offsets into x
    conv_pool:     [S, C, W-1] the last W-1 inputs of each stored sequence; any strides, read in place
    read_slots:    [N] int, start state slot per sequence (-1: zeros)
    write_slots:   [N] int, slot that receives the sequence's last W-1 inputs (-1: none)
    out_pool:      [S', C, W-1] pool written through write_slots (default: conv_pool)
    chunk_indices: [NT, 2] (sequence, chunk) pairs for chunks of CONV_CHUNK tokens
                   (fla's `prepare_chunk_indices(cu_seqlens, 64)`; computed, with a host sync, when None)
    config:        run this one config instead of the autotuner (tests of every config)
    split:         None: return y [T, C]; s in [0, C]: return (y[:, :s], y[:, s:]), each contiguous
                   (the same values: only where they are stored differs)
    out:           where to store y (default: new), as returned: [T, C], or with `split` the two
                   blocks, each contiguous, the second after the first in one allocation (token
                   slices of a whole sweep's blocks: each phase's conv writes its rows of them)
    Returns y: [T, C] contiguous (or the two blocks), x's dtype.
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, C], got {tuple(x.shape)}")
    T, C = x.shape
    if weight.ndim != 2 or weight.shape[0] != C or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C={C}, W>=2], got {tuple(weight.shape)}")
    W = weight.shape[1]
    out_pool = conv_pool if out_pool is None else out_pool
    for name, pool in (("conv_pool", conv_pool), ("out_pool", out_pool)):
        if pool.ndim != 3 or tuple(pool.shape[1:]) != (C, W - 1):
            raise ValueError(f"{name} must be [S, C={C}, W-1={W - 1}], got {tuple(pool.shape)}")
    N = read_slots.shape[0]
    if read_slots.shape != (N,) or write_slots.shape != (N,) or cu_seqlens.shape != (N + 1,):
        raise ValueError(f"read_slots {tuple(read_slots.shape)}, write_slots {tuple(write_slots.shape)} must be [N] "
                         f"and cu_seqlens {tuple(cu_seqlens.shape)} [N + 1]")
    # index tensors (never the pools) must be contiguous: a strided index view costs a tiny copy
    read_slots, write_slots, cu_seqlens = read_slots.contiguous(), write_slots.contiguous(), cu_seqlens.contiguous()
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, CONV_CHUNK)
    chunk_indices = chunk_indices.contiguous()
    if chunk_indices.ndim != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(f"chunk_indices must be [NT, 2], got {tuple(chunk_indices.shape)}")
    if split is not None and not 0 <= split <= C:
        raise ValueError(f"split must be in [0, C={C}], got {split}")
    S = C if split is None else split
    if out is None:
        flat = torch.empty(T * C, dtype=x.dtype, device=x.device)
        head, tail = flat[: T * S].view(T, S), flat[T * S :].view(T, C - S)
    else:
        head, tail = (out, out[:, C:]) if split is None else out
        for block, width in ((head, S), (tail, C - S)):
            if tuple(block.shape) != (T, width) or block.dtype != x.dtype or not block.is_contiguous():
                raise ValueError(f"out block {tuple(block.shape)} {block.dtype} must be a contiguous [{T}, {width}] "
                                 f"{x.dtype}")
        if C > S and tail.data_ptr() < head.data_ptr() + T * S * head.element_size():
            raise ValueError("out's second block must lie after its first in one allocation")
    tail_base = (tail.data_ptr() - head.data_ptr()) // head.element_size() if C > S else T * S
    y = head if split is None else (head, tail)
    NT = chunk_indices.shape[0]
    if NT == 0 or C == 0:
        return y
    n_class, t_class = shape_class(N, T)
    args = (x, weight, head, conv_pool, out_pool, read_slots, write_slots, cu_seqlens, chunk_indices, C, S, tail_base,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *conv_pool.stride(), *out_pool.stride(),
            n_class, t_class)
    meta = dict(W=W, WP=triton.next_power_of_2(W - 1), BT=CONV_CHUNK)

    def grid(m):
        return (triton.cdiv(C, m["BC"]), NT)

    if config is None:
        _tuned_conv_kernel[grid](*args, **meta, **launch_options())
    else:
        indexed_conv_fwd_kernel[grid](*args, **meta, **config.all_kwargs(), **launch_options())
    return y
