"""The project's own Qwen3.5 text backbone (Gated DeltaNet + gated attention), packed varlen.

One `forward` serves both passes: a state pass (documents; final states written to bank slots)
and a row pass (question rows continuing stored states, nothing written). Which is which is
only in the `PassMeta`. Token mixing goes through an `Ops` backend; everything else (projections,
norms, RoPE, MLP) is here. Parameter names match transformers' `Qwen3_5TextModel`.
"""

from __future__ import annotations

import torch
from torch import nn

from kev.bank.layout import StatePools
from kev.config import LayerType, ModelConfig
from kev.invariant import sigmoid, silu, softplus, tiled_linear
from kev.ops import Ops, PassMeta


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: fp32 maths, scale by (1 + weight), back to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


class Linear(nn.Linear):
    """nn.Linear that can run in fixed row tiles (see kev.invariant), for bitwise batch invariance."""

    row_tile: int = 0  # 0: one plain GEMM (GPU); >0: [tiles, row_tile, in] batched GEMM

    def forward(self, x):
        if not self.row_tile:
            return super().forward(x)
        return tiled_linear(x, self.weight, self.bias, self.row_tile)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per value head: RMS-normalise in fp32, plain `weight` scale, times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, hv = cfg.hidden_size, cfg.linear_num_value_heads
        self.in_proj_qkv = Linear(d, cfg.conv_dim, bias=False)
        self.in_proj_z = Linear(d, cfg.linear_value_dim, bias=False)
        self.in_proj_b = Linear(d, hv, bias=False)
        self.in_proj_a = Linear(d, hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(cfg.conv_dim, 1, cfg.conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(cfg.linear_value_dim, d, bias=False)

    def forward(self, x, meta: PassMeta, ops: Ops, recurrent_pool, conv_pool):
        cfg, T = self.cfg, x.shape[0]
        H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = ops.causal_conv(self.in_proj_qkv(x), self.conv1d.weight[:, 0], meta, conv_pool)  # [T, conv_dim]
        # q, k, v stay column views of one buffer: the ops take strides, nothing copies.
        q = qkv[:, : cfg.linear_key_dim].unflatten(1, (H, K))
        k = qkv[:, cfg.linear_key_dim : 2 * cfg.linear_key_dim].unflatten(1, (H, K))
        v = qkv[:, 2 * cfg.linear_key_dim :].unflatten(1, (HV, V))
        beta = sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * softplus(self.in_proj_a(x).float() + self.dt_bias)  # fp32 always
        o = ops.gated_delta_rule(q, k, v, g, beta, meta, recurrent_pool)  # [T, HV, V]
        z = self.in_proj_z(x).unflatten(1, (HV, V))
        return self.out_proj(self.norm(o, z).reshape(T, HV * V))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, D = cfg.hidden_size, cfg.head_dim
        bias = cfg.attention_bias
        # q_proj yields [query, gate] interleaved per head: [head0 q (D), head0 gate (D), head1 q, ...]
        self.q_proj = Linear(d, cfg.num_attention_heads * D * 2, bias=bias)
        self.k_proj = Linear(d, cfg.num_key_value_heads * D, bias=bias)
        self.v_proj = Linear(d, cfg.num_key_value_heads * D, bias=bias)
        self.o_proj = Linear(cfg.num_attention_heads * D, d, bias=bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, rope, meta: PassMeta, ops: Ops, key_pages, value_pages):
        cfg, T, D = self.cfg, x.shape[0], self.cfg.head_dim
        qg = self.q_proj(x).unflatten(1, (cfg.num_attention_heads, 2 * D))  # [T, Hq, 2D]
        q, gate = qg[..., :D], qg[..., D:]
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(1, (cfg.num_key_value_heads, D))), *rope)
        v = self.v_proj(x).unflatten(1, (cfg.num_key_value_heads, D))
        o = ops.attention(q, k, v, meta, key_pages, value_pages)  # [T, Hq, D]
        return self.o_proj((o * sigmoid(gate)).reshape(T, -1))


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos/sin [T, rotary_dim] for 1-D positions (Qwen3.5's mRoPE reduces to this for text)."""
    rdim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rdim, 2, dtype=torch.float32, device=positions.device) / rdim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rdim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim` channels of every head; x is [T, H, D]."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos[:, None] + rotated * sin[:, None], rest], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: LayerType):
        super().__init__()
        self.layer_type = layer_type
        if layer_type is LayerType.DELTANET:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen35Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def set_batch_invariant(self, row_tile: int = 16) -> "Qwen35Model":
        """Make every projection run in fixed row tiles (the CPU engine's bitwise batch invariance)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.row_tile = row_tile
        return self

    def forward(
        self,
        tokens: torch.Tensor,  # [T] packed token ids
        meta: PassMeta,
        pools: StatePools,
        ops: Ops,
        picks: torch.Tensor | None = None,  # [P] packed indices whose final hidden states to return
    ) -> torch.Tensor:  # [P or T, d] after the final norm
        x = self.embed_tokens(tokens)
        rope = rope_tables(meta.token_positions(), self.cfg, x.dtype)
        deltanet_i = attention_i = 0
        for layer in self.layers:
            h = layer.input_layernorm(x)
            if layer.layer_type is LayerType.DELTANET:
                h = layer.linear_attn(h, meta, ops, pools.recurrent[deltanet_i], pools.conv[deltanet_i])
                deltanet_i += 1
            else:
                h = layer.self_attn(h, rope, meta, ops, pools.keys[attention_i], pools.values[attention_i])
                attention_i += 1
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if picks is not None:
            x = x[picks]  # the head only reads <decide> and each </opt>: norm just those
        return self.norm(x)
