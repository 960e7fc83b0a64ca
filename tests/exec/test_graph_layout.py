"""CUDA-graph keys on CPU: the packed layout (kev.exec.static_pass), the key ladders and the
capture policy (kev.exec.graphs).

The layout runs through the torch reference ops: a row pass packed into a key (its rows end to
end, empty sequences, one padding sequence that reads nothing) gives the real rows' answers of the
unpadded pass (fp32; the torch chunked reference multiplies chunks of another length, so not bit
for bit here: the GPU test checks the Triton kernels bitwise); a state pass packed into a key
(new documents, or the next chunks of long ones) writes bit-identical bank states. The chunk lists
hold exactly fla's chunks of the padded pass, then no-ops. The policy runs with `TritonOps`'
bookkeeping over the torch maths and a stand-in for graph capture.
"""

from itertools import accumulate

import pytest
import torch
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

from kev.bank.bank import Bank
from kev.exec.graphs import CHUNK_STEPS, CapturePolicy, GraphCache, KeyLadder, token_ladder
from kev.ops import get_ops
from kev.ops.fused.reference import ReferenceElementwise
from kev.ops.torch_ops import TorchOps
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.ops.shapes import ShapeClass
from kev.exec.static_pass import CHUNK, GraphKey, PassKind, StaticPass, SweepKey, chunks_needed
from random_models import random_model, tiny_config
from kernel_support import packed_chunks, rel_err


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


@pytest.mark.parametrize("key", [GraphKey(PassKind.ROWS, 160, 8), GraphKey(PassKind.ROWS, 256, 12)], ids=str)
def test_row_layout_gives_the_real_rows(model, key):
    runner, docs, handles = stored(model, get_ops("torch"))
    batch = row_batch(docs, handles)  # 118 tokens in 5 rows, one of them over two chunks
    ref = runner.row_pass(batch)
    before = [t.clone() for t in runner.bank.pools.tensors()]
    sp = StaticPass(key, runner.bank.block_table.shape[1], 16, "cpu")
    assert sp.fits(list(batch.row_lens))
    P = sp.fill_rows(batch.tokens, batch.cu_seqlens, batch.slots, batch.doc_lens, batch.positions, batch.picks,
                     runner.bank.block_table)
    with torch.no_grad():
        out = model(sp.tokens, sp.meta, runner.bank.pools, runner.ops, picks=sp.picks)[:P]
    assert P == batch.picks.shape[0] and rel_err(ref, out) <= 1e-5
    assert torch.equal(sp.tokens[:118], batch.tokens) and sp.tokens[118:].eq(0).all()
    assert sp.read_slots[5:].eq(-1).all() and sp.write_slots.eq(-1).all() and sp.prefix_lens[5:].eq(0).all()
    # the padding in sequences of at most one chunk (64 tokens), then empty sequences at T
    padding_ends = {160: [160], 256: [182, 246, 256]}[key.tokens]
    empty = key.chunks + 1 - 6 - len(padding_ends)
    assert sp.cu_seqlens.tolist() == batch.cu_seqlens.tolist() + padding_ends + [key.tokens] * empty
    assert sp.positions[118:].tolist() == [p for a, b in zip([118, *padding_ends], padding_ends) for p in range(b - a)]
    for b, a in zip(before, runner.bank.pools.tensors()):
        assert torch.equal(b, a), "a padded row pass changed the bank"


@pytest.mark.parametrize("chunk_tokens", [8192, 40], ids=["new", "in-chunks"])
def test_state_layout_writes_identical_states(model, chunk_tokens):
    """Documents packed into a key (then a padding sequence): bit-identical states, for new
    documents and for long ones run chunk by chunk (each chunk continuing its slot)."""
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (48, 30, 100)]
    banks = []
    for padded in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
        bank.alloc(5)  # the documents land in other slots than 0
        handles = [bank.alloc(len(d)) for d in docs]
        runner = Passes(model, bank, get_ops("torch"), state_chunk_tokens=chunk_tokens)
        if padded:
            done = 0
            while done < 100:
                live = [i for i, d in enumerate(docs) if len(d) > done]
                chunks = [docs[i][done : done + chunk_tokens] for i in live]
                sp = StaticPass(GraphKey(PassKind.STATE, 192, 8), bank.block_table.shape[1], 16, "cpu")
                sp.fill_state(chunks, [handles[i].slot for i in live], bank.block_table, [done] * len(live))
                assert sp.positions[: len(chunks[0])].tolist() == list(range(done, done + len(chunks[0])))
                with torch.no_grad():
                    model(sp.tokens, sp.meta, bank.pools, get_ops("torch"), picks=sp.picks)
                done += chunk_tokens
        else:
            runner.state_pass(docs, handles)
        banks.append(bank)
    for a, b in zip(banks[0].pools.tensors(), banks[1].pools.tensors()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block", [CHUNK, 16])
def test_packed_chunks_are_fla_chunks_then_no_ops(block):
    """Over random passes: the list starts with exactly fla's chunk list of the padded cu_seqlens
    (real sequences, the padding in sequences of at most CHUNK tokens, empty ones), fla's offsets
    match, and the rest are no-op entries of the last sequence past its end whose positions stay
    inside the list."""
    g = torch.Generator().manual_seed(7)
    for _ in range(40):
        n = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(1, 150, (n,), generator=g).tolist()
        pad = int(torch.randint(0, 200, (1,), generator=g))
        T = sum(lens) + pad
        pieces = [CHUNK] * (pad // CHUNK) + [pad % CHUNK] * (pad % CHUNK > 0)
        slots = n + max(len(pieces), 1) + int(torch.randint(0, 4, (1,), generator=g))
        entries = chunks_needed(lens, T, block) + int(torch.randint(0, 5, (1,), generator=g))
        chunks, offsets = packed_chunks(lens, T, slots, block, entries)
        seqs = lens + pieces
        cu = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()] + [T] * (slots - len(seqs)))
        fla = prepare_chunk_indices(cu, block)
        assert chunks.shape == (entries, 2) and torch.equal(chunks[: len(fla)], fla)
        assert torch.equal(offsets[:-1], prepare_chunk_offsets(cu, block)[:-1]) and offsets[-1] == entries
        extra = chunks[len(fla):]
        assert extra[:, 0].eq(slots - 1).all() and (offsets[slots - 1] + extra[:, 1]).lt(entries).all()
        last = seqs[-1] if len(seqs) == slots else 0  # the last sequence: a padding piece, or empty
        assert cdiv_t(last, block) <= extra[:, 1].min().item() if len(extra) else True
        assert max(len(fla) and torch.bincount(fla[:, 0])[n:].tolist() or [0]) <= CHUNK // block  # pieces: one chunk
    with pytest.raises(ValueError, match="need more than"):
        packed_chunks([64, 64], 200, 3, CHUNK, 3)
    with pytest.raises(ValueError, match="need more than"):  # room for the entries, not for the padding's sequences
        packed_chunks([64], 200, 2, CHUNK, 8)


def cdiv_t(a, b):
    return -(-a // b)


def test_state_fill_matches_the_layout():
    """The fill (host tensor ops) against the layout spelled out, over random chunks, starts and keys."""
    from kev.exec.transfer import host_int64

    g = torch.Generator().manual_seed(3)
    table = torch.arange(16 * 8, dtype=torch.int32).view(16, 8)
    for key in [GraphKey(PassKind.STATE, 64, 3), GraphKey(PassKind.STATE, 320, 12), GraphKey(PassKind.STATE, 1024, 24)]:
        while True:
            n = int(torch.randint(1, 6, (1,), generator=g))
            docs = [torch.randint(0, 300, (int(torch.randint(1, key.tokens // 2, (1,), generator=g)),),
                                  generator=g).tolist() for _ in range(n)]
            if StaticPass(key, 8, 16, "cpu").fits([len(d) for d in docs]):
                break
        slots = torch.randperm(16, generator=g)[:n].tolist()
        starts = [int(torch.randint(0, 2, (1,), generator=g)) * 100 for _ in range(n)]
        sp = StaticPass(key, table.shape[1], 16, "cpu")
        sp.fill_state(docs, slots, table, starts)
        real = sum(len(d) for d in docs)
        assert sp.tokens.tolist() == [t for d in docs for t in d] + [0] * (key.tokens - real)
        pad = key.tokens - real  # in sequences of at most 64 tokens, each from position 0
        assert sp.positions.tolist() == [s + i for s, d in zip(starts, docs) for i in range(len(d))] + \
            [i % 64 for i in range(pad)]
        ends = [real + min(64 * (j + 1), pad) for j in range(-(-pad // 64))]
        cu = [0, *accumulate(len(d) for d in docs)]
        assert sp.cu_seqlens.tolist() == cu + ends + [key.tokens] * (key.chunks + 1 - len(cu) - len(ends))
        assert sp.write_slots.tolist() == slots + [-1] * (key.chunks - n)
        assert sp.read_slots.tolist() == [s if st else -1 for s, st in zip(slots, starts)] + [-1] * (key.chunks - n)
        assert sp.prefix_lens.tolist() == starts + [0] * (key.chunks - n)
        assert torch.equal(sp.block_table[:n], table[slots])
    for values in ([], [0], [2**40, -1, 5], list(range(3000))):
        assert torch.equal(host_int64(values), torch.tensor(values, dtype=torch.int64))


def test_key_ladders():
    """Every pass within the caps has a key, the smallest that fits; the ladder pads a pass by at
    most a quarter of its tokens above 128; beyond the caps, no key."""
    assert token_ladder(8192)[:9] == (16, 32, 48, 64, 80, 96, 112, 128, 160) and token_ladder(8192)[-1] == 8192
    assert token_ladder(1000)[-1] == 1000 and token_ladder(16) == (16,)
    ladder = KeyLadder(PassKind.ROWS, 8192, 96)
    assert all(b / a <= 1.25 for a, b in zip(ladder.tokens, ladder.tokens[1:]) if a >= 128)
    keys = ladder.keys()
    assert len(keys) == len(set(keys)) and len(keys) <= 200
    g = torch.Generator().manual_seed(11)
    for _ in range(300):
        n = int(torch.randint(1, 97, (1,), generator=g))
        lo, hi = sorted(torch.randint(1, 129, (2,), generator=g).tolist())
        lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
        key = ladder.key_for(lens)
        if sum(lens) > 8192:
            assert key is None
            continue
        assert key in keys and StaticPass(key, 4, 16, "cpu").fits(lens)
        smaller = [k for k in keys if (k.tokens, k.chunks) < (key.tokens, key.chunks) and k.tokens >= sum(lens)
                   and k.chunks <= key.chunks]
        assert not any(StaticPass(k, 4, 16, "cpu").fits(lens) for k in smaller if k.tokens == key.tokens)
    assert ladder.key_for([34] * 80) == GraphKey(PassKind.ROWS, 3072, 96)
    assert ladder.key_for([1] * 97) is None and ladder.key_for([]) is None and ladder.key_for([8193]) is None
    assert ladder.key_for([1] * 40).tokens > 40  # shorter than MIN_SEQ_TOKENS: a larger key, still one
    states = KeyLadder(PassKind.STATE, 16384, 64)
    assert states.key_for([2200] * 5) == GraphKey(PassKind.STATE, 11264, 192)  # a half step: room enough
    # half steps (state ladders, from 1,024 tokens): one document pads at most an eighth, for 16 keys more
    assert not ladder.half_steps and len(states.half_steps) == 16 and len(states.keys()) <= 200
    assert all(len(states.chunk_sizes(T)) == 1 for T in states.half_steps)
    assert states.key_for([2200]) == GraphKey(PassKind.STATE, 2304, 48)
    assert all(states.key_for([n]).tokens <= 1.125 * n for n in range(1024, 16385, 7))
    assert states.key_for([48]) == GraphKey(PassKind.STATE, 48, 2)
    assert all(c in CHUNK_STEPS for k in states.keys() for c in [k.chunks])
    assert GraphKey(PassKind.STATE, 2304, 48).num_slots == 48 and GraphKey(PassKind.ROWS, 96, 12).picks == 96
    assert GraphKey(PassKind.STATE, 2304, 48).picks == 0


def test_best_prefix_cuts_a_full_pass_back_to_its_step():
    """A full pass with more waiting keeps the leading rows that pad least: over random passes the
    mean padding share falls from ~9% to ~1%, never rises, and a cut pass is a prefix with a key."""
    ladder = KeyLadder(PassKind.ROWS, 8192, 96)
    g = torch.Generator().manual_seed(2)
    shares = [0.0, 0.0]
    for _ in range(200):
        n = int(torch.randint(20, 97, (1,), generator=g))
        lens = torch.randint(12, 129, (n,), generator=g).tolist()
        k = ladder.best_prefix(lens)
        full, cut = ladder.key_for(lens), ladder.key_for(lens[:k])
        assert 1 <= k <= n and cut is not None
        pad = [(full.tokens - sum(lens)) / full.tokens, (cut.tokens - sum(lens[:k])) / cut.tokens]
        assert pad[1] <= pad[0]
        shares = [s + p / 200 for s, p in zip(shares, pad)]
    assert shares[0] > 0.05 and shares[1] < 0.03, shares
    assert ladder.best_prefix([100] * 30) == 30  # 3,000 tokens pad to 3,072: nothing to gain
    assert ladder.best_prefix([8193]) == 1 and ladder.best_prefix([]) == 0


def test_best_cut_with_split_pieces_pads_under_one_chunk():
    """The bank's pieces may be cut short at whole chunks (`best_cut(lens, 64)`): over random passes
    of documents the cut pass pads less than a chunk whenever it is cut, its share never rises, and
    it is the leading pieces with the last one shortened to a multiple of 64."""
    ladder = KeyLadder(PassKind.STATE, 16384, 64)
    g = torch.Generator().manual_seed(3)
    shares, cuts = [0.0, 0.0], 0
    for _ in range(200):
        n = int(torch.randint(2, 20, (1,), generator=g))
        lens = torch.exp(torch.empty(n).uniform_(3.5, 7.5, generator=g)).long().clamp(max=8192).tolist()
        if sum(lens) > 16384:
            continue
        out = ladder.best_cut(lens, 64)
        full, cut = ladder.key_for(lens), ladder.key_for(out)
        k = len(out)
        assert 1 <= k <= n and out[:-1] == lens[: k - 1] and 0 < out[-1] <= lens[k - 1]
        assert out[-1] == lens[k - 1] or out[-1] % 64 == 0
        pad = [(full.tokens - sum(lens)) / full.tokens, (cut.tokens - sum(out)) / cut.tokens]
        assert pad[1] <= pad[0]
        if out != lens:
            cuts += 1
            assert cut.tokens - sum(out) < 64 or out[-1] == lens[k - 1]  # a split pads less than a chunk
        shares = [s + p for s, p in zip(shares, pad)]
    assert cuts > 20 and shares[1] < shares[0] / 3, (cuts, shares)
    assert ladder.best_cut([1000, 1000]) == [1000, 1000]  # 2,000 in 2,048: nothing to gain
    assert ladder.best_cut([300, 300], 64) == [300, 192]  # 600 real in 640 (0.94); cut, 492 in 512 (0.96)


class FakeGraph:
    def __init__(self, fn, outs):
        self.fn, self.outs, self.replays, self.was_reset = fn, outs, 0, False

    def replay(self):
        for out, new in zip(self.outs, self.fn()):  # (hidden, head probabilities or None)
            if out is not None:
                out.copy_(new)
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

        out, probs = forward()
        return FakeGraph(forward, (out, probs)), out, probs

    monkeypatch.setattr(GraphCache, "_record", record)


def test_start_up_capture_then_replays(model, fake_capture):
    """Every key captured up front: later passes of any shape within the caps replay; a key queued
    by a re-attach is captured at its first use; beyond the caps, the eager path."""
    runner, docs, handles = stored(model, CpuTritonOps())
    graphed = runner.with_graphs(GraphCache(rows=KeyLadder(PassKind.ROWS, 256, 8)))
    keys = graphed.graphs.all_keys()
    assert keys == sorted(keys, key=lambda k: (k.tokens, k.chunks), reverse=True)
    passes = [(12, 30, 5), (3,), (70, 60, 50, 40, 30), (20,) * 8]
    needed = list(dict.fromkeys(graphed.graphs.rows.key_for(lens) for lens in passes))
    assert set(needed) <= set(keys)
    graphed.graphs.capture(graphed, needed)  # the services capture `keys`: on CPU, only the ones used here
    assert graphed.graphs.stats.captures == len(needed)
    for lens in passes:
        b = row_batch(docs, handles, lens=lens)
        assert rel_err(runner.row_pass(b), graphed.row_pass(b)) <= 1e-5
    assert graphed.graphs.stats.replays == 4 and graphed.graphs.stats.eager == 0
    too_long = row_batch(docs, handles, lens=(200, 100))
    assert torch.equal(graphed.row_pass(too_long), runner.row_pass(too_long)) and graphed.graphs.stats.unbucketed == 1
    no_lens = RowBatch(*[getattr(too_long, f) for f in ("tokens", "cu_seqlens", "slots", "doc_lens", "picks",
                                                          "positions")])
    graphed.row_pass(no_lens)
    assert graphed.graphs.stats.unbucketed == 2
    # a re-attach queues the keys; the first pass of a key captures it, then replays
    again = runner.with_graphs(GraphCache(rows=KeyLadder(PassKind.ROWS, 256, 8)))
    again.graphs.queue(again.graphs.all_keys())
    b = row_batch(docs, handles, lens=(12, 30, 5))
    first, second = again.row_pass(b), again.row_pass(b)
    assert torch.equal(first, second) and again.graphs.stats.captures == 1 and again.graphs.stats.eager == 0
    assert len(again.graphs.pending) == len(keys) - 1


def test_the_head_runs_inside_the_row_graph(model, fake_capture):
    """With a head, a row key's graph ends in it (`Passes.row_probabilities`): each option's
    probability equals the eager head's over the unpadded row pass, replay after replay (the head's
    layout is refilled with the rows); a question wider than the table or a pass beyond the ladder
    gets None (the caller's eager path)."""
    from types import SimpleNamespace

    from kev.request.answers import launch_rows, start_answers
    from kev.request.api import Question
    from kev.request.head import DecisionHead, pick_layout

    runner, docs, handles = stored(model, CpuTritonOps())
    g = torch.Generator().manual_seed(5)
    d, R = model.cfg.hidden_size, 16
    head = DecisionHead(torch.randn(R, d, generator=g), torch.randn(R, d, generator=g), torch.randn(R, generator=g),
                        None, 0.8)
    graphed = runner.with_graphs(GraphCache(rows=KeyLadder(PassKind.ROWS, 256, 8), head=head, head_width=6))
    for lens, counts in (((12, 30, 5, 70, 1), (3, 2, 1, 4, 1)), ((9, 40), (6, 2)), ((33, 8, 8), (2, 2, 5))):
        rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lens]
        picks = [[n - 1] + [min(3 * j, n - 1) for j in range(c)] for n, c in zip(lens, counts)]
        owner = [i % len(docs) for i in range(len(rows))]
        batch = RowBatch.build(rows, [handles[o] for o in owner], [len(docs[o]) for o in owner], picks)
        key = graphed.graphs.rows.key_for(lens)
        graphed.graphs.capture(graphed, [key])
        probs = graphed.row_probabilities(batch, pick_layout(counts), max(counts))
        hidden = runner.row_pass(batch)
        starts = [sum(len(p) for p in picks[:i]) for i in range(len(picks))]
        decide = starts
        options = [s + 1 + j for s, c in zip(starts, counts) for j in range(c)]
        want = head.probabilities(hidden[decide], hidden[options], counts)
        assert probs.shape == (hidden.shape[0],)
        torch.testing.assert_close(probs[options], want, rtol=1e-5, atol=1e-6)
        # the scorer's path (`launch_rows`): the graph's head, read back into answers
        prepared = [SimpleNamespace(rows=[SimpleNamespace(
            name=f"r{i}", question=Question.choice("q", [f"o{j}" for j in range(c)]),
            prompt=SimpleNamespace(option_end_indices=[0] * c)) for i, c in enumerate(counts)])]
        got = launch_rows(graphed, head, prepared, batch).result()[0]
        eager = start_answers(head, prepared, hidden).result()[0]
        assert list(got) == list(eager)
        for name in got:
            assert got[name].choice == eager[name].choice
            for o in got[name].probabilities:
                assert abs(got[name].probabilities[o] - eager[name].probabilities[o]) <= 1e-5
    assert graphed.graphs.stats.replays == 6 and graphed.graphs.stats.eager == 0
    assert graphed.row_probabilities(batch, pick_layout(counts), 7) is None  # wider than head_width
    too_long = row_batch(docs, handles, lens=(200, 100))
    assert graphed.row_probabilities(too_long, pick_layout([1, 1]), 1) is None
    assert runner.row_probabilities(batch, pick_layout(counts), max(counts)) is None  # no graphs, no head


def test_uncaptured_keys_run_eagerly_padded(model):
    """A key never captured (no start-up capture) runs eagerly in its padded shape, uncounted for capture."""
    runner, docs, handles = stored(model, CpuTritonOps())
    padded = runner.with_graphs(GraphCache(rows=KeyLadder(PassKind.ROWS, 256, 8)))
    b = row_batch(docs, handles, lens=(12, 30, 5))
    for _ in range(3):
        assert rel_err(runner.row_pass(b), padded.row_pass(b)) <= 1e-5
    assert padded.graphs.stats.eager_bucketed == 3 and padded.graphs.pending == [] and padded.graphs.graphs() == []


def test_graphed_state_pass_writes_what_the_runner_writes(model, fake_capture):
    """Graphed state passes store exactly what Passes.state_pass stores: short documents in one
    key, and long ones chunk by chunk (every chunk pass keyed)."""
    g = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (64, 1, 33, 17, 64, 5, 140)]
    banks = []
    for graphed in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=len(docs) + 2, num_blocks=128, block_size=16)
        bank.alloc(3)  # the documents land in other slots than 0
        runner = Passes(model, bank, CpuTritonOps(), state_chunk_tokens=64)
        handles = [bank.alloc(len(d)) for d in docs]
        if graphed:
            passes = runner.with_graphs(GraphCache(states=KeyLadder(PassKind.STATE, 512, 8),
                                                   policy=CapturePolicy.ON_FIRST_USE))
            assert passes.state_keyed([len(d) for d in docs])
            passes.state_pass(docs, handles)
            assert passes.graphs.stats.replays == 3 and passes.graphs.stats.eager == 0  # chunks 0-63, 64-127, 128-139
        else:
            runner.state_pass(docs, handles)
        banks.append(bank)
    for a, b in zip(banks[0].pools.tensors(), banks[1].pools.tensors()):
        assert torch.equal(a, b)


def new_documents_and_rows(bank, seed):
    """Two new documents (slots allocated, nothing stored yet) and three rows over them: one sweep's input."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (50, 9)]
    handles = [bank.alloc(len(d)) for d in docs]
    return docs, handles, row_batch(docs, handles, lens=(12, 30, 5), seed=seed)


SMALL = dict(rows=KeyLadder(PassKind.ROWS, 128, 8), states=KeyLadder(PassKind.STATE, 128, 4))


def test_graphed_sweep_matches_the_runner(model, fake_capture):
    """One sweep in a SweepKey (documents packed as in a state key, rows as in a row key) stores
    exactly what the unpadded sweep stores and gives its rows' answers (fp32, see the module
    docstring); a replay with other documents and rows follows them."""
    results = []
    for graphed in (False, True):
        bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
        bank.alloc(3)  # the documents land in other slots than 0
        runner = Passes(model, bank, CpuTritonOps())
        passes = runner.with_graphs(GraphCache(**SMALL, policy=CapturePolicy.ON_FIRST_USE)) if graphed else runner
        out = []
        for rep in range(2):
            docs, handles, batch = new_documents_and_rows(bank, 40 + rep)
            out.append((passes.sweep(docs, handles, batch), [t.clone() for t in bank.pools.tensors()]))
            for h in handles:
                bank.free(h)
        if graphed:
            assert passes.graphs.graphs() == [SweepKey(GraphKey(PassKind.STATE, 64, 3), GraphKey(PassKind.ROWS, 48, 4))]
            assert passes.graphs.stats.captures == 1 and passes.graphs.stats.replays == 2 and passes.graphs.stats.eager == 0
        results.append(out)
    for (h1, bank1), (h2, bank2) in zip(*results):
        assert rel_err(h1, h2) <= 1e-5
        for a, b in zip(bank1, bank2):
            assert torch.equal(a, b)


def test_sweep_without_its_graph_replays_the_two_graphs(model, fake_capture):
    """Until a sweep key is captured, the state graph and the row graph run instead of an eager
    sweep; the sweep is queued after `min_uses` uses and replayed once captured."""
    bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
    runner = Passes(model, bank, CpuTritonOps())
    passes = runner.with_graphs(GraphCache(**SMALL, min_uses=2))
    state, rows = GraphKey(PassKind.STATE, 64, 3), GraphKey(PassKind.ROWS, 48, 4)
    passes.graphs.capture(passes, [state, rows])  # of all_keys(), the two this test's passes use
    outs = []
    for rep in range(3):
        docs, handles, batch = new_documents_and_rows(bank, 50 + rep)
        replays = passes.graphs.stats.replays
        outs.append(passes.sweep(docs, handles, batch))
        assert passes.graphs.stats.replays - replays == (2 if rep < 2 else 1) and passes.graphs.stats.eager == 0
        ref = runner.row_pass(batch)  # the states the sweep stored, read by the plain row pass
        assert rel_err(ref, outs[-1]) <= 1e-5
        for h in handles:
            bank.free(h)
        if rep == 1:
            assert passes.graphs.pending == [SweepKey(state, rows)] and passes.capture_when_idle() == 1
    assert SweepKey(state, rows) in passes.graphs.graphs()


def test_a_sweep_is_captured_once_its_uses_would_have_paid_for_the_capture(model, fake_capture):
    """Calibrated (a pass's fixed cost measured, each key's capture timed), a sweep key is queued
    for an idle capture only once its uses, each saving one pass's fixed cost, add up to what its two
    keys' captures took: here (30 + 20 ms) / 10 ms = 5 uses; a rarer key stays two replays. Not
    calibrated: `min_uses`."""
    bank = Bank.allocate(model.cfg, num_slots=6, num_blocks=128, block_size=16)
    runner = Passes(model, bank, CpuTritonOps())
    passes = runner.with_graphs(GraphCache(**SMALL, min_uses=2))
    graphs = passes.graphs
    state, rows = GraphKey(PassKind.STATE, 64, 3), GraphKey(PassKind.ROWS, 48, 4)
    graphs.capture(passes, [state, rows])
    sweep = SweepKey(state, rows)
    assert graphs.uses_to_capture(sweep) == 2  # not calibrated
    graphs.fixed_s = 0.010
    graphs._capture_s.update({state: 0.030, rows: 0.020})  # as timed at start-up (here: set, not timed)
    assert graphs.uses_to_capture(sweep) == 5
    for use in range(1, 6):
        docs, handles, batch = new_documents_and_rows(bank, 60 + use)
        replays = graphs.stats.replays
        passes.sweep(docs, handles, batch)
        assert graphs.stats.replays - replays == 2 and graphs.stats.eager == 0  # the two graphs
        for h in handles:
            bank.free(h)
        assert graphs.pending == ([sweep] if use == 5 else []), use
    assert passes.capture_when_idle() == 1 and sweep in graphs.graphs()
    graphs.fixed_s = 1.0  # a fixed cost above the captures' time: min_uses still holds
    assert graphs.uses_to_capture(sweep) == 2


def test_gathered_plan_follows_a_bucket_between_replays():
    """GatheredOps on a CUDA-graph key: the gather plan is re-derived from the key's index
    buffers at every call (a plan kept from the capture's synthetic fill read slot 0 and one page
    a row: wrong states, and past the page table for 2,200-token prefixes), P comes from
    max_prefix_tokens, and a replaced row buffer stays alive for the graphs that hold it."""
    from kev.ops.gathered_ops import GatheredOps, PrefixTooLong
    from kev.ops.meta import PassMeta

    ops = GatheredOps(max_prefix_tokens=100)
    sp = StaticPass(GraphKey(PassKind.ROWS, 128, 4), 16, 16, "cpu")
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


def test_key_meta_carries_the_key_class():
    """A key's meta carries the key's class (what its graph tunes under, and what a sweep's
    document phase mixes under), not a guess from its padded sequence count."""
    key = GraphKey(PassKind.STATE, 1024, 24)
    static = StaticPass(key, 32, 16, "cpu")
    assert key.shape_class is ShapeClass.DOCS_FEW and static.meta.pass_class(key.num_tokens) is key.shape_class
    rows = StaticPass(GraphKey(PassKind.ROWS, 2048, 96), 8, 16, "cpu")
    assert rows.meta.pass_class(2048) is rows.key.shape_class is ShapeClass.ROWS_WIDE
    assert SweepKey(key, rows.key).shape_class is key.shape_class


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python inside it."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [3, 60])
def test_a_fill_is_a_few_torch_calls_whatever_its_size(model, rows):
    """Each torch op gives the GIL up, and the thread that feeds the GPU may then wait up to the
    switch interval to get it back from a request thread (kev/serving/interpreter.py): a fill in
    front of a replay makes the same few calls for 3 rows or 60, 1 document or 8, and fills from
    host ints the block a fill from tensors makes."""
    runner, docs, handles = stored(model, get_ops("torch"))
    g = torch.Generator().manual_seed(rows)
    batch = row_batch(docs, handles, lens=torch.randint(1, 70, (rows,), generator=g).tolist(), seed=rows)
    key = KeyLadder(PassKind.ROWS, 8192, 96).key_for(batch.row_lens)
    table = runner.bank.block_table
    from_tensors = StaticPass(key, table.shape[1], 16, "cpu")
    from_tensors.fill_rows(batch.tokens, batch.cu_seqlens, batch.slots, batch.doc_lens, batch.positions, batch.picks,
                           table)
    sp = StaticPass(key, table.shape[1], 16, "cpu")
    args = ([r.tolist() for r in batch.tokens.split(list(batch.row_lens))], [handles[i % len(docs)] for i in range(rows)],
            batch.doc_lens.tolist(), [[n - 1, 0] for n in batch.row_lens])
    with _TorchCalls() as counted:  # a keyed pass never copies the batch's own tensors to the device
        P = sp.fill_rows(*RowBatch.build(*args).host_fields(), table)
    assert P == batch.picks.shape[0] and torch.equal(sp._ints, from_tensors._ints)
    assert len(counted.calls) <= 8, counted.calls

    n_docs = 1 if rows == 3 else 8
    doc_key = KeyLadder(PassKind.STATE, 16384, 64).key_for([300] * n_docs)
    st = StaticPass(doc_key, table.shape[1], 16, "cpu")
    chunks = [torch.randint(0, 300, (300,), generator=g).tolist() for _ in range(n_docs)]
    with _TorchCalls() as counted:
        st.fill_state(chunks, list(range(n_docs)), table, [0] * n_docs)
    assert len(counted.calls) <= 8, counted.calls
    assert st.tokens[: 300 * n_docs].tolist() == [t for c in chunks for t in c]


def test_a_fill_appends_its_ints_as_given():
    """The fill's C-speed appends (`kev.exec.static_pass._extend` / `_repeat`): lists, ranges (also
    past the counting array, which then grows), anything iterable, repeats; the same ints as a plain
    append."""
    from array import array

    from kev.exec import static_pass

    out = array("q")
    parts = [[5, -1, 7], range(3, 9), range(70_000, 70_004), (1, 2), range(4, 4), iter([9])]
    for part in parts:
        static_pass._extend(out, part)
    static_pass._repeat(out, -1, 3)
    static_pass._repeat(out, 8, 0)
    assert out.tolist() == [5, -1, 7, *range(3, 9), *range(70_000, 70_004), 1, 2, 9, -1, -1, -1]
    assert len(static_pass._COUNTING) >= 70_004
