"""Small random `Qwen35Model`s for tests that need no transformers reference."""

import torch

from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model


def tiny_config(hv_per_h: int = 2, layers=("linear_attention",) * 3 + ("full_attention",), **over) -> ModelConfig:
    raw = dict(model_type="qwen3_5_text", vocab_size=300, hidden_size=64, intermediate_size=96,
               num_hidden_layers=len(layers), layer_types=list(layers), num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2 * hv_per_h,
               linear_key_head_dim=16, linear_value_head_dim=16,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    raw.update(over)
    return ModelConfig.from_dict(raw)


def random_model(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> Qwen35Model:
    """Every parameter random, norms and dt_bias included (their zero/one defaults hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    model = Qwen35Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if ("norm" in name or "dt_bias" in name or "A_log" in name) else 0.08
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model.to(dtype).eval().set_batch_invariant()
