"""Shared pieces of the GPU benchmarks: Kev shapes with random weights, the matmul ceiling, timing."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable

import torch

from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model

# The Kev family: the published Qwen3.5 text shapes of each size (docs/design.md §2; docs/models.md
# has the table with parameter counts). Every size: vocab 248,320, attention head_dim 256 with RoPE
# (theta 1e7) on its first quarter, DeltaNet key / value head dims 128, conv kernel 4, one full-
# attention layer in four (`full_attention_interval` 4), rms eps 1e-6. Where the facts come from
# (the Hugging Face `config.json` text configs of Qwen/Qwen3.5-*, checked against these copies):
# - 0.8B: THUDM/slime scripts/models/qwen3.5-0.8B.sh (24 layers, hidden 1,024, MLP 3,584, 8 / 2
#   heads); copies of its config.json in public code give 16 key / 16 value DeltaNet heads and
#   tied embeddings;
# - 4B: the shape every GPU figure so far used (16 / 32 DeltaNet heads, tied);
# - 9B: transformers 5.17.0's `Qwen3_5TextConfig` defaults, documented there as "the Qwen3.5-9B
#   style configuration" (32 layers, hidden 4,096, MLP 12,288, 16 / 4 heads, 16 / 32 DeltaNet
#   heads, untied);
# - 27B: THUDM/slime scripts/models/qwen3.5-27B.sh (64 layers, hidden 5,120, MLP 17,408, 24 / 4
#   heads, untied) and the Qwen3.5/3.6-27B model card (48 value / 16 key DeltaNet heads).
_QWEN35 = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
KEV_0_8B = dict(_QWEN35, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16, tie_word_embeddings=True)
KEV_4B = dict(_QWEN35, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
              num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=True)
KEV_9B = dict(_QWEN35, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
              num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32, tie_word_embeddings=False)
KEV_27B = dict(_QWEN35, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48, tie_word_embeddings=False)
KEV_MODELS: dict[str, dict] = {"kev-0.8b": KEV_0_8B, "kev-4b": KEV_4B, "kev-9b": KEV_9B, "kev-27b": KEV_27B}


def kev_config(name: str) -> ModelConfig:
    """The shape of a Kev size by its name in `KEV_MODELS` ('kev-0.8b', 'kev-4b', 'kev-9b', 'kev-27b')."""
    if name not in KEV_MODELS:
        raise ValueError(f"unknown Kev model {name!r}; known: {', '.join(KEV_MODELS)}")
    return ModelConfig.from_dict(KEV_MODELS[name])


def kev4b_config() -> ModelConfig:
    return kev_config("kev-4b")


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


def matmul_rates(sustain_s: float = 5.0, n: int = 8192) -> dict:
    """The bf16 GEMM rate two ways.

    `matmul_tflops` is `matmul_tflops()`: 20 GEMMs after 3 warm ones, ~30 ms, so the clock is at its
    boost (too short for nvidia-smi's samples). A load run keeps the GPU busy for many seconds at its
    power limit (700 W on the H200), where the clock may be lower: `matmul_tflops_sustained` is the
    rate of back-to-back GEMMs over the last half of `sustain_s` seconds, with the SM clock and board
    power over that half (`matmul_sustained_gpu`). The first is what `ceiling_fraction` divides by;
    the second tells how much of a load's distance from it is the clock."""
    burst = matmul_tflops(n)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    graph, _ = capture(lambda: [a @ b for _ in range(10)])
    start = time.perf_counter()
    while time.perf_counter() - start < sustain_s / 2:  # reach the power limit first
        graph.replay()
        torch.cuda.synchronize()
    with GpuSampler() as sustained_clock:
        replays = max(1, int(sustain_s / 2 / (cuda_ms(graph.replay, 1)[0] * 1e-3)))
        ms = cuda_ms(lambda: [graph.replay() for _ in range(replays)], 1)[0]
    return {"matmul_tflops": burst,
            "matmul_tflops_sustained": 2 * n**3 * 10 * replays / (ms * 1e-3) / 1e12,
            "matmul_sustained_gpu": sustained_clock.medians}


class GpuSampler:
    """nvidia-smi sampling the SM clock (MHz) and board power (W) every 50 ms while in the block;
    `medians` is {"sm_mhz": ..., "power_w": ...}, or None without nvidia-smi or samples."""

    QUERY = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"]

    def __init__(self):
        self.medians: dict | None = None
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "GpuSampler":
        try:
            self._proc = subprocess.Popen(self.QUERY, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi here
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        self.medians = smi_medians(out)


def smi_medians(text: str) -> dict | None:
    """Medians of nvidia-smi's "clocks.sm, power.draw" CSV lines (no header, no units); lines that
    do not parse (a device listed as [N/A], a partial last line) are skipped."""
    rows = []
    for line in text.splitlines():
        try:
            sm, power = (float(x) for x in line.split(","))
        except ValueError:
            continue
        rows.append((sm, power))
    if not rows:
        return None
    return {"sm_mhz": statistics.median(r[0] for r in rows), "power_w": statistics.median(r[1] for r in rows),
            "samples": len(rows)}


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


def capture(fn: Callable[[], object], pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `fn` up on a side stream (compiles, autotunes), then capture it; returns (graph, output).
    `pool`: a memory pool shared with other graphs that never replay at the same time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def floor_ms(cfg: ModelConfig, tokens: int, tflops: float) -> float:
    """The matmul floor of one pass: 2 x non-embedding params x tokens at the measured rate."""
    return 2 * cfg.non_embedding_params() * tokens / (tflops * 1e12) * 1e3


def run_info() -> dict:
    commit = os.environ.get("KEV_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    from kev.ops import pdl

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {"commit": commit, "gpu": gpu, "torch": torch.__version__,
            "pdl": pdl.enabled()}  # our kernels launched with programmatic dependent launch (kev/ops/pdl.py)


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(json.dumps(obj, indent=2))
