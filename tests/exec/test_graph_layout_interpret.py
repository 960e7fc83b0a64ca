"""The CUDA-graph bucket layouts through the Triton kernels, under TRITON_INTERPRET=1 on CPU.

The conv, delta-rule and attention kernels (TritonOps, with the static chunk lists a bucket pins)
give bit-identical outputs for the real tokens, and store bit-identical states, when a pass is
padded into a bucket: rows padded at their end to L over two chunks (ROWS), and documents each
followed by a padding sequence, with empty sequences and no-op chunks (STATE). The same check at
the real head dims runs on the GPU (tests/exec/test_graphs_gpu.py). Three cases: the interpreter is slow.
"""

import pytest
import torch

from kernel_support import make_pools, packed
from kev.ops.meta import PassMeta
from kev.exec.static_pass import GraphKey, PassKind, StaticPass
from random_models import tiny_config



def inputs(cfg, T, g):
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
        cfg.linear_value_head_dim
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(x=r(T, cfg.conv_dim), q=r(T, H, K), k=r(T, H, K), v=r(T, HV, V), g=-torch.rand(T, HV, generator=g),
                beta=torch.rand(T, HV, generator=g), aq=r(T, cfg.num_attention_heads, cfg.head_dim),
                ak=r(T, cfg.num_key_value_heads, cfg.head_dim), av=r(T, cfg.num_key_value_heads, cfg.head_dim))


@pytest.mark.parametrize("kind,lens,L,cap", [
    # rows: `pytest -m slow` (~15 s); the GPU suite checks row-bucket padding exact in every token-mixing kernel
    pytest.param(PassKind.ROWS, [65, 100, 3], 128, 4, marks=pytest.mark.slow),  # two chunks per row, two padding rows
    (PassKind.STATE, [48, 30], 64, 4),  # two empty documents, padding sequences, no-op chunks
    # a document filling its pair (empty padding sequence), one past a chunk, one short: every kind
    # of spare entry in the filled chunk lists (kev.exec.static_pass.pair_chunks)
    (PassKind.STATE, [130, 70, 5], 130, 3),
], ids=["rows", "state", "state-spare-entries"])
def test_bucket_padding_is_bit_exact(interp, kind, lens, L, cap):
    cfg = tiny_config(hv_per_h=2)
    g = torch.Generator().manual_seed(1)
    N, key = len(lens), GraphKey(kind, cap, L, 8)
    real, padded = inputs(cfg, sum(lens), g), inputs(cfg, key.num_tokens, g)  # random padding everywhere
    dst = torch.tensor([n * L + t for n, m in enumerate(lens) for t in range(m)])
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
        read, write, prefix = torch.full((N,), -1), torch.tensor([1, 4, 6][:N]), torch.zeros(N, dtype=torch.int64)
    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=prefix,
                    block_table=table[read.clamp(min=0) if kind is PassKind.ROWS else write])
    ops = interp.triton_ops.TritonOps()
    sp = StaticPass(key, table.shape[1], interp.attn.query_block(cfg.num_attention_heads // cfg.num_key_value_heads),
                    "cpu")
    if kind is PassKind.ROWS:
        zeros = torch.zeros(sum(lens), dtype=torch.int64)
        sp.fill_rows(zeros, cu, read, prefix, zeros, torch.zeros(0, dtype=torch.int64), table)
    else:
        sp.fill_state([[0] * m for m in lens], write.tolist(), table)
    ops.pin(sp.meta, sp.indices())

    def run(inp, m, pools):
        return (ops.causal_conv(inp["x"], weight, m, pools.conv[0]),
                ops.gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], m, pools.recurrent[0]),
                ops.attention(inp["aq"], inp["ak"], inp["av"], m, pools.keys[0], pools.values[0]))

    for name, a, b in zip(("conv", "delta rule", "attention"), run(real, meta, pools_a), run(padded, sp.meta, pools_b)):
        assert torch.equal(a, b[dst]), f"{name}: padding changed a real output"
    for a, b in zip(pools_a.tensors(), pools_b.tensors()):
        assert torch.equal(a, b), "padding changed a stored state"
