"""Batch-invariant building blocks: a token's result never depends on what shares its pass.

Two CPU effects break that with plain torch calls:
- sigmoid, silu and softplus take a different code path for a tensor's tail than for its
  vectorised body, so a value depends on where it sits in the batch. exp and log1p do not;
  the activations here are built from them (~1 ulp from the library versions).
- GEMMs pick kernels and reduction orders by the row count M. `tiled_linear` always multiplies
  fixed [tile, in] blocks, so every row sees the same kernel whatever M is.
"""

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    # Above 20 softplus(x) == x in fp32; the clamp keeps exp finite so gradients stay finite.
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int = 16) -> torch.Tensor:
    """x [T, in] @ weight[out, in]^T (+ bias) computed as [T/tile, tile, in] batched GEMMs."""
    T = x.shape[0]
    padded = torch.cat([x, x.new_zeros((-T) % tile, x.shape[1])]).view(-1, tile, x.shape[1])
    out = (padded @ weight.t()).reshape(-1, weight.shape[0])[:T]  # [tiles, tile, in] @ [in, out]
    return out + bias if bias is not None else out
