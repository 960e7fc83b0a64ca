"""The project's own Qwen3.5 text backbone (Gated DeltaNet + gated attention), packed varlen.

One `forward` serves both passes: a state pass (documents; final states written to bank slots)
and a row pass (question rows continuing stored states, nothing written). Which is which is
only in the `PassMeta`. A `PhasedMeta` makes one sweep over the weights serve new documents and
rows over them: token-wise work once over all tokens, token mixing phase by phase. Token mixing and every elementwise step (norms, activations, RoPE) go
through an `Ops` backend: `TorchOps` keeps the CPU's exact batch-invariant maths, the GPU ops run
fused kernels. The model itself computes the projections. Parameter names match transformers'
`Qwen3_5TextModel`.

On GPU, `fuse_projections()` makes each layer's input projections one GEMM (DeltaNet: qkv, z, b,
a; attention: q, k, v; MLP: gate, up). The parameters become row views of one concatenated weight,
so names, shapes and `state_dict` are unchanged; the outputs are column views of one buffer, which
the ops read in place through their strides. Not with batch invariance (the CPU keeps one tiled
GEMM per projection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from kev.bank.layout import StatePools
from kev.model.config import LayerType, ModelConfig
from kev.ops.invariant import tiled_linear
from kev.ops import DeltaGates, Ops, PassMeta
from kev.ops.meta import PhasedMeta, as_phases
from kev.ops.fused import reference
from kev.ops.fused.reference import apply_rope, rms_norm  # noqa: F401  (the model's maths, kept importable here)


Phases = list[tuple[int, int, PassMeta]]  # (first token, end token, meta) of each phase, in order
# Context for one phase's token mixing, from (its meta, its tokens): the phase's autotune class
MixerScope = Callable[[PassMeta, int], AbstractContextManager]


def _no_scope(meta: PassMeta, num_tokens: int) -> AbstractContextManager:
    return nullcontext()


def mix_by_phase(phases: Phases, scope: MixerScope, mix, *tensors: torch.Tensor,
                 new_out: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`mix(meta, *token slices, out=...)` phase by phase, in order (a phase sees every write of the
    ones before it). One phase: the tensors as they are and `out=None` (mix allocates its result).
    Several: `new_out()` ([T, ...]) and each phase writes its own token slice of it: the phases'
    outputs need no join (a copy of the whole output, 0.36 ms of a five-long sweep on the H200)."""
    if len(phases) == 1:
        (_, end, meta), = phases
        with scope(meta, end):
            return mix(meta, *tensors, out=None)
    out = new_out()
    for start, end, meta in phases:
        with scope(meta, end - start):
            mix(meta, *(t[start:end] for t in tensors), out=out[start:end])
    return out


class Linear(nn.Linear):
    """nn.Linear that can run in fixed row tiles (see kev.ops.invariant), for bitwise batch invariance."""

    row_tile: int = 0  # 0: one plain GEMM (GPU); >0: [tiles, row_tile, in] batched GEMM

    def forward(self, x):
        if not self.row_tile:
            return super().forward(x)
        return tiled_linear(x, self.weight, self.bias, self.row_tile)


def _adjacent(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view spanning `parts` when they are contiguous and lie back to back in one storage
    (rows of one buffer), else None."""
    first = parts[0]
    if first.device.type == "meta" or not all(p.is_contiguous() for p in parts):
        return None
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset or p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


class FusedProjection:
    """Linears of one input run as one GEMM. Their weights (and biases) become row views of one
    concatenated buffer, so the parameters keep their names and `state_dict` its keys; calling it
    returns the outputs as column views of one [T, sum(out)] buffer."""

    def __init__(self, linears: Sequence[Linear]):
        if any(lin.row_tile for lin in linears):
            raise ValueError("fused projections are one plain GEMM: not with batch-invariant row tiles")
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("fused projections need a bias on all of them or on none")
        self.linears = tuple(linears)
        self.splits = [lin.out_features for lin in linears]
        with torch.no_grad():
            # Weights already back to back in one buffer (mapped from the owner that fused them:
            # kev/bank/shared_weights.py) are adopted as they are, without a copy.
            self.weight = _adjacent([lin.weight for lin in linears])
            if self.weight is None:
                self.weight = torch.cat([lin.weight for lin in linears])  # [sum(out), in]
            self.bias = None
            if linears[0].bias is not None:
                self.bias = _adjacent([lin.bias for lin in linears])
                if self.bias is None:
                    self.bias = torch.cat([lin.bias for lin in linears])
            start = 0
            for lin, n in zip(linears, self.splits):
                lin.weight = nn.Parameter(self.weight[start:start + n], requires_grad=lin.weight.requires_grad)
                if self.bias is not None:
                    lin.bias = nn.Parameter(self.bias[start:start + n], requires_grad=lin.bias.requires_grad)
                start += n
        self._pointers = self._views()

    def _views(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for lin in self.linears for t in (lin.weight, lin.bias) if t is not None)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._views() != self._pointers:
            raise RuntimeError("a fused projection's parameters were replaced (load_state_dict(assign=True)?): "
                               "call fuse_projections() again")
        return F.linear(x, self.weight, self.bias).split(self.splits, dim=-1)  # [T, sum(out)] -> column views

    def first_from(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        """As calling it, but the first linear only on x[start:] (two GEMMs): ([T - start, out0],
        the others as column views of one [T, rest] buffer)."""
        if start == 0:
            return self(x)
        n, b = self.splits[0], self.bias
        first = F.linear(x[start:], self.weight[:n], None if b is None else b[:n])
        rest = F.linear(x, self.weight[n:], None if b is None else b[n:]).split(self.splits[1:], dim=-1)
        return (first, *rest)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return reference.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per value head: RMS-normalise in fp32, plain `weight` scale, times silu(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return reference.gated_rms_norm(x, z, self.weight, self.eps)


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
        self.fused: FusedProjection | None = None

    def fuse_projections(self) -> None:
        self.fused = FusedProjection([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def forward(self, x, phases: Phases, ops: Ops, recurrent_pool, conv_pool, scope: MixerScope = _no_scope,
                keep: torch.Tensor | None = None,  # keep: the only tokens whose output is read (None: all)
                joined: PassMeta | None = None):  # several phases as one pass (PhasedMeta.joined)
        cfg, T = self.cfg, x.shape[0]
        H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kd = cfg.linear_key_dim
        if self.fused is not None:
            mixed, z, b, a = self.fused(x)  # column views of one [T, conv_dim + value_dim + 2 HV] buffer
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        gates = DeltaGates(a, b, self.A_log, self.dt_bias)  # formed by the delta rule (kev/ops/gates.py)
        z = z.unflatten(1, (HV, V))

        def conv(meta, mixed, out=None):  # q,k [t, 2 kd] and v [t, value_dim]
            # q,k and v in two blocks of one buffer: the delta rule needs v contiguous (fla's WY
            # recompute), and q, k stay column views (the ops take strides): nothing copies.
            return ops.causal_conv(mixed, self.conv1d.weight[:, 0], meta, conv_pool, split=2 * kd, out=out)

        def delta_rule(meta, qk, v):  # the delta rule and the output norm over all T tokens
            q, k = qk[:, :kd].unflatten(1, (H, K)), qk[:, kd:].unflatten(1, (H, K))
            o = ops.gated_delta_rule(q, k, v.unflatten(1, (HV, V)), gates, meta, recurrent_pool)  # [T, HV, V]
            return ops.gated_rms_norm(o, z, self.norm.weight, self.norm.eps)

        if joined is None:  # one phase
            (_, _, meta), = phases
            with scope(meta, T):
                o = delta_rule(meta, *conv(meta, mixed))
        else:
            # Only the conv and the delta rule's state pass read what an earlier phase wrote (a new
            # document's conv tail and state): they run phase by phase, into one output. The
            # per-chunk steps of the delta rule and the norm run once over every phase's tokens.
            flat = x.new_empty(T * cfg.conv_dim)
            qk, v = flat[: T * 2 * kd].view(T, 2 * kd), flat[T * 2 * kd :].view(T, cfg.conv_dim - 2 * kd)
            for start, end, meta in phases:
                with scope(meta, end - start):
                    conv(meta, mixed[start:end], out=(qk[start:end], v[start:end]))
            with scope(joined, T):
                o = delta_rule(joined, qk, v)
        o = o if keep is None else o[keep]
        return self.out_proj(o.flatten(1))


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
        self.fused: FusedProjection | None = None

    def fuse_projections(self) -> None:
        self.fused = FusedProjection([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x, rope, phases: Phases, ops: Ops, key_pages, value_pages, scope: MixerScope = _no_scope,
                keep: torch.Tensor | None = None):  # keep: the only tokens whose output is read (None: all)
        cfg, T, D, Hq = self.cfg, x.shape[0], self.cfg.head_dim, self.cfg.num_attention_heads
        # With `keep` (the last layer) the phases no kept token lies in only store their K/V: no
        # queries, no attention. Picks lie in a sweep's last phase (its rows, kev.ops.meta.PhasedMeta)
        # and a state pass has none, so queries start at `read`: the rows' first token, or T.
        read = 0 if keep is None else phases[-1][0] if keep.numel() else T
        if self.fused is not None:
            qg, k, v = self.fused.first_from(x, read)  # [T - read, Hq 2D]; k, v [T, Hkv D] column views
        else:
            qg, k, v = self.q_proj(x[read:]), self.k_proj(x), self.v_proj(x)
        qg = qg.unflatten(1, (Hq, 2 * D))  # [T - read, Hq, 2D]
        q, gate = qg[..., :D], qg[..., D:]
        cos, sin = rope
        q = ops.rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos[read:], sin[read:])  # [T - read, Hq, D]
        k = ops.rms_norm_rope(k.unflatten(1, (cfg.num_key_value_heads, D)), self.k_norm.weight, self.k_norm.eps,
                              cos, sin)  # [T, Hkv, D]
        v = v.unflatten(1, (cfg.num_key_value_heads, D))
        for start, end, meta in phases:
            if end <= read and end > start:
                with scope(meta, end - start):
                    ops.store_kv(k[start:end], v[start:end], meta, key_pages, value_pages,
                                 Hq // cfg.num_key_value_heads)

        def mix(meta, q, k, v, gate, out):  # one phase's sequences: attention, its output gate
            return ops.attention(q, k, v, meta, key_pages, value_pages, gate=gate, out=out)

        queried = [(s - read, e - read, m) for s, e, m in phases if s >= read]
        if not queried:  # a state pass's last layer: nothing reads its output
            return self.o_proj(x.new_empty(0, Hq * D))
        o = mix_by_phase(queried, scope, mix, q, k[read:], v[read:], gate,
                         new_out=lambda: x.new_empty(T - read, Hq, D))  # [T - read, Hq, D]
        o = o if keep is None else o[keep - read if read else keep]
        return self.o_proj(o.flatten(1))


def rope_tables(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos/sin [T, rotary_dim] for 1-D positions (Qwen3.5's mRoPE reduces to this for text)."""
    emb = positions[:, None] * _rope_frequencies(cfg, positions.device)  # [T, rdim], fp32 (int64 * fp32)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_FREQUENCIES: dict[tuple[float, int, torch.device], torch.Tensor] = {}


def _rope_frequencies(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """[rdim] fp32: the inverse frequencies, twice (rotate-half layout), made by the ops every pass
    once made them with (the same bits) and cached per device. Not cached when first made inside a
    CUDA graph capture: a capture records kernels without running them, so the tensor would hold
    nothing for an eager pass."""
    rdim = cfg.rotary_dim
    key = (cfg.rope_theta, rdim, device)
    freqs = _FREQUENCIES.get(key)
    if freqs is None:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rdim, 2, dtype=torch.float32, device=device) / rdim))
        freqs = torch.cat([inv_freq, inv_freq])
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                return freqs
            torch.cuda.current_stream(device).synchronize()  # made before a pass on another stream reads them
        _FREQUENCIES[key] = freqs
    return freqs


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused: FusedProjection | None = None

    def fuse_projections(self) -> None:
        self.fused = FusedProjection([self.gate_proj, self.up_proj])

    def forward(self, x, ops: Ops):
        if self.fused is not None:
            gate, up = self.fused(x)  # column views of one [T, 2F] buffer
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.silu_mul(gate, up))


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
        """Make every projection run in fixed row tiles (the CPU engine's bitwise batch invariance).
        Row tiles need one GEMM per projection: fused projections are undone first."""
        if row_tile:
            self.unfuse_projections()
        for m in self.modules():
            if isinstance(m, Linear):
                m.row_tile = row_tile
        return self

    def _fusable(self):
        return [m for m in self.modules() if isinstance(m, (GatedDeltaNet, Attention, MLP))]

    @property
    def projections_fused(self) -> bool:
        return any(m.fused is not None for m in self._fusable())

    def fuse_projections(self) -> "Qwen35Model":
        """One GEMM for each layer's input projections (GPU serving; not with batch invariance).

        Call after loading. Weights are concatenated layer by layer (one layer's weights of extra
        memory at a time); the parameters become views of the fused weights, so `state_dict`,
        `load_state_dict` (copying) and `.to()` keep working (`.to()` re-fuses on the new device)."""
        for m in self._fusable():
            m.fuse_projections()
        return self

    def unfuse_projections(self) -> "Qwen35Model":
        """Back to one GEMM per projection (the parameters stay views of the fused weights)."""
        for m in self._fusable():
            m.fused = None
        return self

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() replace each parameter's data on its own: fuse again afterwards.
        fused = self.projections_fused
        self.unfuse_projections()
        out = super()._apply(fn, recurse)
        if fused:
            self.fuse_projections()
        return out

    def forward(
        self,
        tokens: torch.Tensor,  # [T] packed token ids
        meta: PassMeta | PhasedMeta,
        pools: StatePools,
        ops: Ops,
        picks: torch.Tensor | None = None,  # [P] packed indices whose final hidden states to return
        mixer_scope: MixerScope | None = None,  # around each phase's token mixing (phased passes)
    ) -> torch.Tensor:  # [P or T, d] after the final norm
        phases, scope = as_phases(meta, tokens.shape[0]), mixer_scope or _no_scope
        joined = meta.joined if isinstance(meta, PhasedMeta) and len(phases) > 1 else None
        if picks is not None and len(phases) > 1 and picks.device.type == "cpu" and picks.numel() \
                and int(picks.min()) < phases[-1][0]:  # checked where it costs no device read
            raise ValueError("a phased pass's picks must lie in its last phase (the rows): the last layer "
                             "runs no queries for the earlier phases")
        x = self.embed_tokens(tokens)
        rope = rope_tables(meta.token_positions(), self.cfg, x.dtype)
        deltanet_i = attention_i = 0
        h = None  # the last block's output, added to x by the next norm (one fused pass on GPU)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            norm = layer.input_layernorm
            if h is None:
                normed = ops.rms_norm(x, norm.weight, norm.eps)
            else:
                x, normed = ops.add_rms_norm(x, h, norm.weight, norm.eps)
            # The head only reads <decide> and each </opt>: past the last mixer (its output projection,
            # the last MLP, the final norm) only those tokens run. A state pass reads none (0 picks).
            keep = picks if i == last else None
            if layer.layer_type is LayerType.DELTANET:
                h = layer.linear_attn(normed, phases, ops, pools.recurrent[deltanet_i], pools.conv[deltanet_i], scope,
                                      keep, joined)
                deltanet_i += 1
            else:
                h = layer.self_attn(normed, rope, phases, ops, pools.keys[attention_i], pools.values[attention_i],
                                    scope, keep)
                attention_i += 1
            if keep is not None:
                x = x[keep]
            norm = layer.post_attention_layernorm
            x, normed = ops.add_rms_norm(x, h, norm.weight, norm.eps)
            h = layer.mlp(normed, ops)
        if h is None:  # no layers
            return ops.rms_norm(x if picks is None else x[picks], self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(x, h, self.norm.weight, self.norm.eps)[1]
