"""The delta rule's intra-chunk pair, fla's fused KK^T + solve then its WY recompute, against our
inverse (`kev.ops.delta_rule.kkt_solve`) then the same recompute, side by side in one process at
Kev-4B's DeltaNet heads.

The L2-flushed floors (`kernel_floors.json`) left fla's pair furthest over its floor of all the
non-GEMM kernels (0.35 of bandwidth on the H100), most of it in the KK^T + solve (10.5 ms of the
H200 state pass's profile against ~2.4 ms of traffic). Each config of ours is timed at the passes'
shapes (the state pass benchmark's 16 x 2,048 tokens, a loaded six-short state pass of 11 x 48, its
row pass of 63 x 32) by CUDA-graph replay, beside fla's two kernels alone and together, and its
inverse, W and U are compared with fla's (max abs, fraction of identical elements) and with the
fp64 solve (relative error, on the smallest shape).

    python -m bench.kkt_solve_ab --out bench/results/kkt_solve_ab.json
"""

from __future__ import annotations

import argparse

import torch
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
from fla.ops.utils.index import prepare_chunk_indices

from bench.common import kev4b_config, run_info, write_json
from kev.ops.autotune import graph_bench
from kev.ops.delta_rule.kkt_solve import KKT_CONFIGS, kkt_solve, kkt_solve_reference


def inputs(seqs: int, seq_tokens: int, H: int, HV: int, K: int, V: int, gen: torch.Generator):
    """Normalised keys, values, a chunk-local cumsum of log2 decays and beta, as `prep` leaves them."""
    T = seqs * seq_tokens
    k = torch.randn(T, H, K, device="cuda", generator=gen)
    k = (k / k.norm(dim=-1, keepdim=True)).to(torch.bfloat16)
    v = torch.randn(T, HV, V, device="cuda", generator=gen).to(torch.bfloat16)
    decay = -torch.rand(T, HV, device="cuda", generator=gen) * 0.3
    pos = torch.arange(T, device="cuda") % seq_tokens
    g = torch.zeros_like(decay)
    for c in range(0, seq_tokens, 64):  # the cumsum restarts every chunk of every sequence
        sel = (pos >= c) & (pos < c + 64)
        g[sel] = decay[sel].view(seqs, -1, HV).cumsum(1).view(-1, HV)
    beta = torch.rand(T, HV, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.arange(seqs + 1, device="cuda") * seq_tokens
    return k, v, g.contiguous(), beta, cu, prepare_chunk_indices(cu, 64)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="16x2048,11x48,63x32", help="sequences x tokens, comma-separated")
    args = p.parse_args()
    cfg = kev4b_config()
    H, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    K, V = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for shape in args.shapes.split(","):
        seqs, seq_tokens = (int(x) for x in shape.split("x"))
        k, v, g, beta, cu, chunks = inputs(seqs, seq_tokens, H, HV, K, V, gen)

        def fla_pair():
            return chunk_gated_delta_rule_fwd_intra(k=k[None], v=v[None], g=g[None], beta=beta[None], cu_seqlens=cu,
                                                    chunk_size=64, chunk_indices=chunks)

        w_ref, u_ref, a_ref = fla_pair()

        def recompute(a):
            return recompute_w_u_fwd(k=k[None], v=v[None], beta=beta[None], A=a[None], g=g[None], cu_seqlens=cu,
                                     chunk_indices=chunks)

        case = {"seqs": seqs, "seq_tokens": seq_tokens, "tokens": seqs * seq_tokens,
                "fla_pair_us": graph_bench(fla_pair) * 1e3,
                "fla_recompute_us": graph_bench(lambda: recompute(a_ref[0])) * 1e3, "configs": []}
        case["fla_kkt_solve_us"] = case["fla_pair_us"] - case["fla_recompute_us"]  # with its memset
        if seqs * seq_tokens <= 4096:
            ref = kkt_solve_reference(k.cpu(), g.cpu(), beta.cpu(), cu.cpu())
            case["fla_rel_err_vs_fp64"] = ((a_ref[0].cpu().double() - ref).norm() / ref.norm()).item()
        for c in KKT_CONFIGS:
            row = {"config": {"num_warps": c[0], "block_k": c[1], "heads_per_program": c[2], "diagonal": c[3]}}
            try:
                a = kkt_solve(k, g, beta, cu, chunks, *c)
                row["kkt_solve_us"] = graph_bench(lambda c=c: kkt_solve(k, g, beta, cu, chunks, *c)) * 1e3
                row["pair_us"] = graph_bench(lambda c=c: recompute(kkt_solve(k, g, beta, cu, chunks, *c))) * 1e3
                row["over_fla_pair"] = row["pair_us"] / case["fla_pair_us"]
                row["kkt_over_fla_kkt"] = row["kkt_solve_us"] / case["fla_kkt_solve_us"]
                w, u = recompute(a)
                row["max_abs_vs_fla"] = {n: (x.float() - y.float()).abs().max().item()
                                         for n, x, y in (("a", a, a_ref[0]), ("w", w, w_ref), ("u", u, u_ref))}
                row["identical_fraction_a"] = (a == a_ref[0]).float().mean().item()
                row["replay_identical"] = bool(torch.equal(a, kkt_solve(k, g, beta, cu, chunks, *c)))
                row["identical_to_first_config"] = bool(torch.equal(a, kkt_solve(k, g, beta, cu, chunks,
                                                                                  *KKT_CONFIGS[0])))
                if "fla_rel_err_vs_fp64" in case:
                    row["rel_err_vs_fp64"] = ((a.cpu().double() - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            case["configs"].append(row)
            print(shape, row, flush=True)
        done = [r for r in case["configs"] if "pair_us" in r]
        if done:
            best = min(done, key=lambda r: r["pair_us"])
            case["best"], case["best_over_fla_pair"] = best["config"], best["over_fla_pair"]
        print(f"{shape}: fla pair {case['fla_pair_us']:.1f} us (KK^T + solve {case['fla_kkt_solve_us']:.1f}, "
              f"recompute {case['fla_recompute_us']:.1f}); best ours {case.get('best_over_fla_pair', float('nan')):.3f} "
              f"of fla's pair", flush=True)
        cases.append(case)
    write_json(args.out, {**run_info(), "H": H, "HV": HV, "K": K, "V": V, "cases": cases})


if __name__ == "__main__":
    main()
