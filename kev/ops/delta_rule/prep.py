"""The delta rule's inputs in one launch: q and k L2-normalised, the gates formed and summed per chunk.

Per DeltaNet layer the chunked delta rule needs q and k L2-normalised per head (contiguous
[T, H, K] copies: fla's WY and output kernels read them so), beta = sigmoid(b), and the chunk-local
cumsum of the log decay g = -exp(A_log) softplus(a + dt_bias), in log2 units (fla 0.6.0's gate
convention: every decay is an exp2). These were three launches (our strided L2 norm, the gates,
fla's `chunk_local_cumsum`) and an fp32 round trip of g through memory. Here one program per (chunk,
key head) does all of it for its 64 tokens: both heads' norms, then the gates of the value heads
that read that key head (value head j reads key head j // (HV / H)), summed along the chunk.

One fixed block shape, no autotune: the only reductions (a row's sum of squares, a chunk's cumsum)
then have one order, in every process.

The gates come from the layer's projections (`DeltaGates` with a, b: the model's) or are given as
g and beta (tests). Reference: `delta_rule_inputs_reference` (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fla.ops.utils.constant import RCP_LN2

from kev.ops.fused.activations import round_to
from kev.ops.gates import DeltaGates
from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import chunk_entry

CHUNK = 64  # BT of every chunked piece of the delta rule (fla's fused KK^T solve needs 64)
L2_EPS = 1e-6  # x / sqrt(|x|^2 + eps), as the reference (kev.ops.torch_ops.l2_normalize)


@triton.jit
def _l2_normalised_heads(x, y, tok, m, o_k, i_h, stride_t, stride_h, eps, H: tl.constexpr, K: tl.constexpr):
    """Head i_h of x at tokens `tok` ([BT]) normalised into the contiguous [T, H, K] y."""
    b_x = tl.load(x + tok[:, None] * stride_t + i_h * stride_h + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    b_y = b_x * tl.rsqrt(tl.sum(b_x * b_x, 1) + eps)[:, None]
    tl.store(y + (tok[:, None] * H + i_h) * K + o_k[None, :], b_y.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["T"])
def delta_rule_prep_kernel(
    q, k,  # [T, H, K] raw, any strides over T and H, unit stride over K
    a, b,  # RAW: the [T, HV] a and b projections through row strides; else g [T, HV] fp32 and beta
    A_log, dt_bias,  # [HV] (RAW only)
    q_out, k_out,  # [T, H, K] contiguous: normalised
    g_out,  # [T, HV] fp32 contiguous: the chunk-local cumsum of the log decay, in log2 units
    beta_out,  # [T, HV] contiguous
    cu_seqlens,  # [N + 1]
    chunk_indices,  # [NT, 2] (sequence, chunk within it)
    T, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_a_t, stride_b_t,
    eps, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr,
    RAW: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_ct, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, L = chunk_entry(chunk_indices, cu_seqlens, i_ct)
    o_t = i_t * BT + tl.arange(0, BT)  # [BT] token inside the sequence
    m_t = o_t < L  # a chunk-list entry past its sequence's end (a CUDA-graph key's no-op) masks all
    tok = bos + o_t

    o_k = tl.arange(0, BK)
    m = m_t[:, None] & (o_k < K)[None, :]
    _l2_normalised_heads(q, q_out, tok, m, o_k, i_h, stride_q_t, stride_q_h, eps, H, K)
    _l2_normalised_heads(k, k_out, tok, m, o_k, i_h, stride_k_t, stride_k_h, eps, H, K)

    G: tl.constexpr = HV // H
    o_g = tl.arange(0, BG)
    o_hv = i_h * G + o_g  # the value heads that read key head i_h
    m_g = m_t[:, None] & (o_g < G)[None, :]
    DB: tl.constexpr = beta_out.dtype.element_ty
    b_b = tl.load(b + tok[:, None] * stride_b_t + o_hv[None, :], mask=m_g, other=0.0)
    b_a = tl.load(a + tok[:, None] * stride_a_t + o_hv[None, :], mask=m_g, other=0.0).to(tl.float32)
    if RAW:
        b_b = b_b.to(tl.float32)
        b_d = round_to(1.0 + round_to(tl.exp(-b_b), DB), DB)
        b_beta = tl.math.div_rn(1.0, b_d)  # sigmoid(b), rounded to b's dtype as the reference's steps
        b_x = b_a + tl.load(dt_bias + o_hv, mask=o_g < G, other=0.0).to(tl.float32)[None, :]
        # softplus: x above 20, else log1p(exp(x)); log1p(e) = log(u) * e / (u - 1) with u = 1 + e (exact as u -> 1)
        b_e = tl.exp(tl.minimum(b_x, 20.0))
        b_u = 1.0 + b_e
        b_lp = tl.where(b_u == 1.0, b_e, tl.log(b_u) * tl.math.div_rn(b_e, tl.where(b_u == 1.0, 1.0, b_u - 1.0)))
        b_sp = tl.where(b_x > 20.0, b_x, b_lp)
        b_A = tl.load(A_log + o_hv, mask=o_g < G, other=0.0).to(tl.float32)
        b_g = -tl.exp(b_A)[None, :] * b_sp
    else:
        b_beta, b_g = b_b, b_a  # given: beta and the log decay
    # Tokens past the sequence's end follow its last one, so their terms never reach a kept sum.
    b_g = tl.cumsum(b_g, axis=0) * scale
    o_out = tok[:, None] * HV + o_hv[None, :]
    tl.store(g_out + o_out, b_g, mask=m_g)
    tl.store(beta_out + o_out, b_beta.to(DB), mask=m_g)


def _columns(name: str, t: torch.Tensor, T: int, HV: int) -> int:
    if tuple(t.shape) != (T, HV) or (HV > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be [T={T}, HV={HV}] with unit stride over HV, got {tuple(t.shape)} "
                         f"strides {t.stride()}")
    return t.stride(0)


def delta_rule_inputs(q: torch.Tensor, k: torch.Tensor, gates: DeltaGates, cu_seqlens: torch.Tensor,
                      chunk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the chunked delta rule reads, in one launch.

    q, k:          [T, H, K] raw, unit stride over K (column views of the conv's output are fine)
    gates:         the pass's gates ([T, HV], HV a multiple of H): raw projections or given
    cu_seqlens:    [N + 1]; chunk_indices: [NT, 2] fla's prepare_chunk_indices(cu_seqlens, 64); every
                   token in exactly one entry (entries past their sequence's end are no-ops)
    Returns (q, k normalised: contiguous [T, H, K] in q's dtype; g: [T, HV] fp32 chunk-local cumsum
    of the log decay in log2 units; beta: [T, HV] contiguous, in b's (given: beta's) dtype).
    """
    if q.ndim != 3 or k.shape != q.shape or q.stride(2) != 1 or k.stride(2) != 1 or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, K] of one dtype with unit "
                         f"stride over K, got strides {q.stride()} {k.stride()}")
    T, H, K = q.shape
    HV = gates.shape[1] if len(gates.shape) == 2 else -1
    if HV < 1 or HV % H:
        raise ValueError(f"gates {tuple(gates.shape)} must be [T={T}, HV] with HV a multiple of H={H}")
    if gates.raw:
        x, y = gates.a, gates.b
        for name, t in (("A_log", gates.A_log), ("dt_bias", gates.dt_bias)):
            if tuple(t.shape) != (HV,) or t.stride(0) != 1:
                raise ValueError(f"{name} must be a contiguous [HV={HV}], got {tuple(t.shape)}")
    else:
        x, y = gates.g, gates.beta
        if x.dtype != torch.float32:
            raise ValueError(f"g must be fp32, got {x.dtype}")
    stride_a, stride_b = _columns("a" if gates.raw else "g", x, T, HV), _columns("b" if gates.raw else "beta", y, T, HV)
    q_out, k_out = (torch.empty((T, H, K), dtype=q.dtype, device=q.device) for _ in range(2))
    g = torch.empty((T, HV), dtype=torch.float32, device=q.device)
    beta = torch.empty((T, HV), dtype=y.dtype, device=q.device)
    NT = chunk_indices.shape[0]
    if T == 0 or NT == 0:
        return q_out, k_out, g, beta
    A_log, dt_bias = (gates.A_log, gates.dt_bias) if gates.raw else (x, x)  # unread when given
    delta_rule_prep_kernel[(NT, H)](
        q, k, x, y, A_log, dt_bias, q_out, k_out, g, beta, cu_seqlens.contiguous(), chunk_indices.contiguous(),
        T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), stride_a, stride_b, L2_EPS, RCP_LN2,
        H=H, HV=HV, K=K, BK=triton.next_power_of_2(K), BT=CHUNK, BG=triton.next_power_of_2(HV // H),
        RAW=gates.raw, num_warps=4, **launch_options())
    return q_out, k_out, g, beta


def delta_rule_inputs_reference(q: torch.Tensor, k: torch.Tensor, gates: DeltaGates, cu_seqlens: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`delta_rule_inputs` in plain torch: fp32 maths (the gates as `DeltaGates.values`), each
    sequence's cumsum restarting every CHUNK tokens."""
    qn = (q.float() * torch.rsqrt((q.float() ** 2).sum(-1, keepdim=True) + L2_EPS)).to(q.dtype)
    kn = (k.float() * torch.rsqrt((k.float() ** 2).sum(-1, keepdim=True) + L2_EPS)).to(k.dtype)
    g, beta = gates.values()
    g = g.float().clone()
    cu = cu_seqlens.tolist()
    for s, e in zip(cu, cu[1:]):
        for c in range(s, e, CHUNK):
            g[c:min(c + CHUNK, e)] = g[c:min(c + CHUNK, e)].cumsum(0)
    return qn, kn, g * RCP_LN2, beta.contiguous()
