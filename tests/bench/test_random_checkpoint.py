"""bench/random_checkpoint.py: every Kev size by name, and weights larger than a shard written as
shards with their index, which the services' loader reads like one file (tiny model, CPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

try:  # `python -m pytest` from the repo root has it on sys.path; a bare `pytest` may not
    import bench  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import random_checkpoint  # noqa: E402
from bench.common import KEV_MODELS, kev_config  # noqa: E402
from kev.loading import LoadedModel  # noqa: E402
from kev.model.checkpoint import INDEX_FILE, WEIGHTS_FILE  # noqa: E402


def test_every_kev_size_by_name(tmp_path):
    assert set(KEV_MODELS) == {"kev-0.8b", "kev-4b", "kev-9b", "kev-27b"} <= set(random_checkpoint.SIZES)
    ratios = [kev_config(m).linear_num_value_heads // kev_config(m).linear_num_key_heads for m in KEV_MODELS]
    assert ratios == [1, 2, 2, 3]
    for flag in ("--model", "--size"):  # --size: the flag's old name
        out = tmp_path / flag.strip("-")
        assert random_checkpoint.main([flag, "tiny", "--device", "cpu", "--out", str(out)]) == 0
        assert json.loads((out / "kev.json").read_text()) == {"model_id": "tiny-random"}


def test_sharded_weights_load_like_one_file(tmp_path, monkeypatch):
    one = random_checkpoint.write_random_checkpoint(tmp_path / "one", "tiny")
    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 200_000)
    sharded = random_checkpoint.write_random_checkpoint(tmp_path / "sharded", "tiny")
    assert (one / WEIGHTS_FILE).is_file() and not (one / INDEX_FILE).exists()
    index = json.loads((sharded / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and not (sharded / WEIGHTS_FILE).exists()
    assert files == {p.name for p in sharded.glob("model-*.safetensors")}
    a = LoadedModel.load(one).model.state_dict()
    b = LoadedModel.load(sharded).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # rewriting a directory as another size leaves no stale shard behind
    (sharded / "kev.json").unlink()
    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 10**12)
    random_checkpoint.write_random_checkpoint(sharded, "tiny")
    assert (sharded / WEIGHTS_FILE).is_file() and not (sharded / INDEX_FILE).exists()
    assert not list(sharded.glob("model-*"))
