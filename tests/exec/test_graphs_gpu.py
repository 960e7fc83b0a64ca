"""CUDA graphs and shape-class autotune on the GPU (H200; skipped on CPU by the `gpu` marker).

A small model (width 512, 4 layers) with Kev-4B's heads (H 16, HV 32, K = V = 128; Hq 16, Hkv 4,
head_dim 256), random bf16 weights, documents of 5..1,100 tokens in the bank, every class warmed
first (but docs_wide: the ladders here stop below it).
- the token-mixing kernels give bit-identical real outputs and stored states when a pass is packed
  into a key (kev.exec.static_pass: its sequences end to end, padding sequences of at most one
  chunk to T tokens, empty sequences, no-op chunk entries), rows, new documents and continuing
  chunks alike;
- graph replays equal eager runs of the same key bit for bit, with new rows, slots, prefix
  lengths, row lengths and row counts between replays; a batch that fills its key exactly (no
  padding tokens, every token picked) equals `Passes.row_pass` bit for bit; padded batches are
  reported against it (other GEMM row counts);
- graphed state passes (short documents, and long ones chunk by chunk) store what the eager
  keyed pass stores;
- every autotuner a pass launches is a hot (class-cached) one; capture after warm-up never tunes.
Autotuning here benchmarks with short reps (the configs only have to be consistent, not best).
"""


import pytest
import torch
from triton.runtime.autotuner import Autotuner

from kernel_support import class_launches, fast_hot_autotuners, kev4b_heads_config, make_pools, packed, rel_err
from kev.bank.bank import Bank
from kev.exec.graphs import CapturePolicy, GraphCache, KeyLadder
from kev.ops.shapes import ShapeClass
from kev.ops.autotune import ClassTuner, graph_bench
from kev.exec.warm_up import warm_up
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.exec.static_pass import GraphKey, PassKind, StaticPass, SweepKey, chunks_needed
from random_models import random_model

pytestmark = pytest.mark.gpu

DOC_LENS = (5, 64, 129, 300, 1100)
WARM = (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_FEW)
# The ladders of these tests (keys are captured only where a test uses them): rows up to the wide
# class, state passes up to 2,304 tokens (docs_few at most).
ROWS = KeyLadder(PassKind.ROWS, 4096, 96)
STATES = KeyLadder(PassKind.STATE, 2304, 8)


@pytest.fixture(scope="module")
def hot():
    """The hot autotuners with fast benchmarks; their globals are put back afterwards."""
    with fast_hot_autotuners() as tuners:
        yield tuners


@pytest.fixture(scope="module")
def setup(hot):
    cfg = kev4b_heads_config()
    model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda()
    bank = Bank.allocate(cfg, num_slots=16, num_blocks=16 * 36, block_size=64, dtype=torch.bfloat16,
                         device="cuda", max_doc_tokens=2304)
    tuner = ClassTuner(hot, bench=graph_bench)  # as serving_tuner, on the fixture's autotuners
    runner = Passes(model, bank, TritonOps(), tuner=tuner)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in DOC_LENS]
    handles = [bank.alloc(n) for n in DOC_LENS]
    runner.state_pass(docs, handles)
    warm_up(runner, WARM, row_slot=handles[3].slot, row_prefix=DOC_LENS[3])
    return dict(cfg=cfg, model=model, bank=bank, tuner=tuner, runner=runner, handles=handles)


def row_lens(n_rows, g, row_len=32, total=None):
    """`n_rows` row lengths of 1..row_len tokens; `total` tokens in all when given (which, with the
    row count, decides the key: rows of at most 64 tokens take one chunk each)."""
    if total is None:
        return torch.randint(1, row_len + 1, (n_rows,), generator=g).tolist()
    assert n_rows <= total <= n_rows * row_len
    lens, extra = [1] * n_rows, total - n_rows
    while extra:
        i = int(torch.randint(0, n_rows, (1,), generator=g))
        if lens[i] < row_len:
            lens[i], extra = lens[i] + 1, extra - 1
    return lens


def make_batch(setup, n_rows, seed, row_len=32, total=None):
    """Rows of 1..row_len tokens (`total` in all when given) over random documents, one pick per
    row (its last token)."""
    g = torch.Generator().manual_seed(seed)
    lens = row_lens(n_rows, g, row_len, total)
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    owners = torch.randint(0, len(DOC_LENS), (n_rows,), generator=g).tolist()
    return RowBatch.build(rows, [setup["handles"][o] for o in owners], [DOC_LENS[o] for o in owners],
                          [[n - 1] for n in lens], device="cuda")


# ---- the token-mixing kernels under padding ----------------------------------------------------

def layer_inputs(T, C, H, HV, K, V, Hq, Hkv, D, g):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(T, C).bfloat16().cuda(), q=r(T, H, K).bfloat16().cuda(), k=r(T, H, K).bfloat16().cuda(),
                v=r(T, HV, V).bfloat16().cuda(), g=(-torch.rand(T, HV, generator=g)).cuda(),
                beta=torch.rand(T, HV, generator=g).bfloat16().cuda(), aq=r(T, Hq, D).bfloat16().cuda(),
                ak=r(T, Hkv, D).bfloat16().cuda(), av=r(T, Hkv, D).bfloat16().cuda())


def run_ops(ops, inp, meta, pools, weight):
    conv = ops.causal_conv(inp["x"], weight, meta, pools.conv[0])
    gates = DeltaGates.given(inp["g"], inp["beta"])
    o = ops.gated_delta_rule(inp["q"], inp["k"], inp["v"], gates, meta, pools.recurrent[0])
    a = ops.attention(inp["aq"], inp["ak"], inp["av"], meta, pools.keys[0], pools.values[0])
    return conv, o, a


@pytest.mark.parametrize("key,lens,starts", [
    (GraphKey(PassKind.ROWS, 128, 6), [1, 17, 33, 64], None),  # one chunk a row, an empty sequence, a no-op entry
    (GraphKey(PassKind.ROWS, 192, 8), [65, 100, 3], None),  # rows over two chunks
    (GraphKey(PassKind.STATE, 128, 4), [48, 30], None),  # a padding sequence, an empty one, a no-op chunk
    (GraphKey(PassKind.STATE, 2048, 48), [1100, 64, 700], None),  # long documents, 184 padding tokens in 3 sequences
    (GraphKey(PassKind.STATE, 205, 8), [130, 70, 5], None),  # no padding tokens: no-ops on an empty sequence
    (GraphKey(PassKind.STATE, 768, 16), [700, 30], [1024, 0]),  # a chunk continuing its slot, a new document
], ids=["rows-1chunk", "rows-2chunks", "state-short", "state-long", "state-exact", "state-continuing"])
def test_padding_is_exact_in_the_token_mixing_kernels(setup, key, lens, starts):
    cfg = setup["cfg"]
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    C, Hq, Hkv, D = cfg.conv_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(len(lens) * key.tokens)
    N, kind = len(lens), key.kind
    assert N < key.chunks and chunks_needed(lens, key.tokens) <= key.chunks  # the pass fits the key
    real = layer_inputs(sum(lens), C, H, HV, K, V, Hq, Hkv, D, g)
    padded = layer_inputs(key.num_tokens, C, H, HV, K, V, Hq, Hkv, D, g)  # random padding everywhere
    dst = torch.arange(sum(lens), device="cuda")  # packed: the real tokens first, the padding after
    for name in real:
        padded[name][dst] = real[name]
    weight = (torch.randn(C, cfg.conv_kernel, generator=g) * 0.5).bfloat16().cuda()
    pools_a, table = make_pools(cfg, 8, 2304, 64, torch.bfloat16, "cuda")
    for t in pools_a.tensors():
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    pools_b, _ = make_pools(cfg, 8, 2304, 64, torch.bfloat16, "cuda")
    for a, b in zip(pools_a.tensors(), pools_b.tensors()):
        b.copy_(a)
    as_long = dict(dtype=torch.int64, device="cuda")
    cu = packed(lens, "cuda")
    if kind is PassKind.ROWS:
        read, write = torch.tensor([3, 0, 3, 6][:N], **as_long), torch.full((N,), -1, **as_long)
        prefix = torch.tensor([300, 5, 1100, 64][:N], **as_long)
    else:
        write = torch.tensor([1, 2, 4][:N], **as_long)
        prefix = torch.tensor(starts or [0] * N, **as_long)
        read = torch.where(prefix > 0, write, -1)  # a continuing chunk reads its own slot
    # the key's class on both: the same configs and attention mode
    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=prefix,
                    block_table=table[read.clamp(min=0) if kind is PassKind.ROWS else write],
                    shape_class=key.shape_class)
    ops = TritonOps()
    sp = StaticPass(key, table.shape[1], 16, "cuda")
    if kind is PassKind.ROWS:
        zeros = torch.zeros(sum(lens), **as_long)
        sp.fill_rows(zeros, cu, read, prefix, zeros, torch.zeros(0, **as_long), table)
    else:
        sp.fill_state([[0] * m for m in lens], write.tolist(), table, starts)
    ops.pin(sp.meta, sp.indices())
    with setup["tuner"].use(key.shape_class):  # one class: the same configs for both
        out_a = run_ops(ops, real, meta, pools_a, weight)
        out_b = run_ops(ops, padded, sp.meta, pools_b, weight)
    for name, a, b in zip(("conv", "delta rule", "attention"), out_a, out_b):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a, b[dst]), f"{name}: padded differs, max {(a.float() - b[dst].float()).abs().max()}"
    for a, b in zip(pools_a.tensors(), pools_b.tensors()):
        assert torch.equal(a, b), "padding changed a stored state"


# ---- whole passes ------------------------------------------------------------------------------

# Each triple shares one row key: T tokens in all (7 fewer with each seed, still in T's step) and
# row counts whose chunk lists round up to one size (rows of at most 32 tokens: one chunk each).
@pytest.mark.parametrize("tokens,row_counts,key", [
    (256, (9, 11, 10), GraphKey(PassKind.ROWS, 256, 12)),  # rows_few
    (512, (17, 23, 20), GraphKey(PassKind.ROWS, 512, 24)),  # rows_mid
    (2560, (95, 90, 93), GraphKey(PassKind.ROWS, 2560, 96)),  # rows_wide
], ids=["rows_few", "rows_mid", "rows_wide"])
def test_row_graph_replays_equal_eager_bitwise(setup, tokens, row_counts, key):
    runner, bank = setup["runner"], setup["bank"]
    graphed = runner.with_graphs(GraphCache(rows=ROWS, policy=CapturePolicy.ON_FIRST_USE))
    eager = runner.with_graphs(GraphCache(rows=ROWS))  # the same keys, never captured: eager, padded
    before = [t.clone() for t in bank.pools.tensors()]
    report = []
    for seed, n_rows in enumerate(row_counts):  # new rows, slots, prefix lengths, row lengths and count: one graph
        batch = make_batch(setup, n_rows, 100 * row_counts[0] + seed, total=tokens - 7 * seed)
        assert graphed.graphs.row_key(batch) == key
        a, b = graphed.row_pass(batch), eager.row_pass(batch)
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a, b), f"replay != eager, max {(a.float() - b.float()).abs().max()}"
        plain = runner.row_pass(batch)
        report.append((torch.equal(a, plain), rel_err(plain, a)))
        assert rel_err(plain, a) <= 2e-2
    assert graphed.graphs.graphs() == [key]
    assert graphed.graphs.stats.captures == 1 and graphed.graphs.stats.replays == 3
    assert eager.graphs.stats.eager_bucketed == 3 and eager.graphs.graphs() == []
    print(f"rows={row_counts}: padded key vs unpadded Passes.row_pass (bitwise, rel err):", report)
    for b, a in zip(before, bank.pools.tensors()):
        assert torch.equal(b, a), "a graphed row pass changed the bank"


@pytest.mark.parametrize("n_rows,row_len", [(8, 32), (64, 64)], ids=str)
def test_exact_fit_equals_runner_bitwise(setup, n_rows, row_len):
    """Rows whose tokens fill a key (T of the ladder, no padding tokens) and every token picked (a
    row key's picks are T: the last layer's projection, run on the picks, sees the same M in the
    graph as in the unpadded pass): the replay equals the unpadded pass bit for bit, the key's
    empty sequences and no-op chunks notwithstanding."""
    runner = setup["runner"]
    graphed = runner.with_graphs(GraphCache(rows=ROWS, policy=CapturePolicy.ON_FIRST_USE))
    g = torch.Generator().manual_seed(n_rows)
    rows = [torch.randint(0, 300, (row_len,), generator=g).tolist() for _ in range(n_rows)]
    owners = [i % len(DOC_LENS) for i in range(n_rows)]
    batch = RowBatch.build(rows, [setup["handles"][o] for o in owners], [DOC_LENS[o] for o in owners],
                           [list(range(row_len))] * n_rows, device="cuda")
    key = graphed.graphs.row_key(batch)
    assert key.tokens == key.picks == n_rows * row_len == batch.picks.shape[0], key
    a = graphed.row_pass(batch)
    assert graphed.graphs.stats.replays == 1 and graphed.graphs.stats.padding_tokens == 0
    assert torch.equal(a, runner.row_pass(batch))


def slot_states(bank, handle, n_tokens):
    pages = bank.block_table[handle.slot, : -(-n_tokens // 64)].long()
    return ([p[handle.slot] for p in bank.pools.recurrent] + [p[handle.slot] for p in bank.pools.conv]
            + [p[pages].flatten(0, 1)[:n_tokens] for p in bank.pools.keys + bank.pools.values])


@pytest.mark.parametrize("lens,chunk_tokens,passes", [([48], 8192, 1), ([1100, 700], 8192, 1), ([1100, 700], 512, 3)],
                         ids=["short", "long", "in-chunks"])
def test_graphed_state_pass_stores_what_eager_stores(setup, lens, chunk_tokens, passes):
    """New documents in one key, or long ones chunk by chunk (512 + 512, then 512 + 188 continuing
    their slots, then 76), each chunk pass in its own key."""
    runner, bank = setup["runner"], setup["bank"]
    base = Passes(runner.model, bank, runner.ops, state_chunk_tokens=chunk_tokens, tuner=runner.tuner)
    g = torch.Generator().manual_seed(sum(lens))
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    graphed = base.with_graphs(GraphCache(states=STATES, policy=CapturePolicy.ON_FIRST_USE))
    eager = base.with_graphs(GraphCache(states=STATES))  # the same keys, never captured
    assert graphed.state_keyed(lens)
    results = []
    for p in (graphed, eager, base):
        handles = [bank.alloc(n) for n in lens]
        p.state_pass(docs, handles)
        results.append([s.clone() for h, n in zip(handles, lens) for s in slot_states(bank, h, n)])
        for h in handles:
            bank.free(h)
    assert graphed.graphs.stats.captures == passes and graphed.graphs.stats.replays == passes
    assert eager.graphs.stats.eager_bucketed == passes and graphed.graphs.stats.state_tokens == sum(lens)
    for a, b, c in zip(*results):
        assert torch.equal(a, b), "graphed state pass != eager keyed pass"
        assert rel_err(c, a) <= 2e-2
    print(f"state pass {lens} in chunks of {chunk_tokens}: keyed == Passes.state_pass bitwise:",
          all(torch.equal(a, c) for a, _, c in zip(*results)))


def sweep(setup, passes, docs, rows, owners):
    """`passes.state_and_row_pass` of new `docs` (fresh slots, freed after) and `rows`; row n reads
    document owners[n]: the sweep's documents first, then the stored DOC_LENS ones. Returns
    (hidden states, the new documents' stored states)."""
    bank, doc_lens = setup["bank"], [len(d) for d in docs]
    handles = [bank.alloc(n) for n in doc_lens]
    every, every_len = handles + setup["handles"], doc_lens + list(DOC_LENS)
    batch = RowBatch.build(rows, [every[o] for o in owners], [every_len[o] for o in owners],
                           [[len(r) - 1] for r in rows], device="cuda")
    hidden = passes.sweep(docs, handles, batch)
    states = [s.clone() for h, n in zip(handles, doc_lens) for s in slot_states(bank, h, n)]
    for h in handles:
        bank.free(h)
    return hidden, states


@pytest.mark.parametrize("doc_lens,n_rows,row_tokens", [((48,), 6, 128), ((700, 30), 20, 512)], ids=str)
def test_sweep_graph_replays_equal_eager_bitwise(setup, doc_lens, n_rows, row_tokens):
    """One sweep (new documents, then rows over them and over stored documents) in a SweepKey:
    replays with new documents, slots and rows equal eager runs of the same key bit for bit, hidden
    states and stored states; the unpadded sweep agrees to bf16 (other GEMM row counts)."""
    runner = setup["runner"]
    graphed = runner.with_graphs(GraphCache(rows=ROWS, states=STATES, policy=CapturePolicy.ON_FIRST_USE))
    eager = runner.with_graphs(GraphCache(rows=ROWS, states=STATES))  # the same keys, never captured
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in doc_lens]
        lens = row_lens(n_rows, g, total=row_tokens)  # the same row key every time
        rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
        owners = torch.randint(0, len(docs) + len(DOC_LENS), (n_rows,), generator=g).tolist()
        owners[0] = 0  # at least one row over a document of this sweep
        (a, states_a), (b, states_b), (c, states_c) = (sweep(setup, passes, docs, rows, owners)
                                                        for passes in (graphed, eager, runner))
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a, b), f"sweep replay != eager, max {(a.float() - b.float()).abs().max()}"
        assert rel_err(c, a) <= 2e-2
        for sa, sb, sc in zip(states_a, states_b, states_c):
            assert torch.equal(sa, sb), "sweep replay stored other states than the eager key"
            assert rel_err(sc, sa) <= 2e-2
    (key,) = graphed.graphs.graphs()
    assert isinstance(key, SweepKey) and key.state == STATES.key_for(doc_lens) and key.rows.tokens == row_tokens
    assert graphed.graphs.stats.captures == 1 and graphed.graphs.stats.replays == 3
    assert eager.graphs.stats.eager_bucketed == 3


def test_sweep_indexed_equals_gathered_bitwise(setup):
    """One sweep through the indexed ops and through the gathered ones (the same tuner, so the same
    configs): hidden states and stored states equal bit for bit. The joined delta rule's rows start
    from their new document's state, which the gathered variant copies after the documents' scan."""
    from kev.ops.gathered_ops import GatheredOps

    runner = setup["runner"]
    gathered = Passes(runner.model, setup["bank"], GatheredOps(), tuner=setup["tuner"])
    g = torch.Generator().manual_seed(11)
    doc_lens = (700, 30)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in doc_lens]
    lens = torch.randint(1, 33, (9,), generator=g).tolist()
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    owners = [0, 1, 2, 0, 3, 1, 0, 2, 1]  # the sweep's two documents and two stored ones
    (a, states_a), (b, states_b) = (sweep(setup, passes, docs, rows, owners) for passes in (runner, gathered))
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b), f"indexed != gathered, max {(a.float() - b.float()).abs().max()}"
    assert all(torch.equal(x, y) for x, y in zip(states_a, states_b)), "the two stored other states"


def test_every_launched_autotuner_is_class_cached(setup, monkeypatch):
    runner, hot = setup["runner"], setup["tuner"].autotuners
    launched = set()
    original = Autotuner.run

    def run(self, *args, **kwargs):
        launched.add(id(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Autotuner, "run", run)
    runner.row_pass(make_batch(setup, 5, 7))  # rows_few: split-mode attention
    # rows_mid (400 row tokens): the one-program attention. This model's only attention layer is
    # its last, where a state pass only stores its K/V (no attention kernel runs there).
    runner.row_pass(make_batch(setup, 17, 8, total=400))
    h = setup["bank"].alloc(300)
    runner.state_pass([[1] * 300], [h])  # docs_few
    setup["bank"].free(h)
    torch.cuda.synchronize()
    names = {id(at): name for name, at in hot.items()}
    assert launched <= set(names), "a pass launched an autotuner the class caches do not cover"
    assert {names[i] for i in launched} == set(hot), "a hot autotuner never ran"


def test_capture_after_warm_up_never_autotunes(setup, monkeypatch):
    tuner = setup["tuner"]
    # every hot kernel a class launches has a config there
    assert all(len(tuner.caches(cls)[name]) for cls in WARM for name in class_launches(cls, tuner.autotuners))
    sizes = {cls: [len(c) for c in tuner.caches(cls).values()] for cls in WARM}

    def no_bench(self, *args, **kwargs):
        raise AssertionError(f"{self.base_fn.__name__} autotuned after warm-up")

    monkeypatch.setattr(Autotuner, "_bench", no_bench)
    graphed = setup["runner"].with_graphs(GraphCache(rows=ROWS, states=STATES))
    batches = [make_batch(setup, 6, 1, total=150), make_batch(setup, 24, 2, total=700),
               make_batch(setup, 90, 3, row_len=64, total=4000)]
    keys = [graphed.graphs.row_key(b) for b in batches] + [graphed.graphs.state_key([2200])]
    assert [k.shape_class for k in keys] == list(WARM)  # one key of every warmed class
    order = [k for k in graphed.graphs.all_keys() if k in keys]  # start-up's capture order: largest first
    graphed.graphs.capture(graphed, order)
    assert graphed.graphs.graphs() == order and order[0] == keys[2]
    assert {cls: [len(c) for c in tuner.caches(cls).values()] for cls in WARM} == sizes
    for b in batches:
        assert torch.isfinite(graphed.row_pass(b).float()).all()
    assert graphed.graphs.stats.replays == 3 and graphed.graphs.stats.eager == 0
