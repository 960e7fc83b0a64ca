"""The ops the backbone delegates, behind one small interface.

Three token-mixing ops take packed varlen tensors plus a `PassMeta` saying where each sequence's
state comes from and goes to. The model's elementwise steps (norms, activations, RoPE) are ops
too, so the GPU runs them as fused kernels while the CPU keeps its exact batch-invariant maths.
The model computes only the projections itself. Two implementations: `TorchOps` (the reference,
the CPU engine path) and the GPU ops, which read and write the bank in place by slot index and
fuse the elementwise steps. The model never knows which one runs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kev.ops.gates import DeltaGates
from kev.ops.meta import HostMeta, PassMeta


class Ops(Protocol):
    name: str

    def causal_conv(
        self,
        x: torch.Tensor,  # [T, C] packed q,k,v channels before the conv (may be a strided view)
        weight: torch.Tensor,  # [C, W]
        meta: PassMeta,
        conv_pool: torch.Tensor,  # [S, C, W-1]: the last W-1 inputs of each stored sequence
        split: int | None = None,  # None: one [T, C] output; s: channels [0, s) and [s, C) apart
        out=None,  # where to write the result, in the returned form (a phase's token slice of a sweep's)
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, C] silu(conv(x)) in x's dtype, or
        ...  # its two channel blocks [T, s], [T, C - s] (contiguous on GPU: the model's q,k and v)

    def gated_delta_rule(
        self,
        q: torch.Tensor,  # [T, H, K] raw (normalised and scaled inside)
        k: torch.Tensor,  # [T, H, K] raw (normalised inside)
        v: torch.Tensor,  # [T, HV, V]
        gates: DeltaGates,  # [T, HV]: the a, b projections (formed inside: kev/ops/gates.py) or given
        meta: PassMeta,  # may be a `PhasedMeta.joined`: its phases' state passes run in order
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
        gate: torch.Tensor | None = None,  # [T, Hq, D] (may be a strided view): the output gate
        out: torch.Tensor | None = None,  # [T, Hq, D] contiguous to write into (a phase's token slice)
    ) -> torch.Tensor:  # [T, Hq, D], times sigmoid(gate) when given (fused into the store on GPU)
        ...

    def store_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D] after norm and RoPE
        v: torch.Tensor,  # [T, Hkv, D]
        meta: PassMeta,
        key_pages: torch.Tensor,  # [NB, BS, Hkv, D]
        value_pages: torch.Tensor,  # [NB, BS, Hkv, D]
        group: int,  # Hq / Hkv of the attention it replaces (the GPU kernel's token blocks)
    ) -> None:  # `attention`'s K/V store alone: the same pages, the same bits
        ...


    # ---- norms and activations (the model's elementwise steps; fused kernels on GPU) ----

    def rms_norm(
        self,
        x: torch.Tensor,  # [T, D] or [T, H, D], unit stride over D (may be a strided view)
        weight: torch.Tensor,  # [D]: the scale is 1 + weight (zero-centred)
        eps: float,
    ) -> torch.Tensor:  # same shape, x's dtype; fp32 maths
        ...

    def add_rms_norm(
        self,
        x: torch.Tensor,  # [T, D] residual stream
        h: torch.Tensor,  # [T, D] a block's output
        weight: torch.Tensor,  # [D]
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x + h, rms_norm(x + h)), both [T, D]
        ...

    def rms_norm_rope(
        self,
        x: torch.Tensor,  # [T, H, D] q or k heads (may be a strided view)
        weight: torch.Tensor,  # [D]
        eps: float,
        cos: torch.Tensor,  # [T, R] rotary tables, R <= D
        sin: torch.Tensor,  # [T, R]
    ) -> torch.Tensor:  # [T, H, D] rms_norm, then rotate-half RoPE on the first R channels
        ...

    def gated_rms_norm(
        self,
        x: torch.Tensor,  # [T, HV, V] delta-rule output
        z: torch.Tensor,  # [T, HV, V] gate (may be a strided view)
        weight: torch.Tensor,  # [V]: plain scale
        eps: float,
        out: torch.Tensor | None = None,  # [T, HV, V] contiguous to write into (a phase's token slice)
    ) -> torch.Tensor:  # [T, HV, V] rms_norm(x) * weight * silu(z), x's dtype (`out` when given)
        ...

    def silu_mul(
        self,
        gate: torch.Tensor,  # [T, F] (may be a column view of a fused gate+up projection)
        up: torch.Tensor,  # [T, F]
    ) -> torch.Tensor:  # [T, F] silu(gate) * up
        ...


def get_ops(backend: str, gathered_max_prefix_tokens: int | None = None) -> Ops:
    """`torch` (reference, any device), `triton` (GPU kernels reading the bank in place) or
    `gathered` (the same kernels on states first copied into row buffers: the benchmark baseline;
    `gathered_max_prefix_tokens` sizes its page buffer, required under CUDA graphs)."""
    if backend == "torch":
        from kev.ops.torch_ops import TorchOps

        return TorchOps()
    if backend == "triton":
        from kev.ops.triton_ops import TritonOps

        return TritonOps()
    if backend == "gathered":
        from kev.ops.gathered_ops import GatheredOps

        return GatheredOps(gathered_max_prefix_tokens)
    raise ValueError(f"unknown ops backend {backend!r} (expected 'torch', 'triton' or 'gathered')")


__all__ = ["Ops", "PassMeta", "HostMeta", "DeltaGates", "get_ops"]
