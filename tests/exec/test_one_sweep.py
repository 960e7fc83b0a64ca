"""One sweep over the weights for new documents and their rows (`Passes.sweep`)
equals the two passes it replaces: the same stored states and the same picked hidden states, bit
for bit on CPU (batch-invariant projections; the reference mixers run sequence by sequence)."""

import pytest
import torch

from kev.bank.bank import Bank
from kev.ops import get_ops
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from random_models import random_model, tiny_config


@pytest.fixture(scope="module", params=[1, 3], ids=lambda r: f"hv_per_h={r}")
def model(request):
    # HV/H changes the head grouping inside the delta rule: one representative per ratio.
    return random_model(tiny_config(hv_per_h=request.param), seed=10 + request.param)


def make_runner(model, chunk=8192):
    return Passes(model, Bank.allocate(model.cfg, num_slots=8, num_blocks=64, block_size=16), get_ops("torch"),
                  state_chunk_tokens=chunk)


def random_case(seed, doc_lens, row_lens, owners):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in doc_lens]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in row_lens]
    picks = [sorted({0, len(r) - 1, len(r) // 2}) for r in rows]
    return docs, rows, picks, owners


def run_both(model, docs, rows, picks, owners, stored=()):
    """(one sweep, two passes): (picked states, bank tensors) of each. `stored`: documents already
    in the bank (state-passed first, on both runners alike); owner i >= len(docs) reads stored[i - len(docs)]."""
    out = []
    for one_sweep in (True, False):
        runner = make_runner(model)
        old = [runner.bank.alloc(len(d)) for d in stored]
        if stored:
            runner.state_pass(list(stored), old)
        new = [runner.bank.alloc(len(d)) for d in docs]
        handles = new + old
        all_docs = list(docs) + list(stored)
        batch = RowBatch.build(rows, [handles[o] for o in owners], [len(all_docs[o]) for o in owners], picks)
        if one_sweep:
            hidden = runner.sweep(docs, new, batch)
        else:
            runner.state_pass(docs, new)
            hidden = runner.row_pass(batch)
        out.append((hidden, [t.clone() for t in runner.bank.pools.tensors()]))
    return out


@pytest.mark.parametrize("doc_lens,row_lens,owners", [
    ((48,), (32,) * 6, (0,) * 6),  # six-short's shape, scaled: one new document, its rows
    ((5, 70, 129), (1, 17, 64, 3), (2, 0, 1, 1)),  # several documents, chunk edges, rows in any order
], ids=["one_doc", "three_docs"])
def test_one_sweep_equals_two_passes_bitwise(model, doc_lens, row_lens, owners):
    docs, rows, picks, owners = random_case(sum(doc_lens), doc_lens, row_lens, owners)
    (h1, bank1), (h2, bank2) = run_both(model, docs, rows, picks, owners)
    assert torch.equal(h1, h2)
    for a, b in zip(bank1, bank2):
        assert torch.equal(a, b)


def test_rows_over_stored_and_new_documents(model):
    """Rows of one sweep may read a document stored earlier as well as one written in the sweep."""
    docs, rows, picks, _ = random_case(5, (40,), (9, 30, 4), ())
    stored = random_case(6, (66,), (), ())[0]
    (h1, bank1), (h2, bank2) = run_both(model, docs, rows, picks, (1, 0, 1), stored=stored)
    assert torch.equal(h1, h2)
    for a, b in zip(bank1, bank2):
        assert torch.equal(a, b)


def test_long_documents_fall_back_to_two_passes(model):
    """A document longer than a chunk carries its state across chunks: not one sweep, same result."""
    runner = make_runner(model, chunk=64)
    docs, rows, picks, owners = random_case(7, (150,), (12,), (0,))
    assert not runner.fits_one_sweep(docs) and runner.fits_one_sweep([docs[0][:64]])
    h = runner.bank.alloc(150)
    batch = RowBatch.build(rows, [h], [150], picks)
    swept = runner.sweep(docs, [h], batch)
    assert torch.equal(swept, runner.row_pass(batch))
