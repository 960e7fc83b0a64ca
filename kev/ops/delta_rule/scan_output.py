"""The indexed scan with the output in the same kernel: state pass and chunk output fused.

`indexed_scan` (the state pass) stores the state at every chunk's start (`h`, [chunks, HV, K, V])
and the corrected values (`v_new`) for fla's `chunk_fwd_o`, which reads them back to form the
output. Here the program that walks a sequence's chunks forms each chunk's output itself, while
the chunk-start state is still in its registers, so neither `h` nor `v_new` is ever written: per
layer that is one kernel instead of two, and for a row (one chunk, a bank state it only reads)
no copy of the bank state at all. The last chunk of a sequence that writes nowhere (every row)
skips the state update it would throw away.

Per chunk, with S the chunk-start state, G the chunk-local cumsum of the log2 decay and U, W fla's
WY-transformed values and keys (as in `indexed_scan`):
    V' = U - W S
    O  = scale * ( diag(2^G) Q S + tril(Q K^T * 2^(G_t - G_j)) V' )
    S  <- 2^G_last S + K^T diag(2^(G_last - G)) V'
S and V' enter the output matmuls rounded to the activations' dtype, as the split path stores them.

Reference: `indexed_scan.indexed_scan` + fla's `chunk_fwd_o` (the split path), and
`naive.recurrent_gated_delta_rule` / `chunk_torch.chunk_gated_delta_rule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.delta_rule.chunk_steps import corrected_values, next_state, slot_state, write_slot_state
from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import preserve_written_slots, shape_class

CHUNK = 64  # the chunk of fla's WY pieces that produce w and u

# The configs that spill least, compiled for sm_90 at Kev-4B's heads (bench/kernel_resources.py;
# bytes of stack a thread): BV 16 at 4 warps and BV 32 at 8 (0), BV 64 at 8 (16 at 1 stage, 128 at
# 2), BV 32 at 4 (24 at 2 stages, 264 at 1), BV 64 at 4 (400). All use 254-255 registers. The
# autotuner picks per shape class; every config gives the same bits.
SCAN_OUTPUT_CONFIGS = [
    triton.Config({"BV": BV}, num_warps=num_warps, num_stages=num_stages)
    for BV, num_warps, num_stages in [(16, 4, 2), (16, 4, 3), (64, 8, 1), (64, 8, 2), (32, 4, 1), (32, 4, 2),
                                      (32, 8, 2), (64, 4, 1)]
]
if triton.knobs.runtime.interpret:  # the autotuner cannot benchmark without a GPU: pin one config
    SCAN_OUTPUT_CONFIGS = SCAN_OUTPUT_CONFIGS[:1]


@triton.jit(do_not_specialize=["N_CLASS", "T_CLASS"])
def indexed_scan_output_kernel(
    q,  # [T, H, K] normalised queries
    k,  # [T, H, K] normalised keys
    w,  # [T, HV, K]
    u,  # [T, HV, V]
    g,  # [T, HV] fp32 chunk-local cumsum of the log2 decay
    o,  # [T, HV, V] out
    state_pool,  # [S, HV, K, V] fp32, read through read_slots
    out_pool,  # [S', HV, K, V] fp32, written through write_slots
    read_slots, write_slots,  # [N]
    cu_seqlens,  # [N + 1]
    scale,
    stride_q_t, stride_k_t, stride_w_t, stride_u_t, stride_g_t,
    stride_s_s, stride_s_h, stride_s_k, stride_s_v,
    stride_o_s, stride_o_h, stride_o_k, stride_o_v,
    N_CLASS, T_CLASS,  # shape-class autotune keys only
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    NT = tl.cdiv(L, BT)

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    o_c = tl.arange(0, BT)  # position within the chunk

    b_write = tl.load(write_slots + i_n).to(tl.int64)
    b_h = slot_state(state_pool, read_slots, i_n, i_h, o_k, o_v, m_kv,
                     stride_s_s, stride_s_h, stride_s_k, stride_s_v)  # [BK, BV]

    i_kh = i_h // (HV // H)  # value head i_h reads key head i_h // (HV / H)
    p_q = q + bos * stride_q_t + i_kh * K
    p_k = k + bos * stride_k_t + i_kh * K
    p_w = w + bos * stride_w_t + i_h * K
    p_u = u + bos * stride_u_t + i_h * V
    p_o = o + (bos * HV + i_h) * V
    p_g = g + bos * stride_g_t + i_h
    for i_t in range(NT):  # no .to() on i_t: the interpreter's range yields Python ints
        o_t = i_t * BT + o_c
        m_t = o_t < L
        b_hc = b_h.to(k.dtype.element_ty)  # the chunk-start state as the split path stores it
        b_v = corrected_values(b_hc, p_w, p_u, o_t, m_t, o_k, m_k, o_v, m_v, stride_w_t, stride_u_t)
        b_vc = b_v.to(u.dtype.element_ty)  # as the split path stores it

        b_g = tl.load(p_g + o_t * stride_g_t, mask=m_t, other=0.0).to(tl.float32)
        b_q = tl.load(p_q + o_t[:, None] * stride_q_t + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        # The keys are loaded twice, token-major here for Q K^T and key-major for the state update
        # below: one tile as the B operand of one dot and the A operand of another is what this
        # kernel did and neither split kernel does, and only rows longer than a chunk, which ran
        # both dots (a row's one chunk skips the update), faulted on sm_90
        # (bench/scan_output_faults.py). The second load reads an L2-hot tile.
        b_kr = tl.load(p_k + o_t[:, None] * stride_k_t + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        # [BT, BK] @ [BK, BV] -> [BT, BV]
        b_o = tl.dot(b_q, b_hc) * tl.exp2(b_g)[:, None]
        # [BT, BK] @ [BK, BT] -> [BT, BT]
        b_A = tl.dot(b_q, tl.trans(b_kr)) * tl.exp2(b_g[:, None] - b_g[None, :])
        b_A = tl.where((o_c[:, None] >= o_c[None, :]) & m_t[:, None] & m_t[None, :], b_A, 0.0)
        # [BT, BT] @ [BT, BV] -> [BT, BV]
        b_o = b_o * scale + tl.dot(b_A.to(b_vc.dtype), b_vc) * scale
        tl.store(p_o + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        # the update; a sequence's last chunk needs it only when its final state is written
        if (i_t + 1 < NT) | (b_write >= 0):
            b_k = tl.load(p_k + o_t[None, :] * stride_k_t + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
            b_h = next_state(b_h, b_k, b_v, b_g, p_g, stride_g_t, i_t, L, m_t, BT)

    write_slot_state(b_h, out_pool, write_slots, i_n, i_h, o_k, o_v, m_kv,
                     stride_o_s, stride_o_h, stride_o_k, stride_o_v)


_save, _restore = preserve_written_slots("out_pool", "write_slots")
_tuned_scan_output_kernel = triton.autotune(configs=SCAN_OUTPUT_CONFIGS,
                                            key=["H", "HV", "K", "V", "N_CLASS", "T_CLASS"],
                                            pre_hook=_save, post_hook=_restore)(indexed_scan_output_kernel)


def indexed_scan_output(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    scale: float,
    *,
    out_pool: torch.Tensor | None = None,
    o: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """The state pass and the chunk output of sequences over chunks of CHUNK tokens, in one kernel.

    q, k:          [T, H, K] normalised queries and keys (unit stride over K, heads contiguous)
    w:             [T, HV, K] WY-transformed keys (fla's recompute_w_u), k's dtype
    u:             [T, HV, V] WY-transformed values
    g:             [T, HV] fp32 chunk-local cumsum of the decay, in log2 units
    cu_seqlens:    [N + 1]
    state_pool:    [S, HV, K, V] fp32, any strides, read in place through read_slots [N] (-1: zeros)
    out_pool:      [S', HV, K, V] fp32 written through write_slots [N] (-1: no write); default state_pool
    scale:         the query scale
    o:             the output, preallocated (default: new). The sequences may be some of a pass's:
                   cu_seqlens are offsets into the whole pass's q, ..., o, so a slice of the pass's
                   cu_seqlens runs those sequences alone (a phase).
    Returns o: [T, HV, V] in u's dtype.
    """
    T, H, K = k.shape
    HV, V = u.shape[1], u.shape[2]
    out_pool = state_pool if out_pool is None else out_pool
    if K > 256:
        raise ValueError(f"key head dim {K} > 256 is not supported (state [K, BV] lives in registers)")
    if HV % H:
        raise ValueError(f"value heads {HV} must be a multiple of key heads {H}")
    if tuple(q.shape) != (T, H, K) or tuple(w.shape) != (T, HV, K) or u.shape[0] != T or tuple(g.shape) != (T, HV):
        raise ValueError(f"q {tuple(q.shape)} must be [T={T}, H={H}, K={K}] like k, w {tuple(w.shape)} [T, HV={HV}, K], "
                         f"u {tuple(u.shape)} [T, HV, V], g {tuple(g.shape)} [T, HV]")
    for name, t in (("q", q), ("k", k), ("w", w), ("u", u)):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
            raise ValueError(f"{name} {tuple(t.shape)} needs heads and features contiguous, strides {t.stride()}")
    for name, pool in (("state_pool", state_pool), ("out_pool", out_pool)):
        if pool.ndim != 4 or tuple(pool.shape[1:]) != (HV, K, V) or pool.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [S, HV={HV}, K={K}, V={V}], got {tuple(pool.shape)} {pool.dtype}")
    N = read_slots.shape[0]
    if write_slots.shape != (N,) or cu_seqlens.shape != (N + 1,):
        raise ValueError(f"read_slots {tuple(read_slots.shape)}, write_slots {tuple(write_slots.shape)}, "
                         f"cu_seqlens {tuple(cu_seqlens.shape)} must be [N], [N], [N + 1]")
    read_slots, write_slots, cu_seqlens = read_slots.contiguous(), write_slots.contiguous(), cu_seqlens.contiguous()
    if o is None:
        o = torch.empty((T, HV, V), dtype=u.dtype, device=u.device)
    if tuple(o.shape) != (T, HV, V) or o.dtype != u.dtype or not o.is_contiguous():
        raise ValueError(f"o {tuple(o.shape)} {o.dtype} must be contiguous [{T}, {HV}, {V}] {u.dtype}")
    if N == 0:
        return o
    n_class, t_class = shape_class(N, T)
    args = (q, k, w, u, g, o, state_pool, out_pool, read_slots, write_slots, cu_seqlens, scale,
            q.stride(0), k.stride(0), w.stride(0), u.stride(0), g.stride(0), *state_pool.stride(), *out_pool.stride(),
            n_class, t_class)
    meta = dict(H=H, HV=HV, K=K, V=V, BT=CHUNK, BK=max(16, triton.next_power_of_2(K)))

    def grid(m):
        return (triton.cdiv(V, m["BV"]), N * HV)

    if config is None:
        _tuned_scan_output_kernel[grid](*args, **meta, **launch_options())
    else:
        indexed_scan_output_kernel[grid](*args, **meta, **config.all_kwargs(), **launch_options())
    return o
