"""The gated delta rule token by token from bank slots by index: one kernel for short passes.

The chunked forward (`indexed_scan.indexed_chunk_gated_delta_rule`) is five launches per layer
(L2 norm, chunk-local cumsum, fused KK^T solve + WY recompute, our state pass, fla's output
kernel). For a pass of short sequences (question rows, short new documents) that is mostly launch
latency. This kernel does the whole layer in one launch: one program per (sequence n, value head
hv, block of BV value features) loads the fp32 state [K, BV] from `state_pool[read_slots[n], hv]`
through explicit strides (zeros for a negative index), walks the sequence's tokens with the
recurrence of `naive.recurrent_gated_delta_rule`, and writes the final state to
`out_pool[write_slots[n], hv]` only when that index is >= 0 (rows never write).

Per token t, with q and k L2-normalised here (x / sqrt(|x|^2 + eps), fp32, as `TorchOps` and
`l2norm_heads`) and q scaled by `scale`:
    S <- exp(g_t) S                               (g natural-log decay: the naive maths, no log2)
    v_new = beta_t (v_t - S^T k_t)
    S <- S + k_t v_new^T
    o_t = S^T q_t
Value head hv reads key head hv // (HV / H): q and k are never expanded. q, k, v are read in place
as the strided column views the model passes (unit stride over features); nothing is copied.
The state never leaves fp32 registers (the chunked path rounds it to k's dtype for its output
kernel), so the two paths agree to the inputs' precision, not bit for bit.

Cost: each step is a serial chain over the sequence (a row of L tokens is L dependent steps), so
this is for short sequences only; `TritonOps(recurrent_classes=...)` chooses it per shape class.
Reference: `naive.recurrent_gated_delta_rule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.conv.indexed_conv import preserve_written_slots, shape_class
from kev.ops.delta_rule.contract import check_delta_rule_args

# (BV, num_warps). Every config computes each output element from the same fp32 values; whether
# the K reductions also round identically for every config is what the GPU test checks.
# One config, not a tuned set: the [K, BV] state is spread over lanes and warps along K by BV and
# num_warps, so each (BV, num_warps) sums S^T k in another order and rounds differently, and the
# project promises that every config of an own kernel gives the same bits. The candidates are kept
# for timing (bench); a fixed-order K reduction would make them all servable.
RECURRENT_CANDIDATES = [
    triton.Config({"BV": BV}, num_warps=num_warps, num_stages=1)
    for BV, num_warps in [(32, 4), (16, 1), (8, 1), (16, 2), (32, 2), (64, 4)]
]
RECURRENT_CONFIGS = RECURRENT_CANDIDATES[:1]


@triton.jit(do_not_specialize=["N_CLASS", "T_CLASS"])
def indexed_recurrent_fwd_kernel(
    q,  # [T, H, K] any strides over T and H, unit stride over K
    k,  # [T, H, K] likewise
    v,  # [T, HV, V] any strides over T and HV, unit stride over V
    g,  # [T, HV] fp32 natural-log decay
    beta,  # [T, HV]
    o,  # [T, HV, V] out, contiguous
    state_pool,  # [S, HV, K, V] fp32, read through read_slots
    out_pool,  # [S', HV, K, V] fp32, written through write_slots
    read_slots, write_slots,  # [N]
    cu_seqlens,  # [N + 1]
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_g_t, stride_g_h, stride_b_t, stride_b_h,
    stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_s, stride_o_h, stride_o_k, stride_o_v,
    scale, eps,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)  # value head i_hv reads key head i_hv // (HV / H)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    b_read = tl.load(read_slots + i_n).to(tl.int64)
    p_h0 = state_pool + tl.maximum(b_read, 0) * stride_s_s + i_hv * stride_s_h \
        + o_k[:, None] * stride_s_k + o_v[None, :] * stride_s_v
    b_h = tl.load(p_h0, mask=m_kv & (b_read >= 0), other=0.0).to(tl.float32)  # [BK, BV]

    p_q = q + bos * stride_q_t + i_h * stride_q_h + o_k
    p_k = k + bos * stride_k_t + i_h * stride_k_h + o_k
    p_v = v + bos * stride_v_t + i_hv * stride_v_h + o_v
    p_g = g + bos * stride_g_t + i_hv * stride_g_h
    p_b = beta + bos * stride_b_t + i_hv * stride_b_h
    p_o = o + (bos * HV + i_hv) * V + o_v
    # token 0's inputs; inside the loop token t + 1's are loaded before token t's maths, so their
    # latency overlaps it (the recurrence is a serial chain over the tokens)
    m_t = L > 0
    n_q = tl.load(p_q, mask=m_k & m_t, other=0.0)
    n_k = tl.load(p_k, mask=m_k & m_t, other=0.0)
    n_v = tl.load(p_v, mask=m_v & m_t, other=0.0)
    n_g = tl.load(p_g, mask=m_t, other=0.0)
    n_b = tl.load(p_b, mask=m_t, other=0.0)
    for t in range(L):  # no .to() on t: the interpreter's range yields Python ints
        b_q, b_k, b_v = n_q.to(tl.float32), n_k.to(tl.float32), n_v.to(tl.float32)  # [BK], [BK], [BV]
        b_g, b_beta = n_g.to(tl.float32), n_b.to(tl.float32)
        m_t = t + 1 < L
        n_q = tl.load(p_q + (t + 1) * stride_q_t, mask=m_k & m_t, other=0.0)
        n_k = tl.load(p_k + (t + 1) * stride_k_t, mask=m_k & m_t, other=0.0)
        n_v = tl.load(p_v + (t + 1) * stride_v_t, mask=m_v & m_t, other=0.0)
        n_g = tl.load(p_g + (t + 1) * stride_g_t, mask=m_t, other=0.0)
        n_b = tl.load(p_b + (t + 1) * stride_b_t, mask=m_t, other=0.0)

        b_q = b_q * (tl.rsqrt(tl.sum(b_q * b_q, 0) + eps) * scale)  # x / sqrt(|x|^2 + eps), then the scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + eps)
        b_h = b_h * tl.exp(b_g)
        # [BK, BV] * [BK, 1] summed over K -> [BV]: S^T k
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h = b_h + b_k[:, None] * b_v[None, :]  # [BK, 1] x [1, BV] -> [BK, BV]
        # [BK, BV] * [BK, 1] summed over K -> [BV]: S^T q
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(p_o + t * (HV * V), b_o.to(o.dtype.element_ty), mask=m_v)

    tl.debug_barrier()  # the start state is fully read before the (maybe same) slot is written
    b_write = tl.load(write_slots + i_n).to(tl.int64)
    p_ht = out_pool + tl.maximum(b_write, 0) * stride_o_s + i_hv * stride_o_h \
        + o_k[:, None] * stride_o_k + o_v[None, :] * stride_o_v
    tl.store(p_ht, b_h.to(out_pool.dtype.element_ty), mask=m_kv & (b_write >= 0))


_save, _restore = preserve_written_slots("out_pool", "write_slots")
_tuned_recurrent_kernel = triton.autotune(configs=RECURRENT_CONFIGS, key=["H", "HV", "K", "V", "N_CLASS", "T_CLASS"],
                                          pre_hook=_save, post_hook=_restore)(indexed_recurrent_fwd_kernel)


def _check_features(name: str, x: torch.Tensor) -> None:
    if x.ndim != 3 or x.stride(2) != 1:
        raise ValueError(f"{name} must be [T, heads, dim] with unit stride over dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")


def indexed_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    *,
    out_pool: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    config: triton.Config | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Varlen gated delta rule, one launch, token by token, from (and to) bank slots by index.

    The contract of `indexed_chunk_gated_delta_rule`, so `TritonOps` can call either:
    q:             [T, H, K] raw queries, any strides with unit stride over K (L2-normalised inside)
    k:             [T, H, K] raw keys, likewise
    v:             [T, HV, V] values, any strides with unit stride over V; HV a multiple of H
                   (value head j reads key head j // (HV/H))
    g:             [T, HV] fp32 log decay (natural log, per token), any strides
    beta:          [T, HV] any float dtype and strides
    cu_seqlens:    [N + 1] int64 sequence offsets
    state_pool:    [S, HV, K, V] fp32, read in place at read_slots [N] (-1: zero state)
    write_slots:   [N] slot of out_pool (default state_pool) that receives the final state (-1: none)
    scale:         query scale (default K^-0.5)
    chunk_indices, chunk_offsets: accepted for the common signature and unused (no chunks here)
    config:        run this one config instead of the autotuner
    Returns o: [T, HV, V] contiguous, in v's dtype.
    """
    del chunk_indices, chunk_offsets  # the recurrent form has no chunks
    T, H, K, HV, V = check_delta_rule_args(q, k, v, g, beta)
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_features(name, x)
    if K > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported (state [K, BV] lives in registers)")
    out_pool = state_pool if out_pool is None else out_pool
    for name, pool in (("state_pool", state_pool), ("out_pool", out_pool)):
        if pool.ndim != 4 or tuple(pool.shape[1:]) != (HV, K, V) or pool.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [S, HV={HV}, K={K}, V={V}], got {tuple(pool.shape)} {pool.dtype}")
    N = read_slots.shape[0]
    if read_slots.shape != (N,) or write_slots.shape != (N,) or cu_seqlens.shape != (N + 1,):
        raise ValueError(f"read_slots {tuple(read_slots.shape)}, write_slots {tuple(write_slots.shape)} must be [N] "
                         f"and cu_seqlens {tuple(cu_seqlens.shape)} [N + 1]")
    # index tensors (never the pools) must be contiguous: a strided index view costs a tiny copy
    read_slots, write_slots, cu_seqlens = read_slots.contiguous(), write_slots.contiguous(), cu_seqlens.contiguous()
    scale = K ** -0.5 if scale is None else scale
    o = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)
    if T == 0 or N == 0:
        return o
    n_class, t_class = shape_class(N, T)
    args = (q, k, v, g, beta, o, state_pool, out_pool, read_slots, write_slots, cu_seqlens,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), *state_pool.stride(), *out_pool.stride(),
            scale, eps, n_class, t_class)
    meta = dict(H=H, HV=HV, K=K, V=V, BK=max(16, triton.next_power_of_2(K)))

    def grid(m):
        return (triton.cdiv(V, m["BV"]), N * HV)

    if config is None:
        _tuned_recurrent_kernel[grid](*args, **meta)
    else:
        indexed_recurrent_fwd_kernel[grid](*args, **meta, **config.all_kwargs())
    return o
