"""How much device memory a state pass needs above the weights and the bank: the bound the bank's
start-up plan and its pass-size cap are checked against."""

from __future__ import annotations

import torch

from kev.model.config import ModelConfig

# Safety factor of `state_pass_peak_bytes` over its itemised estimate: kernel temporaries not listed,
# allocation rounding, tensors freed a little later than the listing assumes.
PEAK_SLACK = 1.5


def state_pass_peak_bytes(cfg: ModelConfig, tokens: int, sequences: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bound on the device memory one state pass of `tokens` packed tokens (`sequences` documents)
    allocates above the weights and the bank (the runner's own chunking makes this the whole story
    for any document length: a long document runs `state_chunk_tokens` at a time, its state riding
    in its slot, so nothing grows with the document).

    Itemised per token (activation dtype e bytes, fp32 4 bytes), the largest of the three layer
    kinds while it runs, plus the residual stream around it:
    - residual stream: x, its norm and the previous block's output: 3 d e
    - DeltaNet: the fused projection output (conv_dim + value_dim + 2 HV) e, the conv output
      conv_dim e, g (fp32) and beta, l2-normalised q and k 2 H K e, v made contiguous, fla's
      chunk-local cumsum (fp32), WY w, u and A (HV K + HV V + HV 64) e, v_new, o (HV V e each);
      plus the state at every chunk start, HV K V e per 64-token chunk
    - attention: the fused q/gate, k, v output (2 Hq D + 2 Hkv D) e, q and k after norm/RoPE,
      o and the gated o
    - MLP: gate/up 2 F e, silu(gate) * up F e, the down projection d e
    - positions, token ids, RoPE tables
    times `PEAK_SLACK`. Kev-4B at 8,192 tokens: ~126 KB per token, the DeltaNet layer, 1.55 GB bound."""
    e = torch.empty((), dtype=dtype).element_size()
    d, F = cfg.hidden_size, cfg.intermediate_size
    H, K = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    HV, V = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    chunk = 64  # the delta rule's chunk (kev.ops.delta_rule.indexed_scan.CHUNK)
    residual = 3 * d * e
    deltanet = ((cfg.conv_dim + cfg.linear_value_dim + 2 * HV) * e + cfg.conv_dim * e + HV * (4 + e)
                + 2 * H * K * e + HV * V * e + HV * 4 + (HV * K + HV * V + HV * chunk) * e + 2 * HV * V * e)
    attention = (2 * Hq * D + 2 * Hkv * D) * e + (Hq * D + Hkv * D) * e + 2 * Hq * D * e
    mlp = 3 * F * e + d * e
    index = 2 * 8 + cfg.rotary_dim * (2 * e + 12)
    per_token = residual + max(deltanet, attention, mlp) + index
    chunk_states = (tokens // chunk + sequences) * HV * K * V * e if cfg.deltanet_layers else 0
    return int(PEAK_SLACK * (tokens * per_token + chunk_states))
