"""The indexed scan's per-chunk steps, inlined into its kernel (`indexed_scan`): the start state
read from a bank slot, the corrected values V' = U - W S and what a chunk stores for the output
kernel, the state carried to the next chunk, and the final state written to a slot. G is the
chunk-local cumsum of the log2 decay.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_state(pool, slots, i_n, i_h, o_k, o_v, m_kv, stride_s, stride_h, stride_k, stride_v):
    """The fp32 [BK, BV] state of value head i_h in `pool[slots[i_n]]` (zeros for a negative slot)."""
    b_slot = tl.load(slots + i_n).to(tl.int64)
    p = pool + tl.maximum(b_slot, 0) * stride_s + i_h * stride_h + o_k[:, None] * stride_k + o_v[None, :] * stride_v
    return tl.load(p, mask=m_kv & (b_slot >= 0), other=0.0).to(tl.float32)


@triton.jit
def write_slot_state(b_h, pool, slots, i_n, i_h, o_k, o_v, m_kv, stride_s, stride_h, stride_k, stride_v):
    """Stores the state in `pool[slots[i_n]]`; nothing for a negative slot."""
    tl.debug_barrier()  # the start state is fully read before the (maybe same) slot is written
    b_slot = tl.load(slots + i_n).to(tl.int64)
    p = pool + tl.maximum(b_slot, 0) * stride_s + i_h * stride_h + o_k[:, None] * stride_k + o_v[None, :] * stride_v
    tl.store(p, b_h.to(pool.dtype.element_ty), mask=m_kv & (b_slot >= 0))


@triton.jit
def corrected_values(b_hc, p_w, p_u, o_t, m_t, o_k, m_k, o_v, m_v, stride_w_t, stride_u_t):
    """V' = U - W S of one chunk in fp32 [BT, BV], S (`b_hc`) in the activations' dtype."""
    b_w = tl.load(p_w + o_t[:, None] * stride_w_t + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_u = tl.load(p_u + o_t[:, None] * stride_u_t + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    # [BT, BK] @ [BK, BV] -> [BT, BV]
    return b_u.to(tl.float32) - tl.dot(b_w, b_hc)


@triton.jit
def chunk_outputs(b_h, h, v_new, p_w, p_u, p_vn, boh, i_t, i_h, o_t, m_t, o_k, m_k, o_v, m_v, m_kv,
                  stride_w_t, stride_u_t, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """What chunk i_t hands `chunk_fwd_o`: its start state into h and its V' into v_new; returns V'."""
    b_hc = b_h.to(h.dtype.element_ty)  # k's dtype (indexed_scan checks)
    tl.store(h + ((boh + i_t) * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :], b_hc, mask=m_kv)
    b_v = corrected_values(b_hc, p_w, p_u, o_t, m_t, o_k, m_k, o_v, m_v,
                           stride_w_t, stride_u_t)
    tl.store(p_vn + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])
    return b_v


@triton.jit
def next_state(b_h, b_k, b_v, b_g, p_g, stride_g_t, i_t, L, m_t, BT: tl.constexpr):
    """The state after chunk i_t: 2^G_last S + K^T diag(2^(G_last - G)) V' (`b_k` as [BK, BT])."""
    last = tl.minimum((i_t + 1) * BT, L) - 1
    b_g_last = tl.load(p_g + last * stride_g_t).to(tl.float32)
    b_v = b_v * tl.where(m_t, tl.exp2(b_g_last - b_g), 0.0)[:, None]
    # [BK, BT] @ [BT, BV] -> [BK, BV]
    return tl.dot(b_k, b_v.to(b_k.dtype), b_h * tl.exp2(b_g_last))
