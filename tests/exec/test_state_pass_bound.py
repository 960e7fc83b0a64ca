"""The state pass's memory bound (`kev.exec.memory.state_pass_peak_bytes`): its arithmetic on CPU.
The GPU test (`exec/test_state_pass_gpu.py`) enforces it against a measured peak."""

import torch

from kev.bank.bank import Bank
from kev.model.config import ModelConfig
from kev.ops.torch_ops import TorchOps
from kev.exec.passes import Passes
from kev.exec.memory import PEAK_SLACK, state_pass_peak_bytes
from random_models import random_model, tiny_config

KEV_4B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, intermediate_size=9216,
              num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def test_kev4b_bound_is_the_deltanet_layer_of_one_chunk():
    cfg = ModelConfig.from_dict(KEV_4B)
    bound = state_pass_peak_bytes(cfg, 8192)
    # the DeltaNet layer dominates: its fused projection output alone is 12,352 x 2 bytes per token,
    # the states at every 64-token chunk start 32 x 128 x 128 x 2 / 64 = 16 KiB per token
    assert 8192 * (12352 * 2 + 16384) * PEAK_SLACK < bound < 2e9
    per_token = bound / PEAK_SLACK / 8192
    assert 120_000 < per_token < 130_000
    # linear in tokens (up to the per-sequence chunk-start states)
    assert state_pass_peak_bytes(cfg, 4 * 8192, sequences=4) == 4 * bound
    # wider MLP: the MLP term takes over once it is the largest
    wide = ModelConfig.from_dict({**KEV_4B, "intermediate_size": 40960})
    assert state_pass_peak_bytes(wide, 8192) > bound


def test_runner_bound_is_its_first_pass():
    cfg = tiny_config()
    model = random_model(cfg)
    bank = Bank.allocate(cfg, num_slots=2, num_blocks=64, dtype=torch.float32)
    runner = Passes(model, bank, TorchOps(), state_chunk_tokens=256)
    f32 = torch.float32
    assert runner.state_pass_peak_bytes([5000], f32) == runner.state_pass_peak_bytes([256], f32) \
        == state_pass_peak_bytes(cfg, 256, 1, f32)
    assert runner.state_pass_peak_bytes([100, 5000], f32) == state_pass_peak_bytes(cfg, 356, 2, f32)
    assert runner.state_pass_peak_bytes([], f32) == 0
