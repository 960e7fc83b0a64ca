"""Random-weight checkpoint directories for the load comparison (the services load from disk).

`--model kev-0.8b | kev-4b | kev-9b | kev-27b`: a Kev size's shapes (bench.common.KEV_MODELS), bf16,
written from `bench.common.random_model` on the GPU (Kev-4B ~8 GB, Kev-27B ~51 GB: put it under /tmp
on the device, which has the disk for one such model at a time). `tiny`: a 4-layer model for CPU
runs and CI. Weights over SHARD_BYTES go into shards with a `model.safetensors.index.json` (one
shard in host memory at a time). All get a random pointer head (R = 256, fp32), the demo model's
word-level tokenizer (kev/demo_model/tokenizer.json: any tokenizer will do, the load figures are per
token) and a `kev.json` naming the model. A directory already holding a complete checkpoint of the
same config is reused (`kev.json` is written last, so an interrupted write is redone).

    python -m bench.random_checkpoint --model kev-27b --device cuda --out /tmp/kev-27b-random
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import KEV_MODELS, random_model
from kev.model.checkpoint import INDEX_FILE, WEIGHTS_FILE
from kev.model.config import ModelConfig
from kev.request.head import DecisionHead, save_head

DEMO_TOKENIZER = Path(__file__).resolve().parents[1] / "kev" / "demo_model" / "tokenizer.json"
HEAD_DIM = 256
TINY = dict(model_type="qwen3_5_text", vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
SIZES = {**KEV_MODELS, "tiny": TINY}
SHARD_BYTES = 5 * 10**9  # weights per safetensors file at most (one tensor may exceed it alone)


def write_random_checkpoint(directory: str | Path, size: str, device: str = "cpu", seed: int = 0) -> Path:
    """Writes (or reuses) a random checkpoint of `size` (a `SIZES` name); returns its path.
    Weights are bf16 on a GPU, fp32 on CPU (what the services load them as)."""
    directory = Path(directory)
    cfg = ModelConfig.from_dict(SIZES[size])
    config_text = json.dumps(cfg.to_text_dict(), indent=2)
    if (directory / "kev.json").exists() and (directory / "config.json").read_text() == config_text:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kev.json").unlink(missing_ok=True)
    for old in (*directory.glob("model*.safetensors"), directory / INDEX_FILE):  # an earlier size's
        old.unlink(missing_ok=True)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    start = time.perf_counter()
    model = random_model(cfg, device=device, dtype=dtype, seed=seed)
    save_weights(directory, {"model." + k: v for k, v in model.state_dict().items()}, SHARD_BYTES)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()  # the services need that memory; this process only drives them
    (directory / "config.json").write_text(config_text)
    g = torch.Generator().manual_seed(seed + 1)
    d = cfg.hidden_size
    # Scaled so that logits spread over a few units: answers are not all uniform.
    head = DecisionHead(w_q=torch.randn(HEAD_DIM, d, generator=g) * d**-0.5 * 4,
                        w_k=torch.randn(HEAD_DIM, d, generator=g) * d**-0.5 * 4, b_q=None, b_k=None, temperature=1.0)
    save_head(directory / "head.safetensors", head)
    shutil.copyfile(DEMO_TOKENIZER, directory / "tokenizer.json")
    (directory / "kev.json").write_text(json.dumps({"model_id": f"{size}-random"}))
    print(f"wrote {size} random checkpoint to {directory} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return directory


def save_weights(directory: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> None:
    """`model.safetensors`, or shards of at most `shard_bytes` and their index when the weights are
    larger: each shard is copied to the host, written and dropped before the next."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        part = {k: tensors[k].detach().to("cpu").contiguous() for k in names}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update(dict.fromkeys(names, file))
        del part
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.random_checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--size", dest="model", choices=list(SIZES), default="kev-4b",
                   help="a Kev size (bench.common.KEV_MODELS) or 'tiny' (--size: the old name of this flag)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    write_random_checkpoint(args.out, args.model, args.device, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
