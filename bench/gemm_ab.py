"""cuBLAS's default GEMM against PyTorch TunableOp's pick, side by side in one process (H200).

Two thirds of a five-long sweep's GPU time are its projections' GEMMs (~740 TFLOP/s at M = 2,368:
2,208 document + 160 row tokens), and cuBLAS picks their kernels by heuristics. TunableOp times
the cuBLAS / cuBLASLt candidates for each shape and keeps the fastest. This measures, for every
distinct projection of Kev-4B at the served token counts, the default's time, then (TunableOp
enabled and tuned on that shape) the pick's time, both by CUDA-graph replay (`graph_bench`, as
the class tuner times kernels), and the pick's largest difference from the default's output.
`sweep_ms_saved` weighs each M = 2,368 shape by its uses in one five-long sweep.

    python -m bench.gemm_ab --out bench/results/gemm_ab.json
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F

from bench.common import kev4b_config, run_info, write_json
from kev.model.config import LayerType
from kev.ops.autotune import graph_bench


def projections(cfg) -> Counter:
    """(N, K) of each layer's GEMMs (fused input projections as the model builds them) -> uses."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    shapes: Counter = Counter()
    for kind in cfg.layer_types:
        if kind is LayerType.DELTANET:
            qkv = 2 * cfg.linear_key_dim + cfg.linear_value_dim
            shapes[(qkv + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads, d)] += 1  # qkv, z, b, a
            shapes[(d, cfg.linear_value_dim)] += 1
        else:
            shapes[(2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim, d)] += 1
            shapes[(d, cfg.num_attention_heads * cfg.head_dim)] += 1
        shapes[(2 * f, d)] += 1
        shapes[(d, f)] += 1
    return shapes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="160,2368,6144", help="M values: rows of one request, a five-long sweep, 96 x 64 rows")
    p.add_argument("--max-tuning-ms", type=int, default=200)
    args = p.parse_args()
    cfg = kev4b_config()
    uses = projections(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for M in [int(m) for m in args.tokens.split(",")]:
        for (N, K), n in sorted(uses.items()):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            cases.append(dict(M=M, N=N, K=K, uses_per_sweep=n, x=x, w=w))
    for c in cases:  # the default first, TunableOp off
        c["default_out"] = F.linear(c["x"], c["w"])
        c["default_us"] = graph_bench(lambda c=c: F.linear(c["x"], c["w"])) * 1e3
    tunable = torch.cuda.tunable
    tunable.set_filename("/tmp/kev_tunableop.csv")
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(args.max_tuning_ms)
    for c in cases:
        out = F.linear(c["x"], c["w"])  # tunes this shape
        c["tuned_us"] = graph_bench(lambda c=c: F.linear(c["x"], c["w"])) * 1e3
        c["tuned_vs_default_max_abs"] = (out.float() - c["default_out"].float()).abs().max().item()
        c["ratio"] = c["tuned_us"] / c["default_us"]
        c["tflops_default"] = 2 * c["M"] * c["N"] * c["K"] / c["default_us"] / 1e6
        c["tflops_tuned"] = 2 * c["M"] * c["N"] * c["K"] / c["tuned_us"] / 1e6
    results = [{k: v for k, v in c.items() if k not in ("x", "w", "default_out")} for c in cases]
    sweep = [c for c in results if c["M"] == 2368]
    saved = sum(c["uses_per_sweep"] * (c["default_us"] - c["tuned_us"]) for c in sweep) / 1e3
    total = sum(c["uses_per_sweep"] * c["default_us"] for c in sweep) / 1e3
    write_json(args.out, {**run_info(), "cases": results, "sweep_gemm_ms_default": total, "sweep_ms_saved": saved,
                          "tunableop_results": [list(r) for r in tunable.get_results()]})
    for c in results:
        print(f"M {c['M']:5d} N {c['N']:5d} K {c['K']:5d}: default {c['default_us']:7.1f} us, TunableOp "
              f"{c['tuned_us']:7.1f} us ({c['ratio']:.3f}), max abs diff {c['tuned_vs_default_max_abs']:.2e}")
    print(f"five-long sweep GEMMs: default {total:.2f} ms, TunableOp saves {saved:.2f} ms")


if __name__ == "__main__":
    main()
