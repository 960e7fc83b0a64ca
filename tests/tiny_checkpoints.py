"""Tiny random Qwen3.5 checkpoints with transformers as the reference (test support, not tests).

    # conftest.py puts tests/ on sys.path
    from tiny_checkpoints import hide_fla, lora_hooks, make_hf_checkpoint, make_lora_adapter

    path, hf = make_hf_checkpoint(tmp_path / "ckpt", hv_per_h=3, nested=True, shards=2)
    with hide_fla() as calls:            # the HF reference must run its torch paths on CPU
        ref = hf.model(input_ids).last_hidden_state
    assert calls["torch_chunk_gated_delta_rule"]
    adapter = make_lora_adapter(tmp_path / "lora", path, rank=4, alpha=8)
    with hide_fla(), lora_hooks(hf, adapter):    # the adapter applied unmerged, as a reference
        ...

Every norm weight, dt_bias and A_log is randomised: their defaults (zeros / ones) make a wrong
`(1 + w)` vs `w` or a dropped bias invisible.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

LORA_TARGETS = (
    "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
    "q_proj", "k_proj", "v_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip

_HF_MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
# Module globals the HF layers call; transformers binds fla's kernels to them at import when fla
# is installed, and those Triton kernels cannot run on a CPU.
_TORCH_PATHS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def tiny_text_config(hv_per_h: int = 2, tied: bool = True, **over) -> dict:
    """A flat `qwen3_5_text` config.json dict (also valid as Qwen3_5TextConfig(**d))."""
    cfg = {
        "model_type": "qwen3_5_text",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 2 * hv_per_h,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        # Larger than HF's 0.02 so every block moves the residual stream visibly.
        "initializer_range": 0.05,
        "tie_word_embeddings": tied,
        # Explicit: HF's default theta is not Qwen3.5's.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    }
    if "num_hidden_layers" in over and "layer_types" not in over:
        n = over["num_hidden_layers"]
        over["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    cfg.update(over)
    return cfg


@contextlib.contextmanager
def hide_fla() -> Iterator[Counter[str]]:
    """Make transformers' Qwen3.5 layers call their torch reference code; yields call counts.

    transformers picks fla at import time (`use_kernel_func_from_hub_with_fallback` wraps the torch
    function and keeps it as `__wrapped__`), so the module globals are swapped for the torch
    functions here and restored on exit. The counts prove the torch path ran.
    """
    modeling = importlib.import_module(_HF_MODELING)
    calls: Counter[str] = Counter()
    saved = {name: getattr(modeling, name) for name in _TORCH_PATHS}

    def torch_path(name: str, dispatcher):
        fn = inspect.unwrap(dispatcher)
        assert fn.__module__ == _HF_MODELING, f"{name} unwrapped to {fn.__module__}.{fn.__name__}"
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())

        def run(*args, **kwargs):
            calls[name] += 1
            # The dispatcher drops keywords its target does not take; keep that contract.
            return fn(*args, **(kwargs if takes_any else {k: v for k, v in kwargs.items() if k in params}))

        return run

    try:
        for name, dispatcher in saved.items():
            setattr(modeling, name, torch_path(name, dispatcher))
        yield calls
    finally:
        for name, dispatcher in saved.items():
            setattr(modeling, name, dispatcher)


def _randomise(model: nn.Module, gen: torch.Generator) -> None:
    def fill(p: torch.Tensor, values: torch.Tensor) -> None:
        p.copy_(values.to(p.dtype))

    with torch.no_grad():
        for name, p in model.named_parameters():
            n = p.numel()
            if name.endswith("linear_attn.norm.weight"):  # plain weight (init ones)
                fill(p, torch.empty(n).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("norm.weight"):  # zero-centred (1 + w) norms (init zeros)
                fill(p, 0.3 * torch.randn(n, generator=gen))
            elif name.endswith("dt_bias"):
                fill(p, torch.empty(n).uniform_(-1.0, 1.0, generator=gen))
            elif name.endswith("A_log"):
                # A in [0.02, 1]: decays of 0.5-0.99 per step, so state survives across chunk boundaries.
                fill(p, torch.empty(n).uniform_(0.02, 1.0, generator=gen).log())
            elif name.endswith(".bias"):
                fill(p, 0.1 * torch.randn(n, generator=gen))


def _hf_model(cfg: dict, seed: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hf_cfg._attn_implementation = "eager"  # the plainest reference
    with torch.random.fork_rng(devices=[]):  # HF initialises from the global RNG; leave it as found
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(hf_cfg).float().eval()
    _randomise(model, torch.Generator().manual_seed(seed + 1))
    return hf_cfg, model


def _save_tensors(directory: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_hf_checkpoint(
    directory: str | Path,
    hv_per_h: int = 2,
    tied: bool = True,
    nested: bool = False,
    seed: int = 0,
    shards: int = 1,
    overrides: dict | None = None,
):
    """Write a tiny checkpoint dir; returns (path, fp32 eval Qwen3_5ForCausalLM holding its weights).

    nested=True writes the published multimodal layout: `qwen3_5` config with `text_config`,
    `model.language_model.*` weights, plus `model.visual.*` and `mtp.*` tensors a loader must skip.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_text_config(hv_per_h, tied, **(overrides or {}))
    hf_cfg, model = _hf_model(cfg, seed)

    # clone: tied tensors share storage, which safetensors refuses.
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if tied:
        del tensors["lm_head.weight"]  # as save_pretrained does
    text_dict = hf_cfg.to_dict()
    if not nested:
        config = text_dict
    else:
        tensors = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 2)
        d = cfg["hidden_size"]
        tensors |= {
            "model.visual.patch_embed.proj.weight": torch.randn(32, 3, 2, 4, 4, generator=gen),
            "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=gen),
            "model.visual.merger.linear_fc2.weight": torch.randn(d, 128, generator=gen),
            "mtp.fc.weight": torch.randn(d, 2 * d, generator=gen),
            "mtp.layers.0.self_attn.q_proj.weight": torch.randn(4 * 32, d, generator=gen),
            "mtp.norm.weight": torch.randn(d, generator=gen),
        }
        config = {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "tie_word_embeddings": tied,
            "text_config": text_dict,
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "num_heads": 2,
                              "intermediate_size": 64, "out_hidden_size": d, "patch_size": 4},
        }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    _save_tensors(directory, tensors, shards)
    return directory, model


def _stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    index = checkpoint / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    shapes = {}
    for file in files:
        with safe_open(checkpoint / file, framework="pt") as f:
            shapes |= {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return shapes


def make_lora_adapter(
    directory: str | Path,
    base_ckpt: str | Path,
    rank: int = 4,
    alpha: float = 8,
    seed: int = 0,
    use_rslora: bool = False,
    targets: tuple[str, ...] = LORA_TARGETS,
) -> Path:
    """PEFT-style adapter for every `targets` linear of the base, named as PEFT would for that base.

    B is random (PEFT initialises it to zero, which would make any merge look right).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in sorted(_stored_shapes(Path(base_ckpt)).items()):
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or module.rsplit(".", 1)[-1] not in targets or key.startswith(("model.visual.", "mtp.")):
            continue
        out_dim, in_dim = shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = 0.1 * torch.randn(rank, in_dim, generator=gen)
        tensors[f"base_model.model.{module}.lora_B.weight"] = 0.05 * torch.randn(out_dim, rank, generator=gen)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_ckpt),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "use_rslora": use_rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted(targets),
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return directory


@contextlib.contextmanager
def lora_hooks(model: nn.Module, adapter_dir: str | Path) -> Iterator[int]:
    """Apply an adapter UNMERGED to an HF model: y += scale * (x @ A^T) @ B^T on each adapted linear.

    Reads the files itself (independent of kev.model.lora) so it can serve as the reference; yields
    the number of hooked layers. Adapters made for a nested base are mapped onto the text model.
    """
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        for key in f.keys():
            module, _, half = key.removeprefix("base_model.model.").rpartition(".lora_")
            pairs.setdefault(module, {})[half[0]] = f.get_tensor(key).float()
    modules = dict(model.named_modules())
    handles = []

    def hook(a: torch.Tensor, b: torch.Tensor):
        return lambda _mod, inputs, out: out + ((inputs[0] @ a.T) @ b.T) * scale  # [.., in] -> [.., r] -> [.., out]

    try:
        for module, ab in pairs.items():
            if module not in modules:  # a nested base's adapter on Qwen3_5ForCausalLM
                module = module.replace("model.language_model.", "model.", 1)
            handles.append(modules[module].register_forward_hook(hook(ab["A"], ab["B"])))
        yield len(handles)
    finally:
        for h in handles:
            h.remove()


# ---- Kev training runs (what `kev convert` reads) ----

RUN_WORDS = tuple(
    "the a of to in is was not customer order refund late broken phone account login error billing team support "
    "contract termination early notice days allow may must cancel fee angry calm urgent please help which should "
    "level low medium high shipping address wrong item missing package".split()
)
HEAD_NAMING = {  # head.pt state-dict names per naming (w_q, w_k, b_q, b_k)
    "w": ("w_q.weight", "w_k.weight", "w_q.bias", "w_k.bias"),
    "proj": ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias"),
    "kev": ("w_q", "w_k", "b_q", "b_k"),
}


def make_run_head(hidden_size: int, head_dim: int = 16, naming: str = "proj", bias: bool = True, seed: int = 0,
                  dtype: torch.dtype = torch.float32, temperature: float = 0.7, **fields) -> dict:
    """A Kev run's head.pt dict (kev/model/convert.py documents it); `fields` override its keys."""
    gen = torch.Generator().manual_seed(seed + 50)
    names = HEAD_NAMING[naming]
    state = {names[0]: 0.3 * torch.randn(head_dim, hidden_size, generator=gen),
             names[1]: 0.3 * torch.randn(head_dim, hidden_size, generator=gen)}
    if bias:
        state |= {names[2]: 0.2 * torch.randn(head_dim, generator=gen), names[3]: 0.2 * torch.randn(head_dim, generator=gen)}
    head = {"base": "Qwen/Qwen3.5-Tiny", "base_revision": "0123456789abcdef0123456789abcdef01234567", "lora": True,
            "head_dim": head_dim, "weights_dtype": "bfloat16", "temperature": temperature,
            "head": {k: v.to(dtype) for k, v in state.items()}}
    head.update(fields)
    return head


def make_kev_run(directory: str | Path, base_ckpt: str | Path, *, adapter: bool = True, naming: str = "proj",
                 bias: bool = True, seed: int = 0, shards: int = 1, **head_fields) -> Path:
    """A Kev training run directory: a LoRA adapter of `base_ckpt` (adapter=True) or full weights
    (the base's files, shards re-cut), `head.pt` (torch.save of `make_run_head`) and a tokenizer.json."""
    from tiny_tokenizer import make_test_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base_ckpt = Path(base_ckpt)
    config = json.loads((base_ckpt / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]
    if adapter:
        make_lora_adapter(directory, base_ckpt, rank=4, alpha=8, seed=seed + 7)
    else:
        (directory / "config.json").write_text(json.dumps(config))
        tensors = {}
        for file in sorted(set(_stored_files(base_ckpt))):
            with safe_open(base_ckpt / file, framework="pt") as f:
                tensors |= {k: f.get_tensor(k) for k in f.keys()}
        _save_tensors(directory, tensors, shards)
    head = make_run_head(hidden, naming=naming, bias=bias, seed=seed, **({"lora": adapter} | head_fields))
    torch.save(head, directory / "head.pt")
    make_test_tokenizer(RUN_WORDS).save(str(directory / "tokenizer.json"))
    return directory


def _stored_files(checkpoint: Path) -> list[str]:
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"]
