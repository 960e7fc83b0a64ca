"""A checkpoint directory loaded into everything a process runs: backbone, head and prompt builder.

The engine, the bank and every scorer load through `LoadedModel`, so a model is read, fused (GPU)
or made batch-invariant (CPU) the same way everywhere. A scorer beside a bank that shares its
weights (kev/bank/shared_weights.py) loads everything but the weights and `bind`s a model to the
bank's memory; `own_model` reads them from the checkpoint when the bank shares none."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kev.model.checkpoint import load_checkpoint
from kev.model.config import ModelConfig
from kev.model.qwen35 import Qwen35Model
from kev.request.head import DecisionHead, load_head
from kev.request.prompts import Delimiters, Limits, PromptBuilder


@dataclass(frozen=True)
class LoadedModel:
    """Everything read from a checkpoint directory, ready to run."""

    model_id: str
    model: Qwen35Model | None  # None: loaded without weights (`bind` or `own_model` makes one)
    head: DecisionHead
    builder: PromptBuilder
    config: ModelConfig
    device: str
    dtype: torch.dtype
    source: tuple[str, str | None]  # checkpoint and adapter directories (`own_model`)

    @classmethod
    def load(cls, checkpoint_dir: str | Path, adapter_dir: str | Path | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, limits: Limits = Limits(), *, weights: bool = True,
             host_staging: bool = False) -> "LoadedModel":
        """`weights=False`: no weights read (`model` is None). `host_staging`: the weights are read
        and fused in host memory, prepared for `device` but left on the host, for the bank to move
        them into the memory it shares (one copy on the device at any time, even while loading)."""
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        ckpt = load_checkpoint(checkpoint_dir, adapter_dir, dtype=dtype, device="cpu" if host_staging else device,
                               require_head=True, require_tokenizer=True, weights=weights)
        model = None
        if weights:
            model = _prepared(_empty_model(ckpt.config), device, ckpt.weights, move=not host_staging)
        delimiters = Delimiters(**ckpt.meta.delimiters) if ckpt.meta.delimiters else Delimiters()
        builder = PromptBuilder(Tokenizer.from_file(str(ckpt.tokenizer_path)), delimiters, limits)
        head = load_head(ckpt.head_path, ckpt.config.hidden_size, device=device)
        return cls(ckpt.meta.model_id, model, head, builder, ckpt.config, device, dtype,
                   (str(checkpoint_dir), None if adapter_dir is None else str(adapter_dir)))

    def bind(self, weights: Mapping[str, torch.Tensor]) -> Qwen35Model:
        """A model whose parameters are `weights` themselves, no copy (another process's memory,
        mapped): the owner prepared them for this device, fused projections included, which the
        model adopts in place."""
        for name, t in weights.items():
            if t.dtype != self.dtype or t.device.type != torch.device(self.device).type:
                raise ValueError(f"shared weight {name!r} is {t.dtype} on {t.device}; this process runs "
                                 f"{self.dtype} on {self.device}")
        return _prepared(_empty_model(self.config), self.device, weights, move=False)

    def own_model(self) -> Qwen35Model:
        """This process's own copy of the weights, read from the checkpoint."""
        ckpt = load_checkpoint(self.source[0], self.source[1], dtype=self.dtype, device=self.device)
        return _prepared(_empty_model(ckpt.config), self.device, ckpt.weights, move=True)


def _empty_model(config: ModelConfig) -> Qwen35Model:
    with torch.device("meta"):  # no random init to throw away: ~20-80 s of CPU for Kev-4B
        return Qwen35Model(config)


def _prepared(model: Qwen35Model, device: str, weights: Mapping[str, torch.Tensor], move: bool) -> Qwen35Model:
    """`weights` assigned (every parameter is one of them, or a view: no copy), then the model made
    ready for `device`: batch-invariant on CPU, one GEMM per layer's input projections on GPU."""
    if device == "cpu":
        model.set_batch_invariant()  # CPU promise: answers bit-identical whatever shares a pass
    model.load_state_dict(weights, strict=True, assign=True)
    if move:
        model = model.to(device)
    if device != "cpu":
        model.fuse_projections()  # adopts weights already fused back to back (kev/model/qwen35.py)
    return model.eval()
