"""A sweep's projection GEMM time against its token count M, cuBLAS's default kernels (H200).

cuBLAS picks each GEMM's kernel by heuristics on the exact (M, N, K), so a few padding tokens can
change the tile and the time more than the tokens themselves do: five-long's eager sweep (M =
2,360) ran its projections ~1 ms faster than the graphed one padded into the 2,208-token state
bucket (M = 2,368) in the 19aa823 profile. This times every distinct Kev-4B projection at each M,
weighs them by their uses in one sweep, and prints the sweep's GEMM milliseconds per M, so a state
bucket can be chosen where the sweep is fastest, not where it is smallest.

    python -m bench.gemm_tokens --out bench/results/gemm_tokens.json --tokens 2360:2624:8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import kev4b_config, run_info, write_json
from bench.gemm_ab import projections
from kev.ops.autotune import graph_bench


def token_counts(spec: str) -> list[int]:
    """'2360,2368' or 'lo:hi:step' (hi inclusive) or a mix of both, comma-separated."""
    out: list[int] = []
    for part in spec.split(","):
        if ":" in part:
            lo, hi, step = (int(x) for x in part.split(":"))
            out.extend(range(lo, hi + 1, step))
        else:
            out.append(int(part))
    return sorted(set(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", default="2360:2624:8")
    args = p.parse_args()
    uses = projections(kev4b_config())
    gen = torch.Generator(device="cuda").manual_seed(0)
    Ms = token_counts(args.tokens)
    weights = {(N, K): torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
               for (N, K) in uses}
    xs = {K: torch.randn(max(Ms), K, device="cuda", dtype=torch.bfloat16, generator=gen) for (_, K) in uses}
    rows = []
    for M in Ms:
        per_shape = {}
        for (N, K), n in sorted(uses.items()):
            x, w = xs[K][:M], weights[(N, K)]
            per_shape[f"{N}x{K}"] = graph_bench(lambda x=x, w=w: F.linear(x, w)) * 1e3
        sweep_ms = sum(uses[tuple(int(v) for v in k.split("x"))] * us for k, us in per_shape.items()) / 1e3
        rows.append(dict(M=M, sweep_gemm_ms=sweep_ms, us_per_token=sweep_ms * 1e3 / M, shapes_us=per_shape))
        print(f"M {M:5d}: sweep GEMMs {sweep_ms:6.2f} ms ({sweep_ms * 1e3 / M:.3f} us/token)  "
              + " ".join(f"{k} {v:6.1f}" for k, v in per_shape.items()), flush=True)
    best = min(rows, key=lambda r: r["sweep_gemm_ms"])
    write_json(args.out, {**run_info(), "uses_per_sweep": {f"{N}x{K}": n for (N, K), n in uses.items()},
                          "rows": rows, "fastest_M": best["M"]})
    print(f"fastest M {best['M']}: {best['sweep_gemm_ms']:.2f} ms")


if __name__ == "__main__":
    main()
