"""The three token-mixing ops the backbone delegates, behind one small interface.

The model computes projections, norms and RoPE itself and hands these ops packed varlen
tensors plus a `PassMeta` saying where each sequence's state comes from and goes to. Two
implementations: `TorchOps` (fp32 reference, the CPU engine path) and the GPU ops, which read
and write the bank in place by slot index. The model never knows which one runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kev.ops.meta import HostMeta, PassMeta


class Ops(Protocol):
    name: str

    def causal_conv(
        self,
        x: torch.Tensor,  # [T, C] packed q,k,v channels before the conv (may be a strided view)
        weight: torch.Tensor,  # [C, W]
        meta: PassMeta,
        conv_pool: torch.Tensor,  # [S, C, W-1]: the last W-1 inputs of each stored sequence
    ) -> torch.Tensor:  # [T, C] silu(conv(x)), in x's dtype
        ...

    def gated_delta_rule(
        self,
        q: torch.Tensor,  # [T, H, K] raw (normalised and scaled inside)
        k: torch.Tensor,  # [T, H, K] raw (normalised inside)
        v: torch.Tensor,  # [T, HV, V]
        g: torch.Tensor,  # [T, HV] fp32 log decay
        beta: torch.Tensor,  # [T, HV]
        meta: PassMeta,
        state_pool: torch.Tensor,  # [S, HV, K, V] fp32
    ) -> torch.Tensor:  # [T, HV, V]
        ...

    def attention(
        self,
        q: torch.Tensor,  # [T, Hq, D] after norm and RoPE
        k: torch.Tensor,  # [T, Hkv, D] after norm and RoPE
        v: torch.Tensor,  # [T, Hkv, D]
        meta: PassMeta,
        key_pages: torch.Tensor,  # [NB, BS, Hkv, D]
        value_pages: torch.Tensor,  # [NB, BS, Hkv, D]
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def get_ops(backend: str) -> Ops:
    """`torch` (reference, any device) or `triton` (GPU kernels reading the bank in place)."""
    if backend == "torch":
        from kev.ops.torch_ops import TorchOps

        return TorchOps()
    if backend == "triton":
        from kev.ops.triton_ops import TritonOps

        return TritonOps()
    raise ValueError(f"unknown ops backend {backend!r} (expected 'torch' or 'triton')")


__all__ = ["Ops", "PassMeta", "HostMeta", "get_ops"]
