"""Shared pieces of the GPU benchmarks: Kev shapes with random weights, the matmul ceiling, timing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable

import torch

from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model

# Published Qwen3.5-4B text shapes (DESIGN §2).
KEV_4B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, intermediate_size=9216,
              num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
              linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
              linear_value_head_dim=128, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})


def kev4b_config() -> ModelConfig:
    return ModelConfig.from_dict(KEV_4B)


@torch.no_grad()
def random_model(cfg: ModelConfig, device="cuda", dtype=torch.bfloat16, seed=0) -> Qwen35Model:
    """Random weights at serving scale: std 0.02 projections, randomised norms/decays."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen35Model(cfg)
    model = model.to_empty(device=device).to(dtype)
    for name, p in model.named_parameters():
        if "A_log" in name:
            p.uniform_(-1.0, 1.0)
        elif "dt_bias" in name or "norm" in name:
            p.normal_(0.0, 0.1)
        else:
            p.normal_(0.0, 0.02)
    return model.eval()


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """Measured bf16 GEMM rate of this GPU now (the ceiling varies run to run)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = cuda_ms(lambda: a @ b, reps)
    return 2 * n**3 / (statistics.median(ms) * 1e-3) / 1e12


def cuda_ms(fn: Callable[[], object], reps: int) -> list[float]:
    """GPU time of each of `reps` calls, from CUDA events."""
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end))
    return out


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up on a side stream (compiles, autotunes), then capture it; returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def floor_ms(cfg: ModelConfig, tokens: int, tflops: float) -> float:
    """The matmul floor of one pass: 2 x non-embedding params x tokens at the measured rate."""
    return 2 * cfg.non_embedding_params() * tokens / (tflops * 1e12) * 1e3


def run_info() -> dict:
    commit = os.environ.get("KEV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"commit": commit, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(json.dumps(obj, indent=2))
