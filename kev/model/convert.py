"""`kev convert`: a Kev training run directory -> a checkpoint directory this project serves.

A published Kev run holds one of

    adapter run:  adapter_config.json + adapter_model.safetensors (a PEFT LoRA of the base)
    full run:     config.json + model.safetensors (or model-*.safetensors + model.safetensors.index.json)

plus `head.pt` and the tokenizer (`tokenizer.json`, optional `tokenizer_config.json`,
`special_tokens_map.json`). `head.pt` is a torch.save'd dict:

    base            str     the base model's name / hub id (only a name: the base directory is given)
    base_revision   str     the base's revision (a hub commit), or None
    lora            bool, None or a dict of LoRA settings (r, lora_alpha): whether the run is an adapter
    head_dim        int     R, the rows of the head's projections
    weights_dtype   str or torch.dtype: the dtype the run saved its weights in (recorded, not used)
    temperature     float, or a one-element float tensor, finite and > 0
    head            the head's state dict, one of three namings (each bias optional, both or neither):
                        w_q.weight, w_k.weight [, w_q.bias, w_k.bias]
                        q_proj.weight, k_proj.weight [, q_proj.bias, k_proj.bias]
                        w_q, w_k [, b_q, b_k]                     (this project's own names)
                    weights [head_dim, hidden_size], biases [head_dim], float32/bfloat16/float16/float64,
                    every value finite

It is read with `torch.load(weights_only=True)`: torch's restricted unpickler, which builds only
tensors and plain containers and never calls what a pickle names, so a crafted file fails instead
of running code. Anything else (not a dict, a missing or unknown key, a wrong type, shape or
dtype, a mixed naming) is a CheckpointError naming the file and what is wrong.

What is written (`convert_run`), into a new directory (moved into place only when complete):

    config.json, model*.safetensors   the base's (adapter run) or the run's (full run), copied byte
                                      for byte (or hard-linked with `link=True`)
    adapter_config.json, adapter_model.safetensors   adapter run only: the run's, merged at load
    head.safetensors                  kev.request.head's format, with the temperature
    tokenizer.json (+ tokenizer_config.json, special_tokens_map.json)   the run's, else the base's
    kev.json                          model_id (sanitised), base, base_revision, weights_dtype

Why the adapter stays beside the base instead of being merged into new full weights: the loader
already merges in fp32 and rounds once to whatever dtype the process serves in (fp32 on CPU, bf16
on GPU, docs/design.md §1). Merged weights written here would need a dtype chosen now: bf16 would
make CPU serving lose the fp32 merge, fp32 would double the size of a bf16 base. Keeping the files
also keeps the output the size of the base (nothing if hard-linked) and the adapter auditable.

Before anything is written, the base is checked against the head (hidden size), the adapter
against the base (every LoRA tensor's shape, through the merge), the head against the base, and,
when the base directory is a hub cache snapshot (`models--ORG--NAME/snapshots/REVISION`), its name
and revision against `base` and `base_revision`. The finished directory is loaded once more
(`check=True`) as a server would load it, weights included.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kev.model.checkpoint import (
    CONFIG_FILE, HEAD_FILE, INDEX_FILE, META_FILE, RUN_HEAD_FILE, TOKENIZER_FILE, WEIGHTS_FILE,
    check_model_id, find_side_files, load_checkpoint, read_config, sanitise_model_id,
)
from kev.model.config import CheckpointError
from kev.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_config
from kev.model.weight_names import PathLike, read_json

__all__ = ["RunHead", "convert_run", "read_run_head", "HEAD_NAMINGS"]

log = logging.getLogger(__name__)

RUN_KEYS = ("base", "base_revision", "lora", "head_dim", "weights_dtype", "temperature", "head")
_REQUIRED_KEYS = ("base", "head_dim", "temperature", "head")
# Accepted head state-dict namings: (w_q, w_k, b_q, b_k) names in the run's file.
HEAD_NAMINGS = (
    ("w_q.weight", "w_k.weight", "w_q.bias", "w_k.bias"),
    ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"),
    ("w_q", "w_k", "b_q", "b_k"),
)
_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
                "float64": "float64", "double": "float64"}
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, eq=False)
class RunHead:
    """A validated head.pt: the head's tensors under this project's names, fp32, and its provenance."""

    base: str
    base_revision: str | None
    lora: bool | dict | None
    weights_dtype: str | None
    temperature: float
    w_q: torch.Tensor
    w_k: torch.Tensor
    b_q: torch.Tensor | None
    b_k: torch.Tensor | None

    @property
    def head_dim(self) -> int:
        return self.w_q.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w_q.shape[1]


def _load_restricted(path: Path) -> object:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        # weights_only: torch's restricted unpickler (tensors, dtypes, plain containers); never pickle.load.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as e:  # UnpicklingError for a forbidden global, RuntimeError for a bad archive, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{path}: not loadable as plain tensors and values (torch.load weights_only=True refused it: {first}); "
            "nothing in it was executed"
        ) from None


def _dtype_name(path: Path, value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = str(value)
    if isinstance(value, str):
        name = _DTYPE_NAMES.get(value.removeprefix("torch.").lower())
        if name is not None:
            return name
    raise CheckpointError(f"{path}: 'weights_dtype' {value!r} is not a float dtype ({', '.join(sorted(set(_DTYPE_NAMES.values())))})")


def _temperature(path: Path, value: object) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.ndim > 1 or not value.is_floating_point():
            raise CheckpointError(
                f"{path}: 'temperature' is a {value.dtype} tensor of shape {list(value.shape)}, expected one float"
            )
        value = float(value.reshape(()))
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise CheckpointError(f"{path}: 'temperature' must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{path}: 'temperature' is {value}, expected finite and > 0")
    return float(value)


def read_run_head(path: PathLike, hidden_size: int | None = None) -> RunHead:
    """Reads and checks a Kev run's `head.pt` (module docstring); `hidden_size`: the base's, when known."""
    path = Path(path)
    raw = _load_restricted(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a dict with keys {', '.join(RUN_KEYS)}, got {type(raw).__name__}")
    if bad := sorted(repr(k) for k in raw if not isinstance(k, str)):
        raise CheckpointError(f"{path}: key {bad[0]} is not a string")
    if missing := [k for k in _REQUIRED_KEYS if k not in raw]:
        raise CheckpointError(f"{path}: missing key {missing[0]!r} (a Kev head.pt holds {', '.join(RUN_KEYS)})")
    if unknown := sorted(set(raw) - set(RUN_KEYS)):
        raise CheckpointError(f"{path}: unknown key {unknown[0]!r} (a Kev head.pt holds {', '.join(RUN_KEYS)})")

    base = raw["base"]
    if not isinstance(base, str) or not base:
        raise CheckpointError(f"{path}: 'base' must be a non-empty string (the base model's name), got {base!r}")
    revision = raw.get("base_revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise CheckpointError(f"{path}: 'base_revision' must be a non-empty string or None, got {revision!r}")
    lora = raw.get("lora")
    if lora is not None and not isinstance(lora, bool | dict):
        raise CheckpointError(f"{path}: 'lora' must be a bool, None or a dict of LoRA settings, got {lora!r}")
    head_dim = raw["head_dim"]
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise CheckpointError(f"{path}: 'head_dim' must be a positive int, got {head_dim!r}")
    weights_dtype = _dtype_name(path, raw.get("weights_dtype"))
    temperature = _temperature(path, raw["temperature"])

    state = raw["head"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: 'head' must be the head's state dict, got {type(state).__name__}")
    accepted = "; ".join(" + ".join(n[:2]) + f" (biases {n[2]}, {n[3]})" for n in HEAD_NAMINGS)
    used = [n for n in HEAD_NAMINGS if any(k in n for k in state)]
    if len(used) > 1:
        keys = [next(str(k) for k in state if k in n) for n in used]
        raise CheckpointError(f"{path}: 'head' mixes namings ({', '.join(map(repr, keys))}); accepted namings: {accepted}")
    if not used:
        raise CheckpointError(f"{path}: 'head' has keys {sorted(map(str, state))}, accepted namings: {accepted}")
    naming = used[0]
    if unknown := sorted(str(k) for k in state if k not in naming):
        raise CheckpointError(f"{path}: 'head' has unexpected key {unknown[0]!r} beside {naming[0]!r} "
                              f"(accepted namings: {accepted})")
    for name in naming[:2]:
        if name not in state:
            raise CheckpointError(f"{path}: 'head' lacks {name!r}")
    if (naming[2] in state) != (naming[3] in state):
        raise CheckpointError(f"{path}: 'head' has only one of {naming[2]!r}, {naming[3]!r} (both biases or neither)")

    tensors: dict[str, torch.Tensor] = {}
    for ours, theirs in zip(("w_q", "w_k", "b_q", "b_k"), naming, strict=True):
        if theirs not in state:
            continue
        t = state[theirs]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{path}: 'head'[{theirs!r}] is a {type(t).__name__}, expected a tensor")
        if t.dtype not in _HEAD_DTYPES:
            raise CheckpointError(f"{path}: 'head'[{theirs!r}] has dtype {t.dtype}, expected one of "
                                  f"{', '.join(str(d) for d in _HEAD_DTYPES)}")
        d = hidden_size if hidden_size is not None else (t.shape[-1] if t.ndim == 2 else -1)
        want = [head_dim, d] if ours.startswith("w_") else [head_dim]
        if list(t.shape) != want or d <= 0:
            raise CheckpointError(f"{path}: 'head'[{theirs!r}] has shape {list(t.shape)}, expected {want} "
                                  f"(head_dim {head_dim}{'' if hidden_size is None else f', base hidden size {hidden_size}'})")
        t = t.detach().to(torch.float32).contiguous()
        if not torch.isfinite(t).all():
            raise CheckpointError(f"{path}: 'head'[{theirs!r}] holds non-finite values")
        tensors[ours] = t
    if tensors["w_q"].shape != tensors["w_k"].shape:
        raise CheckpointError(f"{path}: 'head' weights {naming[0]!r} {list(tensors['w_q'].shape)} and {naming[1]!r} "
                              f"{list(tensors['w_k'].shape)} differ in shape")
    return RunHead(base=base, base_revision=revision, lora=lora, weights_dtype=weights_dtype, temperature=temperature,
                   w_q=tensors["w_q"], w_k=tensors["w_k"], b_q=tensors.get("b_q"), b_k=tensors.get("b_k"))


def _weight_file_names(directory: Path) -> list[str]:
    """The weight files a checkpoint directory's loader would read (the index included)."""
    if (directory / INDEX_FILE).is_file():
        weight_map = read_json(directory / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{directory / INDEX_FILE}: needs a 'weight_map' object")
        return [INDEX_FILE, *sorted({str(f) for f in weight_map.values()})]
    return [WEIGHTS_FILE]


def _check_base_identity(base_dir: Path, head: RunHead) -> None:
    """A hub cache snapshot names its repo and revision: check them against head.pt's."""
    resolved = base_dir.resolve()
    repo_dir = resolved.parent.parent
    if resolved.parent.name != "snapshots" or not repo_dir.name.startswith("models--"):
        log.warning("%s: cannot check that this is %s%s (not a hub cache snapshot); trusting the caller", base_dir,
                    head.base, f" at {head.base_revision}" if head.base_revision else "")
        return
    repo = repo_dir.name.removeprefix("models--").replace("--", "/")
    if repo.lower() != head.base.lower() and repo.split("/")[-1].lower() != head.base.split("/")[-1].lower():
        raise CheckpointError(f"{base_dir}: is a snapshot of {repo!r}, but the run was trained on {head.base!r}")
    if head.base_revision and resolved.name != head.base_revision:
        raise CheckpointError(f"{base_dir}: is revision {resolved.name!r} of {repo!r}, but the run was trained on "
                              f"revision {head.base_revision!r}")


def _check_lora_field(run_dir: Path, head: RunHead, adapter: bool) -> None:
    path = run_dir / RUN_HEAD_FILE
    if head.lora is not None and bool(head.lora) != adapter:
        what = "an adapter" if adapter else "full weights, no adapter"
        raise CheckpointError(f"{path}: 'lora' is {head.lora!r}, but the run directory holds {what}")
    if adapter and isinstance(head.lora, dict):
        spec = read_adapter_config(run_dir)
        for key, value in (("r", spec.rank), ("lora_alpha", spec.alpha), ("alpha", spec.alpha)):
            if key in head.lora and head.lora[key] != value:
                raise CheckpointError(f"{path}: 'lora'[{key!r}] is {head.lora[key]!r}, but {ADAPTER_CONFIG} says {value!r}")


def _place(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError as e:  # another file system, or links not allowed: copy instead
            log.info("%s: hard link failed (%s), copying", src, e)
    shutil.copy2(src, dst)


def convert_run(run_dir: PathLike, out_dir: PathLike, base_dir: PathLike | None = None, *,
                model_id: str | None = None, link: bool = False, overwrite: bool = False,
                check: bool = True) -> Path:
    """Writes the checkpoint directory `out_dir` for the Kev run `run_dir` (module docstring).

    `base_dir`: the base checkpoint directory head.pt's `base` names (required for an adapter run;
    for a full run only a tokenizer fallback). `model_id`: kev.json's id (checked), default the run
    directory's name, sanitised. `overwrite`: replace an existing `out_dir`. `check`: load the result
    as a server would (weights included) before it is moved into place. Returns `out_dir`.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    base = Path(base_dir) if base_dir is not None else None
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: run directory not found")
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir}: already exists (overwrite=True / --force replaces it)")
    if out_dir.resolve() in {run_dir.resolve(), *( [base.resolve()] if base else [] )}:
        raise CheckpointError(f"{out_dir}: the output must be a new directory, not the run or the base")
    model_id = (check_model_id(model_id, "--model-id") if model_id is not None
                else sanitise_model_id(run_dir.resolve().name, str(run_dir)))

    adapter = (run_dir / ADAPTER_CONFIG).is_file()
    full = (run_dir / CONFIG_FILE).is_file()
    if adapter and full:
        raise CheckpointError(f"{run_dir}: holds both {ADAPTER_CONFIG} and {CONFIG_FILE}; a run is an adapter or "
                              "full weights, remove the one that does not belong")
    if not adapter and not full:
        raise CheckpointError(f"{run_dir}: neither an adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}) nor full "
                              f"weights ({CONFIG_FILE} + {WEIGHTS_FILE} or {INDEX_FILE})")
    if adapter and base is None:
        raise CheckpointError(f"{run_dir}: is a LoRA adapter run; give the base checkpoint directory (--base)")
    weights_dir = base if adapter else run_dir
    assert weights_dir is not None
    if adapter and (weights_dir / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{weights_dir}: the base directory holds an adapter itself; give a plain base")

    config = read_config(weights_dir)
    head = read_run_head(run_dir / RUN_HEAD_FILE, hidden_size=config.hidden_size)
    _check_lora_field(run_dir, head, adapter)
    if adapter:
        _check_base_identity(weights_dir, head)
    tokenizer_dir = next((d for d in (run_dir, base) if d is not None and (d / TOKENIZER_FILE).is_file()), None)
    if tokenizer_dir is None:
        where = " or ".join(str(d / TOKENIZER_FILE) for d in (run_dir, base) if d is not None)
        raise CheckpointError(f"{where}: tokenizer not found")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        for name in [CONFIG_FILE, *_weight_file_names(weights_dir)]:
            _place(weights_dir / name, work / name, link)
        if adapter:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                _place(run_dir / name, work / name, link)
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, work / name)
        _save_head(work / HEAD_FILE, head)
        meta = {"model_id": model_id, "base": head.base, "base_revision": head.base_revision,
                "weights_dtype": head.weights_dtype}
        (work / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        if check:
            _check_output(work)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        work.rename(out_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("%s: converted %s run %s (model id %r, base %s%s)", out_dir, "adapter" if adapter else "full-weight",
             run_dir, model_id, head.base, f" @ {head.base_revision}" if head.base_revision else "")
    return out_dir


def _save_head(path: Path, head: RunHead) -> None:
    # The head file's one home is kev.request.head (imported here, not at the top: the model layer
    # sits below the request layer, and only this offline tool needs both).
    from kev.request.head import DecisionHead, save_head

    save_head(path, DecisionHead(head.w_q, head.w_k, head.b_q, head.b_k, head.temperature))


def _check_output(directory: Path) -> None:
    """Loads `directory` as a server would: config, adapter merge, head, tokenizer and delimiters."""
    from tokenizers import Tokenizer

    from kev.request.head import load_head
    from kev.request.prompts import Delimiters, PromptBuilder

    ckpt = load_checkpoint(directory, require_head=True, require_tokenizer=True)
    load_head(ckpt.head_path, ckpt.config.hidden_size)
    delimiters = Delimiters(**ckpt.meta.delimiters) if ckpt.meta.delimiters else Delimiters()
    try:
        PromptBuilder(Tokenizer.from_file(str(ckpt.tokenizer_path)), delimiters)
    except Exception as e:  # e.g. a tokenizer without the delimiter tokens (DESIGN §1)
        raise CheckpointError(f"{ckpt.tokenizer_path}: not usable with the prompt format ({e})") from None
    find_side_files(directory)  # the model id every process will derive
