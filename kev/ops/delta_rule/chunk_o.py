"""The delta rule's output with the DeltaNet output norm in its store: one kernel for fla's
`chunk_fwd_o` then `gated_rms_norm`.

Per chunk of 64 tokens and value head, o = scale (diag(2^G) Q S + (Q K^T * 2^(G_i - G_j), causal) V'),
S the chunk's start state and V' its corrected values (both from the indexed scan), G the chunk-local
cumsum of the log2 decay. fla's kernel writes o ([T, HV, V] bf16) and the norm reads it back with z
to write rms_norm(o) * weight * silu(z): at 32,768 tokens of Kev-4B, 0.54 GB a layer moved for
nothing. Here one program holds a whole head's [64, V] tile (V = 128), rounds o to the activations'
dtype as fla's store does, and applies the norm's own steps (`norms.gated_norm_rows`) before its
one store. So the result is the two kernels' up to their dots' summation order.

Reference: fla's `chunk_fwd_o` then `kev.ops.fused.norms.gated_rms_norm` (the torch path:
`kev.ops.delta_rule.chunk_torch` then `kev.ops.fused.reference.gated_rms_norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.fused.norms import gated_norm_rows
from kev.ops.fused.reference import GatedNorm
from kev.ops.pdl import launch_options, wait_for_previous

on = False  # True: the delta rule's output and norm run as this kernel (bench A/B: `--chunk-o`)


@triton.jit(do_not_specialize=["T"])
def chunk_o_norm_kernel(
    q, k,  # [T, H, K] contiguous, normalised
    v,  # [T, HV, V] contiguous: the corrected values V'
    h,  # [NT, HV, K, V]: each chunk's start state
    g,  # [T, HV] fp32: chunk-local cumsum of the log2 decay
    z,  # [T, HV, V] through (stride_z_t, stride_z_h)
    w,  # [V]
    y,  # [T, HV, V] contiguous out
    cu_seqlens, chunk_indices,
    scale, eps, T, stride_z_t, stride_z_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
    ROUND_W: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_c * 2)
    i_t = tl.load(chunk_indices + i_c * 2 + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    i_h = i_hv // (HV // H)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < L
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    rows = bos + o_t
    b_q = tl.load(q + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)  # [BT, K]
    b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :])  # [K, V]
    b_g = tl.load(g + rows * HV + i_hv, mask=m_t, other=0.0)
    b_o = tl.dot(b_q, b_h) * tl.exp2(b_g)[:, None]  # [BT, V]
    b_A = tl.dot(b_q, tl.trans(b_k)) * tl.exp2(b_g[:, None] - b_g[None, :])  # [BT, BT]
    b_A = tl.where((o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :], b_A, 0.0)
    b_v = tl.load(v + (rows[:, None] * HV + i_hv) * V + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_o = b_o * scale + tl.dot(b_A.to(b_v.dtype), b_v) * scale
    DT: tl.constexpr = y.dtype.element_ty
    b_x = b_o.to(DT).to(tl.float32)  # o as fla's kernel stores it
    b_z = tl.load(z + rows[:, None] * stride_z_t + i_hv * stride_z_h + o_v[None, :], mask=m_t[:, None],
                  other=0.0).to(tl.float32)
    b_w = tl.load(w + o_v).to(tl.float32)
    tl.store(y + (rows[:, None] * HV + i_hv) * V + o_v[None, :], gated_norm_rows(b_x, b_z, b_w, eps, V, DT, ROUND_W),
             mask=m_t[:, None])


def chunk_o_norm(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, h: torch.Tensor, g_cum: torch.Tensor,
                 scale: float, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, norm: GatedNorm,
                 chunk: int = 64) -> torch.Tensor:
    """gated_rms_norm(chunk_fwd_o(...), z, weight, eps) in one kernel.

    q, k:  [T, H, K] contiguous, normalised; v_new [T, HV, V] contiguous; h [NT, HV, K, V];
    g_cum: [T, HV] fp32; chunk_indices [NT, 2] (sequence, chunk) as fla's prepare_chunk_indices.
    K and V powers of two (one program holds a whole head). Returns [T, HV, V] in v_new's dtype.
    """
    T, H, K = q.shape
    HV, V = v_new.shape[1], v_new.shape[2]
    z, weight, eps = norm
    if z.shape != v_new.shape or z.stride(2) != 1 or weight.shape != (V,) or weight.stride(0) != 1:
        raise ValueError(f"norm: z {tuple(z.shape)} must be [T, HV, V] = {tuple(v_new.shape)} with unit stride "
                         f"over V, weight [V={V}] contiguous, got {tuple(weight.shape)}")
    if triton.next_power_of_2(K) != K or triton.next_power_of_2(V) != V:
        raise ValueError(f"head dims K={K}, V={V} must be powers of two")
    if not (q.is_contiguous() and k.is_contiguous() and v_new.is_contiguous() and h.is_contiguous()
            and g_cum.is_contiguous()):
        raise ValueError("q, k, v_new, h and g_cum must be contiguous")
    y = torch.empty_like(v_new)
    NT = chunk_indices.shape[0]
    if T == 0 or NT == 0:
        return y
    chunk_o_norm_kernel[(NT, HV)](q, k, v_new, h, g_cum, z, weight, y, cu_seqlens, chunk_indices, scale, eps, T,
                                  z.stride(0), z.stride(1), H=H, HV=HV, K=K, V=V, BT=chunk,
                                  ROUND_W=torch.promote_types(weight.dtype, v_new.dtype) == v_new.dtype,
                                  num_warps=8 if K * V >= 128 * 128 else 4, num_stages=1, **launch_options())
    return y
