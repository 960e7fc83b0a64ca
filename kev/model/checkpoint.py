"""Loading a Kev / Qwen3.5 checkpoint directory into named tensors, checked against the config.

Checkpoint directory (what `KEV_CHECKPOINT` points at):

    config.json                     Qwen3.5 config: flat `qwen3_5_text`, or the published multimodal
                                    `qwen3_5` with the decoder under `text_config` (kev.model.config parses both)
    model.safetensors               the weights in one file, or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json   sharded (index `weight_map`)
    head.safetensors                the decision head (read by kev.request.head.load_head; optional here)
    tokenizer.json                  the tokenizers-library tokenizer (optional here)
    kev.json                        optional: {"model_id": "...", "delimiters": {role: token text}}

Tensor names: flat saves use `model.*`, nested saves `model.language_model.*`; both map to the
backbone's names (`embed_tokens.weight`, `layers.{i}...`, see `expected_shapes`). `model.visual.*`,
`mtp.*` and `lm_head.*` are ignored: serving runs neither the vision tower, multi-token prediction
nor the LM head. Anything else that does not map to an expected name is an error, as is a missing
tensor or a wrong shape. Tensors only come from safetensors: nothing is ever unpickled.

An optional LoRA adapter directory (PEFT layout: `adapter_config.json` + `adapter_model.safetensors`,
see kev.model.lora) is merged at load. The base is read in fp32, merged in fp32 and rounded once to the
serving dtype. A Kev release of that kind ships its head, tokenizer and kev.json beside the
adapter, so those files are looked up in the adapter directory first, then in the checkpoint
directory; the default model id is the name of the directory they describe (adapter, else checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from kev.model.config import CheckpointError, ModelConfig
from kev.model.lora import merge_lora
from kev.model.weight_names import FLAT_PREFIX, IGNORED_PREFIXES, NESTED_PREFIX, PathLike, expected_shapes, read_json

__all__ = [
    "Checkpoint",
    "CheckpointMeta",
    "DELIMITER_ROLES",
    "expected_shapes",
    "load_checkpoint",
    "read_config",
    "read_weights",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEAD_FILE = "head.safetensors"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "kev.json"

# Prompt delimiters a kev.json may override (DESIGN §1 gives the defaults).
DELIMITER_ROLES = ("state", "q", "opt", "opt_end", "decide")

def read_config(checkpoint_dir: PathLike) -> ModelConfig:
    """Parse `config.json`; also checks the head ratios the kernels rely on."""
    path = Path(checkpoint_dir) / CONFIG_FILE
    config = ModelConfig.from_dict(read_json(path), source=str(path))
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise CheckpointError(
            f"{path}: linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {config.linear_num_key_heads}"
        )
    if config.num_attention_heads % config.num_key_value_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )
    if config.rotary_dim % 2 or not 0 < config.rotary_dim <= config.head_dim:
        raise CheckpointError(f"{path}: rotary dim {config.rotary_dim} of head_dim {config.head_dim} is not usable")
    return config


def _weight_files(checkpoint_dir: Path) -> dict[Path, set[str] | None]:
    """Weight files to read, each with the tensor names its index promises (None: single file)."""
    single, index = checkpoint_dir / WEIGHTS_FILE, checkpoint_dir / INDEX_FILE
    if single.is_file() and index.is_file():
        # Two sources of truth: a half-finished re-save could mix versions, so refuse to guess.
        raise CheckpointError(f"{checkpoint_dir}: both {WEIGHTS_FILE} and {INDEX_FILE} present; keep one")
    if single.is_file():
        return {single: None}
    if not index.is_file():
        pickles = sorted(p.name for p in checkpoint_dir.glob("*.bin")) + sorted(
            p.name for p in checkpoint_dir.glob("*.pt*")
        )
        hint = f" (found {pickles}: pickled weights are never loaded, convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"{single}: weight file not found, nor {INDEX_FILE}{hint}")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: needs a non-empty 'weight_map' object of tensor name -> file")
    promised: dict[Path, set[str]] = {}
    for name, file in weight_map.items():
        # A bare file name only: an index must not reach outside its directory.
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, not a .safetensors file name")
        path = checkpoint_dir / file
        if not path.is_file():
            raise CheckpointError(f"{index}: tensor {name!r} is in {file}, which is missing")
        promised.setdefault(path, set()).add(name)
    return {path: names for path, names in promised.items()}


def _iter_tensors(files: dict[Path, set[str] | None]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, stored name, tensor) for every tensor on disk, checked against the index."""
    for path, promised in files.items():
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names = set(f.keys())
                if promised is not None:
                    if lost := sorted(promised - names):
                        raise CheckpointError(f"{path}: index lists tensor {lost[0]!r} here, but the file lacks it")
                    if extra := sorted(names - promised):
                        raise CheckpointError(f"{path}: tensor {extra[0]!r} is not listed in {INDEX_FILE}")
                for name in sorted(names):
                    yield path, name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for a truncated or bad header
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _model_name(stored: str, nested: bool) -> str | None:
    """Backbone name of a stored tensor; None for parts serving ignores; '' for an unknown name."""
    if stored.startswith(IGNORED_PREFIXES):
        return None
    prefix = NESTED_PREFIX if nested else FLAT_PREFIX
    return stored[len(prefix) :] if stored.startswith(prefix) else ""


def read_weights(
    checkpoint_dir: PathLike,
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Backbone tensors by `expected_shapes` name, cast to `dtype` on `device`; exact set and shapes checked."""
    checkpoint_dir = Path(checkpoint_dir)
    shapes = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    source: dict[str, Path] = {}
    for path, stored, tensor in _iter_tensors(_weight_files(checkpoint_dir)):
        name = _model_name(stored, config.nested)
        if name is None:
            continue
        if name not in shapes:
            layout = "nested (model.language_model.*)" if config.nested else "flat (model.*)"
            raise CheckpointError(f"{path}: unexpected tensor {stored!r} for a {layout} checkpoint of this config")
        if name in weights:
            raise CheckpointError(f"{path}: tensor {stored!r} already read from {source[name]}")
        if tuple(tensor.shape) != shapes[name]:
            raise CheckpointError(
                f"{path}: tensor {stored!r} has shape {tuple(tensor.shape)}, config needs {shapes[name]}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {stored!r} has dtype {tensor.dtype}, expected floating point")
        weights[name] = tensor.to(dtype=dtype).to(device)
        source[name] = path
    if missing := [n for n in shapes if n not in weights]:
        prefix = NESTED_PREFIX if config.nested else FLAT_PREFIX
        where = checkpoint_dir / (INDEX_FILE if (checkpoint_dir / INDEX_FILE).is_file() else WEIGHTS_FILE)
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {prefix + missing[0]!r}{more}")
    # expected_shapes order (layer by layer), whatever order the files store.
    return {n: weights[n] for n in shapes}


@dataclass(frozen=True)
class CheckpointMeta:
    model_id: str
    # Only the roles kev.json overrides (DELIMITER_ROLES -> token text); defaults live with the prompts.
    delimiters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    head_path: Path | None
    tokenizer_path: Path | None
    meta: CheckpointMeta


def _read_meta(path: Path | None, default_id: str) -> CheckpointMeta:
    if path is None:
        return CheckpointMeta(model_id=default_id)
    raw = read_json(path)
    if unknown := sorted(set(raw) - {"model_id", "delimiters"}):
        raise CheckpointError(f"{path}: unknown field {unknown[0]!r} (known: model_id, delimiters)")
    model_id = raw.get("model_id", default_id)
    if not isinstance(model_id, str) or not model_id:
        raise CheckpointError(f"{path}: 'model_id' must be a non-empty string")
    delimiters = raw.get("delimiters", {})
    if not isinstance(delimiters, dict):
        raise CheckpointError(f"{path}: 'delimiters' must be an object of role -> token text")
    for role, token in delimiters.items():
        if role not in DELIMITER_ROLES:
            raise CheckpointError(f"{path}: unknown delimiter role {role!r} (known: {', '.join(DELIMITER_ROLES)})")
        if not isinstance(token, str) or not token:
            raise CheckpointError(f"{path}: delimiter {role!r} must be a non-empty string")
    return CheckpointMeta(model_id=model_id, delimiters=dict(delimiters))


@dataclass(frozen=True)
class SideFiles:
    head_path: Path | None
    tokenizer_path: Path | None
    meta: CheckpointMeta


def find_side_files(checkpoint_dir: PathLike, adapter_dir: PathLike | None = None, *,
                    require_head: bool = False, require_tokenizer: bool = False) -> SideFiles:
    """Head, tokenizer and kev.json: looked for beside the adapter first, then the checkpoint."""
    search = [Path(d) for d in (adapter_dir, checkpoint_dir) if d is not None]

    def find(file: str, required: bool, what: str) -> Path | None:
        for d in search:
            if (d / file).is_file():
                return d / file
        if required:
            raise CheckpointError(f"{' or '.join(str(d / file) for d in search)}: {what} not found")
        return None

    return SideFiles(head_path=find(HEAD_FILE, require_head, "decision head"),
                     tokenizer_path=find(TOKENIZER_FILE, require_tokenizer, "tokenizer"),
                     meta=_read_meta(find(META_FILE, False, "kev.json"), default_id=search[0].resolve().name))


def load_checkpoint(
    checkpoint_dir: PathLike,
    adapter_dir: PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    require_head: bool = False,
    require_tokenizer: bool = False,
) -> Checkpoint:
    """Config, checked weights (LoRA merged if `adapter_dir`), and where the head/tokenizer are.

    fp32 on CPU and bf16 on GPU are the caller's choice through `dtype`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    adapter = Path(adapter_dir) if adapter_dir is not None else None
    # Side files first: a missing head should fail before gigabytes of weights are read.
    config = read_config(checkpoint_dir)
    side = find_side_files(checkpoint_dir, adapter, require_head=require_head, require_tokenizer=require_tokenizer)
    head_path, tokenizer_path, meta = side.head_path, side.tokenizer_path, side.meta

    if adapter is None:
        weights = read_weights(checkpoint_dir, config, dtype=dtype, device=device)
    else:

        # fp32 until the merge is done, then one rounding per tensor (DESIGN §1).
        merged = merge_lora(read_weights(checkpoint_dir, config), adapter, config)
        weights = {}
        for name in list(merged):
            weights[name] = merged.pop(name).to(dtype=dtype).to(device)  # pop frees each fp32 tensor once cast
    return Checkpoint(config, weights, head_path, tokenizer_path, meta)
