"""The services' passes on CUDA (kev/exec/passes.py; H200, skipped on CPU by the `gpu` marker).

What the bank and a scorer build at start-up, on a small model (width 512, 4 layers) with Kev-4B's
heads, random bf16 weights, projections fused as `LoadedModel` does on GPU, and small pass caps
(so few keys to capture):
- the classes of the role's keys are warmed, then every key of its ladders is captured;
- a scorer-style row pass through the served passes equals `Passes.row_pass` bit for bit when the
  batch fills its key exactly, and is close when padded;
- after start-up nothing autotunes: replays, passes beyond the caps, captures after a re-attach;
- a re-attach queues its keys (each captured at its first use or when idle) without warming
  again, with the same results;
- the bank's graphed state passes store close to what `Passes.state_pass` stores.
Autotuning here benchmarks with short reps (the configs only have to be consistent, not best).
"""


import pytest
import torch
from triton.runtime.autotuner import Autotuner

from kev.exec import passes as passes_module
from kev.bank.bank import Bank
from kev.exec.graphs import KeyLadder
from kev.exec.static_pass import PassKind
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
# A scorer's caps (KEV_MAX_TOKENS_PER_PASS, KEV_MAX_ROWS_PER_PASS) and the bank's (--max-pass-tokens,
# --max-pass-documents), small: 83 row keys and 59 state keys, rows_few / rows_mid and rows_few / docs_few.
SCORER_PLAN = GraphPlan(row_tokens=512, row_seqs=16)
BANK_PLAN = GraphPlan(state_tokens=1024, state_seqs=4)


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
    bank_passes.state_pass(docs, handles)  # 1,469 tokens: beyond the bank's caps here, an eager pass
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
    tokens (n_rows x row_len tokens in all: fills its key when that is a ladder size and every
    token is picked, picks_per_row == row_len)."""
    g = torch.Generator().manual_seed(seed)
    vocab = served["cfg"].vocab_size
    lens = [row_len] * n_rows if exact else torch.randint(picks_per_row, row_len + 1, (n_rows,), generator=g).tolist()
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    owners = [i % len(DOC_LENS) for i in range(n_rows)]
    picks = [sorted(torch.randperm(n, generator=g)[:picks_per_row].tolist()) for n in lens]
    return RowBatch.build(rows, [served["handles"][o] for o in owners], [DOC_LENS[o] for o in owners], picks,
                          device="cuda")


def test_start_up_warms_the_role_then_captures_its_keys(served):
    scorer, passes = served["scorer"], served["passes"]
    assert scorer.ladders() == (KeyLadder(PassKind.ROWS, 512, 16), None)
    # the classes of the scorer's keys: up to 512 row tokens
    assert scorer.warmed == scorer.warm_classes == [ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID]
    # every hot kernel a warmed class launches has a config there
    assert all(len(scorer.tuner.caches(c)[name]) for c in scorer.warmed
               for name in class_launches(c, scorer.tuner.autotuners))
    keys = passes.graphs.all_keys()
    assert len(keys) == len(scorer.ladders()[0].keys()) and set(passes.graphs.graphs()) == set(keys)
    assert passes.graphs.stats is scorer.graph_stats and not passes.graphs.stats.capture_errors
    assert passes.graphs.stats.captures == len(keys) and not passes.idle_work
    bank_builder, bank_passes = served["bank_builder"], served["bank_passes"]
    assert bank_builder.warmed == [ShapeClass.ROWS_FEW, ShapeClass.DOCS_FEW] and bank_builder.tuner is not scorer.tuner
    assert set(bank_passes.graphs.graphs()) == set(KeyLadder(PassKind.STATE, 1024, 4).keys())
    assert not bank_passes.graphs.stats.capture_errors


def test_served_row_pass_equals_runner_bitwise(served, no_autotune):
    passes = served["passes"]
    replays = passes.graphs.stats.replays
    batch = row_batch(served, 8, 32, 32, seed=1, exact=True)  # 256 tokens, every one picked: a key exactly
    assert passes.graphs.row_key(batch).tokens == 256
    out = passes.row_pass(batch)
    assert passes.graphs.stats.replays == replays + 1
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, passes.with_graphs(None).row_pass(batch)), "served replay != the eager row pass"
    padded = row_batch(served, 15, 32, 4, seed=2)  # padded in tokens and chunks
    out = passes.row_pass(padded)
    assert passes.graphs.stats.replays == replays + 2
    assert rel_err(passes.with_graphs(None).row_pass(padded), out) <= 2e-2


def test_nothing_autotunes_after_start_up(served, no_autotune):
    passes = served["passes"]
    stats = passes.graphs.stats
    before = (stats.replays, stats.eager_bucketed, stats.unbucketed, stats.captures)
    small = row_batch(served, 3, 16, 2, seed=3)  # rows_few: a start-up graph
    first = passes.row_pass(small)
    assert torch.equal(passes.row_pass(small), first), "two replays differ"
    mid = row_batch(served, 16, 32, 2, seed=4, exact=True)  # rows_mid, at the caps (512 tokens, 16 rows): a graph
    assert torch.isfinite(passes.row_pass(mid).float()).all()
    many = row_batch(served, 17, 20, 2, seed=5)  # more rows than the cap: the plain class-tuned pass
    assert torch.isfinite(passes.row_pass(many).float()).all()
    long = row_batch(served, 1, 600, 2, seed=6, exact=True)  # more tokens than the cap: likewise
    assert torch.isfinite(passes.row_pass(long).float()).all()
    torch.cuda.synchronize()
    after = (stats.replays, stats.eager_bucketed, stats.unbucketed, stats.captures)
    assert [a - b for a, b in zip(after, before)] == [3, 0, 2, 0]
    assert not stats.capture_errors and not passes.idle_work


def test_reattach_queues_new_graphs_without_warming_again(served, no_autotune, monkeypatch):
    scorer, passes = served["scorer"], served["passes"]
    monkeypatch.setattr(passes_module, "warm_up", lambda *a, **k: pytest.fail("warmed up again"))
    again = scorer.build(served["bank"], capture=False)  # what a re-attach does
    keys = again.graphs.all_keys()  # capture order: largest first
    assert again.graphs is not passes.graphs and again.tuner is scorer.tuner
    assert again.graphs.graphs() == [] and again.graphs.pending == keys and again.idle_work
    captures = again.graphs.stats.captures
    batch = row_batch(served, 8, 32, 32, seed=7, exact=True)
    key = again.graphs.row_key(batch)
    # a queued key is captured at its first use (a loaded server is never idle), then replayed
    assert torch.equal(again.row_pass(batch), passes.row_pass(batch))
    assert again.graphs.graphs() == [key] and key not in again.graphs.pending
    assert again.graphs.stats.captures == captures + 1
    assert torch.equal(again.row_pass(batch), passes.row_pass(batch))
    # the rest when idle, one at a time, largest first
    assert again.capture_when_idle() == 1 and again.graphs.graphs()[-1] == [k for k in keys if k != key][0]
    assert len(again.graphs.pending) == len(keys) - 2 and not again.graphs.stats.capture_errors


def slot_states(bank, handle, n_tokens):
    pages = bank.block_table[handle.slot, : -(-n_tokens // 64)].long()
    return ([p[handle.slot] for p in bank.pools.recurrent] + [p[handle.slot] for p in bank.pools.conv]
            + [p[pages].flatten(0, 1)[:n_tokens] for p in bank.pools.keys + bank.pools.values])


@pytest.mark.parametrize("lens,path", [([48], "replay"), ([200], "replay"), ([300, 100, 20], "replay"),
                                       ([1100], "unbucketed"), ([100] * 5, "unbucketed")],
                         ids=["replay-48", "replay-200", "replay-3-docs", "beyond-tokens", "beyond-docs"])
def test_bank_state_passes(served, no_autotune, lens, path):
    """Within the bank's caps (1,024 tokens, 4 documents) a state pass replays a start-up graph;
    beyond them it is the plain class-tuned pass. Either stores close to `Passes.state_pass`."""
    bank, bank_passes = served["bank"], served["bank_passes"]
    stats = bank_passes.graphs.stats
    g = torch.Generator().manual_seed(sum(lens))
    docs = [torch.randint(0, served["cfg"].vocab_size, (n,), generator=g).tolist() for n in lens]
    plain = Passes(served["model"], bank, bank_passes.ops, tuner=served["bank_builder"].tuner)
    assert bank_passes.state_keyed(lens) is (path == "replay")
    before = (stats.replays, stats.unbucketed, stats.captures)
    results = []
    for passes in (bank_passes, plain):
        handles = [bank.alloc(n) for n in lens]
        passes.state_pass(docs, handles)
        results.append([s.clone() for h, n in zip(handles, lens) for s in slot_states(bank, h, n)])
        for h in handles:
            bank.free(h)
    assert (stats.replays - before[0], stats.unbucketed - before[1], stats.captures - before[2]) == \
        ((1, 0, 0) if path == "replay" else (0, 1, 0))
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
    # 8 rows of 32 tokens each: one key for both passes
    a, b = row_batch(served, 8, 32, 3, seed=21, exact=True), row_batch(served, 8, 32, 3, seed=22, exact=True)
    assert passes.graphs.row_key(a) == passes.graphs.row_key(b)
    want = answer_rows(head, prepared, passes.row_pass(a))
    batch_a = lambda: row_batch(served, 8, 32, 3, seed=21, exact=True)  # noqa: E731 - packed again, inside the check
    torch.cuda.set_sync_debug_mode("error")  # launching a pass must never wait for the GPU
    try:
        pending = start_answers(head, prepared, passes.row_pass(batch_a()))
        passes.row_pass(b)  # the same key's graph, new rows, queued before A's answers are read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.ready is not None  # on its way, not read yet
    got = pending.result()
    assert got == want
    assert got != answer_rows(head, prepared, passes.row_pass(b))


def test_the_banks_idle_sweep_runs_on_graphs_only(served):
    """The bank with idle sweeps (`GraphPlan.sweep_one_document`, bank_service): start-up captures its
    state keys and its sweep rows' keys, and measures a pass's fixed cost; a new document's sweep with
    its rows then runs as the two graphed passes, and, once its uses would have paid for its capture
    (`GraphCache.uses_to_capture`) and it was captured while idle, as its own graph: never eagerly,
    never a capture on a request's path, and close to the two eager passes."""
    from kev.exec.static_pass import SweepKey

    cfg, model = served["cfg"], served["model"]
    bank = Bank.allocate(cfg, num_slots=8, num_blocks=64, block_size=64, dtype=torch.bfloat16, device="cuda",
                         max_doc_tokens=512)
    plan = GraphPlan(state_tokens=1024, state_seqs=4, row_tokens=256, row_seqs=8, sweep_one_document=True)
    passes = PassBuilder(model, TritonOps(), PassRole.BOTH, plan).build(bank)
    graphs = passes.graphs
    assert set(graphs.graphs()) == set(KeyLadder(PassKind.STATE, 1024, 4).keys() + KeyLadder(PassKind.ROWS, 256, 8).keys())
    assert not passes.idle_work
    assert 0 < graphs.fixed_s < 0.1  # one small pass's replay, in seconds
    captures = graphs.stats.captures
    g = torch.Generator().manual_seed(5)
    doc = torch.randint(0, cfg.vocab_size, (100,), generator=g).tolist()
    lens = (20, 33, 9)
    rows = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    picks = [[0, n // 2, n - 1] for n in lens]

    def batch(h):
        return RowBatch.build(rows, [h] * len(rows), [len(doc)] * len(rows), picks, device="cuda")

    h = bank.alloc(len(doc))
    key = SweepKey(graphs.state_key([len(doc)]), graphs.row_key(batch(h)))
    bank.free(h)
    need = graphs.uses_to_capture(key)  # the two keys' capture times over the fixed cost
    assert need >= graphs.min_uses
    eager, outs, captured = graphs.stats.eager, [], []
    for use in range(need + 2):
        h = bank.alloc(len(doc))
        outs.append(passes.sweep([doc], [h], batch(h)).clone())
        bank.free(h)
        if passes.idle_work:  # the sweep, queued once it would have paid: an idle bank captures it
            assert passes.capture_when_idle() == 1
            captured.append(use)
    # the first `need` uses ran as two replays and queued the sweep, captured while idle; then replays
    assert captured == [need - 1] and key in graphs.graphs()
    assert graphs.stats.eager == eager and not graphs.stats.capture_errors
    assert graphs.stats.captures == captures + 1  # the sweep's, while idle: none on a pass's path
    h = bank.alloc(len(doc))
    reference = passes.with_graphs(None)
    reference.state_pass([doc], [h])
    want = reference.row_pass(batch(h))
    for out in outs:
        assert rel_err(want, out) <= 2e-2
