"""The rotary tables: one multiply from cached frequencies, the same bits as forming them per pass."""

import pytest
import torch

from kev.model.config import ModelConfig
from kev.model.qwen35 import rope_tables
from random_models import tiny_config


def _per_pass(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """The tables as every pass formed them before the frequencies were cached."""
    rdim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_are_the_per_pass_tables_bit_for_bit(dtype):
    cfg = tiny_config()
    g = torch.Generator().manual_seed(7)
    for _ in range(3):  # the second and third calls read the cached frequencies
        positions = torch.randint(0, 40_000, (257,), generator=g)
        cos, sin = rope_tables(positions, cfg, dtype)
        want_cos, want_sin = _per_pass(positions, cfg, dtype)
        assert cos.dtype == dtype and cos.shape == (257, cfg.rotary_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
