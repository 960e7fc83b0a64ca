"""The gated delta rule, one token at a time: the plain maths every faster form is checked against.

Per value head, with S of shape [K, V] (fp32, or fp64 for oracles):
    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t
q and k arrive already L2-normalised, q already scaled by K^-0.5, k/q already expanded to value heads.
"""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [L, HV, K]
    k: torch.Tensor,  # [L, HV, K]
    v: torch.Tensor,  # [L, HV, V]
    g: torch.Tensor,  # [L, HV] log decay
    beta: torch.Tensor,  # [L, HV]
    state: torch.Tensor,  # [HV, K, V], not modified
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [L, HV, V], final state [HV, K, V]) in the dtype of `state`."""
    dt = state.dtype
    S = state.clone()
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    out = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", S, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    o = torch.stack(out) if out else v.new_zeros(v.shape)
    return o, S
