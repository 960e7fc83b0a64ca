"""Row passes from stored states equal one forward over document + row, and never change the bank."""

import pytest
import torch

from kev.bank.bank import Bank
from kev.ops import PassMeta, get_ops
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from random_models import random_model, tiny_config
from kernel_support import rel_err


def full_forward(model, tokens):
    """Reference: one sequence from scratch, nothing stored."""
    T = len(tokens)
    bank = Bank.allocate(model.cfg, 1, -(-T // 16), block_size=16)
    meta = PassMeta(cu_seqlens=torch.tensor([0, T]), read_slots=torch.tensor([-1]), write_slots=torch.tensor([-1]),
                    prefix_lens=torch.tensor([0]), block_table=torch.arange(-(-T // 16), dtype=torch.int32)[None])
    with torch.no_grad():
        return model(torch.tensor(tokens), meta, bank.pools, get_ops("torch"))


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda r: f"hv_per_h={r}")
def model(request):
    # HV/H changes the head grouping inside the delta rule: one representative per ratio.
    return random_model(tiny_config(hv_per_h=request.param), seed=request.param)


def make_runner(model, chunk=8192):
    bank = Bank.allocate(model.cfg, num_slots=8, num_blocks=64, block_size=16)
    return Passes(model, bank, get_ops("torch"), state_chunk_tokens=chunk)


@pytest.mark.parametrize("doc_len,row_lens", [(1, [1, 5]), (63, [64, 3]), (65, [129, 1]), (300, [200, 17])],
                         ids=lambda v: str(v))
def test_row_pass_equals_full_forward(model, doc_len, row_lens):
    g = torch.Generator().manual_seed(doc_len)
    doc = torch.randint(0, 300, (doc_len,), generator=g).tolist()
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in row_lens]
    runner = make_runner(model)
    h = runner.bank.alloc(len(doc))
    runner.state_pass([doc], [h])
    before = [t.clone() for t in runner.bank.pools.tensors()]
    picks = [list(range(len(r))) for r in rows]
    out = runner.row_pass(RowBatch.build(rows, [h] * len(rows), [doc_len] * len(rows), picks))
    start = 0
    for r in rows:
        ref = full_forward(model, doc + r)[doc_len:]
        assert rel_err(ref, out[start:start + len(r)]) <= 1e-5
        start += len(r)
    for b, a in zip(before, runner.bank.pools.tensors()):
        assert torch.equal(b, a), "a row pass changed the bank"


def test_chunked_state_pass_equals_one_pass(model):
    """Long documents go through in chunks carrying the state in the slot: same states as one pass."""
    doc = torch.randint(0, 300, (250,), generator=torch.Generator().manual_seed(7)).tolist()
    one, chunked = make_runner(model), make_runner(model, chunk=64)
    h1, h2 = one.bank.alloc(len(doc)), chunked.bank.alloc(len(doc))
    one.state_pass([doc], [h1])
    chunked.state_pass([doc], [h2])
    for a, b in zip(one.bank.pools.tensors(), chunked.bank.pools.tensors()):
        assert rel_err(a, b) <= 1e-5 if a.abs().sum() > 0 else torch.equal(a, b)


def test_batch_invariance_bitwise(model):
    """A row's hidden states do not depend on what else shares its pass (CPU, bit for bit)."""
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 130, 7)]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (12, 30, 5, 70)]
    owner = [0, 1, 1, 2]
    runner = make_runner(model)
    hs = [runner.bank.alloc(len(d)) for d in docs]
    runner.state_pass(docs, hs)
    picks = [[len(r) - 1, 0] for r in rows]
    together = runner.row_pass(RowBatch.build(rows, [hs[o] for o in owner], [len(docs[o]) for o in owner], picks))
    for i, r in enumerate(rows):
        alone = runner.row_pass(RowBatch.build([r], [hs[owner[i]]], [len(docs[owner[i]])], [picks[i]]))
        assert torch.equal(alone, together[2 * i : 2 * i + 2])
    # states written in a batch equal states written alone
    solo = make_runner(model)
    h = solo.bank.alloc(len(docs[1]))
    solo.state_pass([docs[1]], [h])
    assert torch.equal(solo.bank.pools.recurrent[0][h.slot], runner.bank.pools.recurrent[0][hs[1].slot])


@pytest.mark.slow
def test_65536_token_document_in_chunks():
    """The longest allowed document goes through in slot-carried chunks; rows then read it."""
    # Two layers and one attention head: attention over 64k tokens dominates the CPU time.
    model = random_model(tiny_config(hv_per_h=2, layers=("linear_attention", "full_attention"),
                                     num_attention_heads=1), seed=5)
    doc = torch.randint(0, 300, (65536,), generator=torch.Generator().manual_seed(3)).tolist()
    states = []
    for chunk in (8192, 16384):
        bank = Bank.allocate(model.cfg, num_slots=1, num_blocks=65536 // 64, block_size=64)
        runner = Passes(model, bank, get_ops("torch"), state_chunk_tokens=chunk)
        h = bank.alloc(len(doc))
        runner.state_pass([doc], [h])
        states.append((runner, h))
    (a, ha), (b, hb) = states
    for x, y in zip(a.bank.pools.tensors(), b.bank.pools.tensors()):
        assert rel_err(x, y) <= 1e-4
    row = [5, 6, 7, 8]
    out_a = a.row_pass(RowBatch.build([row], [ha], [len(doc)], [[3]]))
    out_b = b.row_pass(RowBatch.build([row], [hb], [len(doc)], [[3]]))
    assert rel_err(out_a, out_b) <= 1e-4
