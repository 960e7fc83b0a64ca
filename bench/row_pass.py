"""The row pass against the matmul floor (issue 5's `row_pass.json`): 96 rows x 64 tokens.

16 documents already in the bank x 6 question rows of 64 tokens, Kev-4B shapes, random bf16
weights. The served path (fused projections: one GEMM per layer's input projections; fused norm
and activation kernels; `TritonOps`) is timed as a CUDA-graph replay, the way the server runs row
passes. Beside it, in the same run and alternating with it: the path before fusion (one GEMM per
projection, the torch norms/activations of `TorchOps` around the same token-mixing kernels).
floor = 2 x non-embedding params x tokens / the bf16 matmul rate measured in this run;
efficiency = floor / measured.

Also in the same run: every config of the conv kernel and the attention key tile (`block_n`) at
these shapes, and a profile (top kernels of one eager pass of the served path).

    python -m bench.row_pass --out bench/results/row_pass.json --kernels-out bench/results/row_pass_kernels.json \
        --profile-out runs/row_pass_profile.txt
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from bench.common import capture, cuda_ms, floor_ms, kev4b_config, matmul_tflops, random_model, run_info, write_json
from kev.bank.bank import Bank
from kev.ops.fused.reference import ReferenceElementwise
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes


DEVICE = "cuda"


class TorchElementwiseOps(ReferenceElementwise, TritonOps):
    """The same token-mixing kernels with the torch norms and activations: the path before fusion."""

    name = "triton+torch-elementwise"


def rel_err(ref, out):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def cached_rows(model, cfg, doc_tokens, docs, per_doc, row_tokens):
    """A bank holding `docs` documents and a row batch of docs x per_doc rows continuing them."""
    gen = torch.Generator().manual_seed(doc_tokens)
    bank = Bank.allocate(cfg, num_slots=docs, num_blocks=docs * (-(-doc_tokens // 64)), block_size=64,
                         dtype=torch.bfloat16, device=DEVICE, max_doc_tokens=doc_tokens)
    runner = Passes(model, bank, TritonOps())
    documents = [torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist() for _ in range(docs)]
    handles = [bank.alloc(doc_tokens) for _ in documents]
    runner.state_pass(documents, handles)
    rows = [torch.randint(0, cfg.vocab_size, (row_tokens,), generator=gen).tolist() for _ in range(docs * per_doc)]
    batch = RowBatch.build(rows, [handles[i // per_doc] for i in range(len(rows))], [doc_tokens] * len(rows),
                           [[row_tokens - 1]] * len(rows), device=DEVICE)
    return bank, batch, runner.row_meta(batch)


def run_case(model, cfg, doc_tokens, rows, row_tokens, reps, tflops):
    docs = 16
    bank, batch, meta = cached_rows(model, cfg, doc_tokens, docs, rows // docs, row_tokens)
    served, before_ops = TritonOps(), TorchElementwiseOps()
    snapshot = [t.clone() for t in bank.pools.tensors()]

    def pass_with(ops):
        with torch.no_grad():
            return model(batch.tokens, meta, bank.pools, ops, picks=batch.picks)

    model.unfuse_projections()
    out_before = pass_with(before_ops)
    g_before, _ = capture(lambda: pass_with(before_ops))
    keep = [p.detach() for p in model.parameters()]  # the graph above reads these weights: keep them alive
    model.fuse_projections()
    out = pass_with(served)
    g_served, gout = capture(lambda: pass_with(served))
    g_served.replay()
    graph_equals_eager = torch.equal(gout, out)
    t_served, t_before = [], []
    for _ in range(reps):  # alternate so drift hits both alike
        t_served += cuda_ms(g_served.replay, 1)
        t_before += cuda_ms(g_before.replay, 1)
    eager = cuda_ms(lambda: pass_with(served), 3)
    unchanged = all(torch.equal(a, b) for a, b in zip(snapshot, bank.pools.tensors()))
    med = statistics.median
    floor = floor_ms(cfg, rows * row_tokens, tflops)
    result = {"rows": rows, "row_tokens": row_tokens, "doc_tokens": doc_tokens, "docs": docs,
              "measured_ms": med(t_served), "floor_ms": floor, "matmul_tflops": tflops,
              "efficiency": floor / med(t_served), "before_fusion_ms": med(t_before),
              "before_fusion_efficiency": floor / med(t_before), "eager_ms": med(eager),
              "graph_equals_eager": graph_equals_eager, "bank_unchanged": unchanged,
              "rel_err_vs_before_fusion": rel_err(out_before, out), "reps": reps}
    del g_before, g_served, keep
    return result, (bank, batch, meta)


def time_us(fn, reps=7):
    fn()
    return statistics.median(cuda_ms(fn, reps)) * 1e3


def kernel_sweeps(model, cfg, bank, batch, meta):
    """Every conv config and attention key tile at the pass's shapes (kernels alone, CUDA events)."""
    from kev.ops.attention import paged_prefix
    from kev.ops.conv import indexed_conv

    ops = TritonOps()
    idx = ops.prepare(meta)
    T = batch.tokens.shape[0]
    C = cfg.conv_dim
    width = C + cfg.linear_value_dim + 2 * cfg.linear_num_value_heads
    x = torch.randn(T, width, device=DEVICE, dtype=torch.bfloat16)[:, :C]  # the fused projection's qkv view
    weight = torch.randn(C, cfg.conv_kernel, device=DEVICE, dtype=torch.bfloat16)
    pool = bank.pools.conv[0]
    conv = {}
    for c in indexed_conv.CONV_CONFIGS:
        us = time_us(lambda: indexed_conv.indexed_causal_conv(
            x=x, weight=weight, cu_seqlens=meta.cu_seqlens, conv_pool=pool, read_slots=meta.read_slots,
            write_slots=meta.write_slots, chunk_indices=idx.chunks, config=c))
        conv[str(c)] = {"us": us, "GB_s": 2 * T * C * 2 / (us * 1e-6) / 1e9}
    conv_tuned = time_us(lambda: indexed_conv.indexed_causal_conv(
        x=x, weight=weight, cu_seqlens=meta.cu_seqlens, conv_pool=pool, read_slots=meta.read_slots,
        write_slots=meta.write_slots, chunk_indices=idx.chunks))

    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(T, Hq, D, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(T, Hkv, D, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    chunks = idx.attention_chunks(meta.cu_seqlens, paged_prefix.query_block(Hq // Hkv))
    attn = {}
    for bn in (32, 16):  # every config (NV: value splits) at the served key tile and at 16
        for c in paged_prefix.ATTN_CONFIGS:
            us = time_us(lambda: paged_prefix.paged_prefix_attention(
                q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens,
                key_pages=bank.pools.keys[0], value_pages=bank.pools.values[0], block_table=meta.block_table,
                write_slots=meta.write_slots, chunk_indices=chunks, config=c, block_n=bn))
            attn[f"BN={bn} {c}"] = us
    attn_tuned = time_us(lambda: paged_prefix.paged_prefix_attention(
        q=q, k=k, v=v, cu_seqlens=meta.cu_seqlens, prefix_lens=meta.prefix_lens, key_pages=bank.pools.keys[0],
        value_pages=bank.pools.values[0], block_table=meta.block_table, write_slots=meta.write_slots,
        chunk_indices=chunks))
    return {"tokens": T, "conv_us_per_config": conv, "conv_tuned_us": conv_tuned, "attention_us": attn,
            "attention_tuned_us": attn_tuned}


def profile_pass(model, bank, batch, meta, path):
    from torch.profiler import ProfilerActivity, profile

    ops = TritonOps()
    with torch.no_grad():
        for _ in range(2):
            model(batch.tokens, meta, bank.pools, ops, picks=batch.picks)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(batch.tokens, meta, bank.pools, ops, picks=batch.picks)
            torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    gemm = sum(e.self_device_time_total for e in events
               if any(s in e.key for s in ("nvjet", "gemm", "cutlass", "xmma"))) / 1e3
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # runs/ is created on first use
    with open(path, "w") as f:
        f.write(f"one eager row pass, served path: GPU time {total:.2f} ms, GEMM kernels {gemm:.2f} ms\n")
        f.write(events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    return {"profile_total_ms": total, "profile_gemm_ms": gemm}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/row_pass.json")
    ap.add_argument("--kernels-out", default=None)
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--row-tokens", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, nargs="+", default=[2200, 370], help="first: the reported case")
    args = ap.parse_args()
    cfg = kev4b_config()
    model = random_model(cfg)
    tflops = matmul_tflops()
    info = run_info()
    cases = []
    for i, doc in enumerate(args.doc_tokens):
        case, state = run_case(model, cfg, doc, args.rows, args.row_tokens, args.reps, tflops)
        cases.append(case)
        write_json(args.out, {**info, **cases[0], "cases": cases})  # after every case: a cut-off run keeps it
        if i == 0:  # the reported case: a profile, and its kernels one by one
            extra = profile_pass(model, *state, args.profile_out) if args.profile_out else {}
            if args.kernels_out:
                write_json(args.kernels_out, {**info, "doc_tokens": doc, **extra, **kernel_sweeps(model, cfg, *state)})
        del state
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
