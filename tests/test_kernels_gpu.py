"""GPU checks of the indexed row path (run on the H200; skipped on CPU by conftest's `gpu` marker).

A small model with the real head dims (K = V = 128, attention head_dim 256, HV/H = 2, Hq/Hkv = 4)
and random bf16 weights. Documents are state-passed into strided bank pools (a long one in
chunks carried in its slot); rows of 1/17/64/129 tokens in passes of 1/3/8/17/96 rows read them
back through repeated, strided and changed slot indices.
- indexed (`TritonOps`) == gathered (`GatheredOps`) bit for bit, hidden states of every token;
- the bank is bit-for-bit unchanged by row passes;
- every autotune config of each own kernel gives bit-identical outputs (and states);
- Triton ~= the torch reference (`TorchOps`) for hidden states and stored states;
- no kernel compiles again when the batch size changes (1..64).
"""

import pytest
import torch

from kernel_support import make_pools, packed, row_pass, state_pass
from kev.ops.gathered_ops import GatheredOps
from kev.ops.torch_ops import TorchOps
from kev.ops.triton_ops import TritonOps
from random_models import random_model, tiny_config

pytestmark = pytest.mark.gpu

DOC_LENS = (5, 64, 129, 300, 1100, 2200)
ROW_LENS = (1, 17, 64, 129)
SLOTS = (6, 0, 3, 5, 1, 2)  # slot of each document (slot 4 stays empty)


def rel_err(ref, out):
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_config(hv_per_h=2, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
                      linear_key_head_dim=128, linear_value_head_dim=128)
    model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda()
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in DOC_LENS]
    banks = {}
    for name, ops in (("triton", TritonOps()), ("torch", TorchOps())):
        pools, table = make_pools(cfg, 7, 2304, 64, torch.bfloat16, "cuda", strided=True)
        state_pass(model, ops, pools, table, docs, list(SLOTS), chunk=1024)  # 2200 tokens: 3 chunks via the slot
        banks[name] = pools
    doc_lens = torch.zeros(7, dtype=torch.int64)
    doc_lens[list(SLOTS)] = torch.tensor(DOC_LENS)
    return dict(model=model, cfg=cfg, docs=docs, banks=banks, table=table, doc_lens=doc_lens.cuda())


def make_rows(n_rows, seed):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 300, (ROW_LENS[i % len(ROW_LENS)],), generator=g).tolist() for i in range(n_rows)]
    owners = torch.randint(0, len(DOC_LENS), (n_rows,), generator=g)
    slots = torch.tensor(SLOTS)[owners]
    # a strided index view: every other element of an interleaved buffer
    read = torch.stack([slots, torch.full_like(slots, 99)], 1).reshape(-1).cuda()[::2]
    assert not read.is_contiguous() or n_rows == 1
    return rows, read


@pytest.mark.parametrize("n_rows", [1, 3, 8, 17, 96], ids=lambda n: f"rows={n}")
def test_indexed_equals_gathered_bitwise(setup, n_rows):
    model, pools, table, doc_lens = setup["model"], setup["banks"]["triton"], setup["table"], setup["doc_lens"]
    before = [t.clone() for t in pools.tensors()]
    indexed, gathered = TritonOps(), GatheredOps()
    for seed in (n_rows, 1000 + n_rows):  # changed indices, same shapes
        rows, read = make_rows(n_rows, seed)
        a = row_pass(model, indexed, pools, table, rows, read, doc_lens)
        b = row_pass(model, gathered, pools, table, rows, read, doc_lens)
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"indexed != gathered, max diff {(a.float() - b.float()).abs().max().item()}"
        again = row_pass(model, indexed, pools, table, rows, read.contiguous(), doc_lens)
        assert torch.equal(a, again), "a repeated (contiguous-index) pass differs"
    for b, a in zip(before, pools.tensors()):
        assert torch.equal(b, a), "a row pass changed the bank"


def test_triton_matches_torch_reference(setup):
    model, table, doc_lens = setup["model"], setup["table"], setup["doc_lens"]
    ref_bank, tri_bank = setup["banks"]["torch"], setup["banks"]["triton"]
    report = {kind: max(rel_err(r[list(SLOTS)], o[list(SLOTS)])
                        for r, o in zip(getattr(ref_bank, kind), getattr(tri_bank, kind)))
              for kind in ("recurrent", "conv", "keys", "values")}
    rows, read = make_rows(17, 5)
    h_ref = row_pass(model, TorchOps(), setup["banks"]["torch"], table, rows, read, doc_lens)
    h_tri = row_pass(model, TritonOps(), setup["banks"]["triton"], table, rows, read, doc_lens)
    report["hidden"] = rel_err(h_ref, h_tri)
    print("triton vs torch rel err:", report)
    assert report["recurrent"] <= 3e-2 and report["conv"] <= 3e-2
    assert report["keys"] <= 3e-2 and report["values"] <= 3e-2
    assert report["hidden"] <= 5e-2


def kernel_inputs(seed=0, n=17):
    """Layer-shaped bf16 inputs for the kernels on their own (K = V = 128, D = 256)."""
    g = torch.Generator().manual_seed(seed)
    lens = [ROW_LENS[i % 4] for i in range(n)]
    T, H, HV, K, V, C, W, S = sum(lens), 4, 8, 128, 128, 2 * 4 * 128 + 8 * 128, 4, 9
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    # a slot written in a pass is read by no other sequence of it (the ops' contract)
    read = torch.randint(0, S - 2, (n,), generator=g)
    read[0], read[2] = -1, S - 2
    write = torch.full((n,), -1)
    write[1], write[2] = S - 1, S - 2  # one fresh slot, one read == write (a document continuing in place)
    # attention: rows share documents (page tables 0..7); row 3 alone owns table 8 and stores its K/V there
    table_rows = torch.randint(0, 8, (n,), generator=g)
    table_rows[3] = 8
    attn_write = torch.full((n,), -1)
    attn_write[3] = 0
    return dict(
        cu=packed(lens, "cuda"), read=read.cuda(), write=write.cuda(),
        qkv=r(T, C).bfloat16().cuda(), weight=(r(C, W) * 0.5).bfloat16().cuda(),
        conv_pool=r(S, C, W - 1).bfloat16().cuda(), state_pool=(r(S, HV, K, V) * 0.1).cuda(),
        g=(-torch.rand(T, HV, generator=g)).cuda(), beta=torch.rand(T, HV, generator=g).bfloat16().cuda(),
        q=r(T, 8, 256).bfloat16().cuda(), k=r(T, 2, 256).bfloat16().cuda(), v=r(T, 2, 256).bfloat16().cuda(),
        prefix=torch.randint(0, 600, (n,), generator=g).cuda(),
        pages=(r(9 * 12, 64, 2, 256).bfloat16().cuda(), r(9 * 12, 64, 2, 256).bfloat16().cuda()),
        table=torch.arange(9 * 12, dtype=torch.int32).view(9, 12)[table_rows].cuda(),
        attn_write=attn_write.cuda(),
        H=H, HV=HV, K=K, V=V,
    )


def test_every_autotune_config_bit_identical():
    from kev.ops.attention import paged_prefix
    from kev.ops.conv import indexed_conv
    from kev.ops.delta_rule import indexed_scan

    x = kernel_inputs()
    H, HV, K, V = x["H"], x["HV"], x["K"], x["V"]
    hk = H * K

    def conv(cfg):
        pool = x["conv_pool"].clone()
        y = indexed_conv.indexed_causal_conv(x=x["qkv"], weight=x["weight"], cu_seqlens=x["cu"], conv_pool=pool,
                                             read_slots=x["read"], write_slots=x["write"], config=cfg)
        return y, pool

    def l2(cfg):
        return (indexed_scan.l2norm_heads(x["qkv"][:, :hk].unflatten(1, (H, K)), config=cfg),)

    def scan(cfg):
        pool = x["state_pool"].clone()
        qkv = x["qkv"]
        o = indexed_scan.indexed_chunk_gated_delta_rule(
            q=qkv[:, :hk].unflatten(1, (H, K)), k=qkv[:, hk:2 * hk].unflatten(1, (H, K)),
            v=qkv[:, 2 * hk:].unflatten(1, (HV, V)), g=x["g"], beta=x["beta"], cu_seqlens=x["cu"],
            state_pool=pool, read_slots=x["read"], write_slots=x["write"], scan_config=cfg)
        return o, pool

    def attn(cfg):
        kp, vp = x["pages"][0].clone(), x["pages"][1].clone()
        o = paged_prefix.paged_prefix_attention(q=x["q"], k=x["k"], v=x["v"], cu_seqlens=x["cu"],
                                                prefix_lens=x["prefix"], key_pages=kp, value_pages=vp,
                                                block_table=x["table"], write_slots=x["attn_write"], config=cfg)
        return o, kp, vp

    for name, fn, configs in (("conv", conv, indexed_conv.CONV_CONFIGS), ("l2norm", l2, indexed_scan.L2NORM_CONFIGS),
                              ("scan", scan, indexed_scan.SCAN_CONFIGS), ("attention", attn,
                                                                          paged_prefix.ATTN_CONFIGS)):
        first = fn(configs[0])
        assert all(torch.isfinite(t.float()).all() for t in first), name
        for cfg in configs[1:]:
            out = fn(cfg)
            for a, b in zip(first, out):
                assert torch.equal(a, b), f"{name}: config {cfg} differs from {configs[0]}"


def test_kernels_match_references():
    """Each kernel on its own at the real head dims, against the torch reference."""
    from kev.ops.attention.paged_prefix import paged_prefix_attention
    from kev.ops.conv.indexed_conv import indexed_causal_conv
    from kev.ops.conv.naive import causal_conv_reference
    from kev.ops.delta_rule.indexed_scan import indexed_chunk_gated_delta_rule
    from kev.ops.meta import PassMeta

    x = kernel_inputs(seed=1)
    H, HV, K, V = x["H"], x["HV"], x["K"], x["V"]
    hk = H * K
    read, write, cu = x["read"], x["write"], x["cu"]
    pool, ref_pool = x["conv_pool"].clone(), x["conv_pool"].clone()
    y = indexed_causal_conv(x=x["qkv"], weight=x["weight"], cu_seqlens=cu, conv_pool=pool, read_slots=read,
                            write_slots=write)
    y_ref = causal_conv_reference(x["qkv"], x["weight"], cu.tolist(), ref_pool, read.tolist(), write.tolist())
    assert rel_err(y_ref, y) <= 1e-2 and torch.equal(pool, ref_pool)

    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=x["prefix"],
                    block_table=x["table"])
    qkv = y
    q, k, v = (qkv[:, :hk].unflatten(1, (H, K)), qkv[:, hk:2 * hk].unflatten(1, (H, K)),
               qkv[:, 2 * hk:].unflatten(1, (HV, V)))
    spool, ref_spool = x["state_pool"].clone(), x["state_pool"].clone()
    o = indexed_chunk_gated_delta_rule(q=q, k=k, v=v, g=x["g"], beta=x["beta"], cu_seqlens=cu, state_pool=spool,
                                       read_slots=read, write_slots=write)
    o_ref = TorchOps().gated_delta_rule(q, k, v, x["g"], x["beta"], meta, ref_spool)
    print("delta rule rel err:", rel_err(o_ref, o), rel_err(ref_spool, spool))
    assert rel_err(o_ref, o) <= 2e-2 and rel_err(ref_spool, spool) <= 2e-2

    kp, vp = x["pages"][0].clone(), x["pages"][1].clone()
    rkp, rvp = kp.clone(), vp.clone()
    wmeta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=x["attn_write"], prefix_lens=x["prefix"],
                     block_table=x["table"])
    a = paged_prefix_attention(q=x["q"], k=x["k"], v=x["v"], cu_seqlens=cu, prefix_lens=x["prefix"], key_pages=kp,
                               value_pages=vp, block_table=x["table"], write_slots=wmeta.write_slots)
    a_ref = TorchOps().attention(x["q"], x["k"], x["v"], wmeta, rkp, rvp)
    print("attention rel err:", rel_err(a_ref, a))
    assert rel_err(a_ref, a) <= 2e-2 and torch.equal(kp, rkp) and torch.equal(vp, rvp)


def test_no_recompiles_over_batch_sizes(setup, monkeypatch):
    """After one warm pass, row passes of 1..64 rows (32 tokens each) compile nothing new."""
    from triton import knobs

    model, pools, table, doc_lens = setup["model"], setup["banks"]["triton"], setup["table"], setup["doc_lens"]
    ops = TritonOps()
    g = torch.Generator().manual_seed(3)

    def rows_of(n):
        rows = [torch.randint(0, 300, (32,), generator=g).tolist() for _ in range(n)]
        return rows, torch.tensor(SLOTS, device="cuda")[torch.randint(0, len(SLOTS), (n,), generator=g).cuda()]

    row_pass(model, ops, pools, table, *rows_of(1), doc_lens)
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: compiled.append(kw["repr"]))
    for n in range(1, 65):
        row_pass(model, ops, pools, table, *rows_of(n), doc_lens)
    assert compiled == [], f"{len(compiled)} compiles after warm-up, first: {compiled[:3]}"
