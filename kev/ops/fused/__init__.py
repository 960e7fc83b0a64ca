"""Fused norms and activations (`norms`, `activations`: Triton) and their reference maths (`reference`)."""

import torch


def output_like(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A kernel's output buffer: `out` (checked: x's shape and dtype, contiguous, so the kernel's
    contiguous store fits it), or a new contiguous tensor like x."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a contiguous {tuple(x.shape)} {x.dtype}")
    return out
