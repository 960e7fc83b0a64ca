"""Fused RMSNorm kernels of the GPU passes: each reads its inputs once and writes its outputs once.

- `rms_norm(x, weight, eps)`: Qwen3.5's zero-centred RMSNorm (fp32 maths, scale by 1 + weight).
- `add_rms_norm(x, h, weight, eps)`: the residual add and the next norm in one pass: (x + h, normed).
- `rms_norm_rope(x, weight, eps, cos, sin)`: the attention layers' per-head q/k norm, then
  rotate-half RoPE on the first `rotary_dim` channels.
- `gated_rms_norm(x, z, weight, eps)`: the DeltaNet output norm, plain `weight` scale, times silu(z).

Every kernel sees its input as rows: a [T, D] tensor, or a [T, H, D] one whose row r is token
r // H, head r % H, read through the tensor's strides (a column slice of a fused projection is
read in place; only the last dim must have unit stride). Outputs are contiguous. The maths follows
`reference.py` step by step, including the rounding to the activations' dtype between steps.
The launch block is picked from D alone (no autotune: nothing to tune inside a CUDA-graph capture).

Reference: `kev.ops.fused.reference` (what `TorchOps` runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import output_like


@triton.jit(do_not_specialize=["R"])
def rms_norm_fwd_kernel(
    x,  # [T, H, D] rows through (stride_x_t, stride_x_h), unit stride over D
    h,  # [T, H, D] residual added before the norm (HAS_RES), through (stride_h_t, stride_h_h)
    w,  # [D]
    cos, sin,  # [T, RD] RoPE tables (ROPE), row stride stride_r_t
    y,  # [R, D] contiguous out: the normalised rows
    s,  # [R, D] contiguous out: x + h (HAS_RES)
    R, eps,
    stride_x_t, stride_x_h, stride_h_t, stride_h_h, stride_r_t,
    H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    HAS_RES: tl.constexpr, ROPE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)  # [BR] row = (token, head)
    m_r = o_r < R
    o_t = (o_r // H).to(tl.int64)
    o_h = o_r % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    p_x = x + o_t[:, None] * stride_x_t + o_h[:, None] * stride_x_h  # [BR, 1]
    b_x = tl.load(p_x + o_d[None, :], mask=m, other=0.0).to(tl.float32)  # [BR, BD]
    if HAS_RES:
        b_h = tl.load(h + o_t[:, None] * stride_h_t + o_h[:, None] * stride_h_h + o_d[None, :], mask=m, other=0.0)
        b_s = (b_x + b_h.to(tl.float32)).to(s.dtype.element_ty)  # the residual stream stays in its dtype
        tl.store(s + o_r[:, None].to(tl.int64) * D + o_d[None, :], b_s, mask=m)
        b_x = b_s.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)  # [BR]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_x * b_rstd[:, None] * (1.0 + b_w)[None, :]
    if ROPE:
        HALF: tl.constexpr = RD // 2
        DT: tl.constexpr = y.dtype.element_ty
        b_y = b_y.to(DT).to(tl.float32)  # the norm's output dtype, as RoPE reads it
        m_rot = o_d < RD
        # the rotate-half partner of every rotary channel, normalised the same way
        o_p = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
        m_p = m_r[:, None] & m_rot[None, :]
        b_xp = tl.load(p_x + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)
        b_wp = tl.load(w + o_p, mask=m_rot, other=0.0).to(tl.float32)
        b_yp = (b_xp * b_rstd[:, None] * (1.0 + b_wp)[None, :]).to(DT).to(tl.float32)
        b_rot = tl.where((o_d < HALF)[None, :], -b_yp, b_yp)  # cat([-x2, x1])
        p_r = o_t[:, None] * stride_r_t + o_d[None, :]
        b_cos = tl.load(cos + p_r, mask=m_p, other=0.0).to(tl.float32)
        b_sin = tl.load(sin + p_r, mask=m_p, other=0.0).to(tl.float32)
        b_a = (b_y * b_cos).to(DT).to(tl.float32)
        b_b = (b_rot * b_sin).to(DT).to(tl.float32)
        b_y = tl.where(m_rot[None, :], b_a + b_b, b_y)
    tl.store(y + o_r[:, None].to(tl.int64) * D + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["R"])
def gated_rms_norm_fwd_kernel(
    x,  # [T, H, D] through (stride_x_t, stride_x_h)
    z,  # [T, H, D] gate through (stride_z_t, stride_z_h)
    w,  # [D]
    y,  # [R, D] contiguous out
    R, eps,
    stride_x_t, stride_x_h, stride_z_t, stride_z_h,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    ROUND_W: tl.constexpr,  # weight * normed is rounded to x's dtype (weight and x share it)
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_t = (o_r // H).to(tl.int64)
    o_h = o_r % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    DT: tl.constexpr = y.dtype.element_ty
    b_x = tl.load(x + o_t[:, None] * stride_x_t + o_h[:, None] * stride_x_h + o_d[None, :], mask=m,
                  other=0.0).to(tl.float32)  # [BR, BD]
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)
    b_n = (b_x * b_rstd[:, None]).to(DT).to(tl.float32)
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_hw = b_w[None, :] * b_n
    if ROUND_W:
        b_hw = b_hw.to(DT).to(tl.float32)
    b_z = tl.load(z + o_t[:, None] * stride_z_t + o_h[:, None] * stride_z_h + o_d[None, :], mask=m,
                  other=0.0).to(tl.float32)
    b_sz = tl.math.div_rn(b_z, 1.0 + tl.exp(-b_z))  # silu in fp32
    tl.store(y + o_r[:, None].to(tl.int64) * D + o_d[None, :], (b_hw * b_sz).to(DT), mask=m)


def _as_rows(name: str, t: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, D, stride_t, stride_h) of a [T, D] or [T, H, D] tensor with unit stride over D."""
    if t.ndim == 2:
        T, D = t.shape
        H, st, sh = 1, t.stride(0), 0
    elif t.ndim == 3:
        T, H, D = t.shape
        st, sh = t.stride(0), t.stride(1)
    else:
        raise ValueError(f"{name} must be [T, D] or [T, H, D], got {tuple(t.shape)}")
    if D > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} {tuple(t.shape)} needs unit stride over its last dim, strides {t.stride()}")
    return T, H, D, st, sh


def _row_block(D: int) -> tuple[int, int, int]:
    """(BR rows, BD >= D, num_warps): ~2k-4k elements per program."""
    BD = triton.next_power_of_2(D)
    BR = max(1, min(16, 2048 // BD))
    return BR, BD, 8 if BD >= 2048 else 4


def _check_weight(weight: torch.Tensor, D: int) -> None:
    if weight.shape != (D,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [D={D}], got {tuple(weight.shape)} strides {weight.stride()}")


def _launch_rms_norm(x, h, weight, eps, cos, sin):
    T, H, D, sx_t, sx_h = _as_rows("x", x)
    _check_weight(weight, D)
    sh_t = sh_h = 0
    if h is not None:
        if h.shape != x.shape:
            raise ValueError(f"residual h {tuple(h.shape)} must match x {tuple(x.shape)}")
        _, _, _, sh_t, sh_h = _as_rows("h", h)
    RD, sr_t = 0, 0
    if cos is not None:
        RD = cos.shape[-1]
        if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] != T or RD % 2 or RD > D:
            raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [T={T}, R] with even R <= "
                             f"D={D}")
        if cos.stride(1) != 1 or sin.stride() != cos.stride():
            raise ValueError(f"cos/sin need unit stride over R and equal strides, got {cos.stride()} {sin.stride()}")
        sr_t = cos.stride(0)
    dtype = torch.promote_types(x.dtype, h.dtype) if h is not None else x.dtype  # the dtype of x + h
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    s = torch.empty(x.shape, dtype=dtype, device=x.device) if h is not None else y
    R = T * H
    if R == 0:
        return y, s
    BR, BD, num_warps = _row_block(D)
    rms_norm_fwd_kernel[(triton.cdiv(R, BR),)](
        x, h if h is not None else x, weight, cos if cos is not None else x, sin if sin is not None else x, y, s,
        R, eps, sx_t, sx_h, sh_t, sh_h, sr_t,
        H=H, D=D, RD=RD, BR=BR, BD=BD, HAS_RES=h is not None, ROPE=cos is not None, num_warps=num_warps,
        **launch_options())
    return y, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of every row.

    x:      [T, D] or [T, H, D], any dtype, any strides with unit stride over D
    weight: [D] contiguous (the norm scale is 1 + weight)
    Returns [same shape] contiguous, x's dtype.
    """
    return _launch_rms_norm(x, None, weight, eps, None, None)[0]


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the next norm in one pass.

    x, h:   [T, D] residual stream and the block's output, same shape, unit stride over D
    weight: [D] contiguous
    Returns (x + h, rms_norm(x + h)): both [T, D] contiguous, in the dtype of x + h.
    """
    y, s = _launch_rms_norm(x, h, weight, eps, None, None)
    return s, y


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE on the first R channels of each head.

    x:        [T, H, D] (a strided column view of a projection is fine; unit stride over D)
    weight:   [D] contiguous
    cos, sin: [T, R] (R even, R <= D), unit stride over R
    Returns [T, H, D] contiguous, x's dtype.
    """
    if x.ndim != 3:
        raise ValueError(f"x must be [T, H, D], got {tuple(x.shape)}")
    return _launch_rms_norm(x, None, weight, eps, cos, sin)[0]


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMSNorm (plain weight scale) times silu(z): the DeltaNet output norm.

    x:      [T, H, D] delta-rule output, unit stride over D
    z:      [T, H, D] gate (a strided column view of the fused projection is fine)
    weight: [D] contiguous
    out:    [T, H, D] contiguous, x's dtype, to write into (a phase's token slice); None: new
    Returns [T, H, D] contiguous, x's dtype (`out` when given).
    """
    if x.ndim != 3 or z.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} must be [T, H, D] and z {tuple(z.shape)} the same")
    T, H, D, sx_t, sx_h = _as_rows("x", x)
    _, _, _, sz_t, sz_h = _as_rows("z", z)
    _check_weight(weight, D)
    y = output_like(x, out)
    R = T * H
    if R == 0:
        return y
    BR, BD, num_warps = _row_block(D)
    gated_rms_norm_fwd_kernel[(triton.cdiv(R, BR),)](
        x, z, weight, y, R, eps, sx_t, sx_h, sz_t, sz_h, H=H, D=D, BR=BR, BD=BD,
        ROUND_W=torch.promote_types(weight.dtype, x.dtype) == x.dtype, num_warps=num_warps, **launch_options())
    return y
