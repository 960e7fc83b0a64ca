"""One DeltaNet layer's non-GEMM kernels, once each, for Nsight Compute to read their counters.

The L2-flushed floors (`kernel_floors.json`) say how far each kernel is from its memory floor, not
why. Five kernels written to beat fla's or to fuse past the floors have lost (`docs/decisions.md`),
so the next step is the hardware's own account: occupancy, the warps' stall reasons, achieved
bandwidth. This script compiles and autotunes everything first, then runs the conv, the prep, fla's
intra-chunk pair, our scan and fla's output kernel once each between `cudaProfilerStart` and
`cudaProfilerStop`, at the state pass benchmark's 16 x 2,048 tokens and Kev-4B's heads. Run it
under `ncu --profile-from-start off` (`gpu_check.sh ncu-delta`): only those launches are profiled.

    ncu --profile-from-start off --clock-control none --csv --page details python -m bench.ncu_delta_rule
"""

from __future__ import annotations

import argparse

import torch
from fla.ops.utils.index import prepare_chunk_indices

from bench.common import kev4b_config
from kev.ops.conv.indexed_conv import indexed_causal_conv
from kev.ops.delta_rule.indexed_scan import indexed_chunk_gated_delta_rule
from kev.ops.gates import DeltaGates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-tokens", type=int, default=2048)
    args = ap.parse_args()
    cfg = kev4b_config()
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    N, T = args.seqs, args.seqs * args.seq_tokens
    C = 2 * H * K + HV * V
    bf = dict(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, C, generator=gen, **bf)
    weight = torch.randn(C, 4, generator=gen, **bf) * 0.5
    ab = torch.randn(T, 2 * HV, generator=gen, **bf)
    gates = DeltaGates(ab[:, :HV], ab[:, HV:], torch.randn(HV, device="cuda", generator=gen),
                       torch.randn(HV, device="cuda", generator=gen))
    cu = torch.arange(N + 1, device="cuda") * args.seq_tokens
    chunks = prepare_chunk_indices(cu, 64)
    none = torch.full((N,), -1, device="cuda", dtype=torch.int64)  # new documents: no start state, none kept
    conv_pool = torch.zeros(1, C, 3, **bf)
    state_pool = torch.zeros(1, HV, K, V, device="cuda")

    def layer():
        qk, v = indexed_causal_conv(x, weight, cu, conv_pool, none, none, chunk_indices=chunks, split=2 * H * K)
        q, k = qk[:, :H * K].unflatten(1, (H, K)), qk[:, H * K:].unflatten(1, (H, K))
        return indexed_chunk_gated_delta_rule(q=q, k=k, v=v.unflatten(1, (HV, V)), gates=gates, cu_seqlens=cu,
                                              state_pool=state_pool, read_slots=none, write_slots=none,
                                              chunk_indices=chunks)

    layer()  # compiles and autotunes (fla's autotuners time their configs at the first call)
    layer()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    layer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled one DeltaNet layer's delta rule and conv at {N} x {args.seq_tokens} tokens")


if __name__ == "__main__":
    main()
