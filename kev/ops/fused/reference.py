"""The plain torch maths of the model's norms, activations and RoPE: the CPU path and the reference.

`TorchOps` runs exactly these (the CPU engine's maths, built from `kev.ops.invariant`'s batch-invariant
activations, so a token's result never depends on what shares its pass). The fused Triton kernels
in `norms.py` and `activations.py` are checked against them; they follow the same dtype steps (the
same roundings to the activations' dtype between steps) but use the GPU's exp/rsqrt, so they agree
to a few ulps, not bit for bit.
"""

from __future__ import annotations

import torch

from kev.ops.invariant import sigmoid, silu, softplus
from kev.ops.utils import output_like


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm over the last dim: fp32 maths, scale by (1 + weight), back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add then the next norm: (x + h, rms_norm(x + h))."""
    x = x + h
    return x, rms_norm(x, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` channels of every head; x is [T, H, D], cos/sin [T, R]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Per-head q/k norm then RoPE (attention layers)."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Per value head: RMS-normalise in fp32, plain `weight` scale, times silu(z) (DeltaNet output).
    `out`: written into and returned (a phase's token slice of the pass's output)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return _written((h * silu(z.float())).to(x.dtype), out)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's silu(gate) * up."""
    return silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The attention output gate: x * sigmoid(gate). `out`: written into and returned."""
    return _written(x * sigmoid(gate), out)


def gated_output(o: torch.Tensor, gate: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """An attention output as `Ops.attention` returns it: times sigmoid(gate) when given, into `out`
    when given."""
    return sigmoid_mul(o, gate, out=out) if gate is not None else _written(o, out)


def _written(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`y`, or `out` holding it (checked as the kernels check theirs)."""
    return y if out is None else output_like(y, out).copy_(y)


def delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """DeltaNet gates from the a/b projections: (g fp32 log decay, beta in b's dtype)."""
    beta = sigmoid(b)
    g = -A_log.float().exp() * softplus(a.float() + dt_bias)  # fp32 always
    return g, beta


class ReferenceElementwise:
    """Mixin: an ops backend's norms and activations as the reference maths above."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    rms_norm_rope = staticmethod(rms_norm_rope)
    gated_rms_norm = staticmethod(gated_rms_norm)
    silu_mul = staticmethod(silu_mul)
