"""The varlen causal depthwise convolution + silu, one sequence at a time: the plain maths the
Triton kernel in `indexed_conv.py` is checked against (the same loop as `TorchOps.causal_conv`).

For a sequence with start state S (its previous W-1 inputs, zeros for a new one) and inputs x:
    full = [S | x]                     (C, W-1+L)
    y[t, c] = silu(sum_j w[c, j] full[c, t + j])
    new state = full[:, -(W-1):]       (the last W-1 inputs, reaching into S when L < W-1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv_reference(
    x: torch.Tensor,  # [T, C] packed inputs
    weight: torch.Tensor,  # [C, W]
    cu_seqlens: list[int],  # N + 1 offsets
    conv_pool: torch.Tensor,  # [S, C, W-1]
    read_slots: list[int],  # N, -1 = zero start
    write_slots: list[int],  # N, -1 = no write
) -> torch.Tensor:  # [T, C] fp32
    """fp32 maths; writes the final states into `conv_pool` (in its dtype) like the kernel."""
    C, W = weight.shape
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for n in range(len(read_slots)):
        s, e = cu_seqlens[n], cu_seqlens[n + 1]
        start = conv_pool[read_slots[n]].float() if read_slots[n] >= 0 else x.new_zeros(C, W - 1, dtype=torch.float32)
        full = torch.cat([start, x[s:e].float().t()], dim=1)  # [C, W-1+L]
        y = F.conv1d(full[None], weight.float()[:, None, :], groups=C)[0]  # [C, L]
        out[s:e] = F.silu(y).t()
        if write_slots[n] >= 0:
            conv_pool[write_slots[n]] = full[:, full.shape[1] - (W - 1):].to(conv_pool.dtype)
    return out
