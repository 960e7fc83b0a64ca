"""The MLP's gate/up GEMM with silu_mul in its store (`kev.ops.fused.gate_up`) against what runs
now, cuBLAS's GEMM then our `silu_mul` kernel, side by side in one process at Kev-4B's MLP shape.

The state pass's floors (`kernel_floors.json`) leave fusion as the only way past them: silu_mul is
~20 ms of a 16 x 2,048 pass on an H100, and the gate/up GEMM writes twice the bytes it needs. The
fusion pays only if our GEMM runs near cuBLAS's rate, so each config is timed at several token
counts (the passes' sizes: one request's rows, a five-long sweep, a loaded state pass, the state
pass benchmark) by CUDA-graph replay (`graph_bench`, as the class tuner times kernels), beside
cuBLAS alone, silu_mul alone and the two in sequence. Each output is checked against the
unfused one (max abs, fraction of identical bf16 elements). A config that does not compile or
fit is recorded with its error.

    python -m bench.gate_up_ab --out bench/results/gate_up_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from bench.common import kev4b_config, run_info, write_json
from kev.ops.autotune import graph_bench
from kev.ops.fused.activations import silu_mul
from kev.ops.fused.gate_up import GATE_UP_CONFIGS, gate_up_silu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="256,2368,8192,32768",
                   help="M values: one request's rows, a five-long sweep, a loaded state pass, the state pass benchmark")
    p.add_argument("--configs", default=None,
                   help="indices into GATE_UP_CONFIGS to time, comma-separated (default all)")
    args = p.parse_args()
    configs = (GATE_UP_CONFIGS if args.configs is None
               else [GATE_UP_CONFIGS[int(i)] for i in args.configs.split(",")])
    cfg = kev4b_config()
    d, f = cfg.hidden_size, cfg.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2 * f, d, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    cases = []
    for M in [int(m) for m in args.tokens.split(",")]:
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        flops = 2 * M * 2 * f * d
        gu = F.linear(x, w)
        ref = silu_mul(gu[:, :f], gu[:, f:])
        case = {"M": M, "N": 2 * f, "K": d,
                "cublas_us": graph_bench(lambda: F.linear(x, w)) * 1e3,
                "silu_mul_us": graph_bench(lambda: silu_mul(gu[:, :f], gu[:, f:])) * 1e3,
                "unfused_us": graph_bench(lambda: silu_mul(*F.linear(x, w).split(f, dim=-1))) * 1e3,
                "configs": []}
        case["cublas_tflops"] = flops / case["cublas_us"] / 1e6
        del gu
        for c in configs:
            row = {"config": dataclasses.asdict(c)}
            try:
                out = gate_up_silu(x, w, c)
                row["us"] = graph_bench(lambda c=c: gate_up_silu(x, w, c)) * 1e3
                row["tflops"] = flops / row["us"] / 1e6
                row["over_unfused"] = row["us"] / case["unfused_us"]
                row["over_cublas_alone"] = row["us"] / case["cublas_us"]
                row["max_abs_vs_unfused"] = (out.float() - ref.float()).abs().max().item()
                row["identical_fraction"] = (out == ref).float().mean().item()
                row["replay_identical"] = bool(torch.equal(out, gate_up_silu(x, w, c)))
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            case["configs"].append(row)
            print(M, row, flush=True)
        done = [r for r in case["configs"] if "us" in r]
        if done:
            best = min(done, key=lambda r: r["us"])
            case["best"] = best["config"]
            case["best_over_unfused"] = best["over_unfused"]
        print(f"M {M}: cuBLAS {case['cublas_us']:.1f} us ({case['cublas_tflops']:.0f} TFLOP/s), silu_mul "
              f"{case['silu_mul_us']:.1f} us, unfused {case['unfused_us']:.1f} us; best fused "
              f"{case.get('best_over_unfused', float('nan')):.3f} of unfused", flush=True)
        cases.append(case)
    write_json(args.out, {**run_info(), "hidden": d, "intermediate": f, "cases": cases})


if __name__ == "__main__":
    main()
