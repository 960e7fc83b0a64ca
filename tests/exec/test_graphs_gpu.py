"""CUDA graphs and shape-class autotune on the GPU (H200; skipped on CPU by the `gpu` marker).

A small model (width 512, 4 layers) with Kev-4B's heads (H 16, HV 32, K = V = 128; Hq 16, Hkv 4,
head_dim 256), random bf16 weights, documents of 5..1,100 tokens in the bank, every class warmed first.
- the token-mixing kernels give bit-identical real outputs and stored states when a pass is padded
  into a bucket (rows padded at their end; documents followed by padding sequences, with empty
  sequences and no-op chunks);
- graph replays equal eager runs of the same bucket bit for bit, with new rows, slots, prefix
  lengths and row lengths between replays; an exactly fitting batch equals `Passes.row_pass` bit
  for bit; padded batches are reported against it (other GEMM row counts);
- graphed short state passes store what the eager pass stores;
- every autotuner a pass launches is a hot (class-cached) one; capture after warm-up never tunes.
Autotuning here benchmarks with short reps (the configs only have to be consistent, not best).
"""


import pytest
import torch
from triton.runtime.autotuner import Autotuner

from kernel_support import class_launches, fast_hot_autotuners, kev4b_heads_config, make_pools, packed, rel_err
from kev.bank.bank import Bank
from kev.exec.graphs import Buckets, CapturePolicy, GraphCache, largest_first
from kev.ops.shapes import ShapeClass
from kev.ops.autotune import ClassTuner, graph_bench
from kev.exec.warm_up import warm_up
from kev.ops.meta import PassMeta
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.exec.static_pass import GraphKey, PassKind, StaticPass
from random_models import random_model

pytestmark = pytest.mark.gpu

DOC_LENS = (5, 64, 129, 300, 1100)
WARM = (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_FEW)


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


def make_batch(setup, n_rows, seed, row_len=32):
    """Rows of 1..row_len tokens (one of exactly row_len: a fixed bucket) over random documents,
    one pick per row (its last token)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, row_len + 1, (n_rows,), generator=g).tolist()
    lens[int(torch.randint(0, n_rows, (1,), generator=g))] = row_len
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
    o = ops.gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], meta, pools.recurrent[0])
    a = ops.attention(inp["aq"], inp["ak"], inp["av"], meta, pools.keys[0], pools.values[0])
    return conv, o, a


@pytest.mark.parametrize("kind,lens,L,cap", [
    (PassKind.ROWS, [1, 17, 33, 64], 64, 6), (PassKind.ROWS, [65, 100, 3], 128, 4),
    (PassKind.STATE, [48, 30], 64, 4), (PassKind.STATE, [1100, 64, 700], 1536, 4),
], ids=["rows-1chunk", "rows-2chunks", "state-short", "state-long"])
def test_padding_is_exact_in_the_token_mixing_kernels(setup, kind, lens, L, cap):
    cfg = setup["cfg"]
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    C, Hq, Hkv, D = cfg.conv_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator().manual_seed(len(lens) * L)
    N, key = len(lens), GraphKey(kind, cap, L, 8)
    real = layer_inputs(sum(lens), C, H, HV, K, V, Hq, Hkv, D, g)
    padded = layer_inputs(key.num_tokens, C, H, HV, K, V, Hq, Hkv, D, g)  # random padding everywhere
    dst = torch.tensor([n * L + t for n, m in enumerate(lens) for t in range(m)], device="cuda")
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
        read, write, prefix = torch.full((N,), -1, **as_long), torch.tensor([1, 2, 4][:N], **as_long), \
            torch.zeros(N, **as_long)
    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=prefix,
                    block_table=table[read.clamp(min=0) if kind is PassKind.ROWS else write])
    ops = TritonOps()
    sp = StaticPass(key, table.shape[1], 16, "cuda")
    if kind is PassKind.ROWS:
        zeros = torch.zeros(sum(lens), **as_long)
        sp.fill_rows(zeros, cu, read, prefix, zeros, torch.zeros(0, **as_long), table)
    else:
        sp.fill_state([[0] * m for m in lens], write.tolist(), table)
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

# Each triple shares one row bucket (counts 1-8 are buckets of their own: 9, 12, 10 all pad to 12).
@pytest.mark.parametrize("row_counts", [(9, 12, 10), (17, 23, 20), (96, 90, 93)], ids=lambda r: f"rows={r[0]}")
def test_row_graph_replays_equal_eager_bitwise(setup, row_counts):
    runner, bank = setup["runner"], setup["bank"]
    graphed = runner.with_graphs(GraphCache(policy=CapturePolicy.ON_FIRST_USE))
    eager = runner.with_graphs(GraphCache(policy=CapturePolicy.WARMUP_ONLY))  # the same buckets, never captured
    before = [t.clone() for t in bank.pools.tensors()]
    report = []
    for seed, n_rows in enumerate(row_counts):  # new rows, slots, prefix lengths, row lengths and count: one graph
        batch = make_batch(setup, n_rows, 100 * row_counts[0] + seed)
        a, b = graphed.row_pass(batch), eager.row_pass(batch)
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a, b), f"replay != eager, max {(a.float() - b.float()).abs().max()}"
        plain = runner.row_pass(batch)
        report.append((torch.equal(a, plain), rel_err(plain, a)))
        assert rel_err(plain, a) <= 2e-2
    assert graphed.graphs.stats.captures == 1 and graphed.graphs.stats.replays == 3 and eager.graphs.stats.eager_bucketed == 3
    print(f"rows={row_counts}: padded bucket vs unpadded Passes.row_pass (bitwise, rel err):", report)
    for b, a in zip(before, bank.pools.tensors()):
        assert torch.equal(b, a), "a graphed row pass changed the bank"


@pytest.mark.parametrize("n_rows,row_len", [(8, 32), (64, 64)], ids=str)
def test_exact_fit_equals_runner_bitwise(setup, n_rows, row_len):
    # 8 picks a row: 64 and 512 picks are picks buckets above the PICKS_PER_ROW floor, so the last
    # layer's projection (run on the picks) sees the same M in the graph as in the unpadded pass.
    runner = setup["runner"]
    graphed = runner.with_graphs(GraphCache(policy=CapturePolicy.ON_FIRST_USE))
    g = torch.Generator().manual_seed(n_rows)
    rows = [torch.randint(0, 300, (row_len,), generator=g).tolist() for _ in range(n_rows)]
    owners = [i % len(DOC_LENS) for i in range(n_rows)]
    batch = RowBatch.build(rows, [setup["handles"][o] for o in owners], [DOC_LENS[o] for o in owners],
                           [[row_len - 1, *range(3, 17, 2)]] * n_rows, device="cuda")
    key = graphed.graphs.buckets.row_key(n_rows, row_len, batch.picks.shape[0])
    assert (key.seqs, key.seq_len, key.picks) == (n_rows, row_len, batch.picks.shape[0]), key
    a = graphed.row_pass(batch)
    assert graphed.graphs.stats.replays == 1
    assert torch.equal(a, runner.row_pass(batch))


def slot_states(bank, handle, n_tokens):
    pages = bank.block_table[handle.slot, : -(-n_tokens // 64)].long()
    return ([p[handle.slot] for p in bank.pools.recurrent] + [p[handle.slot] for p in bank.pools.conv]
            + [p[pages].flatten(0, 1)[:n_tokens] for p in bank.pools.keys + bank.pools.values])


@pytest.mark.parametrize("lens", [[48], [1100, 700]], ids=str)
def test_graphed_state_pass_stores_what_eager_stores(setup, lens):
    runner, bank = setup["runner"], setup["bank"]
    g = torch.Generator().manual_seed(sum(lens))
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
    graphed = runner.with_graphs(GraphCache(Buckets(), policy=CapturePolicy.ON_FIRST_USE))
    eager = runner.with_graphs(GraphCache(Buckets(), policy=CapturePolicy.WARMUP_ONLY))
    results = []
    for passes in (graphed, eager, None):
        handles = [bank.alloc(n) for n in lens]
        (passes or runner).state_pass(docs, handles)
        results.append([s.clone() for h, n in zip(handles, lens) for s in slot_states(bank, h, n)])
        for h in handles:
            bank.free(h)
    assert graphed.graphs.stats.captures == 1 and graphed.graphs.stats.replays == 1
    for a, b, c in zip(*results):
        assert torch.equal(a, b), "graphed state pass != eager bucketed pass"
        assert rel_err(c, a) <= 2e-2
    print(f"state pass {lens}: bucketed == Passes.state_pass bitwise:",
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


@pytest.mark.parametrize("doc_lens,n_rows", [((48,), 6), ((700, 30), 20)], ids=str)
def test_sweep_graph_replays_equal_eager_bitwise(setup, doc_lens, n_rows):
    """One sweep (new documents, then rows over them and over stored documents) in a SweepKey
    bucket: replays with new documents, slots and rows equal eager runs of the same bucket bit for
    bit, hidden states and stored states; the unpadded sweep agrees to bf16 (other GEMM row counts)."""
    runner = setup["runner"]
    graphed = runner.with_graphs(GraphCache(policy=CapturePolicy.ON_FIRST_USE))
    eager = runner.with_graphs(GraphCache(policy=CapturePolicy.WARMUP_ONLY))  # the same buckets, never captured
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in doc_lens]
        lens = torch.randint(1, 33, (n_rows,), generator=g).tolist()
        rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
        owners = torch.randint(0, len(docs) + len(DOC_LENS), (n_rows,), generator=g).tolist()
        owners[0] = 0  # at least one row over a document of this sweep
        (a, states_a), (b, states_b), (c, states_c) = (sweep(setup, passes, docs, rows, owners)
                                                        for passes in (graphed, eager, runner))
        assert torch.isfinite(a.float()).all()
        assert torch.equal(a, b), f"sweep replay != eager, max {(a.float() - b.float()).abs().max()}"
        assert rel_err(c, a) <= 2e-2
        for sa, sb, sc in zip(states_a, states_b, states_c):
            assert torch.equal(sa, sb), "sweep replay stored other states than the eager bucket"
            assert rel_err(sc, sa) <= 2e-2
    assert graphed.graphs.stats.captures == 1 and graphed.graphs.stats.replays == 3 and eager.graphs.stats.eager_bucketed == 3


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
    # rows_mid: the one-program attention. This model's only attention layer is its last, where
    # a state pass only stores its K/V (no attention kernel runs there).
    runner.row_pass(make_batch(setup, 17, 8))
    h = setup["bank"].alloc(200)
    runner.state_pass([[1] * 200], [h])
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
    graphed = setup["runner"].with_graphs(GraphCache(policy=CapturePolicy.WARMUP_ONLY))
    buckets = Buckets()
    keys = [buckets.row_key(6, 32, 1), buckets.row_key(24, 48, 1), buckets.row_key(96, 64, 1),
            GraphKey(PassKind.STATE, 1, 2304)]
    graphed.graphs.capture(graphed, keys)
    assert graphed.graphs.graphs() == largest_first(keys)  # captured most rows first
    assert {cls: [len(c) for c in tuner.caches(cls).values()] for cls in WARM} == sizes
    out = graphed.row_pass(make_batch(setup, 90, 3, row_len=64))
    assert graphed.graphs.stats.replays == 1 and torch.isfinite(out.float()).all()
