"""Loading a Kev / Qwen3.5 checkpoint directory into named tensors, checked against the config.

Checkpoint directory (what `KEV_CHECKPOINT` points at):

    config.json                     Qwen3.5 config: flat `qwen3_5_text`, or the published multimodal
                                    `qwen3_5` with the decoder under `text_config` (kev.model.config parses both)
    model.safetensors               the weights in one file, or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json   sharded (index `weight_map`)
    head.safetensors                the decision head (read by kev.request.head.load_head; optional here)
    tokenizer.json                  the tokenizers-library tokenizer (optional here)
    kev.json                        optional: {"model_id": "...", "delimiters": {role: token text},
                                    "base": "...", "base_revision": "...", "weights_dtype": "..."}
                                    (the last three: provenance written by `kev convert`, not used)
    adapter_config.json + adapter_model.safetensors   optional: a PEFT LoRA merged at load

Tensor names: flat saves use `model.*`, nested saves `model.language_model.*`; both map to the
backbone's names (`embed_tokens.weight`, `layers.{i}...`, see `expected_shapes`). `model.visual.*`,
`mtp.*` and `lm_head.*` are ignored: serving runs neither the vision tower, multi-token prediction
nor the LM head. Anything else that does not map to an expected name is an error, as is a missing
tensor or a wrong shape. Tensors only come from safetensors: nothing is ever unpickled.

A LoRA adapter (PEFT layout: `adapter_config.json` + `adapter_model.safetensors`, see
kev.model.lora) is merged at load, whether it sits inside the checkpoint directory (what `kev convert`
writes) or in a separate adapter directory (`KEV_ADAPTER`); never both, and an adapter file in the
checkpoint directory is never ignored (`resolve_adapter`). The base is read in fp32, merged in fp32 and
rounded once to the serving dtype. A Kev release of the separate kind ships its head, tokenizer and
kev.json beside the adapter, so those files are looked up in the adapter directory first, then in the
checkpoint directory.

Model id (`resolve_model_id`, the one rule every process applies): kev.json's `model_id` must pass
`check_model_id` (1-128 characters of `A-Z a-z 0-9 . _ / + -`, starting with a letter or digit:
the bank's directory keys use `{`, `}`, `@` and `:` as separators, and the id travels in an HTTP/2
header); without one, the id is the name of the directory the side files describe (adapter, else
checkpoint) passed through `sanitise_model_id`. Both happen before any weight is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import logging
import re

import torch
from safetensors import safe_open

from kev.model.config import CheckpointError, ModelConfig
from kev.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge_lora
from kev.model.weight_names import FLAT_PREFIX, IGNORED_PREFIXES, NESTED_PREFIX, PathLike, expected_shapes, read_json

__all__ = [
    "Checkpoint",
    "CheckpointMeta",
    "DELIMITER_ROLES",
    "check_model_id",
    "expected_shapes",
    "find_side_files",
    "load_checkpoint",
    "read_config",
    "read_weights",
    "resolve_adapter",
    "resolve_model_id",
    "sanitise_model_id",
]

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEAD_FILE = "head.safetensors"
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "kev.json"
RUN_HEAD_FILE = "head.pt"  # a Kev training run's head: only `kev convert` reads it

# What a model id may hold (module docstring). `{`, `}` and `@` would break the bank directory's
# hash tag `kev:{<model_id>@<node>}:`, `:` separates the id from the digest in a document key,
# and the id is sent as the affinity header's value.
MODEL_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/+-]{0,127}")
_MODEL_ID_BAD_RUN = re.compile(r"[^A-Za-z0-9._/+-]+")

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


def check_model_id(model_id: object, source: str = "model_id") -> str:
    """`model_id` if it is a usable id (module docstring), else a CheckpointError naming `source`."""
    if not isinstance(model_id, str) or not MODEL_ID_PATTERN.fullmatch(model_id):
        raise CheckpointError(
            f"{source}: model id {model_id!r} is not usable: it needs 1-128 characters of A-Z a-z 0-9 . _ / + -, "
            "starting with a letter or digit (the bank's keys use '{', '}', '@' and ':' as separators)"
        )
    return model_id


def sanitise_model_id(name: str, source: str = "model_id") -> str:
    """A usable id made from a name (a directory's): every run of other characters becomes '-'."""
    cleaned = _MODEL_ID_BAD_RUN.sub("-", name).strip("-._/+")[:128].rstrip("-._/+")
    if not cleaned:
        raise CheckpointError(f"{source}: no usable model id can be made from {name!r}; set 'model_id' in kev.json")
    if cleaned != name:
        log.warning("%s: model id %r sanitised to %r (kev.json's 'model_id' sets it explicitly)", source, name, cleaned)
    return check_model_id(cleaned, source)


@dataclass(frozen=True)
class CheckpointMeta:
    model_id: str
    # Only the roles kev.json overrides (DELIMITER_ROLES -> token text); defaults live with the prompts.
    delimiters: Mapping[str, str] = field(default_factory=dict)
    # Provenance `kev convert` records; informational.
    base: str | None = None
    base_revision: str | None = None
    weights_dtype: str | None = None


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    head_path: Path | None
    tokenizer_path: Path | None
    meta: CheckpointMeta


_META_FIELDS = ("model_id", "delimiters", "base", "base_revision", "weights_dtype")


def _read_meta(path: Path | None, default_dir: Path) -> CheckpointMeta:
    if path is None:
        return CheckpointMeta(model_id=sanitise_model_id(default_dir.resolve().name, str(default_dir)))
    raw = read_json(path)
    if unknown := sorted(set(raw) - set(_META_FIELDS)):
        raise CheckpointError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(_META_FIELDS)})")
    if "model_id" in raw:
        model_id = check_model_id(raw["model_id"], f"{path}: 'model_id'")
    else:
        model_id = sanitise_model_id(default_dir.resolve().name, str(default_dir))
    provenance = {}
    for key in ("base", "base_revision", "weights_dtype"):
        value = raw.get(key)
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{path}: {key!r} must be a string or null, got {value!r}")
        provenance[key] = value
    delimiters = raw.get("delimiters", {})
    if not isinstance(delimiters, dict):
        raise CheckpointError(f"{path}: 'delimiters' must be an object of role -> token text")
    for role, token in delimiters.items():
        if role not in DELIMITER_ROLES:
            raise CheckpointError(f"{path}: unknown delimiter role {role!r} (known: {', '.join(DELIMITER_ROLES)})")
        if not isinstance(token, str) or not token:
            raise CheckpointError(f"{path}: delimiter {role!r} must be a non-empty string")
    return CheckpointMeta(model_id=model_id, delimiters=dict(delimiters), **provenance)


@dataclass(frozen=True)
class SideFiles:
    head_path: Path | None
    tokenizer_path: Path | None
    meta: CheckpointMeta


def resolve_adapter(checkpoint_dir: PathLike, adapter_dir: PathLike | None = None) -> Path | None:
    """The adapter to merge: `adapter_dir`, or the checkpoint directory itself when it holds one.

    An adapter file in the checkpoint directory is never ignored: with a second adapter given, or
    with adapter weights but no adapter_config.json, this refuses. A directory that holds an adapter
    but no base (a Kev run) gets a message saying how to serve it.
    """
    checkpoint_dir = Path(checkpoint_dir)
    adapter = Path(adapter_dir) if adapter_dir is not None else None
    has_config = (checkpoint_dir / ADAPTER_CONFIG).is_file()
    if not has_config and (checkpoint_dir / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(
            f"{checkpoint_dir / ADAPTER_WEIGHTS}: adapter weights without {ADAPTER_CONFIG}; "
            "add the adapter's config or remove the file (it is never ignored)"
        )
    if has_config and not (checkpoint_dir / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{checkpoint_dir}: holds a LoRA adapter but no base model ({CONFIG_FILE}); serve the base as the "
            f"checkpoint with this directory as the adapter (KEV_ADAPTER), or run `kev convert {checkpoint_dir} OUT "
            "--base BASE_DIR`"
        )
    if not has_config:
        return adapter
    if adapter is not None and adapter.resolve() != checkpoint_dir.resolve():
        raise CheckpointError(
            f"{checkpoint_dir / ADAPTER_CONFIG}: the checkpoint directory holds an adapter and another one was "
            f"given ({adapter}); only one adapter is merged, remove one of them"
        )
    return checkpoint_dir


def find_side_files(checkpoint_dir: PathLike, adapter_dir: PathLike | None = None, *,
                    require_head: bool = False, require_tokenizer: bool = False) -> SideFiles:
    """Head, tokenizer and kev.json: looked for beside the adapter first, then the checkpoint.

    Reads no weights; the model id it returns (`meta.model_id`) is what every process derives for
    this checkpoint + adapter (`resolve_model_id`)."""
    checkpoint_dir = Path(checkpoint_dir)
    adapter = resolve_adapter(checkpoint_dir, adapter_dir)
    search = list(dict.fromkeys(d for d in (adapter, checkpoint_dir) if d is not None))

    def find(file: str, required: bool, what: str) -> Path | None:
        for d in search:
            if (d / file).is_file():
                return d / file
        if required:
            hint = ""
            if file == HEAD_FILE and any((d / RUN_HEAD_FILE).is_file() for d in search):
                hint = f" (found {RUN_HEAD_FILE}, a Kev run's head: `kev convert` makes a checkpoint of the run)"
            raise CheckpointError(f"{' or '.join(str(d / file) for d in search)}: {what} not found{hint}")
        return None

    return SideFiles(head_path=find(HEAD_FILE, require_head, "decision head"),
                     tokenizer_path=find(TOKENIZER_FILE, require_tokenizer, "tokenizer"),
                     meta=_read_meta(find(META_FILE, False, "kev.json"), default_dir=search[0]))


def resolve_model_id(checkpoint_dir: PathLike, adapter_dir: PathLike | None = None) -> str:
    """The model id of a checkpoint (+ adapter), checked, before any weight is read: the one rule the
    loader, the client and the services share (module docstring). CheckpointError if unusable."""
    return find_side_files(checkpoint_dir, adapter_dir).meta.model_id


def load_checkpoint(
    checkpoint_dir: PathLike,
    adapter_dir: PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    require_head: bool = False,
    require_tokenizer: bool = False,
    weights: bool = True,
) -> Checkpoint:
    """Config, checked weights (LoRA merged: `adapter_dir`, or one inside the checkpoint directory),
    and where the head/tokenizer are. `weights=False`: everything but the weights (a scorer that
    maps the bank's copy), whose dict is then empty.

    fp32 on CPU and bf16 on GPU are the caller's choice through `dtype`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    # Adapter, side files and model id first: a bad one should fail before gigabytes of weights are read.
    adapter = resolve_adapter(checkpoint_dir, adapter_dir)
    config = read_config(checkpoint_dir)
    side = find_side_files(checkpoint_dir, adapter, require_head=require_head, require_tokenizer=require_tokenizer)
    head_path, tokenizer_path, meta = side.head_path, side.tokenizer_path, side.meta

    if not weights:
        return Checkpoint(config, {}, head_path, tokenizer_path, meta)
    if adapter is None:
        weights = read_weights(checkpoint_dir, config, dtype=dtype, device=device)
    else:
        log.info("merging LoRA adapter %s into %s", adapter, checkpoint_dir)
        # fp32 until the merge is done, then one rounding per tensor (DESIGN §1).
        merged = merge_lora(read_weights(checkpoint_dir, config), adapter, config)
        weights = {}
        for name in list(merged):
            weights[name] = merged.pop(name).to(dtype=dtype).to(device)  # pop frees each fp32 tensor once cast
    return Checkpoint(config, weights, head_path, tokenizer_path, meta)
