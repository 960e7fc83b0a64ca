"""The CUDA-graph key layout through the Triton kernels, under TRITON_INTERPRET=1 on CPU.

The conv, delta-rule and attention kernels (TritonOps, with the static chunk lists a key pins)
give bit-identical outputs for the real tokens, and store bit-identical states, when a pass is
packed into a key (kev.exec.static_pass): its sequences end to end as in the unpadded pass (the
real tokens first), then padding sequences of at most one chunk each up to T tokens, which read
nothing and write nowhere, then empty sequences, and no-op entries filling the chunk lists to C. Rows (ROWS), new
documents and continuing chunks that read their slot (STATE). The same check at the real head
dims runs on the GPU (tests/exec/test_graphs_gpu.py). Few cases: the interpreter is slow.
"""

import pytest
import torch

from interpret_support import accesses_avoid
from kernel_support import make_pools, packed
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.exec.static_pass import GraphKey, PassKind, StaticPass, chunks_needed
from random_models import tiny_config


def inputs(cfg, T, g):
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(T, cfg.conv_dim), q=r(T, H, K), k=r(T, H, K), v=r(T, HV, V), g=-torch.rand(T, HV, generator=g),
                beta=torch.rand(T, HV, generator=g), aq=r(T, cfg.num_attention_heads, cfg.head_dim),
                ak=r(T, cfg.num_key_value_heads, cfg.head_dim), av=r(T, cfg.num_key_value_heads, cfg.head_dim))


@pytest.mark.parametrize("key,lens,starts,hv_per_h", [
    # rows: `pytest -m slow` (~15 s); the GPU suite checks row-key padding exact in every token-mixing kernel.
    # Two rows over two chunks, a 24-token padding sequence, four empty sequences, a no-op entry.
    pytest.param(GraphKey(PassKind.ROWS, 192, 8), [65, 100, 3], None, 2, marks=pytest.mark.slow),
    # a padding sequence (50 tokens), an empty one, a no-op chunk; three value heads per key
    # head (Kev-27B's 48 / 16: the other cases have two)
    (GraphKey(PassKind.STATE, 128, 4), [48, 30], None, 3),
    # 196 padding tokens: four padding sequences (64, 64, 64, 4 tokens), the last in the key's last slot
    (GraphKey(PassKind.STATE, 256, 6), [40, 20], None, 2),
    # no padding tokens (an empty padding sequence: its entries all no-ops), documents ending mid-chunk:
    # `pytest -m slow` (~25 s); the GPU suite's packed-key tests cover it at the real head dims
    pytest.param(GraphKey(PassKind.STATE, 205, 8), [130, 70, 5], None, 2, marks=pytest.mark.slow),
    # a long document's next chunk continuing the state in its slot (reads it), beside a new document:
    # `pytest -m slow` (~30 s); tests/exec/test_graph_layout.py runs continuing chunks through the torch ops
    pytest.param(GraphKey(PassKind.STATE, 128, 6), [40, 20], [64, 0], 2, marks=pytest.mark.slow),
], ids=["rows", "state-hv_per_h=3", "state-padding-pieces", "state-spare-entries", "state-continuing"])
def test_key_padding_is_bit_exact(interp, key, lens, starts, hv_per_h):
    cfg = tiny_config(hv_per_h=hv_per_h)
    g = torch.Generator().manual_seed(1)
    N, kind, real_tokens = len(lens), key.kind, sum(lens)
    assert len(lens) < key.chunks and chunks_needed(lens, key.tokens) <= key.chunks  # the pass fits the key
    # random padding everywhere; rows past the key's tokens, where no-op entries' chunks would lie,
    # that no kernel may touch (a081b28's conv read them: the GPU faulted when they were unmapped)
    beyond = key.chunks * 64 + 64
    real, whole = inputs(cfg, real_tokens, g), inputs(cfg, key.num_tokens + beyond, g)
    padded = {name: t[: key.num_tokens] for name, t in whole.items()}
    guards = [t[key.num_tokens:] for t in whole.values()]
    dst = torch.arange(real_tokens)  # packed: the real tokens first, as in the unpadded pass; the padding after
    for name in real:
        padded[name][dst] = real[name]
    weight = torch.randn(cfg.conv_dim, cfg.conv_kernel, generator=g) * 0.5
    pools_a, table = make_pools(cfg, 8, 2304, 64, torch.float32, "cpu")
    for t in pools_a.tensors():
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    pools_b, _ = make_pools(cfg, 8, 2304, 64, torch.float32, "cpu")
    for a, b in zip(pools_a.tensors(), pools_b.tensors()):
        b.copy_(a)
    cu = packed(lens)
    if kind is PassKind.ROWS:
        read, write, prefix = torch.tensor([3, 0, 6]), torch.full((N,), -1), torch.tensor([300, 5, 1100])
    else:
        begin = torch.tensor(starts or [0] * N)
        write = torch.tensor([1, 4, 6][:N])
        read, prefix = torch.where(begin > 0, write, -1), begin
    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=prefix,
                    block_table=table[read.clamp(min=0) if kind is PassKind.ROWS else write])
    ops = interp.triton_ops.TritonOps()
    sp = StaticPass(key, table.shape[1], interp.attn.query_block(cfg.num_attention_heads // cfg.num_key_value_heads),
                    "cpu")
    assert sp.fits(lens)
    if kind is PassKind.ROWS:
        zeros = torch.zeros(real_tokens, dtype=torch.int64)
        sp.fill_rows(zeros, cu, read, prefix, zeros, torch.zeros(0, dtype=torch.int64), table)
    else:
        sp.fill_state([[0] * m for m in lens], write.tolist(), table, starts)
    assert sp.cu_seqlens[: N + 1].tolist() == cu.tolist() and sp.cu_seqlens[-1] == key.num_tokens
    assert torch.equal(sp.read_slots[:N], read) and torch.equal(sp.write_slots[:N], write)
    assert torch.equal(sp.prefix_lens[:N], prefix)
    ops.pin(sp.meta, sp.indices())

    def run(inp, m, pools):
        return (ops.causal_conv(inp["x"], weight, m, pools.conv[0]),
                ops.gated_delta_rule(inp["q"], inp["k"], inp["v"], DeltaGates.given(inp["g"], inp["beta"]), m,
                                     pools.recurrent[0]),
                ops.attention(inp["aq"], inp["ak"], inp["av"], m, pools.keys[0], pools.values[0]))

    with accesses_avoid(*guards):
        outs = run(padded, sp.meta, pools_b)
    for name, a, b in zip(("conv", "delta rule", "attention"), run(real, meta, pools_a), outs):
        assert torch.equal(a, b[dst]), f"{name}: padding changed a real output"
    for a, b in zip(pools_a.tensors(), pools_b.tensors()):
        assert torch.equal(a, b), "padding changed a stored state"
