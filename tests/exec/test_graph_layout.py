"""CUDA-graph buckets on CPU: the padded layouts (kev.exec.static_pass) and the capture policy (kev.exec.graphs).

The layouts run through the torch reference ops: a ROWS bucket (rows padded at their end, padding
rows reading nothing) gives the real rows' answers of the unpadded pass (fp32; the torch chunked
reference multiplies chunks of another length, so not bit for bit here: the GPU test checks the
Triton kernels bitwise); a STATE bucket (each document followed by its own padding sequence)
writes bit-identical bank states. The static chunk lists agree with fla's. The policy runs with
`TritonOps`' bookkeeping over the torch maths and a stand-in for graph capture.
"""

import pytest
import torch
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

from kev.bank.bank import Bank
from kev.exec.graphs import Buckets, CapturePolicy, GraphCache
from kev.ops import get_ops
from kev.ops.fused.reference import ReferenceElementwise
from kev.ops.torch_ops import TorchOps
from kev.ops.triton_ops import TritonOps
from kev.exec.plan import parse_row_buckets
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.ops.shapes import ShapeClass
from kev.exec.static_pass import CHUNK, GraphKey, PassKind, StaticPass, SweepKey, pair_chunks, static_chunks
from random_models import random_model, tiny_config
from kernel_support import rel_err


class CpuTritonOps(ReferenceElementwise, TritonOps):
    """TritonOps' pinned-index bookkeeping with the torch reference maths (runs on CPU)."""


for _name, _op in vars(TorchOps).items():  # every op the model calls: the torch reference
    if callable(_op) and not _name.startswith("_"):
        setattr(CpuTritonOps, _name, _op)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(hv_per_h=2), seed=3)


def stored(model, ops, doc_lens=(40, 130, 7)):
    bank = Bank.allocate(model.cfg, num_slots=8, num_blocks=128, block_size=16)
    runner = Passes(model, bank, ops)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in doc_lens]
    handles = [bank.alloc(len(d)) for d in docs]
    runner.state_pass(docs, handles)
    return runner, docs, handles


def row_batch(docs, handles, lens=(12, 30, 5, 70, 1), seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    owner = [i % len(docs) for i in range(len(rows))]
    return RowBatch.build(rows, [handles[o] for o in owner], [len(docs[o]) for o in owner],
                          [[len(r) - 1, 0] for r in rows])


@pytest.mark.parametrize("seq_len", [70, 128], ids=lambda L: f"L={L}")
def test_row_layout_gives_the_real_rows(model, seq_len):
    runner, docs, handles = stored(model, get_ops("torch"))
    batch = row_batch(docs, handles)
    ref = runner.row_pass(batch)
    before = [t.clone() for t in runner.bank.pools.tensors()]
    sp = StaticPass(GraphKey(PassKind.ROWS, 8, seq_len, 16), runner.bank.block_table.shape[1], 16, "cpu")
    P = sp.fill_rows(batch.tokens, batch.cu_seqlens, batch.slots, batch.doc_lens, batch.positions, batch.picks,
                     runner.bank.block_table)
    with torch.no_grad():
        out = model(sp.tokens, sp.meta, runner.bank.pools, runner.ops, picks=sp.picks)[:P]
    assert P == batch.picks.shape[0] and rel_err(ref, out) <= 1e-5
    assert sp.read_slots[5:].eq(-1).all() and sp.write_slots.eq(-1).all() and sp.prefix_lens[5:].eq(0).all()
    for b, a in zip(before, runner.bank.pools.tensors()):
        assert torch.equal(b, a), "a padded row pass changed the bank"


def test_state_layout_writes_identical_states(model):
    """Two documents in a 2 x 64 bucket (each followed by a padding sequence): bit-identical states."""
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (48, 30)]
    banks = []
    for padded in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
        bank.alloc(5)  # the documents land in other slots than 0
        handles = [bank.alloc(len(d)) for d in docs]
        if padded:
            sp = StaticPass(GraphKey(PassKind.STATE, 2, 64), bank.block_table.shape[1], 16, "cpu")
            sp.fill_state(docs, [h.slot for h in handles], bank.block_table)
            assert sp.cu_seqlens.tolist() == [0, 48, 64, 94, 128]
            with torch.no_grad():
                model(sp.tokens, sp.meta, bank.pools, get_ops("torch"), picks=sp.picks)
        else:
            Passes(model, bank, get_ops("torch")).state_pass(docs, handles)
        banks.append(bank)
    for a, b in zip(banks[0].pools.tensors(), banks[1].pools.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("seqs,seq_len", [(1, 16), (3, 64), (5, 130)], ids=str)
def test_static_chunks_agree_with_fla(seqs, seq_len):
    cu = torch.arange(seqs + 1) * seq_len  # the ROWS layout: exact
    assert torch.equal(static_chunks(seqs, seq_len, CHUNK, "cpu"), prepare_chunk_indices(cu, CHUNK))
    assert torch.equal(static_chunks(seqs, seq_len, 16, "cpu"), prepare_chunk_indices(cu, 16))
    assert prepare_chunk_offsets(cu, CHUNK).tolist() == [n * -(-seq_len // CHUNK) for n in range(seqs + 1)]


def check_pair_chunks(lens, L, block):
    """pair_chunks against fla's chunk list of the STATE layout's real cu_seqlens: each real chunk
    (n, t) at entry offsets[n] + t, every other entry a chunk past its sequence's end and inside
    the bucket's sequences, nb + 1 entries a pair."""
    chunks, offsets = pair_chunks(torch.tensor(lens, dtype=torch.int64), L, block)
    seq_lens = [m for ln in lens for m in (ln, L - ln)]
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    real = prepare_chunk_indices(cu, block).tolist()
    assert chunks.shape == (len(lens) * (-(-L // block) + 1), 2)
    seen = set()
    for n, t in real:
        assert chunks[offsets[n] + t].tolist() == [n, t], (lens, L, block, n, t)
        seen.add(int(offsets[n] + t))
    for i, (n, t) in enumerate(chunks.tolist()):
        if i not in seen:
            assert 0 <= n < 2 * len(lens) and t * block >= seq_lens[n], (lens, L, block, i, n, t)
            assert t * block <= L, "a no-op entry starts past its pair"


@pytest.mark.parametrize("L,block", [(64, 64), (130, 64), (48, 16), (2208, 64)], ids=str)
def test_pair_chunks_hold_every_real_chunk(L, block):
    """Every document length of one pair (0: an empty pair), then random pairs of a wide bucket."""
    for ln in range(0, L + 1, 1 if L < 200 else 7):
        check_pair_chunks([ln], L, block)
    g = torch.Generator().manual_seed(L)
    check_pair_chunks(torch.randint(0, L + 1, (6,), generator=g).tolist() + [L, 0], L, block)


def test_state_fill_and_host_ints():
    """The STATE layout's fill (host tensor ops) against the layout spelled out per pair, over
    random documents, counts and bucket lengths; `host_int64` equals `torch.tensor` on the lists."""
    from kev.exec.transfer import host_int64

    g = torch.Generator().manual_seed(3)
    table = torch.arange(16 * 8, dtype=torch.int32).view(16, 8)
    for R, L in [(1, 48), (4, 64), (6, 130)]:
        D = int(torch.randint(1, R + 1, (1,), generator=g))
        docs = [torch.randint(0, 300, (int(torch.randint(1, L + 1, (1,), generator=g)),), generator=g).tolist()
                for _ in range(D)]
        slots = torch.randperm(16, generator=g)[:D].tolist()
        sp = StaticPass(GraphKey(PassKind.STATE, R, L), table.shape[1], 16, "cpu")
        sp.fill_state(docs, slots, table)
        tokens, positions, cu, write = [], [], [0], []
        for n in range(R):
            doc = docs[n] if n < D else []
            tokens += doc + [0] * (L - len(doc))
            positions += list(range(len(doc))) + list(range(L - len(doc)))
            cu += [n * L + len(doc), (n + 1) * L]
            write += [slots[n] if n < D else -1, -1]
        assert sp.tokens.tolist() == tokens and sp.positions.tolist() == positions
        assert sp.cu_seqlens.tolist() == cu and sp.write_slots.tolist() == write
        assert torch.equal(sp.block_table[0 : 2 * D : 2], table[slots])
        lens = torch.tensor([len(docs[n]) if n < D else 0 for n in range(R)])
        c, o = pair_chunks(lens, L, CHUNK)
        assert torch.equal(sp.chunks, c) and torch.equal(sp.chunk_offsets, o)
        assert torch.equal(sp.attn_chunks[16], pair_chunks(lens, L, 16)[0])
    for values in ([], [0], [2**40, -1, 5], list(range(3000))):
        assert torch.equal(host_int64(values), torch.tensor(values, dtype=torch.int64))


def test_start_up_buckets_are_captured_largest_first(model):
    """The gathered variant's row buffers grow with the passes that need them and keep what they
    outgrow (graphs point into it): the start-up capture and queue go from the most rows down."""
    from kev.exec.graphs import largest_first

    b = Buckets()
    small, wide, long_rows = b.row_key(2, 32, 2), b.row_key(64, 32, 64), b.row_key(8, 64, 8)
    sweep = SweepKey(b.state_key(1, 48), small)
    assert largest_first([small, sweep, long_rows, wide]) == [wide, long_rows, sweep, small]
    bank = Bank.allocate(model.cfg, num_slots=4, num_blocks=64, block_size=16, dtype=torch.float32)
    graphed = Passes(model, bank, CpuTritonOps()).with_graphs(GraphCache(policy=CapturePolicy.WHEN_IDLE))
    graphed.graphs.queue([small, wide, long_rows])
    assert graphed.graphs.pending == [wide, long_rows, small]


def test_bucket_keys():
    b = Buckets()
    assert b.row_key(6, 32, 6) == GraphKey(PassKind.ROWS, 6, 32, 32)  # picks capacity 5 a row at least
    assert b.row_key(5, 33, 40) == GraphKey(PassKind.ROWS, 5, 48, 64)  # one request's rows: every count to 8
    assert [b.row_key(n, 32, 1).seqs for n in (3, 7, 8, 9)] == [3, 7, 8, 12]
    assert b.row_key(97, 32, 97) == GraphKey(PassKind.ROWS, 104, 32, 1024)
    assert b.row_key(129, 32, 1) is None and b.row_key(4, 129, 1) is None and b.row_key(4, 8, 2000) is None
    assert b.state_key(1, 48) == GraphKey(PassKind.STATE, 1, 48) and b.state_key(1, 49) == GraphKey(PassKind.STATE, 1, 64)
    assert b.row_key(75, 32, 270) == GraphKey(PassKind.ROWS, 80, 32, 512)  # a busy pass: 80, not 96
    assert b.row_key(83, 32, 300) == GraphKey(PassKind.ROWS, 88, 32, 512)  # steps of 8 rows above 32
    # rows of 3 picks and rows of 5 share the graph a start-up 'RxL' bucket captured
    (R, L, P), = parse_row_buckets("32x32")
    assert b.row_key(25, 32, 75) == b.row_key(32, 32, 160) == b.row_key(R, L, P) == GraphKey(PassKind.ROWS, 32, 32, 256)
    assert b.state_key(1, 2200) == GraphKey(PassKind.STATE, 1, 2208) and b.state_key(1, 2209).seq_len == 2304
    assert b.state_key(5, 64) == GraphKey(PassKind.STATE, 6, 64) and b.state_key(1, 4097) is None
    assert b.state_key(64, 48) == GraphKey(PassKind.STATE, 64, 48) and b.state_key(65, 48) is None
    # a bucket exists only while D x L <= max_state_tokens (16,384)
    assert b.state_key(6, 2200) == GraphKey(PassKind.STATE, 6, 2208) and b.state_key(7, 2200) is None
    assert b.state_key(64, 256) == GraphKey(PassKind.STATE, 64, 256) and b.state_key(33, 257) is None
    assert all(D * L <= b.max_state_tokens for D in b.docs for L in b.doc_tokens if b.state_key(D, L) is not None)
    assert GraphKey(PassKind.STATE, 1, 2304).num_slots == 2 and GraphKey(PassKind.ROWS, 6, 32).num_slots == 6


class FakeGraph:
    def __init__(self, fn, out):
        self.fn, self.out, self.replays, self.was_reset = fn, out, 0, False

    def replay(self):
        self.out.copy_(self.fn())
        self.replays += 1

    def reset(self):
        self.was_reset = True


@pytest.fixture
def fake_capture(monkeypatch):
    def record(self, passes, entry):
        def forward():
            # A real graph reads its index buffers at each replay; the torch maths reads the host
            # copy a PassMeta caches on first use: drop it, so a replay sees the buffers as filled now.
            for s in (entry.static, entry.rows):
                if s is not None:
                    s.meta.__dict__.pop("host", None)
            return self._forward(passes, entry)

        out = forward()
        return FakeGraph(forward, out), out

    monkeypatch.setattr(GraphCache, "_record", record)


def test_when_idle_policy_queues_then_captures(model, fake_capture):
    runner, docs, handles = stored(model, CpuTritonOps())
    graphed = runner.with_graphs(GraphCache(policy=CapturePolicy.WHEN_IDLE, min_uses=2))
    batch = row_batch(docs, handles, lens=(12, 30, 5))
    ref = runner.row_pass(batch)
    first = graphed.row_pass(batch)  # eager (bucketed), not queued yet
    assert graphed.graphs.pending == [] and graphed.graphs.stats.eager_bucketed == 1
    second = graphed.row_pass(batch)  # second use: queued, still eager: a busy server never captures
    key = GraphKey(PassKind.ROWS, 3, 32, 16)
    assert graphed.graphs.pending == [key] and graphed.graphs.graphs() == [] and torch.equal(first, second)
    assert graphed.capture_when_idle() == 1 and graphed.graphs.graphs() == [key] and graphed.graphs.pending == []
    third = graphed.row_pass(row_batch(docs, handles, lens=(12, 30, 5)))
    assert graphed.graphs.stats.replays == 1 and torch.equal(first, third)
    assert rel_err(ref, first) <= 1e-5


def test_first_use_policy_lru_and_fallbacks(model, fake_capture):
    runner, docs, handles = stored(model, CpuTritonOps())
    graphed = runner.with_graphs(GraphCache(policy=CapturePolicy.ON_FIRST_USE, max_graphs=2))
    for lens in [(3, 4), (20,), (3, 40, 2)]:  # buckets (2, 16), (1, 32), (3, 48)
        b = row_batch(docs, handles, lens=lens)
        assert rel_err(runner.row_pass(b), graphed.row_pass(b)) <= 1e-5
    assert graphed.graphs.stats.captures == 3 and graphed.graphs.stats.evictions == 1
    assert graphed.graphs.graphs() == [GraphKey(PassKind.ROWS, 1, 32, 8), GraphKey(PassKind.ROWS, 3, 48, 16)]
    too_long = row_batch(docs, handles, lens=(200,))
    assert torch.equal(graphed.row_pass(too_long), runner.row_pass(too_long)) and graphed.graphs.stats.unbucketed == 1
    no_lens = RowBatch(*[getattr(too_long, f) for f in ("tokens", "cu_seqlens", "slots", "doc_lens", "picks",
                                                          "positions")])
    graphed.row_pass(no_lens)
    assert graphed.graphs.stats.unbucketed == 2


@pytest.mark.parametrize("lens,bucket", [((50, 9), (2, 64)), ((64, 1, 33, 17, 64, 5, 40), (8, 64))],
                         ids=["2-docs", "7-docs-in-8"])
def test_graphed_state_pass_writes_what_the_runner_writes(model, fake_capture, lens, bucket):
    """Padded state passes store exactly what Passes.state_pass stores, beyond 4 documents too
    (documents of exactly L tokens: an empty padding sequence after them; one empty pair)."""
    g = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    banks = []
    for graphed in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=len(docs) + 2, num_blocks=128, block_size=16)
        bank.alloc(3)  # the documents land in other slots than 0
        runner = Passes(model, bank, CpuTritonOps())
        handles = [bank.alloc(len(d)) for d in docs]
        if graphed:
            passes = runner.with_graphs(GraphCache(Buckets(docs=(bucket[0],), doc_tokens=(bucket[1],)),
                                                   policy=CapturePolicy.ON_FIRST_USE))
            assert passes.graphs.state_bucket(len(docs), max(lens), passes.state_chunk_tokens) == \
                GraphKey(PassKind.STATE, *bucket)
            passes.state_pass(docs, handles)
            assert passes.graphs.stats.captures == 1 and passes.graphs.stats.replays == 1
        else:
            runner.state_pass(docs, handles)
        banks.append(bank)
    for a, b in zip(banks[0].pools.tensors(), banks[1].pools.tensors()):
        assert torch.equal(a, b)


# Row buckets without the exact counts up to 8, so the sweeps' 3 rows pad to a 4-row bucket.
PADDED_ROWS = Buckets(rows=(1, 2, 4, 8, 16, 32))


def new_documents_and_rows(bank, seed):
    """Two new documents (slots allocated, nothing stored yet) and three rows over them: one sweep's input."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (50, 9)]
    handles = [bank.alloc(len(d)) for d in docs]
    return docs, handles, row_batch(docs, handles, lens=(12, 30, 5), seed=seed)


def test_graphed_sweep_matches_the_runner(model, fake_capture):
    """One sweep in a SweepKey bucket (documents padded as in a STATE bucket, rows as in a ROWS one)
    stores exactly what the unpadded sweep stores and gives its rows' answers (fp32, see the module
    docstring); a replay with other documents and rows follows them."""
    g = torch.Generator().manual_seed(4)
    results = []
    for graphed in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
        bank.alloc(3)  # the documents land in other slots than 0
        runner = Passes(model, bank, CpuTritonOps())
        passes = runner.with_graphs(GraphCache(PADDED_ROWS, policy=CapturePolicy.ON_FIRST_USE)) if graphed else runner
        out = []
        for rep in range(2):
            docs, handles, batch = new_documents_and_rows(bank, 40 + rep)
            out.append((passes.sweep(docs, handles, batch), [t.clone() for t in bank.pools.tensors()]))
            for h in handles:
                bank.free(h)
        if graphed:
            assert passes.graphs.graphs() == [SweepKey(GraphKey(PassKind.STATE, 2, 64), GraphKey(PassKind.ROWS, 4, 32, 32))]
            assert passes.graphs.stats.captures == 1 and passes.graphs.stats.replays == 2 and passes.graphs.stats.unbucketed == 0
        results.append(out)
    for (h1, bank1), (h2, bank2) in zip(*results):
        assert rel_err(h1, h2) <= 1e-5
        for a, b in zip(bank1, bank2):
            assert torch.equal(a, b)


def test_sweep_without_its_graph_replays_the_two_graphs(model, fake_capture):
    """WHEN_IDLE: until a sweep bucket is captured, a state graph and a row graph that exist run
    instead of an eager sweep; the sweep is queued after `min_uses` uses and replayed once captured."""
    bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
    runner = Passes(model, bank, CpuTritonOps())
    passes = runner.with_graphs(GraphCache(PADDED_ROWS, policy=CapturePolicy.WHEN_IDLE, min_uses=2))
    state, rows = GraphKey(PassKind.STATE, 2, 64), GraphKey(PassKind.ROWS, 4, 32, 32)
    passes.graphs.capture(passes, [state, rows])
    outs = []
    for rep in range(3):
        docs, handles, batch = new_documents_and_rows(bank, 50 + rep)
        replays = passes.graphs.stats.replays
        outs.append(passes.sweep(docs, handles, batch))
        assert passes.graphs.stats.replays - replays == (2 if rep < 2 else 1) and passes.graphs.stats.eager_bucketed == 0
        ref = runner.row_pass(batch)  # the states the sweep stored, read by the plain row pass
        assert rel_err(ref, outs[-1]) <= 1e-5
        for h in handles:
            bank.free(h)
        if rep == 1:
            assert passes.graphs.pending == [SweepKey(state, rows)] and passes.capture_when_idle() == 1
    assert SweepKey(state, rows) in passes.graphs.graphs()


def test_gathered_plan_follows_a_bucket_between_replays():
    """GatheredOps on a CUDA-graph bucket: the gather plan is re-derived from the bucket's index
    buffers at every call (a plan kept from the capture's synthetic fill read slot 0 and one page
    a row: wrong states, and past the page table for 2,200-token prefixes), P comes from
    max_prefix_tokens, and a replaced row buffer stays alive for the graphs that hold it."""
    from kev.ops.gathered_ops import GatheredOps, PrefixTooLong
    from kev.ops.meta import PassMeta

    ops = GatheredOps(max_prefix_tokens=100)
    sp = StaticPass(GraphKey(PassKind.ROWS, 4, 32, 8), 16, 16, "cpu")
    ops.pin(sp.meta, sp.indices())
    synthetic = ops.plan(sp.meta)  # as at capture: every row reads nothing
    assert synthetic.rows.tolist() == [0] * 4 and synthetic.row_slots.tolist() == [-1] * 4
    sp.read_slots.copy_(torch.tensor([3, 1, -1, -1]))  # a real fill, in place
    sp.prefix_lens.copy_(torch.tensor([100, 40, 0, 0]))
    sp.block_table[:2] = torch.arange(32, dtype=torch.int32).view(2, 16) + 7
    plan = ops.plan(sp.meta)
    assert plan.rows.tolist() == [3, 1, 0, 0] and plan.row_slots.tolist() == [0, 1, -1, -1]
    pages, table = ops.page_plan(sp.meta, 16)  # P = ceil(100 / 16) = 7 pages a row
    assert table.shape == (4, 7) and torch.equal(pages.view(4, 7)[:2], sp.block_table[:2, :7].long())
    with pytest.raises(ValueError, match="needs max_prefix_tokens"):
        unsized = GatheredOps()
        unsized.pin(sp.meta, sp.indices())
        unsized.page_plan(sp.meta, 16)
    one_pass = PassMeta(torch.tensor([0, 5]), torch.tensor([3]), torch.tensor([-1]), torch.tensor([150]),
                        sp.block_table[:1])
    with pytest.raises(PrefixTooLong, match="150-token prefix"):
        ops.page_plan(one_pass, 16)
    small = ops.buffer("keys", 4, torch.zeros(1, 16, 2, 8))
    ops.buffer("keys", 8, torch.zeros(1, 16, 2, 8))
    assert any(b.data_ptr() == small.data_ptr() for b in ops._outgrown)


def test_bucket_meta_carries_the_bucket_class():
    """A STATE bucket counts each document and its padding sequence as one: its meta's class is the
    bucket's (what its graph tunes under, and what a sweep's document phase mixes under), not the
    class of its 2 D padded sequences."""
    key = GraphKey(PassKind.STATE, 4, 1024)  # docs_few; its 8 padded sequences alone would be docs_wide
    static = StaticPass(key, 32, 16, "cpu")
    assert key.shape_class is ShapeClass.DOCS_FEW and static.meta.num_seqs == 8 and static.meta.pass_class(key.num_tokens) is key.shape_class
    rows = StaticPass(GraphKey(PassKind.ROWS, 6, 32, 8), 8, 16, "cpu")
    assert rows.meta.pass_class(6 * 32) is rows.key.shape_class
    assert SweepKey(key, rows.key).shape_class is key.shape_class
