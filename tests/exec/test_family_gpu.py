"""Every Kev size's heads through the served passes on CUDA (issue 28; H200, skipped on CPU).

The sizes differ, for the kernels, in their heads: Kev-0.8B has 8 / 2 attention heads and one
value head per key head, Kev-4B and Kev-9B 16 / 4 and two, Kev-27B 24 / 4 (six query heads a
group) and three. Each runs here at a small width (512, 4 layers, random bf16 weights, fused
projections) with its own heads, as the services build it: the bank's builder warms its classes
and captures every state key, a scorer's builder every row key, small caps. Then
- the bank's graphed state passes store close to what the eager passes store;
- a served row pass replays its graph and equals, bit for bit, the gathered scorer's served row
  pass over the same bank (the load test's identity, at each size's heads), and is close to the
  eager pass;
- the decision head inside the row graphs (`Passes.row_probabilities`) gives the gathered
  scorer's probabilities bit for bit, close to the eager head over the eager pass;
- nothing ran eagerly within the caps.
"""

import pytest
import torch

from bench.common import KEV_MODELS
from kernel_support import fast_hot_autotuners, rel_err
from kev.bank.bank import Bank
from kev.exec.batch import RowBatch
from kev.exec.passes import PassBuilder, Passes
from kev.exec.plan import GraphPlan, PassRole
from kev.ops.gathered_ops import GatheredOps
from kev.ops.triton_ops import TritonOps
from kev.request.head import DecisionHead, pick_layout
from random_models import random_model, tiny_config

pytestmark = pytest.mark.gpu

HEADS = ("num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
         "linear_key_head_dim", "linear_value_head_dim")
# One size per head layout (Kev-9B's heads are Kev-4B's).
SIZES = ["kev-0.8b", "kev-4b", "kev-27b"]
DOC_LENS = (48, 150, 300)  # 498 tokens: one state key (512 tokens, 4 documents at most)
SCORER_PLAN = GraphPlan(row_tokens=128, row_seqs=8)  # few keys: 38 row keys, 52 state keys a size
BANK_PLAN = GraphPlan(state_tokens=512, state_seqs=4)


def heads_config(size: str):
    """`size`'s heads and head dims at a small width."""
    return tiny_config(hidden_size=512, intermediate_size=1024, **{k: KEV_MODELS[size][k] for k in HEADS})


@pytest.fixture(scope="module")
def fast_autotune():
    with fast_hot_autotuners():
        yield


@pytest.fixture(scope="module", params=SIZES)
def served(request, fast_autotune):
    cfg = heads_config(request.param)
    model = random_model(cfg, seed=2, dtype=torch.bfloat16).set_batch_invariant(0).cuda().fuse_projections()
    bank = Bank.allocate(cfg, num_slots=8, num_blocks=8 * 16, block_size=64, dtype=torch.bfloat16, device="cuda",
                         max_doc_tokens=512)
    bank_passes = PassBuilder(model, TritonOps(), PassRole.STATES, BANK_PLAN).build(bank)
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in DOC_LENS]
    handles = [bank.alloc(n) for n in DOC_LENS]
    bank_passes.state_pass(docs, handles)
    head = DecisionHead(*(torch.randn(shape, generator=g) * 0.05 for shape in ((256, cfg.hidden_size),) * 2),
                        torch.randn(256, generator=g), None, 0.9).to("cuda")
    kev = PassBuilder(model, TritonOps(), PassRole.ROWS, SCORER_PLAN, head=head, head_width=8).build(bank)
    # the gathered scorer's page buffer holds the longest document (KEV_GATHERED_MAX_PREFIX_TOKENS)
    gathered = PassBuilder(model, GatheredOps(max_prefix_tokens=max(DOC_LENS)), PassRole.ROWS, SCORER_PLAN,
                           head=head, head_width=8).build(bank)
    return dict(size=request.param, cfg=cfg, model=model, bank=bank, docs=docs, handles=handles,
                bank_passes=bank_passes, kev=kev, gathered=gathered, head=head)


def rows(served, n_rows, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 16, (n_rows,), generator=g).tolist()  # 8 rows within the 128-token cap
    toks = [torch.randint(0, served["cfg"].vocab_size, (n,), generator=g).tolist() for n in lens]
    owners = [i % len(DOC_LENS) for i in range(n_rows)]
    return RowBatch.build(toks, [served["handles"][o] for o in owners], [DOC_LENS[o] for o in owners],
                          [[n - 1, n // 2, 0] for n in lens], device="cuda")


def test_state_passes_store_what_eager_passes_store(served):
    bank, passes = served["bank"], served["bank_passes"]
    assert passes.graphs.stats.replays > 0 and passes.graphs.stats.eager == 0
    assert not passes.graphs.stats.capture_errors
    again = Bank.allocate(served["cfg"], num_slots=8, num_blocks=8 * 16, block_size=64, dtype=torch.bfloat16,
                          device="cuda", max_doc_tokens=512)
    handles = [again.alloc(n) for n in DOC_LENS]
    assert [h.slot for h in handles] == [h.slot for h in served["handles"]]
    Passes(served["model"], again, TritonOps()).state_pass(served["docs"], handles)
    torch.cuda.synchronize()
    for a, b in zip(bank.pools.tensors(), again.pools.tensors()):
        assert rel_err(b.float(), a.float()) <= 2e-2, served["size"]


@pytest.mark.parametrize("n_rows,seed", [(3, 1), (8, 2)])
def test_served_rows_equal_the_gathered_scorer_bitwise(served, n_rows, seed):
    kev, gathered = served["kev"], served["gathered"]
    batch = rows(served, n_rows, seed)
    replays = kev.graphs.stats.replays
    a = kev.row_pass(batch)
    b = gathered.row_pass(rows(served, n_rows, seed))
    torch.cuda.synchronize()
    assert kev.graphs.stats.replays == replays + 1 and kev.graphs.stats.eager == 0 and gathered.graphs.stats.eager == 0
    assert torch.isfinite(a.float()).all()
    assert torch.equal(a, b), f"{served['size']}: indexed != gathered, max {(a.float() - b.float()).abs().max()}"
    assert rel_err(kev.with_graphs(None).row_pass(rows(served, n_rows, seed)).float(), a.float()) <= 2e-2


@pytest.mark.parametrize("n_rows,seed", [(3, 3), (8, 4)])
def test_the_head_in_the_row_graph_equals_the_gathered_scorers(served, n_rows, seed):
    kev, gathered, head = served["kev"], served["gathered"], served["head"]
    counts = [2] * n_rows  # rows(): picks [decide, two option ends] each
    replays = kev.graphs.stats.replays
    a = kev.row_probabilities(rows(served, n_rows, seed), pick_layout(counts), 2).clone()
    b = gathered.row_probabilities(rows(served, n_rows, seed), pick_layout(counts), 2).clone()
    hidden = kev.with_graphs(None).row_pass(rows(served, n_rows, seed))
    torch.cuda.synchronize()
    assert kev.graphs.stats.replays == replays + 1 and kev.graphs.stats.eager == 0
    assert torch.equal(a, b), f"{served['size']}: indexed != gathered head, max {(a - b).abs().max()}"
    options = [3 * i + j for i in range(n_rows) for j in (1, 2)]
    want = head.probabilities(hidden[0::3], hidden[options], counts)
    assert (a[options] - want).abs().max() <= 2e-2, served["size"]  # bf16 passes of other shapes
    assert torch.allclose(a[options].view(-1, 2).sum(-1), torch.ones(n_rows, device="cuda"), atol=1e-5)
