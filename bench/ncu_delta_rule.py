"""One layer's non-GEMM kernels, once each, for Nsight Compute to read their counters.

The L2-flushed floors (`kernel_floors.json`) say how far each kernel is from its memory floor, not
why. Five kernels written to beat fla's or to fuse past the floors have lost (`docs/decisions.md`),
so the next step is the hardware's own account: occupancy, the warps' stall reasons, achieved
bandwidth. This runs the served path of each of `bench.kernel_floors`' cases (the norms, silu-mul,
the conv, the prep, fla's intra-chunk pair, our scan, fla's output kernel) once to compile and
autotune, then once each between `cudaProfilerStart` and `cudaProfilerStop`, at the state pass
benchmark's 16 x 2,048 tokens and Kev-4B's heads. Run it under `ncu --profile-from-start off`
(`gpu_check.sh ncu-delta`): only those launches are profiled.

    ncu --profile-from-start off --clock-control none --csv --page details python -m bench.ncu_delta_rule
"""

from __future__ import annotations

import argparse

import torch

from bench.common import kev4b_config
from bench.kernel_floors import cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-tokens", type=int, default=2048)
    args = ap.parse_args()
    layer = cases(kev4b_config(), args.seqs, args.seq_tokens, "cuda")  # builds inputs, runs each once
    for case in layer:
        case.ours()  # compiled and autotuned before profiling (fla's autotuners time configs at a first call)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for case in layer:
        case.ours()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {', '.join(c.name for c in layer)} at {args.seqs} x {args.seq_tokens} tokens")


if __name__ == "__main__":
    main()
