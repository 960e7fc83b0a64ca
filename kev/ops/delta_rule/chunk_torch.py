"""The gated delta rule in chunks of `BT` tokens (the WY form), in torch: the CPU engine's path.

Within a chunk, with G = cumsum(g), D[t, j] = exp(G_t - G_j) for j <= t and S0 the state at the
chunk's start, the recurrence of `naive.py` unrolls to
    (I + diag(beta) tril(K K^T * D, -1)) U = diag(beta) (V - diag(exp G) K S0)
    O  = diag(exp G) Q S0 + tril(Q K^T * D) U
    S' = exp(G_last) S0 + K^T diag(exp(G_last - G)) U
so a chunk costs a few small matmuls and one triangular solve instead of BT rank-1 updates.
Everything here is differentiable (the demo model trains through it).
"""

from __future__ import annotations

import torch

CHUNK = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [L, HV, K] normalised and scaled, fp32
    k: torch.Tensor,  # [L, HV, K] normalised
    v: torch.Tensor,  # [L, HV, V]
    g: torch.Tensor,  # [L, HV] log decay, fp32
    beta: torch.Tensor,  # [L, HV]
    state: torch.Tensor,  # [HV, K, V] fp32 initial state (not modified)
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [L, HV, V] fp32, final state [HV, K, V] fp32)."""
    q, k, v, g, beta = (x.float().transpose(0, 1) for x in (q, k, v, g, beta))  # head-major
    S = state.float()
    outs = []
    for s in range(0, q.shape[1], chunk):
        e = min(s + chunk, q.shape[1])
        bq, bk, bv, bb = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]  # [HV, C, *]
        G = g[:, s:e].cumsum(-1)  # [HV, C]
        C = e - s
        diff = G[:, :, None] - G[:, None, :]  # [HV, C, C] = G_t - G_j
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        D = diff.masked_fill(~causal, float("-inf")).exp()
        strict = D.tril(-1)
        # [HV, C, K] @ [HV, K, C] -> [HV, C, C]
        lower = bb[:, :, None] * (bk @ bk.transpose(1, 2)) * strict
        eye = torch.eye(C, device=q.device).expand_as(lower)
        rhs = bb[:, :, None] * (bv - G.exp()[:, :, None] * (bk @ S))  # [HV, C, V]
        U = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        # [HV, C, K] @ [HV, K, V] -> [HV, C, V]
        o = G.exp()[:, :, None] * (bq @ S) + ((bq @ bk.transpose(1, 2)) * D) @ U
        outs.append(o)
        tail = (G[:, -1:] - G).exp()  # [HV, C]
        S = G[:, -1].exp()[:, None, None] * S + bk.transpose(1, 2) @ (tail[:, :, None] * U)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o.transpose(0, 1), S
