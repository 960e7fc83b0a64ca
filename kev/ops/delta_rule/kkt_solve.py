"""The delta rule's intra-chunk inverse, (I + A)^-1 per chunk and value head, for fla's WY recompute.

Per chunk of BT = 64 tokens and value head, with G the chunk-local cumsum of the log2 decay,
    A = strict_lower(diag(beta) K K^T * 2^(G_i - G_j)),
and fla's `recompute_w_u_fwd` turns (I + A)^-1 into W and U. fla 0.6.0's fused KK^T + solve
(`chunk_gated_delta_rule_fwd_kkt_solve_kernel`) ran at ~0.23 of the memory floor in the H200
state pass's profile (10.5 ms against ~2.4 ms). Two things differ here:

1. Each diagonal [16, 16] block's inverse by repeated squaring: with N = -A_cc strictly lower,
   N^16 = 0 and (I + A_cc)^-1 = (I + N)(I + N^2)(I + N^4)(I + N^8): six small products. fla
   forward-substitutes row by row, 14 dependent steps of two reductions across the program each.
   The blocks below the diagonal come from the same block forward substitution as fla's,
   X_rc = -X_rr sum_{c <= m < r} A_rm X_mc. Compiled for sm_90 at Kev-4B's heads this needs
   201-224 registers a thread and no spills, where fla's kernel needs 255.
2. Optionally (`heads_per_program` > 1) one program for several value heads of one key head: K K^T
   is the same for the value heads that read a key head (HV / H of them, 2 at Kev-4B), so it is
   formed once and k read once, each value head then applying its own gates and beta to it. It
   holds K K^T across the heads and spills (64-168 bytes a thread): the bench times both.

The output is written whole, zeros above the diagonal, so no memset precedes it (fla zeroes its
buffer first). One config served (the first of `KKT_CONFIGS`), no autotune: served results must not
depend on a shape class's pick. The others are the bench's candidates.

Reference: `kkt_solve_reference` (fp64, torch), fla's fused kernel (the same output up to rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import chunk_entry

on = False  # True: indexed_scan forms (I + A)^-1 with this kernel, then fla's recompute_w_u (bench: `--kkt-solve`)

BT, BC = 64, 16  # the chunk (fla's WY recompute reads [T, HV, 64]) and its four row blocks
# The block merges' products in tf32, as fla's. The diagonal inverses' in fp32 (fla substitutes in fp32):
# "ieee" on the FMA units or "tf32x3" on the tensor cores (three tf32 products, about fp32's
# accuracy), a config's choice: session 33's kernel lost with its merges as "ieee" dots.
MERGE_PRECISION: tl.constexpr = tl.constexpr("tf32")
# (num_warps, BK, value heads a program (0: all of a key head's), diagonal precision): the candidates
# the bench times; the first is the one served. Configs of one precision compute each element with the
# same products in the same order (BK splits the K K^T sums at multiples of 16, as the dots do anyway).
# Compiled for sm_90 at Kev-4B's heads: the "ieee" configs of one value head a program use 201-224
# registers and spill none; K K^T shared by two heads, or "tf32x3", spill 72-136 bytes a thread.
KKT_CONFIGS = ((4, 64, 1, "ieee"), (2, 64, 1, "ieee"), (1, 64, 1, "ieee"), (8, 64, 1, "ieee"), (4, 64, 0, "ieee"),
               (4, 64, 1, "tf32x3"))
NUM_WARPS, BLOCK_K, HEADS_PER_PROGRAM, DIAGONAL = KKT_CONFIGS[0]


@triton.jit
def _rows(i_t, c, L, BC: tl.constexpr):
    """Token offsets (in the sequence) of row block c of chunk i_t (four blocks a chunk), and which are real."""
    o_t = (i_t * 4 + c) * BC + tl.arange(0, BC)
    return o_t, o_t < L


@triton.jit
def _scaled(b_kk, b_beta, b_g_r, b_g_c, m_r, m_c, DIAGONAL: tl.constexpr, BC: tl.constexpr):
    """diag(beta_r) (K_r K_c^T * 2^(G_r - G_c)) on real rows and columns (strictly below the diagonal
    in a diagonal block), zeros elsewhere, where a padded G could overflow the exp2."""
    keep = m_r[:, None] & m_c[None, :]
    if DIAGONAL:
        o_i = tl.arange(0, BC)
        keep = keep & (o_i[:, None] > o_i[None, :])
    return tl.where(keep, b_kk * tl.exp2(b_g_r[:, None] - b_g_c[None, :]), 0.0) * b_beta[:, None]


@triton.jit
def _unit_lower_inverse(b_a, BC: tl.constexpr, PRECISION: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular [16, 16] A: with N = -A (N^16 = 0), the product
    (I + N)(I + N^2)(I + N^4)(I + N^8), each factor's power the last one squared."""
    o_i = tl.arange(0, BC)
    b_p = -b_a
    b_x = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0) + b_p
    for _ in tl.static_range(3):
        b_p = tl.dot(b_p, b_p, input_precision=PRECISION)
        b_x += tl.dot(b_x, b_p, input_precision=PRECISION)
    return b_x


@triton.jit
def _store(p_a, b, o_r, m_r, c, BC: tl.constexpr):
    """Block (row block of o_r, column block c) of one value head's rows of A ([.., 64] at p_a, row stride HV * 64)."""
    o_c = c * BC + tl.arange(0, BC)
    tl.store(p_a + o_r[:, None] + o_c[None, :], b.to(p_a.dtype.element_ty), mask=m_r[:, None])


@triton.jit(do_not_specialize=["T"])
def kkt_solve_kernel(
    k,  # [T, H, K] contiguous, normalised
    g,  # [T, HV] fp32 contiguous: chunk-local cumsum of the log2 decay
    beta,  # [T, HV] contiguous
    a_inv,  # out: [T, HV, 64] in k's dtype, whole rows (zeros above the diagonal)
    cu_seqlens,  # [N + 1]
    chunk_indices,  # [NT, 2] (sequence, chunk within it)
    T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    VPP: tl.constexpr,  # value heads a program (of those that read its key head)
    DIAGONAL_PRECISION: tl.constexpr,  # of the diagonal inverses' products: "ieee" or "tf32x3"
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_ct, i_p = tl.program_id(0), tl.program_id(1)
    G: tl.constexpr = HV // H
    i_h = i_p * VPP // G  # the key head of this program's value heads
    i_n, i_t, bos, L = chunk_entry(chunk_indices, cu_seqlens, i_ct)
    o_0, m_0 = _rows(i_t, 0, L, BC)
    o_1, m_1 = _rows(i_t, 1, L, BC)
    o_2, m_2 = _rows(i_t, 2, L, BC)
    o_3, m_3 = _rows(i_t, 3, L, BC)
    n_tok = L - i_t * 4 * BC  # tokens of the chunk (<= 0: a CUDA-graph key's no-op entry)

    # K K^T's ten blocks on and below the diagonal, once for every value head of this key head
    b_kk00 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk11 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk22 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk32 = tl.zeros([BC, BC], dtype=tl.float32)
    b_kk33 = tl.zeros([BC, BC], dtype=tl.float32)
    p_k = k + (bos * H + i_h) * K
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_k0 = tl.load(p_k + o_0[:, None] * (H * K) + o_k[None, :], mask=m_0[:, None] & m_k[None, :], other=0.0)
        b_kk00 = tl.dot(b_k0, tl.trans(b_k0), b_kk00)
        if n_tok > BC:  # row blocks past the chunk's tokens stay zero: short rows skip their products
            b_k1 = tl.load(p_k + o_1[:, None] * (H * K) + o_k[None, :], mask=m_1[:, None] & m_k[None, :], other=0.0)
            b_kk10 = tl.dot(b_k1, tl.trans(b_k0), b_kk10)
            b_kk11 = tl.dot(b_k1, tl.trans(b_k1), b_kk11)
            if n_tok > 2 * BC:
                b_k2 = tl.load(p_k + o_2[:, None] * (H * K) + o_k[None, :], mask=m_2[:, None] & m_k[None, :],
                               other=0.0)
                b_kk20 = tl.dot(b_k2, tl.trans(b_k0), b_kk20)
                b_kk21 = tl.dot(b_k2, tl.trans(b_k1), b_kk21)
                b_kk22 = tl.dot(b_k2, tl.trans(b_k2), b_kk22)
                if n_tok > 3 * BC:
                    b_k3 = tl.load(p_k + o_3[:, None] * (H * K) + o_k[None, :], mask=m_3[:, None] & m_k[None, :],
                                   other=0.0)
                    b_kk30 = tl.dot(b_k3, tl.trans(b_k0), b_kk30)
                    b_kk31 = tl.dot(b_k3, tl.trans(b_k1), b_kk31)
                    b_kk32 = tl.dot(b_k3, tl.trans(b_k2), b_kk32)
                    b_kk33 = tl.dot(b_k3, tl.trans(b_k3), b_kk33)

    for j in tl.static_range(VPP):
        i_hv = i_p * VPP + j
        p_g, p_b = g + bos * HV + i_hv, beta + bos * HV + i_hv
        b_g0 = tl.load(p_g + o_0 * HV, mask=m_0, other=0.0)
        b_g1 = tl.load(p_g + o_1 * HV, mask=m_1, other=0.0)
        b_g2 = tl.load(p_g + o_2 * HV, mask=m_2, other=0.0)
        b_g3 = tl.load(p_g + o_3 * HV, mask=m_3, other=0.0)
        b_b0 = tl.load(p_b + o_0 * HV, mask=m_0, other=0.0).to(tl.float32)
        b_b1 = tl.load(p_b + o_1 * HV, mask=m_1, other=0.0).to(tl.float32)
        b_b2 = tl.load(p_b + o_2 * HV, mask=m_2, other=0.0).to(tl.float32)
        b_b3 = tl.load(p_b + o_3 * HV, mask=m_3, other=0.0).to(tl.float32)
        b_a10 = _scaled(b_kk10, b_b1, b_g1, b_g0, m_1, m_0, False, BC)
        b_a20 = _scaled(b_kk20, b_b2, b_g2, b_g0, m_2, m_0, False, BC)
        b_a21 = _scaled(b_kk21, b_b2, b_g2, b_g1, m_2, m_1, False, BC)
        b_a30 = _scaled(b_kk30, b_b3, b_g3, b_g0, m_3, m_0, False, BC)
        b_a31 = _scaled(b_kk31, b_b3, b_g3, b_g1, m_3, m_1, False, BC)
        b_a32 = _scaled(b_kk32, b_b3, b_g3, b_g2, m_3, m_2, False, BC)
        b_x00 = _unit_lower_inverse(_scaled(b_kk00, b_b0, b_g0, b_g0, m_0, m_0, True, BC), BC, DIAGONAL_PRECISION)
        b_x11 = _unit_lower_inverse(_scaled(b_kk11, b_b1, b_g1, b_g1, m_1, m_1, True, BC), BC, DIAGONAL_PRECISION)
        b_x22 = _unit_lower_inverse(_scaled(b_kk22, b_b2, b_g2, b_g2, m_2, m_2, True, BC), BC, DIAGONAL_PRECISION)
        b_x33 = _unit_lower_inverse(_scaled(b_kk33, b_b3, b_g3, b_g3, m_3, m_3, True, BC), BC, DIAGONAL_PRECISION)
        # below the diagonal: X_rc = -X_rr sum_{c <= m < r} A_rm X_mc
        b_x10 = -tl.dot(tl.dot(b_x11, b_a10, input_precision=MERGE_PRECISION), b_x00, input_precision=MERGE_PRECISION)
        b_x21 = -tl.dot(tl.dot(b_x22, b_a21, input_precision=MERGE_PRECISION), b_x11, input_precision=MERGE_PRECISION)
        b_x32 = -tl.dot(tl.dot(b_x33, b_a32, input_precision=MERGE_PRECISION), b_x22, input_precision=MERGE_PRECISION)
        b_x20 = -tl.dot(b_x22, tl.dot(b_a20, b_x00, input_precision=MERGE_PRECISION)
                        + tl.dot(b_a21, b_x10, input_precision=MERGE_PRECISION), input_precision=MERGE_PRECISION)
        b_x31 = -tl.dot(b_x33, tl.dot(b_a31, b_x11, input_precision=MERGE_PRECISION)
                        + tl.dot(b_a32, b_x21, input_precision=MERGE_PRECISION), input_precision=MERGE_PRECISION)
        b_x30 = -tl.dot(b_x33, tl.dot(b_a30, b_x00, input_precision=MERGE_PRECISION)
                        + tl.dot(b_a31, b_x10, input_precision=MERGE_PRECISION)
                        + tl.dot(b_a32, b_x20, input_precision=MERGE_PRECISION), input_precision=MERGE_PRECISION)

        p_a = a_inv + (bos * HV + i_hv) * 64
        r_0, r_1, r_2, r_3 = o_0 * (HV * 64), o_1 * (HV * 64), o_2 * (HV * 64), o_3 * (HV * 64)
        b_zero = tl.zeros([BC, BC], dtype=tl.float32)
        _store(p_a, b_x00, r_0, m_0, 0, BC)
        _store(p_a, b_zero, r_0, m_0, 1, BC)
        _store(p_a, b_zero, r_0, m_0, 2, BC)
        _store(p_a, b_zero, r_0, m_0, 3, BC)
        _store(p_a, b_x10, r_1, m_1, 0, BC)
        _store(p_a, b_x11, r_1, m_1, 1, BC)
        _store(p_a, b_zero, r_1, m_1, 2, BC)
        _store(p_a, b_zero, r_1, m_1, 3, BC)
        _store(p_a, b_x20, r_2, m_2, 0, BC)
        _store(p_a, b_x21, r_2, m_2, 1, BC)
        _store(p_a, b_x22, r_2, m_2, 2, BC)
        _store(p_a, b_zero, r_2, m_2, 3, BC)
        _store(p_a, b_x30, r_3, m_3, 0, BC)
        _store(p_a, b_x31, r_3, m_3, 1, BC)
        _store(p_a, b_x32, r_3, m_3, 2, BC)
        _store(p_a, b_x33, r_3, m_3, 3, BC)


def kkt_solve(k: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
              chunk_indices: torch.Tensor, num_warps: int = NUM_WARPS, block_k: int = BLOCK_K,
              heads_per_program: int = HEADS_PER_PROGRAM, diagonal: str = DIAGONAL) -> torch.Tensor:
    """(I + strict_lower(diag(beta) K K^T * 2^(G_i - G_j)))^-1 of every chunk and value head.

    k:     [T, H, K] contiguous, normalised; g_cum [T, HV] fp32 contiguous, the chunk-local cumsum of
           the log2 decay; beta [T, HV] contiguous; HV a multiple of H (value head j reads key head j // (HV / H))
    chunk_indices: [NT, 2] fla's prepare_chunk_indices(cu_seqlens, 64); entries past their
           sequence's end are no-ops
    Returns [T, HV, 64] in k's dtype: row t holds its chunk's row of the inverse (fla's layout, what
    `recompute_w_u_fwd` reads as A).
    """
    if k.ndim != 3 or not k.is_contiguous():
        raise ValueError(f"k must be a contiguous [T, H, K], got {tuple(k.shape)} strides {k.stride()}")
    T, H, K = k.shape
    HV = g_cum.shape[-1] if g_cum.ndim == 2 else -1
    if HV < 1 or HV % H or tuple(g_cum.shape) != (T, HV) or tuple(beta.shape) != (T, HV):
        raise ValueError(f"g_cum {tuple(g_cum.shape)} and beta {tuple(beta.shape)} must be [T={T}, HV], HV a "
                         f"multiple of H={H}")
    if g_cum.dtype != torch.float32 or not (g_cum.is_contiguous() and beta.is_contiguous()):
        raise ValueError(f"g_cum must be fp32 (got {g_cum.dtype}); g_cum and beta contiguous")
    out = torch.empty((T, HV, BT), dtype=k.dtype, device=k.device)
    NT = chunk_indices.shape[0]
    if T == 0 or NT == 0:
        return out
    vpp = heads_per_program or HV // H
    if (HV // H) % vpp:
        raise ValueError(f"heads_per_program={vpp} must divide HV / H = {HV // H}")
    kkt_solve_kernel[(NT, HV // vpp)](k, g_cum, beta, out, cu_seqlens, chunk_indices, T, H=H, HV=HV, K=K, BC=BC,
                                      BK=min(block_k, triton.next_power_of_2(K)), VPP=vpp,
                                      DIAGONAL_PRECISION=diagonal, num_warps=num_warps,
                                      **launch_options())
    return out


def kkt_solve_reference(k: torch.Tensor, g_cum: torch.Tensor, beta: torch.Tensor,
                        cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`kkt_solve` in fp64 torch, chunk by chunk: the triangular system solved, not inverted by parts."""
    T, H, K = k.shape
    HV = g_cum.shape[1]
    kk = k.double().repeat_interleave(HV // H, dim=1)  # [T, HV, K]
    out = torch.zeros(T, HV, BT, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu, cu[1:]):
        for c in range(s, e, BT):
            n = min(c + BT, e) - c
            kc, gc, bc = kk[c:c + n].transpose(0, 1), g_cum[c:c + n].double().T, beta[c:c + n].double().T  # [HV, n, ..]
            a = (kc @ kc.transpose(1, 2)) * torch.exp2(gc[:, :, None] - gc[:, None, :]) * bc[:, :, None]
            a = torch.tril(a, diagonal=-1) + torch.eye(n, dtype=torch.float64)
            inv = torch.linalg.solve_triangular(a, torch.eye(n, dtype=torch.float64).expand(HV, n, n), upper=False)
            out[c:c + n, :, :n] = inv.transpose(0, 1)
    return out
