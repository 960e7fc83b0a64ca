"""The WY form of every chunk in one launch: the project's own intra-chunk kernel.

Per chunk of BT = 64 tokens and value head, with G the chunk-local cumsum of the log2 decay:
    A = strict_lower(diag(beta) K K^T * 2^(G_t - G_j))
    W = (I + A)^-1 diag(beta 2^G) K        U = (I + A)^-1 diag(beta) V
(`chunk_torch.py` solves the same system for U - W S directly.) fla 0.6.0 takes two launches and
a memset for this (`chunk_gated_delta_rule_fwd_intra`): a zeroed [T, HV, 64] buffer, its fused
KK^T + solve writing (I + A)^-1 there in bf16, and `recompute_w_u` reading it back. Here the
inverse never leaves registers: measured 1,279 GB/s against a ~4,160 GB/s floor
(`bench/kernel_floors.py`, session 31), fla's pair was the non-GEMM time furthest over its floor.

The chunk is four blocks of BC = 16 rows. Each diagonal block's (I + A_cc)^-1 comes by forward
substitution, row by row in fp32; the blocks below the diagonal by block forward substitution,
    X_rc = -X_rr sum_{c <= m < r} A_rm X_mc,
with fp32 products (`ieee`: no tf32 rounding of the inverse). X is rounded to the activations'
dtype once, for the W and U products, as fla's stored inverse is.

One config, no autotune: the forward substitution's row sums follow the warp layout, so configs
may differ in the last bits, and served results must not depend on which config a shape class
picked. Not yet in the served path: `indexed_chunk_gated_delta_rule(wy="kev")` runs it; the
default stays fla's pair until a GPU has timed both side by side (`bench/kernel_floors.py`, the
"delta_rule_wy (ours, ...)" rows, three configs).

Reference: `chunk_torch.chunk_gated_delta_rule` (the same maths, solved), fla's
`chunk_gated_delta_rule_fwd_intra` (the same outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import chunk_entry

# Compiled for sm_90 at Kev-4B's heads (bench/kernel_resources.py), the kernel holds A's and its
# inverse's ten [16, 16] blocks at once, as fla's KK^T + solve does: 4 warps use 255 registers a
# thread (8 bytes of stack at BK 32 or 64), 8 warps 254 (none at BK 64), 1 or 2 warps spill
# 232-1,432 bytes. fla's KK^T + solve: 255 registers at 2-4 warps, spilling at 1. Which of the
# unspilled ones is fastest, only a GPU can say (kernel_floors times them beside fla's pair).
WY_NUM_WARPS, WY_BLOCK = 4, 64


@triton.jit
def _block_rows(i_t, c, L, BT: tl.constexpr, BC: tl.constexpr):
    """Token offsets (in the sequence) of the c-th BC-row block of chunk i_t, and which are real."""
    o_t = i_t * BT + c * BC + tl.arange(0, BC)
    return o_t, o_t < L


@triton.jit
def _tile(p, o_t, m_t, o_f, m_f, stride_t):
    """A row block [BC, BF] of a [T, ..., F] tensor (zeros past the sequence and the features)."""
    return tl.load(p + o_t[:, None] * stride_t + o_f[None, :], mask=m_t[:, None] & m_f[None, :], other=0.0)


@triton.jit
def _scaled(b_kk, b_beta, b_g_r, b_g_c, m_r, m_c, BC: tl.constexpr, DIAGONAL: tl.constexpr):
    """diag(beta) (K_r K_c^T * 2^(G_r - G_c)) of two row blocks from their K_r K_c^T, on real rows
    and columns (strictly below the diagonal in a diagonal block); zeros elsewhere, where a padded G
    could overflow the exp2."""
    keep = m_r[:, None] & m_c[None, :]
    if DIAGONAL:
        o_i = tl.arange(0, BC)
        keep = keep & (o_i[:, None] > o_i[None, :])
    return tl.where(keep, b_kk * tl.exp2(b_g_r[:, None] - b_g_c[None, :]), 0.0) * b_beta[:, None]


@triton.jit
def _unit_lower_inverse(b_a, n_rows, BC: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [BC, BC] block A, by forward substitution: row i of
    the inverse is e_i - sum_{m < i} A[i, m] X[m, :] (rows from n_rows on are zero in A: identity)."""
    o_i = tl.arange(0, BC)
    b_x = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for i in range(1, n_rows):
        b_row = tl.sum(tl.where(o_i[:, None] == i, b_a, 0.0), 0)  # A[i, :], indexed by column
        b_x = tl.where(o_i[:, None] == i, b_x - tl.sum(b_row[:, None] * b_x, 0)[None, :], b_x)
    return b_x


@triton.jit
def _times_inverse(p_x, p_out, stride_x, stride_out, F: tl.constexpr, BF: tl.constexpr,
                   o_0, o_1, o_2, o_3, m_0, m_1, m_2, m_3, s_0, s_1, s_2, s_3,
                   x00, x10, x11, x20, x21, x22, x30, x31, x32, x33):
    """out = X diag(s) x over a chunk's four row blocks, BF features at a time: X's ten blocks on
    and below the diagonal times each row block of x scaled by its rows' s, rounded to X's dtype
    (the activations') for the product."""
    for f0 in range(0, F, BF):
        o_f = f0 + tl.arange(0, BF)
        m_f = o_f < F
        b_0 = (_tile(p_x, o_0, m_0, o_f, m_f, stride_x).to(tl.float32) * s_0[:, None]).to(x00.dtype)
        b_1 = (_tile(p_x, o_1, m_1, o_f, m_f, stride_x).to(tl.float32) * s_1[:, None]).to(x00.dtype)
        b_2 = (_tile(p_x, o_2, m_2, o_f, m_f, stride_x).to(tl.float32) * s_2[:, None]).to(x00.dtype)
        b_3 = (_tile(p_x, o_3, m_3, o_f, m_f, stride_x).to(tl.float32) * s_3[:, None]).to(x00.dtype)
        _store_rows(p_out, tl.dot(x00, b_0), o_0, m_0, o_f, m_f, stride_out)
        _store_rows(p_out, tl.dot(x11, b_1, tl.dot(x10, b_0)), o_1, m_1, o_f, m_f, stride_out)
        _store_rows(p_out, tl.dot(x22, b_2, tl.dot(x21, b_1, tl.dot(x20, b_0))), o_2, m_2, o_f, m_f, stride_out)
        _store_rows(p_out, tl.dot(x33, b_3, tl.dot(x32, b_2, tl.dot(x31, b_1, tl.dot(x30, b_0)))), o_3, m_3, o_f,
                    m_f, stride_out)


@triton.jit
def _store_rows(p, b, o_t, m_t, o_f, m_f, stride_t):
    tl.store(p + o_t[:, None] * stride_t + o_f[None, :], b.to(p.dtype.element_ty), mask=m_t[:, None] & m_f[None, :])


@triton.jit
def chunk_wy_fwd_kernel(
    k,  # [T, H, K] normalised keys
    v,  # [T, HV, V]
    g,  # [T, HV] fp32 chunk-local cumsum of the log2 decay
    beta,  # [T, HV]
    w,  # out: [T, HV, K], k's dtype
    u,  # out: [T, HV, V], v's dtype
    cu_seqlens,  # [N + 1]
    chunk_indices,  # [NT, 2] (sequence, chunk within it)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_ct, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, L = chunk_entry(chunk_indices, cu_seqlens, i_ct)
    p_k = k + bos * H * K + (i_h // (HV // H)) * K  # value head i_h reads key head i_h // (HV / H)
    p_g = g + bos * HV + i_h
    p_b = beta + bos * HV + i_h

    o_0, m_0 = _block_rows(i_t, 0, L, BT, BC)
    o_1, m_1 = _block_rows(i_t, 1, L, BT, BC)
    o_2, m_2 = _block_rows(i_t, 2, L, BT, BC)
    o_3, m_3 = _block_rows(i_t, 3, L, BT, BC)
    b_g0 = tl.load(p_g + o_0 * HV, mask=m_0, other=0.0)
    b_g1 = tl.load(p_g + o_1 * HV, mask=m_1, other=0.0)
    b_g2 = tl.load(p_g + o_2 * HV, mask=m_2, other=0.0)
    b_g3 = tl.load(p_g + o_3 * HV, mask=m_3, other=0.0)
    b_b0 = tl.load(p_b + o_0 * HV, mask=m_0, other=0.0).to(tl.float32)
    b_b1 = tl.load(p_b + o_1 * HV, mask=m_1, other=0.0).to(tl.float32)
    b_b2 = tl.load(p_b + o_2 * HV, mask=m_2, other=0.0).to(tl.float32)
    b_b3 = tl.load(p_b + o_3 * HV, mask=m_3, other=0.0).to(tl.float32)

    # K K^T's ten blocks on and below the diagonal, BK features at a time
    s_k = H * K
    b_a00 = tl.zeros([BC, BC], dtype=tl.float32)
    b_a11, b_a22, b_a33 = tl.zeros_like(b_a00), tl.zeros_like(b_a00), tl.zeros_like(b_a00)
    b_a10, b_a20, b_a21 = tl.zeros_like(b_a00), tl.zeros_like(b_a00), tl.zeros_like(b_a00)
    b_a30, b_a31, b_a32 = tl.zeros_like(b_a00), tl.zeros_like(b_a00), tl.zeros_like(b_a00)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_k0 = _tile(p_k, o_0, m_0, o_k, m_k, s_k)
        b_k1 = _tile(p_k, o_1, m_1, o_k, m_k, s_k)
        b_k2 = _tile(p_k, o_2, m_2, o_k, m_k, s_k)
        b_k3 = _tile(p_k, o_3, m_3, o_k, m_k, s_k)
        b_a00 = tl.dot(b_k0, tl.trans(b_k0), b_a00)
        b_a11 = tl.dot(b_k1, tl.trans(b_k1), b_a11)
        b_a22 = tl.dot(b_k2, tl.trans(b_k2), b_a22)
        b_a33 = tl.dot(b_k3, tl.trans(b_k3), b_a33)
        b_a10 = tl.dot(b_k1, tl.trans(b_k0), b_a10)
        b_a20 = tl.dot(b_k2, tl.trans(b_k0), b_a20)
        b_a21 = tl.dot(b_k2, tl.trans(b_k1), b_a21)
        b_a30 = tl.dot(b_k3, tl.trans(b_k0), b_a30)
        b_a31 = tl.dot(b_k3, tl.trans(b_k1), b_a31)
        b_a32 = tl.dot(b_k3, tl.trans(b_k2), b_a32)
    # A = diag(beta) (K K^T * decay), strictly lower
    b_a00 = _scaled(b_a00, b_b0, b_g0, b_g0, m_0, m_0, BC, True)
    b_a11 = _scaled(b_a11, b_b1, b_g1, b_g1, m_1, m_1, BC, True)
    b_a22 = _scaled(b_a22, b_b2, b_g2, b_g2, m_2, m_2, BC, True)
    b_a33 = _scaled(b_a33, b_b3, b_g3, b_g3, m_3, m_3, BC, True)
    b_a10 = _scaled(b_a10, b_b1, b_g1, b_g0, m_1, m_0, BC, False)
    b_a20 = _scaled(b_a20, b_b2, b_g2, b_g0, m_2, m_0, BC, False)
    b_a21 = _scaled(b_a21, b_b2, b_g2, b_g1, m_2, m_1, BC, False)
    b_a30 = _scaled(b_a30, b_b3, b_g3, b_g0, m_3, m_0, BC, False)
    b_a31 = _scaled(b_a31, b_b3, b_g3, b_g1, m_3, m_1, BC, False)
    b_a32 = _scaled(b_a32, b_b3, b_g3, b_g2, m_3, m_2, BC, False)

    # (I + A)^-1: the diagonal blocks (a block past the sequence's end runs no step), then the rest
    # by block forward substitution
    n_rows = L - i_t * BT
    b_x00 = _unit_lower_inverse(b_a00, tl.minimum(n_rows, BC), BC)
    b_x11 = _unit_lower_inverse(b_a11, tl.minimum(n_rows - BC, BC), BC)
    b_x22 = _unit_lower_inverse(b_a22, tl.minimum(n_rows - 2 * BC, BC), BC)
    b_x33 = _unit_lower_inverse(b_a33, tl.minimum(n_rows - 3 * BC, BC), BC)
    b_x10 = -tl.dot(b_x11, tl.dot(b_a10, b_x00, input_precision="ieee"), input_precision="ieee")
    b_x21 = -tl.dot(b_x22, tl.dot(b_a21, b_x11, input_precision="ieee"), input_precision="ieee")
    b_x32 = -tl.dot(b_x33, tl.dot(b_a32, b_x22, input_precision="ieee"), input_precision="ieee")
    b_x20 = -tl.dot(b_x22, tl.dot(b_a20, b_x00, input_precision="ieee")
                    + tl.dot(b_a21, b_x10, input_precision="ieee"), input_precision="ieee")
    b_x31 = -tl.dot(b_x33, tl.dot(b_a31, b_x11, input_precision="ieee")
                    + tl.dot(b_a32, b_x21, input_precision="ieee"), input_precision="ieee")
    b_x30 = -tl.dot(b_x33, tl.dot(b_a30, b_x00, input_precision="ieee")
                    + tl.dot(b_a31, b_x10, input_precision="ieee")
                    + tl.dot(b_a32, b_x20, input_precision="ieee"), input_precision="ieee")
    dt = k.dtype.element_ty
    x00, x10, x11, x20, x21, x22 = b_x00.to(dt), b_x10.to(dt), b_x11.to(dt), b_x20.to(dt), b_x21.to(dt), b_x22.to(dt)
    x30, x31, x32, x33 = b_x30.to(dt), b_x31.to(dt), b_x32.to(dt), b_x33.to(dt)

    # W = X diag(beta 2^G) K and U = X diag(beta) V
    _times_inverse(p_k, w + bos * HV * K + i_h * K, s_k, HV * K, K, BK, o_0, o_1, o_2, o_3, m_0, m_1, m_2, m_3,
                   b_b0 * tl.exp2(b_g0), b_b1 * tl.exp2(b_g1), b_b2 * tl.exp2(b_g2), b_b3 * tl.exp2(b_g3),
                   x00, x10, x11, x20, x21, x22, x30, x31, x32, x33)
    _times_inverse(v + bos * HV * V + i_h * V, u + bos * HV * V + i_h * V, HV * V, HV * V, V, BK,
                   o_0, o_1, o_2, o_3, m_0, m_1, m_2, m_3, b_b0, b_b1, b_b2, b_b3,
                   x00, x10, x11, x20, x21, x22, x30, x31, x32, x33)


def chunk_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_indices: torch.Tensor,
    *,
    num_warps: int = WY_NUM_WARPS,
    block: int = WY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W and U of every chunk of 64 tokens (the module docstring).

    k:             [T, H, K] normalised keys, contiguous
    v:             [T, HV, V] values, contiguous; HV a multiple of H
    g:             [T, HV] fp32 chunk-local cumsum of the log2 decay (`prep.delta_rule_inputs`)
    beta:          [T, HV], contiguous
    cu_seqlens:    [N + 1]; chunk_indices [NT, 2] (fla's prepare_chunk_indices(cu_seqlens, 64))
    Returns (w [T, HV, K] in k's dtype, u [T, HV, V] in v's dtype).
    """
    T, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    if v.shape[0] != T or HV % H:
        raise ValueError(f"v {tuple(v.shape)} must be [T={T}, HV, V] with HV a multiple of H={H}")
    if tuple(g.shape) != (T, HV) or tuple(beta.shape) != (T, HV) or g.dtype != torch.float32:
        raise ValueError(f"g {tuple(g.shape)} {g.dtype} must be fp32 [T={T}, HV={HV}], beta {tuple(beta.shape)} [T, HV]")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} must be contiguous, strides {t.stride()}")
    w = torch.empty((T, HV, K), dtype=k.dtype, device=k.device)
    u = torch.empty((T, HV, V), dtype=v.dtype, device=v.device)
    NT = chunk_indices.shape[0]
    if NT == 0 or T == 0:
        return w, u
    chunk_wy_fwd_kernel[(NT, HV)](
        k, v, g, beta, w, u, cu_seqlens.contiguous(), chunk_indices.contiguous(),
        H=H, HV=HV, K=K, V=V, BT=64, BC=16, BK=block, num_warps=num_warps, **launch_options())
    return w, u
