"""The backbone's shape, parsed once from a checkpoint's `config.json`.

Accepts the text-only save (`model_type: qwen3_5_text`, flat) and the published multimodal
save (`model_type: qwen3_5`, decoder fields under `text_config`). Everything the model needs is a
field here; nothing downstream reads the raw JSON.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CheckpointError(ValueError):
    """A checkpoint file is missing or does not match what the model needs (names the file/tensor)."""


class LayerType(enum.Enum):
    DELTANET = "linear_attention"
    ATTENTION = "full_attention"


TEXT_MODEL_TYPE = "qwen3_5_text"
NESTED_MODEL_TYPE = "qwen3_5"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[LayerType, ...]
    # attention layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    # DeltaNet layers
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    nested: bool = False  # weights under `model.language_model.*`

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v (not z)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.DELTANET)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.ATTENTION)

    def non_embedding_params(self) -> int:
        """Parameters touched per token by the backbone's GEMMs (for matmul-floor figures)."""
        d, f = self.hidden_size, self.intermediate_size
        mlp = 3 * d * f
        attn = d * (2 * self.num_attention_heads * self.head_dim) + 2 * d * (
            self.num_key_value_heads * self.head_dim
        ) + self.num_attention_heads * self.head_dim * d
        hv = self.linear_num_value_heads
        delta = d * (self.conv_dim + self.linear_value_dim + 2 * hv) + self.linear_value_dim * d
        return sum(mlp + (attn if t is LayerType.ATTENTION else delta) for t in self.layer_types)

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        nested = model_type == NESTED_MODEL_TYPE
        if nested:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise CheckpointError(f"{source}: model_type {model_type!r} needs a 'text_config' object")
            tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        elif model_type == TEXT_MODEL_TYPE:
            text = raw
            tie = raw.get("tie_word_embeddings", False)
        else:
            raise CheckpointError(
                f"{source}: unknown model_type {model_type!r} (expected {TEXT_MODEL_TYPE!r} or {NESTED_MODEL_TYPE!r})"
            )

        def need(key):
            if key not in text:
                raise CheckpointError(f"{source}: missing field {key!r}")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        names = text.get("layer_types")
        if names is None:
            interval = int(text.get("full_attention_interval", 4))
            names = [
                LayerType.ATTENTION.value if (i + 1) % interval == 0 else LayerType.DELTANET.value
                for i in range(n_layers)
            ]
        if len(names) != n_layers:
            raise CheckpointError(f"{source}: {len(names)} layer_types for {n_layers} layers")
        layer_types = []
        for i, name in enumerate(names):
            try:
                layer_types.append(LayerType(name))
            except ValueError:
                raise CheckpointError(f"{source}: unsupported layer type {name!r} at layer {i}") from None

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise CheckpointError(f"{source}: unsupported rope_type {rope_type!r}")
        if text.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: unsupported hidden_act {text.get('hidden_act')!r}")

        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            layer_types=tuple(layer_types),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim", 256)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            attention_bias=bool(text.get("attention_bias", False)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            nested=nested,
        )

    def to_text_dict(self) -> dict:
        """The flat `qwen3_5_text` config.json for this shape (used when saving checkpoints)."""
        return {
            "model_type": TEXT_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": [t.value for t in self.layer_types],
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "attention_bias": self.attention_bias,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
