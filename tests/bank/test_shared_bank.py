"""kev.bank.shared: the owner's bank memory mapped by another process, read and written in place.

The owner (this test process) carves a SharedBank and state-passes documents into it; a mapper
(a separate Python process) attaches from the serialized AttachResponse, runs a row pass on a
stored document and a state pass into a slot the owner allocated, and checks a freed handle.
Everything is compared bit for bit with private (unshared) banks.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kev.bank.bank import Bank, BankHandle, StaleHandle
from kev.bank.shared import SharedBank, attach, generation_seed
from kev.ops import get_ops
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.v1 import bank_pb2 as pb
from random_models import random_model, tiny_config

TESTS = Path(__file__).resolve().parents[1]
SEED = 3
DOCS = {"short": 5, "paged": 70, "long": 200}  # tokens: inside one page, across pages, many pages
ROWS = [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]

MAPPER = textwrap.dedent("""
    import sys
    import torch
    from safetensors.torch import save_file
    from kev.bank.bank import BankHandle, StaleHandle
    from kev.bank.shared import attach
    from kev.ops import get_ops
    from kev.exec.batch import RowBatch
    from kev.exec.passes import Passes
    from kev.v1 import bank_pb2 as pb
    from random_models import random_model, tiny_config

    work = sys.argv[1]
    response = pb.AttachResponse.FromString(open(f"{work}/attach.pb", "rb").read())
    args = {k: int(v) for k, v in (a.split("=") for a in sys.argv[2:])}
    bank = attach(response)
    runner = Passes(random_model(tiny_config(), seed=args["seed"]), bank, get_ops("torch"))
    read = BankHandle(args["read_slot"], args["read_gen"])
    rows = [[7, 8, 9, 10], [11, 12], [13, 14, 15, 16, 17, 18]]
    picks = [list(range(len(r))) for r in rows]
    hidden = runner.row_pass(RowBatch.build(rows, [read] * 3, [args["read_len"]] * 3, picks, device=runner.device))
    # Written in place into the owner's slot: the owner checks its own tensors afterwards.
    write = BankHandle(args["write_slot"], args["write_gen"])
    runner.state_pass([list(range(20, 20 + args["write_len"]))], [write])
    try:
        bank.check(BankHandle(args["stale_slot"], args["stale_gen"]))
        stale = 0
    except StaleHandle:
        stale = 1
    save_file({"hidden": hidden.cpu(), "stale": torch.tensor(stale)}, f"{work}/mapper.safetensors")
""")


def doc_tokens(n: int, offset: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(n + offset)
    return torch.randint(0, 300, (n,), generator=g).tolist()


def slot_state(pools, block_table, slot: int, length: int) -> list[torch.Tensor]:
    """Everything stored for one document: DeltaNet states of its slot, K/V of its tokens."""
    out = [p[slot] for p in (*pools.recurrent, *pools.conv)]
    pages = block_table[slot, : -(-length // pools.block_size)].long()
    for pool in (*pools.keys, *pools.values):
        out.append(pool[pages].flatten(0, 1)[:length])  # [pages, bs, Hkv, D] -> [length, Hkv, D]
    return out


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=SEED)


@pytest.fixture
def shared(model, tmp_path):
    bank = SharedBank.create(model.cfg, 2 << 20, instance=f"test-{os.getpid()}-{tmp_path.name}", block_size=16,
                             avg_doc_tokens=64, max_doc_tokens=256, shm_dir="/dev/shm")
    yield bank
    bank.close()


def reference_states(model, doc: list[int]) -> list[torch.Tensor]:
    private = Bank.allocate(model.cfg, 1, 16, block_size=16, max_doc_tokens=256)
    h = private.alloc(len(doc))
    Passes(model, private, get_ops("torch")).state_pass([doc], [h])
    return slot_state(private.pools, private.block_table, h.slot, len(doc))


def test_second_process_reads_and_writes_the_owners_memory(model, shared, tmp_path):
    owner = Passes(model, shared.bank, get_ops("torch"))
    docs = {name: doc_tokens(n) for name, n in DOCS.items()}
    handles = {name: shared.bank.alloc(len(d)) for name, d in docs.items()}
    owner.state_pass(list(docs.values()), list(handles.values()))
    for name, doc in docs.items():  # batched into the shared bank == alone in a private bank
        got = slot_state(shared.bank.pools, shared.bank.block_table, handles[name].slot, len(doc))
        assert all(torch.equal(a, b) for a, b in zip(got, reference_states(model, doc))), name

    write = shared.bank.alloc(33)  # the mapper fills this slot
    stale = shared.bank.alloc(3)
    shared.bank.free(stale)  # the mapper must see this handle dead through the shared generations
    (tmp_path / "attach.pb").write_bytes(shared.attach_response("tiny", "node-a").SerializeToString())
    read = handles["paged"]
    args = dict(seed=SEED, read_slot=read.slot, read_gen=read.generation, read_len=DOCS["paged"],
                write_slot=write.slot, write_gen=write.generation, write_len=33,
                stale_slot=stale.slot, stale_gen=stale.generation)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", MAPPER, str(tmp_path), *(f"{k}={v}" for k, v in args.items())],
                   env=env, check=True, timeout=120)
    result = load_file(str(tmp_path / "mapper.safetensors"))

    picks = [list(range(len(r))) for r in ROWS]
    mine = owner.row_pass(RowBatch.build(ROWS, [read] * 3, [DOCS["paged"]] * 3, picks))
    assert torch.equal(result["hidden"], mine), "the mapper read other states than the owner holds"
    written = slot_state(shared.bank.pools, shared.bank.block_table, write.slot, 33)
    assert all(torch.equal(a, b) for a, b in zip(written, reference_states(model, list(range(20, 53))))), \
        "the mapper's in-place state pass is not in the owner's memory"
    assert result["stale"].item() == 1, "a freed handle passed the mapper's check"


def test_attached_bank_is_a_runner_bank(model, shared):
    """Same process, second mapping: the view a scorer gets, checked field by field."""
    response = pb.AttachResponse.FromString(shared.attach_response("tiny", "node-a").SerializeToString())
    attached = attach(response)
    assert (attached.model, attached.node, attached.instance) == ("tiny", "node-a", shared.instance)
    assert attached.num_slots == shared.bank.pools.num_slots and attached.block_size == 16
    for a, b in zip(attached.pools.tensors(), shared.bank.pools.tensors()):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        assert a.data_ptr() != b.data_ptr()  # its own mapping ...
    h = shared.bank.alloc(40)
    attached.pools.recurrent[1][h.slot].fill_(2.5)  # ... of the same pages
    assert shared.bank.pools.recurrent[1][h.slot].eq(2.5).all()
    assert torch.equal(attached.block_table[h.slot], shared.bank.block_table[h.slot])
    attached.check(h)
    shared.bank.free(h)
    with pytest.raises(StaleHandle):
        attached.check(h)
    with pytest.raises(StaleHandle):
        attached.check(BankHandle(attached.num_slots, h.generation))
    assert torch.equal(attached.block_table[h.slot], torch.full_like(attached.block_table[h.slot], -1))


def test_generations_are_seeded_per_start_and_mirrored(model, tmp_path):
    a = SharedBank.create(model.cfg, 1 << 20, instance=f"gen-a-{os.getpid()}", seed=generation_seed(1_800_000_000))
    b = SharedBank.create(model.cfg, 1 << 20, instance=f"gen-b-{os.getpid()}", seed=generation_seed(1_800_000_001))
    try:
        h = a.bank.alloc(10)
        for _ in range(5):
            a.bank.free(h)
            h = a.bank.alloc(10)
        assert a.tensors["generations"][h.slot].item() == h.generation == generation_seed(1_800_000_000) + 5
        # A bank started a second later issues generations above everything the first one did.
        assert b.bank.alloc(10).generation > h.generation
    finally:
        a.close()
        b.close()


def test_close_unlinks_and_mappings_survive(model):
    bank = SharedBank.create(model.cfg, 1 << 20, instance=f"close-{os.getpid()}")
    (path,) = bank.segment_paths
    response = bank.attach_response("tiny", "n")
    attached = attach(response)
    attached.pools.conv[0].fill_(1.0)
    bank.close()
    assert not path.exists()
    assert attached.pools.conv[0].eq(1.0).all()  # an existing mapping stays valid until dropped
    with pytest.raises(FileNotFoundError):  # a late attach never recreates the file
        attach(response)


def test_bank_rejects_mismatched_tables(model):
    cfg = model.cfg
    pools = Bank.allocate(cfg, 4, 8, block_size=16, max_doc_tokens=64).pools
    with pytest.raises(ValueError, match="block_table"):
        Bank(cfg, pools, 64, block_table=torch.zeros(4, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="generations"):
        Bank(cfg, pools, 64, generations=torch.zeros(4, dtype=torch.int32))
    gens = torch.full((4,), 7, dtype=torch.int64)
    bank = Bank(cfg, pools, 64, block_table=torch.zeros(4, 4, dtype=torch.int32), generations=gens)
    assert bank.block_table.eq(-1).all() and bank.alloc(1).generation == 7


@pytest.mark.gpu
def test_cuda_ipc_shared_with_a_second_process(model, tmp_path):
    """CUDA: pools and block table through IPC handles, generations in /dev/shm; same checks."""
    cuda_model = random_model(tiny_config(), seed=SEED).cuda()
    bank = SharedBank.create(model.cfg, 2 << 20, instance=f"cuda-{os.getpid()}", device="cuda", block_size=16,
                             avg_doc_tokens=64, max_doc_tokens=256)
    try:
        response = bank.attach_response("tiny", "n")
        kinds = {d.name: d.sharing for d in response.pools}
        assert kinds["generations"] == pb.SHARED_MEMORY and kinds["block_table"] == pb.CUDA_IPC
        owner = Passes(cuda_model, bank.bank, get_ops("torch"))
        read = bank.bank.alloc(DOCS["paged"])
        owner.state_pass([doc_tokens(DOCS["paged"])], [read])
        write, stale = bank.bank.alloc(33), bank.bank.alloc(3)
        bank.bank.free(stale)
        (tmp_path / "attach.pb").write_bytes(response.SerializeToString())
        args = dict(seed=SEED, read_slot=read.slot, read_gen=read.generation, read_len=DOCS["paged"],
                    write_slot=write.slot, write_gen=write.generation, write_len=33,
                    stale_slot=stale.slot, stale_gen=stale.generation)
        mapper = MAPPER.replace("seed=args[\"seed\"])", "seed=args[\"seed\"]).cuda()")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", mapper, str(tmp_path), *(f"{k}={v}" for k, v in args.items())],
                       env=env, check=True, timeout=300)
        result = load_file(str(tmp_path / "mapper.safetensors"))
        picks = [list(range(len(r))) for r in ROWS]
        mine = owner.row_pass(RowBatch.build(ROWS, [read] * 3, [DOCS["paged"]] * 3, picks, device="cuda"))
        assert torch.equal(result["hidden"].cuda(), mine)
        private = Bank.allocate(model.cfg, 1, 16, block_size=16, max_doc_tokens=256, device="cuda")
        h = private.alloc(33)
        Passes(cuda_model, private, get_ops("torch")).state_pass([list(range(20, 53))], [h])
        got = slot_state(bank.bank.pools, bank.bank.block_table, write.slot, 33)
        ref = slot_state(private.pools, private.block_table, h.slot, 33)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert result["stale"].item() == 1
    finally:
        bank.close()
