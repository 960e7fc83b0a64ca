"""Tensor names of a Qwen3.5 checkpoint: the prefixes published layouts use, every backbone
tensor's expected shape, and the JSON reader for checkpoint side files. Shared by the checkpoint
loader (`kev.model.checkpoint`) and the LoRA merge (`kev.model.lora`), which builds on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kev.model.config import CheckpointError, LayerType, ModelConfig

# Parts of published checkpoints that serving never runs.
IGNORED_PREFIXES = ("model.visual.", "mtp.", "lm_head.")
FLAT_PREFIX = "model."
NESTED_PREFIX = "model.language_model."

PathLike = str | os.PathLike[str]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every backbone tensor's name and shape: the one definition the loader and the model share."""
    d, f = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, d)}
    for i, kind in enumerate(config.layer_types):
        p = f"layers.{i}."
        if kind is LayerType.DELTANET:
            hv, vd = config.linear_num_value_heads, config.linear_value_dim
            la = p + "linear_attn."
            shapes |= {
                la + "in_proj_qkv.weight": (config.conv_dim, d),  # all q, then all k, then all v
                la + "in_proj_z.weight": (vd, d),
                la + "in_proj_b.weight": (hv, d),
                la + "in_proj_a.weight": (hv, d),
                la + "conv1d.weight": (config.conv_dim, 1, config.conv_kernel),
                la + "A_log": (hv,),
                la + "dt_bias": (hv,),
                la + "norm.weight": (config.linear_value_head_dim,),
                la + "out_proj.weight": (d, vd),
            }
        else:
            q = config.num_attention_heads * config.head_dim
            kv = config.num_key_value_heads * config.head_dim
            sa = p + "self_attn."
            # q_proj yields query and gate interleaved per head, hence 2 * q rows.
            shapes |= {
                sa + "q_proj.weight": (2 * q, d),
                sa + "k_proj.weight": (kv, d),
                sa + "v_proj.weight": (kv, d),
                sa + "o_proj.weight": (d, q),
                sa + "q_norm.weight": (config.head_dim,),
                sa + "k_norm.weight": (config.head_dim,),
            }
            if config.attention_bias:
                shapes |= {
                    sa + "q_proj.bias": (2 * q,),
                    sa + "k_proj.bias": (kv,),
                    sa + "v_proj.bias": (kv,),
                    sa + "o_proj.bias": (d,),
                }
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    shapes["norm.weight"] = (d,)
    return shapes


def read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
