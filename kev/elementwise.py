"""Activations written with exp/log1p only.

torch's CPU kernels for sigmoid, silu and softplus take a different code path for the tail
of a tensor than for its vectorised body, so a token's value would depend on how many tokens
share the pass. exp and log1p do not; building the activations from them keeps every answer
bitwise independent of its batch (differences to the library versions are ~1 ulp).
"""

import torch


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    # Above 20 softplus(x) == x in fp32; the clamp keeps exp finite so gradients stay finite.
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))
