"""The services' passes on CUDA (kev/exec/passes.py; H200, skipped on CPU by the `gpu` marker).

What the bank and a scorer build at start-up, on a small model (width 512, 4 layers) with Kev-4B's
heads, random bf16 weights, projections fused as `LoadedModel` does on GPU:
- the start-up buckets are captured after every class of the role was warmed;
- a scorer-style row pass through the served passes equals `Passes.row_pass` bit for bit when the
  batch fills its bucket exactly, and is close when padded;
- after start-up nothing autotunes: replays, eager bucketed passes, unbucketed passes, idle captures;
- a re-attach builds new graphs (queued, captured when idle) without warming again, with the same results;
- the bank's graphed short state passes store close to what `Passes.state_pass` stores.
Autotuning here benchmarks with short reps (the configs only have to be consistent, not best).
"""


import pytest
import torch
from triton.runtime.autotuner import Autotuner

from kev.exec import passes as passes_module
from kev.bank.bank import Bank
from kev.exec.graphs import largest_first
from kev.ops.shapes import ShapeClass
from kev.ops.triton_ops import TritonOps
from kev.exec.plan import GraphPlan, PassRole
from kev.exec.passes import PassBuilder
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from random_models import random_model
from kernel_support import class_launches, fast_hot_autotuners, kev4b_heads_config, rel_err

pytestmark = pytest.mark.gpu

DOC_LENS = (5, 64, 300, 1100)
SCORER_PLAN = GraphPlan(rows=((8, 32, 64), (4, 32, 20), (96, 64, 512)), docs=(), max_graphs=8, max_rows_per_pass=96)
BANK_PLAN = GraphPlan(rows=(), docs=((1, 64), (1, 256)), max_graphs=4)


@pytest.fixture(scope="module")
def fast_autotune():
    """The hot autotuners with fast benchmarks; their globals are put back afterwards."""
    with fast_hot_autotuners():
        yield


@pytest.fixture(scope="module")
def served(fast_autotune):
    """A bank process's passes (its documents written through them) and a scorer process's passes
    on the same bank, each from its own builder, as the two services build them."""
    cfg = kev4b_heads_config()
    model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda().fuse_projections()
    bank = Bank.allocate(cfg, num_slots=16, num_blocks=16 * 36, block_size=64, dtype=torch.bfloat16,
                         device="cuda", max_doc_tokens=2304)
    bank_builder = PassBuilder(model, TritonOps(), PassRole.STATES, BANK_PLAN)
    bank_passes = bank_builder.build(bank)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in DOC_LENS]
    handles = [bank.alloc(n) for n in DOC_LENS]
    bank_passes.state_pass(docs, handles)
    scorer = PassBuilder(model, TritonOps(), PassRole.ROWS, SCORER_PLAN)
    passes = scorer.build(bank)
    return dict(cfg=cfg, model=model, bank=bank, bank_builder=bank_builder, bank_passes=bank_passes,
                handles=handles, scorer=scorer, passes=passes)


@pytest.fixture
def no_autotune(monkeypatch):
    def no_bench(self, *args, **kwargs):
        raise AssertionError(f"{self.base_fn.__name__} autotuned after start-up")

    monkeypatch.setattr(Autotuner, "_bench", no_bench)


def row_batch(served, n_rows, row_len, picks_per_row, seed, exact=False):
    """Rows over the bank's documents, `picks_per_row` picks each; `exact`: every row `row_len`
    tokens (fills its bucket, if n_rows and the picks are bucket sizes too)."""
    g = torch.Generator().manual_seed(seed)
    vocab = served["cfg"].vocab_size
    lens = [row_len] * n_rows if exact else torch.randint(picks_per_row, row_len + 1, (n_rows,), generator=g).tolist()
    lens[0] = row_len  # the longest row decides the bucket
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    owners = [i % len(DOC_LENS) for i in range(n_rows)]
    picks = [sorted(torch.randperm(n, generator=g)[:picks_per_row].tolist()) for n in lens]
    return RowBatch.build(rows, [served["handles"][o] for o in owners], [DOC_LENS[o] for o in owners], picks,
                          device="cuda")


def test_start_up_warms_the_role_then_captures_its_plan(served):
    scorer, passes = served["scorer"], served["passes"]
    assert scorer.warmed == [c for c in ShapeClass if c.rows]
    # every hot kernel a warmed class launches has a config there
    assert all(len(scorer.tuner.caches(c)[name]) for c in scorer.warmed
               for name in class_launches(c, scorer.tuner.autotuners))
    assert passes.graphs.graphs() == largest_first(scorer.start_keys(passes.graphs.buckets)) and len(passes.graphs.graphs()) == 3
    assert passes.graphs.stats is scorer.graph_stats and not passes.graphs.stats.capture_errors
    bank_builder, bank_passes = served["bank_builder"], served["bank_passes"]
    assert bank_builder.warmed == list(ShapeClass) and bank_builder.tuner is not scorer.tuner
    assert len(bank_passes.graphs.graphs()) == 2


def test_served_row_pass_equals_runner_bitwise(served, no_autotune):
    passes = served["passes"]
    replays = passes.graphs.stats.replays
    batch = row_batch(served, 8, 32, 8, seed=1, exact=True)  # bucket (8, 32, 64) exactly: a start-up graph
    out = passes.row_pass(batch)
    assert passes.graphs.stats.replays == replays + 1
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, passes.with_graphs(None).row_pass(batch)), "served replay != the eager row pass"
    padded = row_batch(served, 90, 64, 4, seed=2)  # bucket (96, 64, 512), padded
    out = passes.row_pass(padded)
    assert passes.graphs.stats.replays == replays + 2
    assert rel_err(passes.with_graphs(None).row_pass(padded), out) <= 2e-2


def test_nothing_autotunes_after_start_up(served, no_autotune):
    passes = served["passes"]
    stats = passes.graphs.stats
    before = (stats.replays, stats.eager_bucketed, stats.unbucketed, stats.captures)
    small = row_batch(served, 3, 16, 2, seed=3)  # bucket (4, 16, 8): no graph yet
    first = passes.row_pass(small)
    second = passes.row_pass(small)  # second use: queued for capture when idle
    assert torch.equal(first, second)
    assert passes.idle_work
    assert passes.capture_when_idle() == 1 and not passes.idle_work
    assert torch.equal(passes.row_pass(small), first), "replay != the eager bucketed pass"
    wide = row_batch(served, 200, 20, 2, seed=4)  # more rows than any bucket: the plain class-tuned pass
    assert torch.isfinite(passes.row_pass(wide).float()).all()
    torch.cuda.synchronize()
    after = (stats.replays, stats.eager_bucketed, stats.unbucketed, stats.captures)
    assert [a - b for a, b in zip(after, before)] == [1, 2, 1, 1]
    assert not stats.capture_errors


def test_reattach_queues_new_graphs_without_warming_again(served, no_autotune, monkeypatch):
    scorer, passes = served["scorer"], served["passes"]
    monkeypatch.setattr(passes_module, "warm_up", lambda *a, **k: pytest.fail("warmed up again"))
    again = scorer.build(served["bank"], capture=False)  # what a re-attach does
    keys = largest_first(scorer.start_keys(again.graphs.buckets))  # capture order
    assert again.graphs is not passes.graphs and again.tuner is scorer.tuner
    assert again.graphs.graphs() == [] and again.graphs.pending == keys
    while again.idle_work:
        again.capture_when_idle()
    assert again.graphs.graphs() == keys and not again.graphs.stats.capture_errors
    batch = row_batch(served, 8, 32, 8, seed=5, exact=True)
    assert torch.equal(again.row_pass(batch), passes.row_pass(batch))


def slot_states(bank, handle, n_tokens):
    pages = bank.block_table[handle.slot, : -(-n_tokens // 64)].long()
    return ([p[handle.slot] for p in bank.pools.recurrent] + [p[handle.slot] for p in bank.pools.conv]
            + [p[pages].flatten(0, 1)[:n_tokens] for p in bank.pools.keys + bank.pools.values])


@pytest.mark.parametrize("lens", [[48], [200], [1100], [100] * 5], ids=["replay-64", "replay-256", "eager-1536",
                                                                       "unbucketed-5-docs"])
def test_bank_state_passes(served, no_autotune, lens):
    bank, bank_passes = served["bank"], served["bank_passes"]
    g = torch.Generator().manual_seed(sum(lens))
    docs = [torch.randint(0, served["cfg"].vocab_size, (n,), generator=g).tolist() for n in lens]
    plain = Passes(served["model"], bank, bank_passes.ops, tuner=served["bank_builder"].tuner)
    results = []
    for passes in (bank_passes, plain):
        handles = [bank.alloc(n) for n in lens]
        passes.state_pass(docs, handles)
        results.append([s.clone() for h, n in zip(handles, lens) for s in slot_states(bank, h, n)])
        for h in handles:
            bank.free(h)
    for a, b in zip(*results):
        assert torch.isfinite(a.float()).all()
        assert rel_err(b, a) <= 2e-2


def test_answers_read_after_the_next_pass_was_launched(served, no_autotune):
    """The scorer keeps two passes in flight (scorer_service/batcher.py): packing pass A, replaying
    it, queueing its head and then pass B never waits for the GPU; A's answers, read after B replayed
    the same graph with other rows, equal A's answers read at once, bit for bit."""
    from types import SimpleNamespace

    from kev.request.api import Question
    from kev.request.answers import answer_rows, start_answers
    from kev.request.head import DecisionHead

    d = served["cfg"].hidden_size
    g = torch.Generator().manual_seed(5)
    head = DecisionHead(w_q=(torch.randn(64, d, generator=g) * d**-0.5 * 4).cuda(),
                        w_k=(torch.randn(64, d, generator=g) * d**-0.5 * 4).cuda(), b_q=None, b_k=None,
                        temperature=1.0)
    rows = tuple(SimpleNamespace(name=f"q{i}", question=Question.noul("x"), prompt=SimpleNamespace(option_end_indices=(0, 0)))
                 for i in range(8))
    prepared = [SimpleNamespace(rows=rows)]  # 8 noul rows: <decide> and two option ends each
    passes = served["passes"]
    a, b = row_batch(served, 8, 32, 3, seed=21), row_batch(served, 8, 32, 3, seed=22)
    want = answer_rows(head, prepared, passes.row_pass(a))
    batch_a = lambda: row_batch(served, 8, 32, 3, seed=21)  # noqa: E731 - packed again, inside the check
    torch.cuda.set_sync_debug_mode("error")  # launching a pass must never wait for the GPU
    try:
        pending = start_answers(head, prepared, passes.row_pass(batch_a()))
        passes.row_pass(b)  # the same 8 x 32 graph, new rows, queued before A's answers are read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.ready is not None  # on its way, not read yet
    got = pending.result()
    assert got == want
    assert got != answer_rows(head, prepared, passes.row_pass(b))
