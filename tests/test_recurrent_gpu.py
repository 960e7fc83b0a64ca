"""GPU checks of the one-launch recurrent delta rule (H200; skipped on CPU by the `gpu` marker).

- recurrent ~= chunked ~= the torch reference at Kev-4B's linear heads (H 16, HV 32, K = V = 128),
  bf16 packed q/k/v views, strided fp32 pool, -1 / repeated / read == write slots, -1 writes;
- every autotune config of the recurrent kernel gives bit-identical outputs and states;
- with recurrent on, indexed (`TritonOps`) == gathered (`GatheredOps`) bit for bit over rows;
- with recurrent on for rows_few, class warm-up then CUDA-graph capture of row buckets and of a
  STATE bucket whose sequence count (documents + padding) falls in another class never autotunes,
  and replays equal eager passes bit for bit;
- per-layer GPU time of chunked vs recurrent on the served short shapes (printed, not asserted).
"""


import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner

from kernel_support import fast_hot_autotuners, kev4b_heads_config, packed, rel_err, row_pass
from kev.bank.bank import Bank
from kev.graphs import Buckets, CapturePolicy, GraphedPasses
from kev.ops.autotune import ClassTuner, ShapeClass
from kev.ops.warm_up import warm_up
from kev.ops.delta_rule import indexed_recurrent
from kev.ops.delta_rule.indexed_scan import indexed_chunk_gated_delta_rule
from kev.ops.gathered_ops import GatheredOps
from kev.ops.meta import PassMeta
from kev.ops.torch_ops import TorchOps
from kev.ops.triton_ops import TritonOps
from kev.runner import RowBatch, Runner
from random_models import random_model
from test_kernels_gpu import SLOTS, make_rows, setup  # noqa: F401  (setup: the module fixture, reused)

pytestmark = pytest.mark.gpu

H, HV, K, V = 16, 32, 128, 128  # Kev-4B's linear heads
ROW_LENS = (1, 17, 32, 64)


def delta_inputs(seed=0, n=12, lens=ROW_LENS):
    g = torch.Generator().manual_seed(seed)
    lens = [lens[i % len(lens)] for i in range(n)]
    T, S = sum(lens), n + 3
    qkv = (torch.randn(T, 2 * H * K + HV * V, generator=g)).bfloat16().cuda()  # one packed buffer
    read = torch.randint(0, S - 2, (n,), generator=g)
    read[0], read[2] = -1, S - 2
    write = torch.full((n,), -1)
    write[1], write[2] = S - 1, S - 2  # one fresh slot, one read == write (a document continuing in place)
    base = torch.randn(2 * S + 1, HV, K + 1, V, generator=g) * 0.05
    return dict(
        q=qkv[:, :H * K].unflatten(1, (H, K)), k=qkv[:, H * K:2 * H * K].unflatten(1, (H, K)),
        v=qkv[:, 2 * H * K:].unflatten(1, (HV, V)), g=(-torch.rand(T, HV, generator=g)).cuda(),
        beta=torch.rand(T, HV, generator=g).bfloat16().cuda(), cu_seqlens=packed(lens, "cuda"),
        read_slots=read.cuda(), write_slots=write.cuda(), pool=base.cuda()[1::2, :, 1:])  # a strided pool view


def run(fn, x, **kw):
    pool = x["pool"].clone()
    args = {k: v for k, v in x.items() if k != "pool"}
    o = fn(**args, state_pool=pool, **kw)
    return o, pool


def test_recurrent_matches_chunked_and_reference():
    x = delta_inputs()
    o_rec, pool_rec = run(indexed_recurrent.indexed_recurrent_gated_delta_rule, x)
    o_chk, pool_chk = run(indexed_chunk_gated_delta_rule, x)
    meta = PassMeta(cu_seqlens=x["cu_seqlens"], read_slots=x["read_slots"], write_slots=x["write_slots"],
                    prefix_lens=torch.zeros_like(x["read_slots"]), block_table=torch.zeros(1, 1, dtype=torch.int32))
    ref_pool = x["pool"].clone()
    o_ref = TorchOps().gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], meta, ref_pool)
    written = x["write_slots"][x["write_slots"] >= 0]
    report = {"o rec/chunk": rel_err(o_chk, o_rec), "o rec/ref": rel_err(o_ref, o_rec),
              "o chunk/ref": rel_err(o_ref, o_chk), "state rec/chunk": rel_err(pool_chk[written], pool_rec[written]),
              "state rec/ref": rel_err(ref_pool[written], pool_rec[written]),
              "state chunk/ref": rel_err(ref_pool[written], pool_chk[written])}
    print("recurrent vs chunked vs torch (rel err):", report)
    assert torch.isfinite(o_rec.float()).all() and o_rec.dtype == x["v"].dtype
    assert report["o rec/chunk"] <= 2e-2 and report["state rec/chunk"] <= 2e-2
    assert report["o rec/ref"] <= 1e-2 and report["state rec/ref"] <= 5e-3
    untouched = torch.ones(x["pool"].shape[0], dtype=torch.bool, device="cuda")
    untouched[written] = False
    assert torch.equal(pool_rec[untouched], x["pool"][untouched]), "a slot without a write changed"


def test_recurrent_candidates_rounding():
    """Reports which timing candidates round like the served config (they are not served: see
    RECURRENT_CONFIGS); the served config equals itself over repeated runs."""
    x = delta_inputs(seed=1)
    served = indexed_recurrent.RECURRENT_CONFIGS[0]
    first = run(indexed_recurrent.indexed_recurrent_gated_delta_rule, x, config=served)
    again = run(indexed_recurrent.indexed_recurrent_gated_delta_rule, x, config=served)
    assert all(torch.equal(a, b) for a, b in zip(first, again)), "the served config is deterministic"
    for cfg in indexed_recurrent.RECURRENT_CANDIDATES[1:]:
        out = run(indexed_recurrent.indexed_recurrent_gated_delta_rule, x, config=cfg)
        same = all(torch.equal(a, b) for a, b in zip(first, out))
        print(f"{cfg}: {'same bits' if same else 'differs'} as {served}")


ALL = frozenset(ShapeClass)


@pytest.mark.parametrize("n_rows", [1, 3, 8, 17, 96], ids=lambda n: f"rows={n}")
def test_indexed_equals_gathered_bitwise_recurrent(setup, n_rows):  # noqa: F811
    model, pools, table, doc_lens = setup["model"], setup["banks"]["triton"], setup["table"], setup["doc_lens"]
    before = [t.clone() for t in pools.tensors()]
    indexed, gathered = TritonOps(recurrent_classes=ALL), GatheredOps(recurrent_classes=ALL)
    for seed in (n_rows, 1000 + n_rows):
        rows, read = make_rows(n_rows, seed)
        a = row_pass(model, indexed, pools, table, rows, read, doc_lens)
        b = row_pass(model, gathered, pools, table, rows, read, doc_lens)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"indexed != gathered, max diff {(a.float() - b.float()).abs().max().item()}"
        c = row_pass(model, TritonOps(), pools, table, rows, read, doc_lens)  # chunked
        assert rel_err(c, a) <= 5e-2, "recurrent row pass far from the chunked one"
    for b, a in zip(before, pools.tensors()):
        assert torch.equal(b, a), "a row pass changed the bank"


@pytest.fixture(scope="module")
def graphed_setup():
    """Class-tuned runner with recurrent on for rows_few only (rows_mid warmed chunked); its own
    autotuner caches."""
    with fast_hot_autotuners() as hot:
        cfg = kev4b_heads_config()
        model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda()
        bank = Bank.allocate(cfg, num_slots=24, num_blocks=24 * 36, block_size=64, dtype=torch.bfloat16,
                             device="cuda", max_doc_tokens=2304)
        ops = TritonOps(recurrent_classes={"rows_few"})
        runner = Runner(model, bank, ops, tuner=ClassTuner(hot))
        g = torch.Generator().manual_seed(0)
        handle = bank.alloc(300)
        runner.state_pass([torch.randint(0, 300, (300,), generator=g).tolist()], [handle])
        warm_up(runner, [ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE],
                row_slot=handle.slot, row_prefix=300)
        yield dict(runner=runner, bank=bank, handle=handle)


def test_graphs_with_recurrent_never_autotune_and_replay_bitwise(graphed_setup, monkeypatch):
    runner, bank, handle = graphed_setup["runner"], graphed_setup["bank"], graphed_setup["handle"]

    def no_bench(self, *args, **kwargs):
        raise AssertionError(f"{self.base_fn.__name__} autotuned after warm-up")

    monkeypatch.setattr(Autotuner, "_bench", no_bench)
    graphed = GraphedPasses(runner, Buckets(), policy=CapturePolicy.ON_FIRST_USE)
    eager = GraphedPasses(runner, Buckets(), policy=CapturePolicy.WARMUP_ONLY)
    g = torch.Generator().manual_seed(1)
    # 8 documents of <= 64 tokens: a STATE bucket of 16 sequences (documents + padding ones), class
    # rows_few although classify(16, 512) is rows_mid: it must run recurrent, the path warmed there
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (48, 64, 5, 33, 64, 17, 1, 60)]
    key = graphed.state_bucket(len(docs), 64)
    assert key is not None and key.shape_class is ShapeClass.ROWS_FEW
    states = []
    for passes in (graphed, eager):
        handles = [bank.alloc(len(d)) for d in docs]
        passes.state_pass(docs, handles)
        states.append([p[h.slot].clone() for h in handles for p in bank.pools.recurrent])
        for h in handles:
            bank.free(h)
    assert all(torch.equal(a, b) for a, b in zip(*states)), "graphed state pass != eager bucketed pass"
    for n_rows in (6, 20):  # rows_few: recurrent; rows_mid: chunked
        rows = [torch.randint(0, 300, (32,), generator=g).tolist() for _ in range(n_rows)]
        batch = RowBatch.build(rows, [handle] * n_rows, [300] * n_rows, [[31]] * n_rows, device="cuda")
        a, b = graphed.row_pass(batch), eager.row_pass(batch)
        assert torch.equal(a, b), f"{n_rows} rows: replay != eager"
    assert graphed.stats.captures == 3


def test_time_chunked_vs_recurrent():
    """GPU time of one layer's delta rule on the served short shapes (printed for the results README)."""
    report = {}
    for n, L in ((1, 16), (1, 48), (6, 32), (5, 32), (16, 64), (96, 32)):
        x = delta_inputs(seed=n, n=n, lens=(L,))
        x["write_slots"] = torch.full_like(x["write_slots"], -1)
        x["read_slots"] = torch.full_like(x["read_slots"], 1)
        args = {k: v for k, v in x.items() if k != "pool"}
        pool = x["pool"]
        times = {}
        for name, fn in (("chunked", indexed_chunk_gated_delta_rule),
                         ("recurrent", indexed_recurrent.indexed_recurrent_gated_delta_rule)):
            fn(**args, state_pool=pool)  # tune (default cache) and compile
            times[name] = triton.testing.do_bench(lambda fn=fn, args=args, pool=pool: fn(**args, state_pool=pool),
                                                  warmup=10, rep=50, return_mode="median") * 1e3
        report[f"{n}x{L}"] = {k: round(v, 1) for k, v in times.items()}
    print("delta rule per layer, us (chunked / recurrent), kernels + launches, median:", report)
