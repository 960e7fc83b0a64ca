"""The one-launch recurrent delta rule (`indexed_recurrent`) and `TritonOps`' choice of it, on CPU.

Kernel tests run under TRITON_INTERPRET=1 (fresh interpreted modules, `interpret_support`) at tiny
shapes (K, V <= 24) against `naive.recurrent_gated_delta_rule` in fp64 on fresh random inputs:
varlen (1, 17, 64 tokens), read slots -1 / repeated / equal to the write slot, a strided pool
view, write slots -1 skipping, HV = H and 2H, masked head dims, both V-block splits, packed q/k/v
views. The dispatch tests need no kernel: the choice is a host decision by shape class.
"""

import pytest
import torch
from kernel_support import packed, rel_err

from kev.ops.autotune import ShapeClass, classify
from kev.ops.delta_rule.naive import recurrent_gated_delta_rule
from kev.ops.meta import PassMeta
from kev.ops.torch_ops import TorchOps, l2_normalize




def strided_pool(g, shape):
    """A pool that is a non-contiguous view of a larger buffer (every other slot, padded inner dims)."""
    base = torch.randn((2 * shape[0] + 1, *[d + 3 for d in shape[1:]]), generator=g) * 0.3
    view = base[1::2][(slice(None), *[slice(1, 1 + d) for d in shape[1:]])]
    assert not view.is_contiguous() and view.shape == shape
    return base, view


# (sequence lengths, read slots, write slots): -1 reads, repeated reads, -1 writes, read == write
CASES = {
    "T1": ([1], [3], [-1]),
    "T1-17-64": ([1, 17, 64], [-1, 2, 2], [4, -1, 1]),
    "T64-17-readwrite": ([64, 17, 1], [5, 0, 0], [5, -1, 3]),
}


def inputs(g, lens, H, HV, K, V):
    """Packed q/k/v column views of one buffer (with padding), as the model passes them."""
    T = sum(lens)
    qkv = torch.randn(T, 2 * H * K + HV * V + 5, generator=g)
    q = qkv[:, :H * K].unflatten(1, (H, K))
    k = qkv[:, H * K:2 * H * K].unflatten(1, (H, K))
    v = qkv[:, 2 * H * K:2 * H * K + HV * V].unflatten(1, (HV, V))
    gb = torch.rand(T, 2 * HV + 1, generator=g)
    gate, beta = -gb[:, :HV] * 0.5, gb[:, HV + 1:]  # strided [T, HV] views too
    return q, k, v, gate, beta


def reference(q, k, v, gate, beta, lens, read, write, before):
    """Per sequence in fp64: normalise like TorchOps, expand key heads, recur token by token."""
    K, ratio = q.shape[2], v.shape[1] // q.shape[1]
    qn = l2_normalize(q.double()).repeat_interleave(ratio, 1) * K ** -0.5
    kn = l2_normalize(k.double()).repeat_interleave(ratio, 1)
    outs, expect = [], before.clone().double()
    cu = packed(lens).tolist()
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        h0 = before[read[n]].double() if read[n] >= 0 else torch.zeros(before.shape[1:], dtype=torch.float64)
        o, final = recurrent_gated_delta_rule(qn[s:e], kn[s:e], v[s:e], gate[s:e], beta[s:e], h0)
        outs.append(o)
        if write[n] >= 0:
            expect[write[n]] = final
    return torch.cat(outs), expect


DIMS = {"K16-V16": (16, 16), "K12-V24": (12, 24)}  # the second masks K (BK 16) and splits V unevenly


@pytest.mark.parametrize("dims", DIMS, ids=list(DIMS))
@pytest.mark.parametrize("ratio", [1, 2], ids=lambda r: f"hv_per_h={r}")
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_recurrent_matches_naive(interp, poisoned, case, ratio, dims):
    lens, read, write = CASES[case]
    K, V = DIMS[dims]
    g = torch.Generator().manual_seed(30 + ratio + K)
    H, S = 2, 6
    HV = H * ratio
    q, k, v, gate, beta = inputs(g, lens, H, HV, K, V)
    base, pool = strided_pool(g, (S, HV, K, V))
    before, base_before = pool.clone(), base.clone()
    o = interp.recurrent.indexed_recurrent_gated_delta_rule(
        q=q, k=k, v=v, g=gate, beta=beta, cu_seqlens=packed(lens), state_pool=pool, read_slots=torch.tensor(read),
        write_slots=torch.tensor(write))
    ref_o, expect = reference(q, k, v, gate, beta, lens, read, write, before)
    assert o.shape == (sum(lens), HV, V) and o.dtype == v.dtype
    assert rel_err(ref_o, o) <= 1e-5, "outputs"
    assert rel_err(expect, pool) <= 1e-5, "final states"
    untouched = [s for s in range(S) if s not in write]
    assert torch.equal(pool[untouched], before[untouched]), "a slot without a write changed"
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[1::2, 1:1 + HV, 1:1 + K, 1:1 + V] = False
    assert torch.equal(base[outside], base_before[outside]), "a write landed outside the pool view"


def test_recurrent_v_split_out_pool_and_packed_views(interp, poisoned):
    """BV 8 (two V blocks per head) == BV 16 bit for bit here; an out_pool takes the writes and the
    read pool stays as it was; contiguous copies of q/k/v give the very same bits."""
    rec = interp.recurrent
    lens, read, write = [17, 5], [1, -1], [0, 2]
    g = torch.Generator().manual_seed(7)
    H, HV, K, V, S = 2, 4, 16, 16, 3
    q, k, v, gate, beta = inputs(g, lens, H, HV, K, V)
    pool = torch.randn(S, HV, K, V, generator=g) * 0.3
    before = pool.clone()
    outs = {}
    for name, BV in (("bv16", 16), ("bv8", 8)):
        out_pool = torch.zeros(S, HV, K, V)
        o = rec.indexed_recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=gate, beta=beta, cu_seqlens=packed(lens), state_pool=pool,
            read_slots=torch.tensor(read), write_slots=torch.tensor(write), out_pool=out_pool,
            config=rec.triton.Config({"BV": BV}, num_warps=1))
        outs[name] = (o, out_pool)
    assert torch.equal(pool, before), "the read pool was written"
    assert torch.equal(outs["bv16"][0], outs["bv8"][0]) and torch.equal(outs["bv16"][1], outs["bv8"][1])
    ref_o, expect = reference(q, k, v, gate, beta, lens, read, write, before)
    assert rel_err(ref_o, outs["bv16"][0]) <= 1e-5
    assert rel_err(expect[[0, 2]], outs["bv16"][1][[0, 2]]) <= 1e-5
    assert torch.equal(outs["bv16"][1][1], torch.zeros(HV, K, V)), "slot 1 has no write"
    contiguous = rec.indexed_recurrent_gated_delta_rule(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=gate.contiguous(), beta=beta.contiguous(),
        cu_seqlens=packed(lens), state_pool=pool.clone(), read_slots=torch.tensor(read),
        write_slots=torch.tensor([-1, -1]))
    assert torch.equal(contiguous, outs["bv16"][0])


def test_recurrent_rejects_bad_shapes(interp):
    rec = interp.recurrent
    T, H, HV, K, V = 4, 2, 3, 16, 16
    args = dict(q=torch.randn(T, H, K), k=torch.randn(T, H, K), v=torch.randn(T, HV, V), g=torch.randn(T, HV),
                beta=torch.rand(T, HV), cu_seqlens=packed([T]), state_pool=torch.zeros(2, HV, K, V),
                read_slots=torch.tensor([-1]), write_slots=torch.tensor([-1]))
    with pytest.raises(ValueError, match="multiple of key heads"):
        rec.indexed_recurrent_gated_delta_rule(**args)
    args.update(v=torch.randn(T, 4, V), g=torch.randn(T, 4), beta=torch.rand(T, 4), state_pool=torch.zeros(2, 4, K, V))
    with pytest.raises(ValueError, match="unit stride"):
        rec.indexed_recurrent_gated_delta_rule(**{**args, "q": torch.randn(T, H, 2 * K)[..., ::2]})
    with pytest.raises(ValueError, match="fp32"):
        rec.indexed_recurrent_gated_delta_rule(**{**args, "state_pool": torch.zeros(2, 4, K, V).double()})


# ---- the choice in TritonOps: a host decision by the pass's autotune class ----

def meta_of(n, L, shape_class=None):
    cu = torch.arange(n + 1) * L
    slots = torch.full((n,), -1)
    return PassMeta(cu_seqlens=cu, read_slots=slots, write_slots=slots.clone(), prefix_lens=torch.zeros(n),
                    block_table=torch.zeros(n, 1, dtype=torch.int32), shape_class=shape_class)


def test_triton_ops_picks_recurrent_only_for_its_classes(monkeypatch):
    from kev.ops import triton_ops
    from kev.ops.gathered_ops import GatheredOps

    shapes = {(6, 32): ShapeClass.ROWS_FEW, (1, 48): ShapeClass.ROWS_FEW, (16, 64): ShapeClass.ROWS_MID,
              (96, 32): ShapeClass.ROWS_WIDE, (1, 2200): ShapeClass.DOCS_FEW, (16, 2048): ShapeClass.DOCS_WIDE}
    assert all(classify(n, n * L) is cls for (n, L), cls in shapes.items())
    off, few = triton_ops.TritonOps(), triton_ops.TritonOps(recurrent_classes={"rows_few"})
    two = GatheredOps(recurrent_classes=[ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID])
    assert off.recurrent_classes == frozenset() and few.recurrent_classes == {ShapeClass.ROWS_FEW}
    for (n, L), cls in shapes.items():
        meta = meta_of(n, L)
        assert not off.recurrent(meta, n * L)
        assert few.recurrent(meta, n * L) is (cls is ShapeClass.ROWS_FEW)
        assert two.recurrent(meta, n * L) is (cls in (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID))
    # a meta that names its class (a CUDA-graph STATE bucket) is taken at its word
    assert few.recurrent(meta_of(16, 32, ShapeClass.ROWS_FEW), 512)
    assert not few.recurrent(meta_of(6, 32, ShapeClass.DOCS_FEW), 192)
    with pytest.raises(ValueError):
        triton_ops.TritonOps(recurrent_classes={"rows"})

    # gated_delta_rule calls the chosen function with the common keyword arguments
    called = []
    monkeypatch.setattr(triton_ops, "indexed_recurrent_gated_delta_rule", lambda **kw: called.append(("rec", kw)))
    monkeypatch.setattr(triton_ops, "indexed_chunk_gated_delta_rule", lambda **kw: called.append(("chunk", kw)))
    H, HV, K, V = 1, 2, 4, 4
    for ops in (few, two, off):
        for n, L in ((6, 32), (16, 64)):
            T = n * L
            ops.gated_delta_rule(torch.zeros(T, H, K), torch.zeros(T, H, K), torch.zeros(T, HV, V),
                                 torch.zeros(T, HV), torch.zeros(T, HV), meta_of(n, L), torch.zeros(2, HV, K, V))
    assert [c[0] for c in called] == ["rec", "chunk", "rec", "rec", "chunk", "chunk"]
    common = {"q", "k", "v", "g", "beta", "cu_seqlens", "state_pool", "read_slots", "write_slots",
              "chunk_indices", "chunk_offsets"}
    assert all(common <= set(kw) for _, kw in called)
    assert called[2][1]["out_pool"] is not None  # gathered: rows buffer read, the bank written


def test_state_bucket_meta_carries_its_class():
    """A STATE bucket of 8 documents x 64 has 16 sequences (each document's padding one): its
    kernels must choose by the bucket's class (the one it is tuned and warmed under)."""
    from kev.static_pass import GraphKey, PassKind, StaticPass

    key = GraphKey(PassKind.STATE, 8, 64)
    sp = StaticPass(key, table_width=2, attn_block=16, device="cpu")
    assert key.shape_class is ShapeClass.ROWS_FEW and classify(sp.meta.num_seqs, key.num_tokens) is ShapeClass.ROWS_MID
    assert sp.meta.pass_class(key.num_tokens) is ShapeClass.ROWS_FEW
    rows = StaticPass(GraphKey(PassKind.ROWS, 16, 32, 16), table_width=2, attn_block=16, device="cpu")
    assert rows.meta.pass_class(16 * 32) is classify(16, 16 * 32)


def test_model_with_recurrent_indexed_equals_gathered_and_reference(interp):
    """Whole tiny model with the recurrent delta rule in every class: indexed == gathered bit for bit,
    ~= torch; rows leave the bank unchanged. Strided pools, repeated and strided read slots, a
    long document state-passed in chunks carried in its slot (its second chunk reads and writes it)."""
    from kernel_support import stored_then_rows
    from random_models import random_model, tiny_config

    model = random_model(tiny_config(hv_per_h=2), seed=3)
    g = torch.Generator().manual_seed(9)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 100)]
    rows = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 17, 64)]
    read = torch.tensor([0, 7, 2, 7, 0, 7])[::2]  # a strided index view: slots 0, 2, 0
    doc_lens = torch.tensor([100, 0, 40, 0])
    everywhere = frozenset(ShapeClass)
    named = (("torch", TorchOps()), ("indexed", interp.triton_ops.TritonOps(everywhere)),
             ("gathered", interp.gathered_ops.GatheredOps(recurrent_classes=everywhere)))
    outs, banks = stored_then_rows(model, named, docs, [2, 0], rows, read, doc_lens, max_doc_tokens=128)
    assert torch.equal(outs["indexed"], outs["gathered"])
    assert rel_err(outs["torch"], outs["indexed"]) <= 1e-4
    for a, b in zip(banks["torch"].tensors(), banks["indexed"].tensors()):
        assert rel_err(a, b) <= 1e-4
