"""Indexed vs gathered row pass, side by side in one run (issue 4's A/B).

16 documents already in the bank x 6 questions of 32 tokens (96 rows), documents of 370 and
2,200 tokens, Kev-4B shapes with random bf16 weights. The gathered baseline is the fair one:
one index_select per state kind per layer into preallocated row buffers, then the same kernels.
`gather_ms` times those copies alone, in the same run. Medians of alternating runs.

Each variant is timed as a CUDA-graph replay (the way the server runs row passes), so what is
measured is GPU work: an eager pass is host-bound here and would hide the copies in launch gaps.
Eager times are reported beside them.

    python -m bench.row_pass_ab --out bench/results/row_pass_ab.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import capture, cuda_ms, floor_ms, kev4b_config, matmul_tflops, random_model, run_info, write_json
from kev.bank.bank import Bank
from kev.ops.gathered_ops import GatheredOps
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes


def gather_only(ops: GatheredOps, meta, pools) -> None:
    """Exactly the copies GatheredOps makes in one pass, nothing else."""
    plan = ops.plan(meta)
    for conv, rec in zip(pools.conv, pools.recurrent):
        torch.index_select(conv, 0, plan.rows, out=ops.buffer("conv", meta.num_seqs, conv))
        torch.index_select(rec, 0, plan.rows, out=ops.buffer("recurrent", meta.num_seqs, rec))
    for kp, vp in zip(pools.keys, pools.values):
        pages, _ = ops.page_plan(meta, kp.shape[1])
        torch.index_select(kp, 0, pages, out=ops.buffer("keys", pages.shape[0], kp))
        torch.index_select(vp, 0, pages, out=ops.buffer("values", pages.shape[0], vp))


def run_case(model, cfg, doc_tokens: int, docs: int, per_doc: int, row_tokens: int, reps: int, tflops: float):
    gen = torch.Generator().manual_seed(doc_tokens)
    bank = Bank.allocate(cfg, num_slots=docs, num_blocks=docs * (-(-doc_tokens // 64)), block_size=64,
                         dtype=torch.bfloat16, device="cuda", max_doc_tokens=doc_tokens)
    indexed, gathered = TritonOps(), GatheredOps(max_prefix_tokens=doc_tokens)
    runner = Passes(model, bank, indexed)
    documents = [torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist() for _ in range(docs)]
    handles = [bank.alloc(doc_tokens) for _ in documents]
    runner.state_pass(documents, handles)
    rows = [torch.randint(0, cfg.vocab_size, (row_tokens,), generator=gen).tolist() for _ in range(docs * per_doc)]
    row_handles = [handles[i // per_doc] for i in range(len(rows))]
    batch = RowBatch.build(rows, row_handles, [doc_tokens] * len(rows), [[row_tokens - 1]] * len(rows), device="cuda")
    meta = runner.row_meta(batch)
    before = [t.clone() for t in bank.pools.tensors()]

    def pass_with(ops):
        with torch.no_grad():
            return model(batch.tokens, meta, bank.pools, ops, picks=batch.picks)

    out_i, out_g = pass_with(indexed), pass_with(gathered)  # warm-up (compiles, autotunes)
    bit_identical = torch.equal(out_i, out_g)
    g_i, gout_i = capture(lambda: pass_with(indexed))
    g_g, gout_g = capture(lambda: pass_with(gathered))
    g_c, _ = capture(lambda: gather_only(gathered, meta, bank.pools))
    g_i.replay(), g_g.replay()
    graph_equals_eager = torch.equal(gout_i, out_i) and torch.equal(gout_g, out_g)
    t_i, t_g, t_copy, e_i, e_g = [], [], [], [], []
    for _ in range(reps):  # alternate so drift hits both alike
        t_i += cuda_ms(g_i.replay, 1)
        t_g += cuda_ms(g_g.replay, 1)
        t_copy += cuda_ms(g_c.replay, 1)
    for _ in range(5):
        e_i += cuda_ms(lambda: pass_with(indexed), 1)
        e_g += cuda_ms(lambda: pass_with(gathered), 1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, bank.pools.tensors()))
    tokens = len(rows) * row_tokens
    med = statistics.median
    return {"rows": len(rows), "row_tokens": row_tokens, "doc_tokens": doc_tokens,
            "gathered_ms": med(t_g), "indexed_ms": med(t_i), "gather_ms": med(t_copy),
            "floor_ms": floor_ms(cfg, tokens, tflops), "bit_identical": bit_identical,
            "bank_unchanged": unchanged, "graph_equals_eager": graph_equals_eager, "reps": reps,
            "eager_indexed_ms": med(e_i), "eager_gathered_ms": med(e_g),
            "saved_fraction_of_gather": (med(t_g) - med(t_i)) / med(t_copy)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/row_pass_ab.json")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--doc-tokens", type=int, nargs="+", default=[370, 2200])
    args = ap.parse_args()
    cfg = kev4b_config()
    model = random_model(cfg)
    tflops = matmul_tflops()
    info = run_info()
    cases = []
    for doc in args.doc_tokens:
        case = {**info, **run_case(model, cfg, doc, docs=16, per_doc=6, row_tokens=32, reps=args.reps, tflops=tflops),
                "matmul_tflops": tflops}
        case["efficiency_indexed"] = case["floor_ms"] / case["indexed_ms"]
        cases.append(case)
        torch.cuda.empty_cache()
    write_json(args.out, cases)


if __name__ == "__main__":
    main()
