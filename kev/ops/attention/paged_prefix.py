"""Varlen causal attention over each sequence's paged document prefix plus its own keys (GQA).

Sequence n has `prefix_lens[n]` tokens of its document already stored in the bank's K/V pages:
position p lives at `key_pages[read_table[n, p // BS], p % BS]`. Its own L tokens follow at
positions prefix .. prefix + L - 1 and attend causally to the prefix and to each other. Keys are
read straight from the pages by block table: no gather. When `write_slots[n] >= 0` the sequence's
own K/V are stored into its pages (`write_table[n]`) at positions prefix .. prefix + L - 1; those
pages are disjoint from the prefix pages the kernel reads, so reads and writes never race.

One program per (block of BM query tokens of one sequence, kv head, value split); the G = Hq / Hkv
query heads of the kv head are stacked into the rows of one tile (row r = token r // G, head r % G),
so every K/V tile feeds G heads. With NV value splits (tuned) each program computes the full scores
and accumulates BD / NV of the value features. Online softmax in fp32 (exp2), P rounded to V's dtype for the PV product
(the reference rounds probabilities to the activations' dtype too).

Split mode, for passes of one request's rows (the rows_few class): over a long document such a
pass has too few programs, each walking the whole prefix (5 rows x 32 tokens over 2,200 tokens:
80 programs of 70 key tiles, 138 us a layer on the H200, against ~2 us of K/V to read). There
the prefix is cut into PREFIX_SPANS spans of whole key tiles (sized from the prefix length alone):
one program per span stores its partial (max, sum, unnormalised output; `paged_prefix_span_kernel`),
then one program per query block merges the partials in span order and goes on over its own keys
(`paged_prefix_finish_kernel`). Its results differ from the one-program loop's in rounding, so the
mode follows the pass's class, which padding to a CUDA-graph bucket keeps and which kev and its
gathered variant share: replays equal eager passes and the two variants agree bit for bit.

Reference: the loop in `TorchOps.attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.index import prepare_chunk_indices

from kev.ops.fused.activations import times_sigmoid
from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.shapes import ShapeClass, classify_seqs
from kev.ops.utils import chunk_entry, output_like, shape_class

# BN is fixed per head dim (not tuned): a different key tile would change the online-softmax order
# and break bit-identical results across configs. NV (value splits) is tuned: NV programs of one
# query block compute the same scores and each accumulates BD / NV of the value features, so every
# output element sees the very same sums. At head dim 256 one program's [64, 256] fp32 accumulator,
# queries and K/V tiles spill (ptxas, sm_90: 255 registers, 1.9 KB spilled per thread at 4 warps,
# 1.1 KB at 8); NV = 2 at 8 warps spills 32 bytes, for the scores computed twice. NV = 4 is for few
# rows over a long prefix, where the programs are too few to fill the GPU (5 rows x 32 tokens over
# 2,200 tokens: 80 programs at NV = 2, 137 us a layer on the H200, against ~2 us of K/V to read).
ATTN_CONFIGS = [
    triton.Config({"NV": nv}, num_warps=num_warps, num_stages=num_stages)
    for nv in [1, 2, 4]
    for num_warps in [4, 8]
    for num_stages in [1, 2]
] + [triton.Config({"NV": nv}, num_warps=4, num_stages=3) for nv in [1, 2]]  # a third stage for long key walks
if triton.knobs.runtime.interpret:  # the autotuner cannot benchmark without a GPU: pin one config
    ATTN_CONFIGS = ATTN_CONFIGS[:1]

# Split mode's prefix spans: fixed, like BN (the merge order depends on it). 5 rows x 32 tokens over
# 2,200 then run 320-1,280 span programs (NV 1-4) of 9 key tiles. Its fp32 workspace is
# PREFIX_SPANS x T x Hq x D: 25 MB for 192 tokens at Kev-4B's 16 x 256, 134 MB for the class's
# widest pass (8 x 128); CUDA graphs share one pool.
PREFIX_SPANS = 8


def split_mode(cls: ShapeClass) -> bool:
    """Whether passes of class `cls` run split mode: one request's rows (rows_few)."""
    return cls is ShapeClass.ROWS_FEW


def query_block(group: int) -> int:
    """Query tokens per program: about 64 stacked rows (G heads per token), at least 16 tokens."""
    return max(16, 64 // triton.next_power_of_2(group))


@triton.jit
def _load_queries(q, bos, L, i_t, i_kvh, stride_q_t, stride_q_h, D: tl.constexpr, BD: tl.constexpr,
                  G: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr):
    """The block's stacked query rows [BR, BD] (row r: token r // G, head r % G), their tokens,
    heads and mask."""
    o_d = tl.arange(0, BD)  # q/k features: the scores use all of them
    o_r = tl.arange(0, BR)
    t_r = i_t * BM + o_r // G  # [BR] token index inside the sequence
    h_r = i_kvh * G + o_r % G  # [BR] query head
    m_r = (o_r < BM * G) & (t_r < L)
    p_q = q + (bos + t_r)[:, None] * stride_q_t + h_r[:, None] * stride_q_h + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & (o_d < D)[None, :], other=0.0)  # [BR, BD]
    return b_q, t_r, h_r, m_r


@triton.jit
def _softmax_step(b_q, b_m, b_l, b_acc, b_k, b_v, b_keep, qk_scale, MASKED: tl.constexpr):
    """One key tile into the online softmax: b_k [BD, BN], b_v [BN, BV]; `b_keep` [BR, BN] (only
    when MASKED) says which scores count. A tile of whole, visible keys skips the mask: the same
    sums, fewer instructions."""
    # [BR, BD] @ [BD, BN] -> [BR, BN]
    b_s = tl.dot(b_q, b_k) * qk_scale
    if MASKED:
        b_s = tl.where(b_keep, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_m_new[:, None])
    b_alpha = tl.exp2(b_m - b_m_new)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    # [BR, BN] @ [BN, BV] -> [BR, BV]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None])
    return b_m_new, b_l, b_acc


@triton.jit
def _load_kv(p_k, p_v, m_d, m_v, m_keys, MASKED: tl.constexpr):
    """A K tile [BD, BN] and a V tile [BN, BV]; MASKED: keys outside `m_keys` [BN] read as 0."""
    if MASKED:
        return tl.load(p_k, mask=m_d[:, None] & m_keys[None, :], other=0.0), \
            tl.load(p_v, mask=m_keys[:, None] & m_v[None, :], other=0.0)
    return tl.load(p_k, mask=m_d[:, None], other=0.0), tl.load(p_v, mask=m_v[None, :], other=0.0)


@triton.jit
def _prefix_tiles(b_q, b_m, b_l, b_acc, key_pages, value_pages, p_rt, lo, hi, end, i_kvh, o_v, qk_scale,
                  stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s, stride_vp_h,
                  D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    """Prefix key tiles from lo to hi (steps of BN), page by page through the block table row
    `p_rt`; keys at `end` or later are masked (MASKED tiles only)."""
    o_d = tl.arange(0, BD)
    m_d, m_v = o_d < D, o_v < D
    o_n = tl.arange(0, BN)
    for start in range(lo, hi, BN):
        o_p = start + o_n
        m_p = o_p < end
        if MASKED:
            b_page = tl.load(p_rt + o_p // BS, mask=m_p, other=0).to(tl.int64)  # [BN]
        else:
            b_page = tl.load(p_rt + o_p // BS).to(tl.int64)
        p_k = key_pages + b_page[None, :] * stride_kp_b + (o_p % BS)[None, :] * stride_kp_s \
            + i_kvh * stride_kp_h + o_d[:, None]
        p_v = value_pages + b_page[:, None] * stride_vp_b + (o_p % BS)[:, None] * stride_vp_s \
            + i_kvh * stride_vp_h + o_v[None, :]
        b_k, b_v = _load_kv(p_k, p_v, m_d, m_v, m_p, MASKED)
        b_m, b_l, b_acc = _softmax_step(b_q, b_m, b_l, b_acc, b_k, b_v, m_p[None, :], qk_scale, MASKED)
    return b_m, b_l, b_acc


@triton.jit
def _prefix_keys(b_q, b_m, b_l, b_acc, key_pages, value_pages, p_rt, lo, hi, i_kvh, o_v, qk_scale,
                 stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s, stride_vp_h,
                 D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
    """The online softmax (b_m, b_l, b_acc) continued over prefix keys [lo, hi): the whole tiles
    unmasked, then the last, partial one masked."""
    full = lo + (hi - lo) // BN * BN  # callers keep lo <= hi (`_span`)
    b_m, b_l, b_acc = _prefix_tiles(b_q, b_m, b_l, b_acc, key_pages, value_pages, p_rt, lo, full, hi, i_kvh, o_v,
                                    qk_scale, stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s,
                                    stride_vp_h, D, BD, BS, BN, False)
    return _prefix_tiles(b_q, b_m, b_l, b_acc, key_pages, value_pages, p_rt, full, hi, hi, i_kvh, o_v, qk_scale,
                         stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s, stride_vp_h,
                         D, BD, BS, BN, True)


@triton.jit
def _own_tiles(b_q, b_m, b_l, b_acc, k, v, bos, L, lo, hi, t_r, i_kvh, o_v, qk_scale,
               stride_k_t, stride_k_h, stride_v_t, stride_v_h,
               D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr):
    """Own key tiles from lo to hi (steps of BN); MASKED tiles drop keys past L or after the query."""
    o_d = tl.arange(0, BD)
    m_d, m_v = o_d < D, o_v < D
    o_n = tl.arange(0, BN)
    for start in range(lo, hi, BN):
        o_j = start + o_n
        m_j = o_j < L
        p_k = k + (bos + o_j)[None, :] * stride_k_t + i_kvh * stride_k_h + o_d[:, None]
        p_v = v + (bos + o_j)[:, None] * stride_v_t + i_kvh * stride_v_h + o_v[None, :]
        b_k, b_v = _load_kv(p_k, p_v, m_d, m_v, m_j, MASKED)
        b_keep = m_j[None, :] & (o_j[None, :] <= t_r[:, None])
        b_m, b_l, b_acc = _softmax_step(b_q, b_m, b_l, b_acc, b_k, b_v, b_keep, qk_scale, MASKED)
    return b_m, b_l, b_acc


@triton.jit
def _own_keys(b_q, b_m, b_l, b_acc, k, v, bos, L, i_t, t_r, i_kvh, o_v, qk_scale,
              stride_k_t, stride_k_h, stride_v_t, stride_v_h,
              D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The online softmax continued over the sequence's own keys, causally: the tiles wholly before
    the block's first query token and L unmasked (every key there exists and is seen by every
    query), then the diagonal tiles masked."""
    hi = tl.minimum((i_t + 1) * BM, L)
    # min with L: unmasked keys past the tokens were d71f63f's crash (blocks past a sequence's end
    # now read as L = 0 in `_block`; the guard stays for any caller's list).
    full = tl.minimum(i_t * BM, L) // BN * BN
    b_m, b_l, b_acc = _own_tiles(b_q, b_m, b_l, b_acc, k, v, bos, L, 0, full, t_r, i_kvh, o_v, qk_scale,
                                 stride_k_t, stride_k_h, stride_v_t, stride_v_h, D, BD, BN, False)
    return _own_tiles(b_q, b_m, b_l, b_acc, k, v, bos, L, full, hi, t_r, i_kvh, o_v, qk_scale,
                      stride_k_t, stride_k_h, stride_v_t, stride_v_h, D, BD, BN, True)


@triton.jit
def _finish(b_m, b_l, b_acc, o, gate, t_r, h_r, m_r, o_v, bos, L, i_n, i_t, i_kvh, prefix, k, v,
            out_key_pages, out_value_pages, write_table, write_slots,
            stride_k_t, stride_k_h, stride_v_t, stride_v_h,
            stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n,
            stride_g_t, stride_g_h,
            HQ: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, GATED: tl.constexpr):
    """Normalise and store the output (GATED: times sigmoid(gate), the attention output gate, with
    `sigmoid_mul`'s roundings: the same bits as that kernel after this one); store the block's own
    K/V into its pages, once per (token, kv head, feature slice)."""
    m_v = o_v < D
    m_o = m_r[:, None] & m_v[None, :]
    DT: tl.constexpr = o.dtype.element_ty
    b_o = (b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]).to(DT)
    if GATED:
        b_g = tl.load(gate + (bos + t_r)[:, None] * stride_g_t + h_r[:, None] * stride_g_h + o_v[None, :], mask=m_o,
                      other=0.0).to(tl.float32)
        b_o = times_sigmoid(b_o.to(tl.float32), b_g, DT)
    p_o = o + (bos + t_r)[:, None] * (HQ * D) + h_r[:, None] * D + o_v[None, :]
    tl.store(p_o, b_o, mask=m_o)

    _store_own_kv(k, v, out_key_pages, out_value_pages, write_table, write_slots, bos, L, i_n, i_t, i_kvh,
                  prefix, o_v, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_okp_b, stride_okp_s,
                  stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n, D, BS, BM)


@triton.jit
def _store_own_kv(k, v, out_key_pages, out_value_pages, write_table, write_slots, bos, L, i_n, i_t, i_kvh,
                  prefix, o_v, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                  stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n,
                  D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr):
    """The block's own K/V (features o_v of kv head i_kvh) into its pages at positions prefix..,
    when its sequence writes (write_slots[i_n] >= 0)."""
    m_v = o_v < D
    b_write = tl.load(write_slots + i_n)
    o_tw = i_t * BM + tl.arange(0, BM)
    m_tw = (o_tw < L) & (b_write >= 0)
    pos = prefix + o_tw
    b_wpage = tl.load(write_table + i_n * stride_wt_n + pos // BS, mask=m_tw, other=0).to(tl.int64)
    m_kv = m_tw[:, None] & m_v[None, :]
    b_k_own = tl.load(k + (bos + o_tw)[:, None] * stride_k_t + i_kvh * stride_k_h + o_v[None, :], mask=m_kv)
    p_ok = out_key_pages + b_wpage[:, None] * stride_okp_b + (pos % BS)[:, None] * stride_okp_s \
        + i_kvh * stride_okp_h + o_v[None, :]
    tl.store(p_ok, b_k_own.to(out_key_pages.dtype.element_ty), mask=m_kv)
    b_v_own = tl.load(v + (bos + o_tw)[:, None] * stride_v_t + i_kvh * stride_v_h + o_v[None, :], mask=m_kv)
    p_ov = out_value_pages + b_wpage[:, None] * stride_ovp_b + (pos % BS)[:, None] * stride_ovp_s \
        + i_kvh * stride_ovp_h + o_v[None, :]
    tl.store(p_ov, b_v_own.to(out_value_pages.dtype.element_ty), mask=m_kv)


@triton.jit
def _fresh(BR: tl.constexpr, BV: tl.constexpr):
    """An empty online softmax: running max (finite: fully masked tiles give exp2(-inf) = 0, not
    NaN), sum and unnormalised output."""
    return tl.full([BR], -1.0e30, dtype=tl.float32), tl.zeros([BR], dtype=tl.float32), \
        tl.zeros([BR, BV], dtype=tl.float32)


@triton.jit
def _own_keys_and_finish(b_q, b_m, b_l, b_acc, o, gate, t_r, h_r, m_r, o_v, bos, L, i_n, i_t, i_kvh, prefix, k, v,
                         out_key_pages, out_value_pages, write_table, write_slots, qk_scale,
                         stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                         stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h,
                         stride_wt_n, stride_g_t, stride_g_h, HQ: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                         BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr):
    """The softmax continued over the block's own keys, then its output and own K/V stored."""
    b_m, b_l, b_acc = _own_keys(b_q, b_m, b_l, b_acc, k, v, bos, L, i_t, t_r, i_kvh, o_v, qk_scale,
                                stride_k_t, stride_k_h, stride_v_t, stride_v_h, D, BD, BM, BN)
    _finish(b_m, b_l, b_acc, o, gate, t_r, h_r, m_r, o_v, bos, L, i_n, i_t, i_kvh, prefix, k, v, out_key_pages,
            out_value_pages, write_table, write_slots, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
            stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n,
            stride_g_t, stride_g_h, HQ, D, BS, BM, GATED)


@triton.jit
def _block(chunk_indices, cu_seqlens, prefix_lens, i_ct, BM: tl.constexpr):
    """(sequence, query block, first token, length, prefix length) of program row i_ct. A block
    past its sequence's end (a CUDA-graph bucket's rows shorter than its L, or a no-op entry of a
    STATE bucket's list) has no query: it reads as length 0 and prefix 0, so it walks no keys
    (it stored nothing either way, but walked the whole prefix and the sequence's own keys)."""
    i_n, i_t, bos, L = chunk_entry(chunk_indices, cu_seqlens, i_ct)
    prefix = tl.load(prefix_lens + i_n).to(tl.int64)
    live = i_t * BM < L
    return i_n, i_t, bos, tl.where(live, L, 0), tl.where(live, prefix, 0)


@triton.jit
def _span(prefix, i_s, NS: tl.constexpr, BN: tl.constexpr):
    """Prefix keys [lo, hi) of span i_s of NS: whole key tiles, sized from the prefix length alone
    (lo <= hi always: the spans past a short prefix are empty, not negative)."""
    span = tl.cdiv(tl.cdiv(prefix, BN), NS) * BN
    lo = i_s * span
    return lo, tl.maximum(tl.minimum(lo + span, prefix), lo)  # an empty span: hi == lo


@triton.jit(do_not_specialize=["N_CLASS", "T_CLASS"])
def paged_prefix_attn_fwd_kernel(
    q,  # [T, Hq, D]
    k, v,  # [T, Hkv, D]
    o,  # [T, Hq, D] contiguous out
    gate,  # GATED: [T, Hq, D] through (stride_g_t, stride_g_h): the output is o * sigmoid(gate)
    key_pages, value_pages,  # [NB, BS, Hkv, D] read through read_table
    out_key_pages, out_value_pages,  # [NB', BS, Hkv, D] written through write_table
    read_table, write_table,  # [N, MB] int page ids
    prefix_lens, write_slots,  # [N]
    cu_seqlens,  # [N + 1]
    chunk_indices,  # [NT, 2] chunks of BM tokens
    qk_scale,  # D^-0.5 * log2(e)
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s, stride_vp_h,
    stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h,
    stride_rt_n, stride_wt_n, stride_g_t, stride_g_h,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, NV: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    """One program per (query block, kv head, value slice): the prefix, then the own keys."""
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    BV: tl.constexpr = BD // NV
    # Query blocks in reverse: a sequence's last blocks walk the most own keys, and launched last
    # they ran on alone at the end (a 2,208-token document: 71 key tiles against 35 on average).
    i_ct = tl.num_programs(0) - 1 - tl.program_id(0)
    i_kvh, i_v = tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, L, prefix = _block(chunk_indices, cu_seqlens, prefix_lens, i_ct, BM)
    o_v = i_v * BV + tl.arange(0, BV)  # this program's slice of the value / output features
    b_q, t_r, h_r, m_r = _load_queries(q, bos, L, i_t, i_kvh, stride_q_t, stride_q_h, D, BD, G, BM, BR)
    b_m, b_l, b_acc = _fresh(BR, BV)
    b_m, b_l, b_acc = _prefix_keys(b_q, b_m, b_l, b_acc, key_pages, value_pages, read_table + i_n * stride_rt_n,
                                   0, prefix, i_kvh, o_v, qk_scale, stride_kp_b, stride_kp_s, stride_kp_h,
                                   stride_vp_b, stride_vp_s, stride_vp_h, D, BD, BS, BN)
    _own_keys_and_finish(b_q, b_m, b_l, b_acc, o, gate, t_r, h_r, m_r, o_v, bos, L, i_n, i_t, i_kvh, prefix, k, v,
                         out_key_pages, out_value_pages, write_table, write_slots, qk_scale,
                         stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_okp_b, stride_okp_s, stride_okp_h,
                         stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n, stride_g_t, stride_g_h,
                         HQ, D, BD, BS, BM, BN, GATED)


@triton.jit(do_not_specialize=["T", "N_CLASS", "T_CLASS"])
def paged_prefix_span_kernel(
    q, key_pages, value_pages, read_table, prefix_lens, cu_seqlens, chunk_indices,
    ws_acc, ws_ml,  # out: [NS, T, Hq, D] fp32 unnormalised partial outputs, [NS, 2, T, Hq] fp32 max and sum
    qk_scale, T,
    stride_q_t, stride_q_h, stride_kp_b, stride_kp_s, stride_kp_h, stride_vp_b, stride_vp_s, stride_vp_h,
    stride_rt_n,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, NV: tl.constexpr, NS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    """Split mode, step 1: one program per (query block, kv head, value slice, prefix span): the
    span's online softmax from a fresh start, stored as a partial. An empty span stores nothing."""
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    BV: tl.constexpr = BD // NV
    i_ct, i_kvh = tl.program_id(0), tl.program_id(1)
    i_v, i_s = tl.program_id(2) // NS, tl.program_id(2) % NS
    i_n, i_t, bos, L, prefix = _block(chunk_indices, cu_seqlens, prefix_lens, i_ct, BM)
    lo, hi = _span(prefix, i_s, NS, BN)  # an empty span (lo >= hi) runs no step and stores nothing
    o_v = i_v * BV + tl.arange(0, BV)
    b_q, t_r, h_r, m_r = _load_queries(q, bos, tl.where(lo < hi, L, 0), i_t, i_kvh, stride_q_t, stride_q_h, D, BD,
                                       G, BM, BR)
    b_m, b_l, b_acc = _fresh(BR, BV)
    b_m, b_l, b_acc = _prefix_keys(b_q, b_m, b_l, b_acc, key_pages, value_pages, read_table + i_n * stride_rt_n,
                                   lo, hi, i_kvh, o_v, qk_scale, stride_kp_b, stride_kp_s, stride_kp_h,
                                   stride_vp_b, stride_vp_s, stride_vp_h, D, BD, BS, BN)
    row = (i_s * T + bos + t_r) * HQ + h_r  # [BR] partial row (span, token, head)
    tl.store(ws_acc + row[:, None] * D + o_v[None, :], b_acc, mask=m_r[:, None] & (o_v < D)[None, :])
    p_ml = ws_ml + (i_s * 2 * T + bos + t_r) * HQ + h_r
    tl.store(p_ml, b_m, mask=m_r & (i_v == 0))  # the same in every value slice: stored once
    tl.store(p_ml + T * HQ, b_l, mask=m_r & (i_v == 0))


@triton.jit(do_not_specialize=["T", "N_CLASS", "T_CLASS"])
def paged_prefix_finish_kernel(
    q, k, v, o, gate, ws_acc, ws_ml, out_key_pages, out_value_pages, write_table, prefix_lens, write_slots,
    cu_seqlens, chunk_indices, qk_scale, T,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n,
    stride_g_t, stride_g_h,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, NV: tl.constexpr, NS: tl.constexpr, GATED: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    """Split mode, step 2: per (query block, kv head, value slice), the prefix spans' partials
    merged in order, then the own keys, the output and the own K/V as in the one-program kernel."""
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    BV: tl.constexpr = BD // NV
    i_ct, i_kvh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, L, prefix = _block(chunk_indices, cu_seqlens, prefix_lens, i_ct, BM)
    o_v = i_v * BV + tl.arange(0, BV)
    b_q, t_r, h_r, m_r = _load_queries(q, bos, L, i_t, i_kvh, stride_q_t, stride_q_h, D, BD, G, BM, BR)
    b_m, b_l, b_acc = _fresh(BR, BV)
    m_acc = m_r[:, None] & (o_v < D)[None, :]
    n_spans = tl.cdiv(prefix, tl.maximum(tl.cdiv(tl.cdiv(prefix, BN), NS) * BN, 1))  # the non-empty ones
    for i_s in range(n_spans):
        row = (i_s * T + bos + t_r) * HQ + h_r
        p_ml = ws_ml + (i_s * 2 * T + bos + t_r) * HQ + h_r
        m_s = tl.load(p_ml, mask=m_r, other=-1.0e30)
        l_s = tl.load(p_ml + T * HQ, mask=m_r, other=0.0)
        acc_s = tl.load(ws_acc + row[:, None] * D + o_v[None, :], mask=m_acc, other=0.0)
        b_m_new = tl.maximum(b_m, m_s)
        b_alpha, b_beta = tl.exp2(b_m - b_m_new), tl.exp2(m_s - b_m_new)
        b_l = b_l * b_alpha + l_s * b_beta
        b_acc = b_acc * b_alpha[:, None] + acc_s * b_beta[:, None]
        b_m = b_m_new
    _own_keys_and_finish(b_q, b_m, b_l, b_acc, o, gate, t_r, h_r, m_r, o_v, bos, L, i_n, i_t, i_kvh, prefix, k, v,
                         out_key_pages, out_value_pages, write_table, write_slots, qk_scale,
                         stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_okp_b, stride_okp_s, stride_okp_h,
                         stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n, stride_g_t, stride_g_h,
                         HQ, D, BD, BS, BM, BN, GATED)


@triton.jit
def paged_store_kernel(
    k, v, out_key_pages, out_value_pages, write_table, prefix_lens, write_slots, cu_seqlens, chunk_indices,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_okp_b, stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n,
    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    """Only the K/V store of the attention kernels, per (query block, kv head): for passes whose
    attention output nobody reads (the last layer of a state pass)."""
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_ct, i_kvh = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, L, prefix = _block(chunk_indices, cu_seqlens, prefix_lens, i_ct, BM)
    _store_own_kv(k, v, out_key_pages, out_value_pages, write_table, write_slots, bos, L, i_n, i_t, i_kvh,
                  prefix, tl.arange(0, BD), stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_okp_b,
                  stride_okp_s, stride_okp_h, stride_ovp_b, stride_ovp_s, stride_ovp_h, stride_wt_n, D, BS, BM)


def valid_configs(configs, named_args, **kwargs):
    """The configs whose value slice BD / NV is still a dot operand (>= 16 features)."""
    return [c for c in configs if kwargs["BD"] // c.kwargs["NV"] >= 16]


def _tuned(kernel):
    return triton.autotune(configs=ATTN_CONFIGS, key=["HQ", "G", "D", "BS", "N_CLASS", "T_CLASS"],
                           prune_configs_by={"early_config_prune": valid_configs})(kernel)


_tuned_attn_kernel = _tuned(paged_prefix_attn_fwd_kernel)
_tuned_span_kernel = _tuned(paged_prefix_span_kernel)
_tuned_finish_kernel = _tuned(paged_prefix_finish_kernel)


def paged_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    out_key_pages: torch.Tensor | None = None,
    out_value_pages: torch.Tensor | None = None,
    write_table: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    scale: float | None = None,
    config: triton.Config | None = None,
    block_n: int | None = None,
    split: bool | None = None,
    spans: int = PREFIX_SPANS,
    block_m: int | None = None,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence over its paged prefix plus its own keys; stores its own K/V.

    q:             [T, Hq, D] queries after norm and RoPE (unit stride over D)
    k, v:          [T, Hkv, D] the sequences' own keys (after norm and RoPE) and values; Hq % Hkv == 0
    cu_seqlens:    [N + 1] int sequence offsets; prefix_lens [N] int stored tokens of each document
    key_pages, value_pages: [NB, BS, Hkv, D] K/V pages, any strides with unit stride over D, read in place
    block_table:   [N, MB] int page ids of each sequence's prefix (read side)
    write_slots:   [N] int; >= 0 stores the sequence's K/V at positions prefix.. in its pages
    out_key_pages, out_value_pages, write_table: the write side (default: the read side)
    chunk_indices: [NT, 2] fla's prepare_chunk_indices(cu_seqlens, query_block(Hq // Hkv));
                   computed (host sync) when None
    scale:         default D^-0.5
    config:        run this one config instead of the autotuner (in split mode: in both kernels)
    block_n:       keys per inner step (default: 64 for head dims <= 128, else 32); the online-softmax
                   order depends on it, so it is fixed per head dim and never autotuned (benchmarks only)
    split:         split mode (default: for a rows_few pass, `classify_seqs(N, T)`; callers that tune by
                   their pass's class pass it from that class, `TritonOps.attention` does)
    spans:         split mode's prefix spans (the merge order depends on it: serving keeps
                   PREFIX_SPANS; other counts are for benchmarks)
    block_m:       query tokens per program (default `query_block(Hq // Hkv)`; others for benchmarks:
                   `chunk_indices` must then be built with it)
    gate:          [T, Hq, D] in q's dtype (unit stride over D; a column view of the q projection is
                   fine): the output is o * sigmoid(gate), the attention output gate, in the store
                   (the bits of `kev.ops.fused.activations.sigmoid_mul` after the ungated attention)
    out:           [T, Hq, D] contiguous, q's dtype, to write the output into (a phase's token slice)
    Returns o: [T, Hq, D] contiguous, q's dtype (`out` when given).
    """
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [T, Hq, D], k {tuple(k.shape)} and v {tuple(v.shape)} "
                         f"[T, Hkv, D]")
    T, HQ, D = q.shape
    HKV = k.shape[1]
    if HQ % HKV:
        raise ValueError(f"query heads Hq={HQ} must be a multiple of kv heads Hkv={HKV}")
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported")
    out_key_pages = key_pages if out_key_pages is None else out_key_pages
    out_value_pages = value_pages if out_value_pages is None else out_value_pages
    write_table = block_table if write_table is None else write_table
    BS = key_pages.shape[1]
    _check_pages(BS, HKV, D, key_pages=key_pages, value_pages=value_pages, out_key_pages=out_key_pages,
                 out_value_pages=out_value_pages)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} needs unit stride over D, strides {t.stride()}")
    N = prefix_lens.shape[0]
    if cu_seqlens.shape != (N + 1,) or write_slots.shape != (N,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} must be [N + 1], prefix_lens "
                         f"{tuple(prefix_lens.shape)} and write_slots {tuple(write_slots.shape)} [N]")
    for name, table in (("block_table", block_table), ("write_table", write_table)):
        if table.ndim != 2 or table.shape[0] != N or table.stride(1) != 1:
            raise ValueError(f"{name} must be [N={N}, MB] with unit column stride, got {tuple(table.shape)}")
    # index tensors (never the pages) must be contiguous: a strided index view costs a tiny copy
    cu_seqlens, prefix_lens, write_slots = cu_seqlens.contiguous(), prefix_lens.contiguous(), write_slots.contiguous()
    G = HQ // HKV
    BM = block_m or query_block(G)
    if chunk_indices is None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, BM)
    chunk_indices = chunk_indices.contiguous()
    o = output_like(q, out)
    if gate is not None and (gate.shape != q.shape or gate.dtype != q.dtype or gate.stride(2) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} must be like q {tuple(q.shape)} {q.dtype}, unit "
                         f"stride over D (strides {gate.stride()})")
    gated = (gate, gate.stride(0), gate.stride(1)) if gate is not None else (o, 0, 0)  # unread when not gated
    NT = chunk_indices.shape[0]
    if NT == 0:
        return o
    scale = D ** -0.5 if scale is None else scale
    BD = max(32, triton.next_power_of_2(D))  # >= 32: a value split of BD / 2 is still a dot operand
    n_class, t_class = shape_class(N, T)
    meta = dict(HQ=HQ, G=G, D=D, BD=BD, BS=BS, BM=BM, BR=max(16, triton.next_power_of_2(BM * G)),
                BN=block_n or (64 if BD <= 128 else 32))
    attn_meta = {**meta, "GATED": gate is not None}  # the kernels that store the output
    qk_scale = scale * 1.4426950408889634
    split = split_mode(classify_seqs(N, T)) if split is None else split
    if not split:
        args = (q, k, v, o, gated[0], key_pages, value_pages, out_key_pages, out_value_pages, block_table,
                write_table, prefix_lens, write_slots, cu_seqlens, chunk_indices, qk_scale,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                *key_pages.stride()[:3], *value_pages.stride()[:3], *out_key_pages.stride()[:3],
                *out_value_pages.stride()[:3], block_table.stride(0), write_table.stride(0), *gated[1:],
                n_class, t_class)
        _launch(paged_prefix_attn_fwd_kernel, _tuned_attn_kernel, config, lambda m: (NT, HKV, m["NV"]), args,
                attn_meta)
        return o
    if spans < 1:
        raise ValueError(f"spans must be >= 1, got {spans}")
    ws_acc = torch.empty((spans, T, HQ, D), dtype=torch.float32, device=q.device)
    ws_ml = torch.empty((spans, 2, T, HQ), dtype=torch.float32, device=q.device)
    span_args = (q, key_pages, value_pages, block_table, prefix_lens, cu_seqlens, chunk_indices, ws_acc, ws_ml,
                 qk_scale, T, q.stride(0), q.stride(1), *key_pages.stride()[:3], *value_pages.stride()[:3],
                 block_table.stride(0), n_class, t_class)
    _launch(paged_prefix_span_kernel, _tuned_span_kernel, config, lambda m: (NT, HKV, m["NV"] * spans),
            span_args, {**meta, "NS": spans})
    finish_args = (q, k, v, o, gated[0], ws_acc, ws_ml, out_key_pages, out_value_pages, write_table, prefix_lens,
                   write_slots, cu_seqlens, chunk_indices, qk_scale, T, q.stride(0), q.stride(1), k.stride(0),
                   k.stride(1), v.stride(0), v.stride(1), *out_key_pages.stride()[:3], *out_value_pages.stride()[:3],
                   write_table.stride(0), *gated[1:], n_class, t_class)
    _launch(paged_prefix_finish_kernel, _tuned_finish_kernel, config, lambda m: (NT, HKV, m["NV"]), finish_args,
            {**attn_meta, "NS": spans})
    return o


def paged_store(
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    prefix_lens: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    block_table: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    chunk_indices: torch.Tensor,
    group: int,
) -> None:
    """The K/V store of `paged_prefix_attention` alone, the same bits in the same pages: sequence n's
    own K/V at positions prefix_lens[n].. of its pages (`block_table[n]`) when write_slots[n] >= 0.
    k, v [T, Hkv, D]; chunk_indices the attention's (fla's prepare_chunk_indices(cu_seqlens,
    query_block(group))), `group` = Hq / Hkv of the attention it stands in for."""
    if k.ndim != 3 or v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hkv, D] with unit stride over D")
    T, HKV, D = k.shape
    BS = key_pages.shape[1]
    _check_pages(BS, HKV, D, key_pages=key_pages, value_pages=value_pages)
    N = prefix_lens.shape[0]
    if cu_seqlens.shape != (N + 1,) or write_slots.shape != (N,) or block_table.ndim != 2 \
            or block_table.shape[0] != N or block_table.stride(1) != 1:
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)}, prefix_lens {tuple(prefix_lens.shape)}, "
                         f"write_slots {tuple(write_slots.shape)}, block_table {tuple(block_table.shape)} must be "
                         f"[N + 1], [N], [N], [N, MB] (unit column stride)")
    chunk_indices = chunk_indices.contiguous()
    if T == 0 or chunk_indices.shape[0] == 0:
        return
    cu_seqlens, prefix_lens, write_slots = cu_seqlens.contiguous(), prefix_lens.contiguous(), write_slots.contiguous()
    paged_store_kernel[(chunk_indices.shape[0], HKV)](
        k, v, key_pages, value_pages, block_table, prefix_lens, write_slots, cu_seqlens, chunk_indices,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *key_pages.stride()[:3], *value_pages.stride()[:3],
        block_table.stride(0), D=D, BD=max(32, triton.next_power_of_2(D)), BS=BS, BM=query_block(group),
        num_warps=4, **launch_options())


def _check_pages(BS: int, HKV: int, D: int, **pages: torch.Tensor) -> None:
    for name, p in pages.items():
        if p.ndim != 4 or tuple(p.shape[1:]) != (BS, HKV, D) or p.stride(3) != 1:
            raise ValueError(f"{name} must be [NB, BS={BS}, Hkv={HKV}, D={D}] with unit stride over D, "
                             f"got {tuple(p.shape)} strides {p.stride()}")


def _launch(kernel, tuned, config, grid, args, meta):
    """`tuned` (the autotuner), or `kernel` with one given config."""
    if config is None:
        tuned[grid](*args, **meta, **launch_options())
    else:
        kernel[grid(config.kwargs)](*args, **meta, **config.all_kwargs(), **launch_options())
