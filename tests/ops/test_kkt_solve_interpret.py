"""The delta rule's intra-chunk inverse (`kev.ops.delta_rule.kkt_solve`) under TRITON_INTERPRET=1:
against the fp64 triangular solve, against fla's fused KK^T + solve (what it replaces), and through
the whole delta rule, switched on against off. fp32 only: the interpreter's bf16 dots are not the
GPU's (the GPU suite checks bf16 at Kev-4B's head shapes)."""

import pytest
import torch

from kernel_support import packed, packed_chunks, rel_err
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta

# sequences across chunk edges (64) and inside one row block (16), one a single token, one empty
# (no slot is read by one sequence and written by another: their order within a pass is not defined)
LENS, READ, WRITE = [70, 1, 0, 130, 5, 33], [2, -1, 1, -1, 0, 6], [3, 4, -1, 7, -1, 5]


def chunk_gates(lens, HV, gen):
    """g: a chunk-local cumsum of negative log2 decays (as `prep` writes it), beta in (0, 1)."""
    T = sum(lens)
    g = -torch.rand(T, HV, generator=gen) * 0.7
    cu = packed(lens).tolist()
    for s, e in zip(cu, cu[1:]):
        for c in range(s, e, 64):
            g[c:min(c + 64, e)] = g[c:min(c + 64, e)].cumsum(0)
    return g.contiguous(), torch.rand(T, HV, generator=gen)


def normalised_keys(T, H, K, gen):
    k = torch.randn(T, H, K, generator=gen)
    return (k / k.norm(dim=-1, keepdim=True)).contiguous()


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_inverse_matches_the_fp64_solve_and_fla(interp, poisoned, ratio):
    gen = torch.Generator().manual_seed(10 + ratio)
    H, K = 2, 32
    HV, T = H * ratio, sum(LENS)
    k = normalised_keys(T, H, K, gen)
    g, beta = chunk_gates(LENS, HV, gen)
    cu = packed(LENS)
    chunks = interp.scan.prepare_chunk_indices(cu, 64)
    out = interp.kkt.kkt_solve(k, g, beta, cu, chunks)
    assert torch.isfinite(out).all(), "unwritten (NaN) elements"
    ref = interp.kkt.kkt_solve_reference(k, g, beta, cu)
    assert rel_err(ref, out) <= 1e-5
    # fla's fused kernel's output, zeros above the diagonal as ours writes them
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra

    v = torch.randn(T, HV, 16, generator=gen)
    _, _, fla_a = chunk_gated_delta_rule_fwd_intra(k=k[None], v=v[None], g=g[None], beta=beta[None], cu_seqlens=cu,
                                                   chunk_size=64, chunk_indices=chunks)
    assert rel_err(fla_a[0], out) <= 1e-5
    # every value head of a key head in one program (K K^T formed once): the same products
    shared = interp.kkt.kkt_solve(k, g, beta, cu, chunks, heads_per_program=0)
    assert torch.equal(shared, out)


def test_no_op_entries_write_nothing(interp):
    """A CUDA-graph key's chunk list has entries past the sequences' ends: they must not write."""
    gen = torch.Generator().manual_seed(3)
    H, HV, K = 2, 4, 32
    lens = [70, 5]
    T = sum(lens)
    k = normalised_keys(T, H, K, gen)
    g, beta = chunk_gates(lens, HV, gen)
    cu = packed(lens)
    exact = interp.kkt.kkt_solve(k, g, beta, cu, interp.scan.prepare_chunk_indices(cu, 64))
    padded_chunks = torch.cat([interp.scan.prepare_chunk_indices(cu, 64), torch.tensor([[1, 1], [1, 2], [0, 5]])])
    assert torch.equal(interp.kkt.kkt_solve(k, g, beta, cu, padded_chunks), exact)


def inputs(seed, ratio):
    gen = torch.Generator().manual_seed(seed)
    H, K, V, S = 2, 16, 32, 8
    HV, T = H * ratio, sum(LENS)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, HV, V, generator=gen)
    gates = DeltaGates.given(-torch.rand(T, HV, generator=gen) * 0.5, torch.rand(T, HV, generator=gen))
    return q, k, v, gates, torch.randn(S, HV, K, V, generator=gen) * 0.3


@pytest.mark.parametrize("ratio", [1, 2])
def test_delta_rule_with_the_inverse_on_matches_off(interp, poisoned, monkeypatch, ratio):
    q, k, v, gates, pool = inputs(20 + ratio, ratio)
    cu, read, write = packed(LENS), torch.tensor(READ), torch.tensor(WRITE)

    def run(on):
        monkeypatch.setattr(interp.kkt, "on", on)
        p = pool.clone()
        return interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=p,
                                                          read_slots=read, write_slots=write), p

    (o_off, pool_off), (o_on, pool_on) = run(False), run(True)
    assert torch.isfinite(o_on).all()
    assert rel_err(o_off, o_on) <= 1e-5
    assert rel_err(pool_off, pool_on) <= 1e-5


def test_indexed_equals_gathered_with_the_inverse_on(interp, poisoned, monkeypatch):
    """Through the ops the model calls: the gathered variant gives the indexed one's bits."""
    monkeypatch.setattr(interp.kkt, "on", True)
    q, k, v, gates, pool = inputs(30, 2)
    cu, read, write = packed(LENS), torch.tensor(READ), torch.tensor(WRITE)
    n = len(LENS)
    meta = PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=torch.zeros(n, dtype=torch.int64),
                    block_table=torch.zeros(n, 1, dtype=torch.int32))
    pool_i, pool_g = pool.clone(), pool.clone()
    indexed = interp.triton_ops.TritonOps().gated_delta_rule(q, k, v, gates, meta, pool_i)
    gathered = interp.gathered_ops.GatheredOps().gated_delta_rule(q, k, v, gates, meta, pool_g)
    assert torch.equal(indexed, gathered)
    assert torch.equal(pool_i, pool_g)


def test_bad_inputs_are_refused(interp):
    gen = torch.Generator().manual_seed(4)
    H, HV, K, T = 2, 4, 32, 20
    k = normalised_keys(T, H, K, gen)
    g, beta = chunk_gates([T], HV, gen)
    cu = packed([T])
    chunks = interp.scan.prepare_chunk_indices(cu, 64)
    cases = [(k.transpose(0, 1).contiguous().transpose(0, 1), g, beta, "k must be"),
             (k, g[:, :3], beta[:, :3], "multiple of H"),
             (k, g[:-1], beta, "must be"),
             (k, g.double(), beta, "fp32"),
             (k, g, torch.rand(HV, T).T, "contiguous")]
    for kk, gg, bb, match in cases:
        with pytest.raises(ValueError, match=match):
            interp.kkt.kkt_solve(kk, gg, bb, cu, chunks)
