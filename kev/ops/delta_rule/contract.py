"""The argument contract both indexed delta-rule forwards share (chunked scan and recurrent), so
`TritonOps` can call either with the same tensors and get the same errors."""

from __future__ import annotations

import torch


def check_delta_rule_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(T, H, K, HV, V) of q, k [T, H, K], v [T, HV, V] (HV a multiple of H), g fp32 and beta [T, HV];
    ValueError naming the first tensor that breaks the contract."""
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, K], v {tuple(v.shape)} [T, HV, V]")
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of key heads H={H} (v {tuple(v.shape)})")
    if tuple(g.shape) != (T, HV) or tuple(beta.shape) != (T, HV):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T={T}, HV={HV}]")
    if g.dtype != torch.float32:
        raise ValueError(f"g must be fp32, got {g.dtype}")
    return T, H, K, HV, V
