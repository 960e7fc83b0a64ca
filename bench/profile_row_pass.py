"""Where a row pass spends GPU time: top kernels of one indexed 96 x 32 pass (Kev-4B, bf16).

The served path: fused projections and the fused norm/activation kernels of `TritonOps`
(`--unfused`: one GEMM per projection). `bench.row_pass --profile-out` profiles the same way
inside its own run.

    python -m bench.profile_row_pass --doc-tokens 2200
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import kev4b_config, random_model
from kev.bank.bank import Bank
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=2200)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--row-tokens", type=int, default=32)
    ap.add_argument("--unfused", action="store_true", help="one GEMM per projection")
    args = ap.parse_args()
    cfg = kev4b_config()
    model = random_model(cfg)
    if not args.unfused:
        model.fuse_projections()
    docs = max(1, args.rows // 6)
    bank = Bank.allocate(cfg, docs, docs * (-(-args.doc_tokens // 64)), dtype=torch.bfloat16, device="cuda",
                         max_doc_tokens=args.doc_tokens)
    runner = Passes(model, bank, TritonOps())
    handles = [bank.alloc(args.doc_tokens) for _ in range(docs)]
    runner.state_pass([torch.randint(0, cfg.vocab_size, (args.doc_tokens,)).tolist() for _ in handles], handles)
    rows = [torch.randint(0, cfg.vocab_size, (args.row_tokens,)).tolist() for _ in range(args.rows)]
    batch = RowBatch.build(rows, [handles[i % docs] for i in range(args.rows)], [args.doc_tokens] * args.rows,
                           [[args.row_tokens - 1]] * args.rows, device="cuda")
    for _ in range(2):
        runner.row_pass(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        runner.row_pass(batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
