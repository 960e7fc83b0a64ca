"""The delta rule's output with the output norm fused in (`kev.ops.delta_rule.chunk_o`) under
TRITON_INTERPRET=1, against fla's `chunk_fwd_o` then our `gated_rms_norm` (what it replaces) and
against the torch reference (TorchOps' delta rule, then the reference norm). fp32 only: the
interpreter's bf16 dots are not the GPU's (the GPU suite checks bf16 at Kev-4B's head shapes)."""

import pytest
import torch

from kernel_support import packed, rel_err
from kev.ops.fused.reference import GatedNorm
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.torch_ops import TorchOps

# sequences across chunk edges (64), one a single token, one empty; reads and writes of slots
LENS, READ, WRITE = [70, 1, 0, 130, 5], [2, -1, 1, -1, 0], [3, 4, -1, 2, -1]


def inputs(seed, ratio):
    g = torch.Generator().manual_seed(seed)
    H, K, V, S = 2, 16, 32, 6
    HV, T = H * ratio, sum(LENS)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v = torch.randn(T, HV, V, generator=g)
    gates = DeltaGates.given(-torch.rand(T, HV, generator=g) * 0.5, torch.rand(T, HV, generator=g))
    zbuf = torch.randn(T, HV, 2 * V, generator=g) * 2  # z a strided view, as out of the fused projection
    norm = GatedNorm(zbuf[..., V:], torch.randn(V, generator=g) * 0.3 + 1, 1e-6)
    pool = torch.randn(S, HV, K, V, generator=g) * 0.3
    return q, k, v, gates, norm, pool


def pass_meta(cu, read, write):
    n = len(LENS)
    return PassMeta(cu_seqlens=cu, read_slots=read, write_slots=write, prefix_lens=torch.zeros(n, dtype=torch.int64),
                    block_table=torch.zeros(n, 1, dtype=torch.int32))


@pytest.mark.parametrize("ratio", [1, 2])
def test_fused_output_norm_matches_unfused_and_reference(interp, poisoned, monkeypatch, ratio):
    q, k, v, gates, norm, pool = inputs(40 + ratio, ratio)
    cu, read, write = packed(LENS), torch.tensor(READ), torch.tensor(WRITE)

    def run(on):
        monkeypatch.setattr(interp.chunk_o, "on", on)
        p = pool.clone()
        o = interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=p,
                                                       read_slots=read, write_slots=write, norm=norm)
        return o, p

    unfused, pool_unfused = run(False)
    fused, pool_fused = run(True)
    assert torch.isfinite(fused).all(), "unwritten (NaN) elements"
    assert torch.equal(pool_fused, pool_unfused)  # the norm changes no state
    assert rel_err(unfused, fused) <= 1e-5
    meta = pass_meta(cu, read, write)
    ref = TorchOps().gated_delta_rule(q, k, v, gates, meta, pool.clone(), norm=norm)
    assert rel_err(ref, fused) <= 2e-3


def test_bad_norms_are_refused(interp, monkeypatch):
    q, k, v, gates, norm, pool = inputs(50, 1)
    monkeypatch.setattr(interp.chunk_o, "on", True)
    cu, read, write = packed(LENS), torch.tensor(READ), torch.tensor(WRITE)
    for bad in (GatedNorm(norm.z[:-1], norm.weight, norm.eps), GatedNorm(norm.z, norm.weight[:-1], norm.eps),
                GatedNorm(norm.z.transpose(1, 2).contiguous().transpose(1, 2), norm.weight, norm.eps)):
        with pytest.raises(ValueError, match="norm"):
            interp.scan.indexed_chunk_gated_delta_rule(q=q, k=k, v=v, gates=gates, cu_seqlens=cu, state_pool=pool,
                                                       read_slots=read, write_slots=write, norm=bad)


def test_indexed_equals_gathered_with_the_fused_norm(interp, poisoned, monkeypatch):
    """Through the ops the model calls, with the fused output norm on: the gathered variant (states
    copied into row buffers first) gives the indexed one's bits, outputs and written slots alike."""
    monkeypatch.setattr(interp.chunk_o, "on", True)
    q, k, v, gates, norm, pool = inputs(60, 2)
    cu, read, write = packed(LENS), torch.tensor(READ), torch.tensor(WRITE)
    meta = pass_meta(cu, read, write)
    pool_i, pool_g = pool.clone(), pool.clone()
    indexed = interp.triton_ops.TritonOps().gated_delta_rule(q, k, v, gates, meta, pool_i, norm=norm)
    gathered = interp.gathered_ops.GatheredOps().gated_delta_rule(q, k, v, gates, meta, pool_g, norm=norm)
    assert torch.equal(indexed, gathered)
    assert torch.equal(pool_i, pool_g)
    monkeypatch.setattr(interp.chunk_o, "on", False)
    unfused = interp.triton_ops.TritonOps().gated_delta_rule(q, k, v, gates, meta, pool.clone(), norm=norm)
    assert rel_err(unfused, indexed) <= 1e-5
