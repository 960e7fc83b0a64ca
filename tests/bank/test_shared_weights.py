"""One copy of the weights per machine (issue 28): the owner moves its model into a shared segment
and runs on it; a mapper binds a model to that memory without copying (kev/bank/shared_weights.py).

- the owner's state and outputs are unchanged by the move, every parameter lies in the segment, and
  fused projections stay one buffer that a mapper adopts in place;
- a mapper in another process holds no private copy (its anonymous resident memory grows by a small
  fraction of the weights while it reads every parameter) and reads the owner's bytes;
- bad descriptors are refused with ValueError / OSError; a dead owner's weights file is reclaimed.
The scorer end to end (mapping the bank's weights, answers equal to the in-process engine's) is in
tests/services/test_scorer_service.py.
"""

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from kev.bank.shared import reclaim_stale_segments
from kev.bank.shared_weights import SharedWeights, map_weights
from kev.loading import _empty_model, _prepared
from kev.model.config import ModelConfig
from kev.ops import get_ops
from kev.v1 import bank_pb2 as pb
from random_models import random_model, tiny_config

REPO = Path(__file__).resolve().parents[2]


def instance() -> str:
    return f"{uuid.uuid4().int % 10**8:x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def forward(model, tokens):
    from kev.bank.bank import Bank
    from kev.exec.passes import Passes

    bank = Bank.allocate(model.cfg, num_slots=2, num_blocks=8, block_size=16)
    handle = bank.alloc(len(tokens))
    Passes(model, bank, get_ops("torch")).state_pass([tokens], [handle])
    return [t.clone() for t in bank.pools.tensors()]


@pytest.mark.parametrize("fused", [False, True], ids=["cpu-layout", "fused-layout"])
def test_owner_runs_on_the_shared_copy_and_a_mapper_adopts_it(fused, tmp_path):
    cfg = tiny_config()
    model = random_model(cfg, seed=3)
    if fused:
        model.set_batch_invariant(0).fuse_projections()  # the GPU layout, run on CPU
    else:
        model.set_batch_invariant()
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want_state = {k: v.clone() for k, v in model.state_dict().items()}
    want = forward(model, tokens)
    shared = SharedWeights.create(model, device="cpu", instance=instance(), shm_dir=tmp_path)
    try:
        base = shared._segment.base
        inside = lambda t: base.data_ptr() <= t.data_ptr() < base.data_ptr() + base.numel()  # noqa: E731
        assert all(inside(p) for p in model.parameters())
        assert all(torch.equal(v, want_state[k]) for k, v in model.state_dict().items())
        assert all(torch.equal(a, b) for a, b in zip(forward(model, tokens), want))
        mapped = map_weights(shared.descriptors())
        mapper = _empty_model(cfg)
        if fused:
            mapper.set_batch_invariant(0)
            mapper.load_state_dict(mapped, strict=True, assign=True)
            mapper.fuse_projections()
            owner_fused = [m.fused.weight for m in model.modules() if getattr(m, "fused", None) is not None]
            mapper_fused = [m.fused.weight for m in mapper.modules() if getattr(m, "fused", None) is not None]
            assert owner_fused and all(inside(w) for w in owner_fused)  # fused once, in the owner
            # the mapper's fused buffers are views of the mapped segment, not copies
            seg = mapped[next(iter(mapped))].untyped_storage().data_ptr()
            assert all(w.untyped_storage().data_ptr() == seg for w in mapper_fused)
        else:
            mapper = _prepared(mapper, "cpu", mapped, move=False)
        assert all(torch.equal(a, b) for a, b in zip(forward(mapper, tokens), want))
        path = shared.segment_paths[0]
        assert path.exists() and path.name.endswith("-weights")
    finally:
        shared.close()
    assert not path.exists()


MAPPER = r"""
import hashlib, json, sys, torch
from kev.bank.shared_weights import map_weights
from kev.loading import _empty_model, _prepared
from kev.model.config import ModelConfig
from kev.v1 import bank_pb2 as pb

def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

cfg = ModelConfig.from_dict(json.loads(sys.argv[1]))
resp = pb.AttachResponse.FromString(open(sys.argv[2], "rb").read())
_empty_model(cfg)  # imports and allocator warm before the measurement
before = rss_anon()
mapped = map_weights(resp.weights)
model = _prepared(_empty_model(cfg), "cpu", mapped, move=False)
digests = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}
base = mapped[next(iter(mapped))]
lo = base.untyped_storage().data_ptr()
hi = lo + base.untyped_storage().nbytes()
inside = all(lo <= p.data_ptr() < hi for p in model.parameters())
print(json.dumps({"grew": rss_anon() - before, "inside": inside, "digests": digests}))
"""


def test_a_mapper_process_holds_no_copy(tmp_path):
    cfg = tiny_config(vocab_size=32768, hidden_size=256, intermediate_size=512)  # ~45 MB of fp32 weights
    model = random_model(cfg, seed=5).set_batch_invariant()
    shared = SharedWeights.create(model, device="cpu", instance=instance(), shm_dir=tmp_path)
    try:
        resp = pb.AttachResponse(weights_shared=True, weights=shared.descriptors())
        (tmp_path / "attach.bin").write_bytes(resp.SerializeToString())
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", MAPPER, json.dumps(cfg.to_text_dict()), str(tmp_path / "attach.bin")],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["inside"], "a parameter of the mapper is not in the owner's segment"
        assert got["grew"] < shared.nbytes / 4, f"the mapper's private memory grew {got['grew']} bytes for " \
                                                f"{shared.nbytes} bytes of weights"
        want = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}
        assert got["digests"] == want
    finally:
        shared.close()


def test_bad_descriptors_are_refused(tmp_path):
    model = random_model(tiny_config(), seed=1)
    shared = SharedWeights.create(model, device="cpu", instance=instance(), shm_dir=tmp_path)
    try:
        good = shared.descriptors()[0]
        bad_dtype = pb.TensorDescriptor()
        bad_dtype.CopyFrom(good)
        bad_dtype.dtype = 99
        with pytest.raises(ValueError, match="unknown dtype"):
            map_weights([bad_dtype])
        past_end = pb.TensorDescriptor()
        past_end.CopyFrom(good)
        past_end.storage_offset = shared.nbytes  # in elements: far past the segment
        with pytest.raises(ValueError, match="does not fit its segment"):
            map_weights([past_end])
        gone = pb.TensorDescriptor()
        gone.CopyFrom(good)
        gone.descriptor = json.dumps({"path": str(tmp_path / "nothing-here"), "bytes": 256}).encode()
        with pytest.raises(OSError):
            map_weights([gone])
    finally:
        shared.close()


def test_a_dead_owners_weights_file_is_reclaimed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f"kev-bank-1a2b-{pid}-cafe01-weights"
    stale.write_bytes(b"\0" * 256)
    assert reclaim_stale_segments(tmp_path) == [stale] and not stale.exists()


CUDA_MAPPER = r"""
import hashlib, json, sys, torch
from kev.bank.shared_weights import map_weights
from kev.loading import _empty_model, _prepared
from kev.model.config import ModelConfig
from kev.v1 import bank_pb2 as pb

cfg = ModelConfig.from_dict(json.loads(sys.argv[1]))
resp = pb.AttachResponse.FromString(open(sys.argv[2], "rb").read())
torch.cuda.init()
before = torch.cuda.memory_allocated()
model = _prepared(_empty_model(cfg), "cuda", map_weights(resp.weights), move=False)
fused = [m.fused.weight for m in model.modules() if getattr(m, "fused", None) is not None]
seg = next(model.parameters()).untyped_storage().data_ptr()
print(json.dumps({"allocated": torch.cuda.memory_allocated() - before,
                  "one_segment": all(p.untyped_storage().data_ptr() == seg for p in model.parameters()),
                  "fused_adopted": bool(fused) and all(w.untyped_storage().data_ptr() == seg for w in fused),
                  "digests": {k: hashlib.sha256(v.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                              for k, v in model.state_dict().items()}}))
"""


@pytest.mark.gpu
def test_cuda_ipc_weights_mapped_by_a_second_process(tmp_path):
    """On the GPU: the owner's fused bf16 model moved from the host into one CUDA IPC buffer; a
    second process maps it, allocates nothing for it, adopts the fused projections in place and
    reads the owner's bytes."""
    cfg = tiny_config()
    model = _prepared(_empty_model(cfg), "cuda", random_model(cfg, seed=7, dtype=torch.bfloat16).state_dict(),
                      move=False)  # host tensors fused as for the GPU: the bank's host staging
    shared = SharedWeights.create(model, device="cuda", instance=instance(), shm_dir=tmp_path)
    try:
        assert all(p.is_cuda for p in model.parameters()) and not shared.segment_paths
        resp = pb.AttachResponse(weights_shared=True, weights=shared.descriptors())
        (tmp_path / "attach.bin").write_bytes(resp.SerializeToString())
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, "-c", CUDA_MAPPER, json.dumps(cfg.to_text_dict()),
                              str(tmp_path / "attach.bin")], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["allocated"] == 0 and got["one_segment"] and got["fused_adopted"]
        want = {k: hashlib.sha256(v.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                for k, v in model.state_dict().items()}
        assert got["digests"] == want
    finally:
        shared.close()
