"""Merging a PEFT LoRA adapter into fp32 backbone weights at load time.

Adapter directory (as PEFT saves it):

    adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, optional use_rslora
    adapter_model.safetensors   `base_model.model.<module>.lora_A.weight` [r, in] and
                                `base_model.model.<module>.lora_B.weight` [out, r]

`<module>` follows whichever HF class the adapter was trained on: `model.layers.{i}...` (text
model), `model.language_model.layers.{i}...` (the multimodal one) or `layers.{i}...` (a bare
backbone), so all three are accepted whatever the base checkpoint's own nesting.

W' = W + scale * B @ A with scale = alpha / r (alpha / sqrt(r) with use_rslora), in fp32. The
caller rounds W' to the serving dtype once. PEFT features that change that formula (DoRA, LoRA
biases, per-module rank/alpha patterns, fully trained `modules_to_save` of the backbone) are
refused, not ignored.

What serving never runs is dropped, each with a log line (logger `kev.model.lora`): a LoRA on the
LM head (`lm_head` in target_modules), a fully trained LM head (`modules_to_save: ["lm_head"]`; PEFT
stores it as `base_model.model.lm_head.weight`), and LoRAs on the vision tower (target names
`qkv`, `proj`, `linear_fc1`, `linear_fc2` or any `visual.` path; tensors under `model.visual.`).
Any other module_to_save (an embedding, a classifier) is refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kev.model.weight_names import FLAT_PREFIX, IGNORED_PREFIXES, NESTED_PREFIX, PathLike, expected_shapes, read_json
from kev.model.config import CheckpointError, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# Linear layers a LoRA may adapt (the last component of the module name).
SUPPORTED_TARGETS = frozenset(
    {
        "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
        "q_proj", "k_proj", "v_proj", "o_proj",
        "gate_proj", "up_proj", "down_proj",
    }
)  # fmt: skip
# Allowed as a target but dropped: serving has no LM head.
IGNORED_TARGETS = frozenset({"lm_head"})
# The vision tower's linear layers (Qwen3.5's `model.visual.*`): allowed as targets, dropped.
VISION_TARGETS = frozenset({"qkv", "proj", "linear_fc1", "linear_fc2"})
# modules_to_save entries serving drops (it has no LM head); any other is refused.
IGNORED_MODULES_TO_SAVE = frozenset({"lm_head"})

log = logging.getLogger(__name__)

# adapter_config.json fields whose non-default value would change the merged weight.
_UNSUPPORTED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "fan_in_fan_out": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None,),
}


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    scale: float
    # Target module names, or PEFT's regex string (then the tensor names are the only truth).
    targets: frozenset[str] | str


def read_adapter_config(adapter_dir: PathLike) -> LoraSpec:
    path = Path(adapter_dir) / ADAPTER_CONFIG
    raw = read_json(path)
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {raw['peft_type']!r} is not supported (only LORA)")
    for key, defaults in _UNSUPPORTED.items():
        if raw.get(key, defaults[0]) not in defaults:
            raise CheckpointError(f"{path}: {key}={raw[key]!r} is not supported; merge it offline or drop it")
    to_save = raw.get("modules_to_save") or []
    if not isinstance(to_save, list) or not all(isinstance(m, str) for m in to_save):
        raise CheckpointError(f"{path}: 'modules_to_save' must be a list of module names, got {to_save!r}")
    if refused := sorted(m for m in to_save if m.rsplit(".", 1)[-1] not in IGNORED_MODULES_TO_SAVE):
        raise CheckpointError(
            f"{path}: modules_to_save={refused!r} is not supported (a fully trained backbone module would have to be "
            "loaded from the adapter); merge it into the base offline. Only 'lm_head' is accepted (and ignored)"
        )
    if to_save:
        log.info("%s: modules_to_save %s ignored: serving has no LM head", path, to_save)
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0:
        raise CheckpointError(f"{path}: 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise CheckpointError(f"{path}: 'lora_alpha' must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora", False) else alpha / rank

    targets = raw.get("target_modules")
    if isinstance(targets, list):
        # PEFT matches list entries as name suffixes, so the last component decides.
        vision = sorted(str(t) for t in targets if _is_vision_target(str(t)))
        if vision:
            log.info("%s: vision-tower targets %s ignored: serving runs no vision tower", path, vision)
        if ignored := sorted(str(t) for t in targets if str(t).rsplit(".", 1)[-1] in IGNORED_TARGETS):
            log.info("%s: targets %s ignored: serving has no LM head", path, ignored)
        names = frozenset(str(t).rsplit(".", 1)[-1] for t in targets if not _is_vision_target(str(t)))
        if unknown := sorted(names - SUPPORTED_TARGETS - IGNORED_TARGETS):
            raise CheckpointError(
                f"{path}: unknown target module {unknown[0]!r} (supported: {', '.join(sorted(SUPPORTED_TARGETS))})"
            )
        targets = names
    elif not isinstance(targets, str):
        raise CheckpointError(f"{path}: 'target_modules' must be a list of names or a regex string")
    return LoraSpec(rank=rank, alpha=float(alpha), scale=scale, targets=targets)


def _is_vision_target(target: str) -> bool:
    return target.rsplit(".", 1)[-1] in VISION_TARGETS or target.startswith(("visual.", "model.visual."))


def _module_name(stored: str) -> str | None:
    """Backbone module of a PEFT module path; None for parts serving ignores."""
    name = stored.removeprefix(PEFT_PREFIX)
    if (name + ".").startswith(IGNORED_PREFIXES):  # "+ ." so the module `lm_head` itself matches
        return None
    for prefix in (NESTED_PREFIX, FLAT_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def read_adapter_tensors(adapter_dir: PathLike) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Backbone module name -> (A [r, in], B [out, r]) in fp32, each pair complete."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        found = sorted(p.name for p in Path(adapter_dir).glob("adapter_model.*"))
        hint = f" (found {found}: pickled adapters are never loaded)" if found else ""
        raise CheckpointError(f"{path}: adapter weights not found{hint}")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    dropped: list[str] = []
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            for stored in sorted(f.keys()):
                module, dot, half = stored.rpartition(".lora_")
                if not dot and _module_name(stored.rpartition(".")[0]) is None:
                    dropped.append(stored)  # e.g. a modules_to_save lm_head.weight
                    continue
                if not dot or half not in ("A.weight", "B.weight"):
                    raise CheckpointError(f"{path}: unexpected tensor {stored!r} (only lora_A/lora_B weights)")
                name = _module_name(module)
                if name is None:
                    dropped.append(stored)
                else:
                    halves.setdefault(name, {})[half[0]] = f.get_tensor(stored).float()
    except CheckpointError:
        raise
    except Exception as e:  # safetensors' own errors for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if dropped:
        log.info("%s: %d tensors of parts serving never runs ignored (LM head, vision tower, MTP): %s%s", path,
                 len(dropped), ", ".join(dropped[:3]), ", ..." if len(dropped) > 3 else "")
    pairs = {}
    for name, ab in halves.items():
        if set(ab) != {"A", "B"}:
            lacking = "B" if "A" in ab else "A"
            raise CheckpointError(f"{path}: module {name!r} has no lora_{lacking}.weight")
        pairs[name] = (ab["A"], ab["B"])
    return pairs


def merge_lora(
    weights: dict[str, torch.Tensor], adapter_dir: PathLike, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """A new dict with every adapted weight replaced by W + scale * B @ A (all fp32, not rounded)."""
    spec = read_adapter_config(adapter_dir)
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    shapes = expected_shapes(config)
    merged = dict(weights)
    for module, (a, b) in read_adapter_tensors(adapter_dir).items():
        target = module.rsplit(".", 1)[-1]
        name = f"{module}.weight"
        if target not in SUPPORTED_TARGETS or name not in shapes:
            raise CheckpointError(f"{path}: LoRA for {module!r}, which is not an adaptable linear layer of this model")
        if isinstance(spec.targets, frozenset) and target not in spec.targets:
            raise CheckpointError(f"{path}: LoRA for {module!r}, but {target!r} is not in target_modules")
        out_dim, in_dim = shapes[name]
        if a.shape != (spec.rank, in_dim) or b.shape != (out_dim, spec.rank):
            raise CheckpointError(
                f"{path}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                f"expected ({spec.rank}, {in_dim}) and ({out_dim}, {spec.rank})"
            )
        base = weights[name]
        if base.dtype != torch.float32:
            # Merging into an already-rounded weight would round twice.
            raise ValueError(f"merge_lora needs fp32 base weights, {name} is {base.dtype}")
        b, a = b.to(base.device), a.to(base.device)
        merged[name] = base + (b @ a) * spec.scale  # [out, r] @ [r, in] -> [out, in]
    return merged
