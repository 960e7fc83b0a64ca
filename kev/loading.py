"""A checkpoint directory loaded into everything a process runs: backbone, head and prompt builder.

The engine, the bank and every scorer load through `LoadedModel.load`, so a model is read, fused
(GPU) or made batch-invariant (CPU) the same way everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kev.model.checkpoint import load_checkpoint
from kev.model.qwen35 import Qwen35Model
from kev.request.head import DecisionHead, load_head
from kev.request.prompts import Delimiters, Limits, PromptBuilder


@dataclass(frozen=True)
class LoadedModel:
    """Everything read from a checkpoint directory, ready to run."""

    model_id: str
    model: Qwen35Model
    head: DecisionHead
    builder: PromptBuilder

    @classmethod
    def load(cls, checkpoint_dir: str | Path, adapter_dir: str | Path | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, limits: Limits = Limits()) -> "LoadedModel":
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        ckpt = load_checkpoint(checkpoint_dir, adapter_dir, dtype=dtype, device=device,
                               require_head=True, require_tokenizer=True)
        with torch.device("meta"):  # no random init to throw away: ~20-80 s of CPU for Kev-4B
            model = Qwen35Model(ckpt.config)
        model.load_state_dict(ckpt.weights, strict=True, assign=True)  # every parameter is a loaded tensor
        model = model.to(device).eval()
        if device == "cpu":
            model.set_batch_invariant()  # CPU promise: answers bit-identical whatever shares a pass
        else:
            model.fuse_projections()  # GPU: one GEMM per layer's input projections
        delimiters = Delimiters(**ckpt.meta.delimiters) if ckpt.meta.delimiters else Delimiters()
        builder = PromptBuilder(Tokenizer.from_file(str(ckpt.tokenizer_path)), delimiters, limits)
        head = load_head(ckpt.head_path, ckpt.config.hidden_size, device=device)
        return cls(ckpt.meta.model_id, model, head, builder)
