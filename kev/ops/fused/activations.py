"""Fused activation kernels of the GPU passes: one read of each input, one write of each output.

- `silu_mul(gate, up)`: the MLP's silu(gate) * up, gate and up column views of one fused
  gate+up projection (read in place through their row stride).
- `sigmoid_mul(x, gate)`: the attention output gate x * sigmoid(gate), gate a strided view. Serving
  fuses it into the attention's store (`times_sigmoid`, kev/ops/attention/paged_prefix.py); this
  kernel is that store's bit-for-bit oracle in the tests.

The DeltaNet gates are formed inside the delta rule's first kernel (`kev.ops.delta_rule.prep`).

The activations are the batch-invariant forms of `kev.ops.invariant` (x / (1 + exp(-x)), ...), with the
same rounding to the inputs' dtype after every step that the torch reference rounds (bf16 tensors
there compute each op in fp32 and round its result). Division is IEEE (`div_rn`); exp is the GPU's.
Blocks are fixed per shape (no autotune inside CUDA-graph capture).

Reference: `kev.ops.fused.reference` (what `TorchOps` runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kev.ops.pdl import launch_options, wait_for_previous
from kev.ops.utils import output_like


@triton.jit
def round_to(x, DT: tl.constexpr):
    """x rounded to DT and back to fp32 (a no-op for fp32)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def times_sigmoid(b_x, b_g, DT: tl.constexpr):
    """x * sigmoid(gate) in DT, x and gate fp32 tiles holding DT values: the attention output gate,
    with the reference's roundings (`sigmoid_mul` here; fused into the attention's store:
    kev/ops/attention/paged_prefix.py)."""
    b_d = round_to(1.0 + round_to(tl.exp(-b_g), DT), DT)
    b_s = round_to(tl.math.div_rn(1.0, b_d), DT)  # sigmoid(gate) in gate's dtype
    return (b_x * b_s).to(DT)


@triton.jit(do_not_specialize=["T"])
def silu_mul_fwd_kernel(
    gate, up,  # [T, C] through row strides, unit stride over C
    y,  # [T, C] contiguous out
    T, C, stride_g_t, stride_u_t,
    BT: tl.constexpr, BC: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m = (o_t < T)[:, None] & (o_c < C)[None, :]
    DT: tl.constexpr = y.dtype.element_ty
    b_g = tl.load(gate + o_t[:, None] * stride_g_t + o_c[None, :], mask=m, other=0.0).to(tl.float32)  # [BT, BC]
    b_u = tl.load(up + o_t[:, None] * stride_u_t + o_c[None, :], mask=m, other=0.0).to(tl.float32)
    b_d = round_to(1.0 + round_to(tl.exp(-b_g), DT), DT)
    b_s = round_to(tl.math.div_rn(b_g, b_d), DT)  # silu(gate) in gate's dtype
    tl.store(y + o_t[:, None] * C + o_c[None, :], (b_s * b_u).to(DT), mask=m)


@triton.jit(do_not_specialize=["T"])
def sigmoid_mul_fwd_kernel(
    x,  # [T, H, D] through (stride_x_t, stride_x_h)
    gate,  # [T, H, D] through (stride_g_t, stride_g_h)
    y,  # [T, H, D] contiguous out
    T, stride_x_t, stride_x_h, stride_g_t, stride_g_h,
    H: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kev/ops/pdl.py
):
    wait_for_previous(USE_PDL)  # nothing read or written before the kernel before it is done
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m = (o_t < T)[:, None] & (o_d < D)[None, :]
    DT: tl.constexpr = y.dtype.element_ty
    b_x = tl.load(x + o_t[:, None] * stride_x_t + i_h * stride_x_h + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(gate + o_t[:, None] * stride_g_t + i_h * stride_g_h + o_d[None, :], mask=m,
                  other=0.0).to(tl.float32)
    tl.store(y + (o_t[:, None] * H + i_h) * D + o_d[None, :], times_sigmoid(b_x, b_g, DT), mask=m)


def _row_stride(name: str, t: torch.Tensor) -> int:
    if t.ndim != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be [T, C] with unit stride over C, got {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up.

    gate, up: [T, C] same dtype, any row strides, unit stride over C (column views of one buffer are fine)
    Returns [T, C] contiguous, gate's dtype.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    sg, su = _row_stride("gate", gate), _row_stride("up", up)
    T, C = gate.shape
    y = torch.empty((T, C), dtype=gate.dtype, device=gate.device)
    if T == 0 or C == 0:
        return y
    BT, BC = 4, 1024
    silu_mul_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BC))](gate, up, y, T, C, sg, su, BT=BT, BC=BC,
                                                                    num_warps=4, **launch_options())
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * sigmoid(gate).

    x:    [T, H, D] (attention output), unit stride over D
    gate: [T, H, D] same dtype (a strided view of the q projection is fine), unit stride over D
    out:  [T, H, D] contiguous, x's dtype, to write into (a phase's token slice); None: new
    Returns [T, H, D] contiguous, x's dtype (`out` when given).
    """
    if x.ndim != 3 or gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [T, H, D] and gate {tuple(gate.shape)} "
                         f"{gate.dtype} the same")
    if x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError(f"x and gate need unit stride over D, got {x.stride()} {gate.stride()}")
    T, H, D = x.shape
    y = output_like(x, out)
    if y.numel() == 0:
        return y
    BD = triton.next_power_of_2(D)
    BT = max(1, 2048 // BD)
    sigmoid_mul_fwd_kernel[(triton.cdiv(T, BT), H)](x, gate, y, T, x.stride(0), x.stride(1), gate.stride(0),
                                                     gate.stride(1), H=H, D=D, BT=BT, BD=BD, num_warps=4,
                                                     **launch_options())
    return y
