"""Packed CUDA-graph keys on the GPU (H200; skipped on CPU by the `gpu` marker): a small model
(width 512, 4 layers) with Kev-4B's heads, random bf16 weights.

- every key of small ladders is captured at start-up; rows of varied lengths and counts, and state
  passes of new and chunked documents, then run only as replays (no eager pass);
- a replay equals the eager run of the same key bit for bit (rows' hidden states and every bank
  state written), and the unpadded eager pass within bf16 rounding (other GEMM row counts);
- a document read in pieces over passes (as the bank splits one at its pass cap) stores the states
  of one pass over it, within bf16 rounding.
"""

import pytest
import torch

from kernel_support import fast_hot_autotuners, kev4b_heads_config, rel_err
from kev.bank.bank import Bank
from kev.exec.batch import RowBatch
from kev.exec.graphs import CapturePolicy, GraphCache, KeyLadder
from kev.exec.passes import Passes
from kev.exec.static_pass import PassKind
from kev.exec.warm_up import warm_up
from kev.ops.autotune import ClassTuner, graph_bench
from kev.ops.shapes import ShapeClass
from kev.ops.triton_ops import TritonOps
from random_models import random_model

pytestmark = pytest.mark.gpu

ROWS = KeyLadder(PassKind.ROWS, 1024, 16)  # 16 rows of up to 69 tokens fit
STATES = KeyLadder(PassKind.STATE, 1024, 8)


@pytest.fixture(scope="module")
def setup():
    with fast_hot_autotuners() as hot:
        cfg = kev4b_heads_config()
        model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda()

        def bank():
            return Bank.allocate(cfg, num_slots=24, num_blocks=24 * 20, block_size=64, dtype=torch.bfloat16,
                                 device="cuda", max_doc_tokens=1280)

        tuner = ClassTuner(hot, bench=graph_bench)
        eager = Passes(model, bank(), TritonOps(), state_chunk_tokens=256, tuner=tuner)
        warm_up(eager, list(ShapeClass))
        yield dict(cfg=cfg, model=model, bank=bank, tuner=tuner)


def passes_on(setup, bank, graphs):
    return Passes(setup["model"], bank, TritonOps(), state_chunk_tokens=256, tuner=setup["tuner"], graphs=graphs)


def documents(seed, lens):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]


def row_batch(handles, doc_lens, seed, n_rows, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 70, (n_rows,), generator=g).tolist()
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    owners = torch.randint(0, len(handles), (n_rows,), generator=g).tolist()
    return RowBatch.build(rows, [handles[o] for o in owners], [doc_lens[o] for o in owners],
                          [[n - 1, 0] for n in lens], device=device)


DOC_SETS = [(5, 64, 129), (300, 700), (1000,), (40,) * 8]  # 700 and 1000 run in chunks of 256


def test_every_key_captured_then_only_replays_bit_identical_to_keyed_eager(setup):
    results = {}
    for mode in ("graphs", "keyed_eager", "plain"):
        bank = setup["bank"]()
        if mode == "plain":
            passes = passes_on(setup, bank, None)
        else:
            passes = passes_on(setup, bank, GraphCache(ROWS, STATES, policy=CapturePolicy.START_UP))
            if mode == "graphs":
                keys = passes.graphs.all_keys()
                passes.graphs.capture(passes, keys)
                assert passes.graphs.stats.captures == len(keys) == len(ROWS.keys()) + len(STATES.keys())
        outs, handles, lens = [], [], []
        for i, lens_i in enumerate(DOC_SETS):
            docs = documents(i, lens_i)
            hs = [bank.alloc(len(d)) for d in docs]
            passes.state_pass(docs, hs)
            handles += hs
            lens += list(lens_i)
        # a document the bank splits across passes: its first chunk beside a new document, then the
        # rest from 128 on (two rounds of 256 and 116 that continue the slot), and once whole to compare
        split_doc, other = documents(9, (500, 90))
        whole, split, beside = bank.alloc(500), bank.alloc(500), bank.alloc(90)
        passes.state_pass([split_doc], [whole])
        passes.state_pass([split_doc[:128], other], [split, beside])
        passes.state_pass([split_doc[128:]], [split], [128])
        handles += [whole, split, beside]
        lens += [500, 500, 90]
        for pool in bank.pools.recurrent + bank.pools.conv:
            assert rel_err(pool[whole.slot].float(), pool[split.slot].float()) <= 2e-2, "split != whole"
        for seed, n in [(1, 1), (2, 5), (3, 16), (4, 9)]:
            batch = row_batch(handles, lens, seed, n)
            assert ROWS.key_for(batch.row_lens) is not None, "the test's batches are within the ladder's caps"
            outs.append(passes.row_pass(batch))
        torch.cuda.synchronize()
        results[mode] = (outs, [t.clone() for t in bank.pools.tensors()])
        if mode == "graphs":
            assert passes.graphs.stats.eager == 0 and passes.graphs.stats.replays > 0
        if mode == "keyed_eager":
            assert passes.graphs.stats.unbucketed == 0 and passes.graphs.stats.replays == 0
    (g_out, g_pools), (k_out, k_pools), (p_out, p_pools) = results["graphs"], results["keyed_eager"], results["plain"]
    for a, b in zip(g_out, k_out):
        assert torch.equal(a, b), "a replay differs from the eager run of its key"
    for a, b in zip(g_pools, k_pools):
        assert torch.equal(a, b), "a graphed state pass stored other states than the eager run of its key"
    for a, b in zip(g_out, p_out):
        assert rel_err(b.float(), a.float()) <= 2e-2
    for a, b in zip(g_pools, p_pools):
        assert rel_err(b.float(), a.float()) <= 2e-2


def test_default_ladders_capture_within_the_stated_bounds(setup):
    """Every key of the services' default ladders (GraphPlan(): a scorer's ~175 row keys, the bank's
    185 state keys) captured, on the small model, within the bounds docs/design.md states: the
    graphs' memory (the one shared pool and the static buffers) at most twice the largest pass's
    activation bound (kev/exec/memory.py), and the captures themselves within 120 s."""
    import time

    from kev.exec.memory import state_pass_peak_bytes
    from kev.exec.passes import PassBuilder
    from kev.exec.plan import GraphPlan, PassRole

    plan = GraphPlan()
    bank = setup["bank"]()
    for role in (PassRole.ROWS, PassRole.STATES):
        rows, states = PassBuilder(None, None, role, plan).ladders()
        passes = passes_on(setup, bank, GraphCache(rows, states))
        keys = passes.graphs.all_keys()
        torch.cuda.synchronize()
        before, start = torch.cuda.memory_reserved(), time.perf_counter()
        passes.graphs.capture(passes, keys)
        torch.cuda.synchronize()
        seconds, grown = time.perf_counter() - start, torch.cuda.memory_reserved() - before
        largest = max(k.tokens for k in keys)
        bound = 2 * state_pass_peak_bytes(setup["cfg"], largest, 1)
        print(f"{role.value}: {len(keys)} graphs in {seconds:.1f} s, {grown / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)")
        assert len(keys) <= 200 and seconds < 120 and grown <= bound
