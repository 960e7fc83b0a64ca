"""The state pass against the matmul floor (issue 5's `state_pass.json`): 16 x 2,048 tokens, one 61,440.

Kev-4B shapes, random bf16 weights, the served path: fused projections, `TritonOps`, a `Passes`
with the shape-class autotune caches warmed at start-up (`warm_up`, the documents' classes).
16 new documents of 2,048 tokens go into the bank through `Passes.state_pass` in one eager pass
(32,768 tokens: beyond the bank's default pass cap, --max-pass-tokens 16,384, where its CUDA-graph
keys stop; the bank would split them into passes of at most that, each a graph replay), timed
with CUDA events from the host call to the GPU done (host gaps included), medians of `--reps`.
floor = 2 x non-embedding params x tokens / the bf16 matmul rate measured in this run;
efficiency = floor / measured.

One 61,440-token document: `Passes.state_pass` in chunks of 8,192 (the state rides in its slot),
its time, and its peak GPU memory above the weights and the bank (max_memory_allocated after a
reset, minus what was allocated before the pass) against `Passes.state_pass_peak_bytes` (the
bound `tests/exec/test_state_pass_gpu.py` enforces). The causal attention over the document is not in
the matmul floor: its FLOPs are reported beside it.

    python -m bench.state_pass --out bench/results/state_pass.json --profile-out runs/state_pass_profile.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import cuda_ms, floor_ms, kev4b_config, matmul_tflops, random_model, run_info, write_json
from kev.bank.bank import Bank
from kev.ops.shapes import ShapeClass, classify
from kev.ops.autotune import serving_tuner
from kev.exec.warm_up import warm_up
from kev.ops.triton_ops import TritonOps
from kev.exec.passes import Passes
from kev.exec.memory import PEAK_SLACK

DEVICE = "cuda"
BLOCK = 64


def attention_tflop(cfg, doc_tokens: int, chunk: int) -> float:
    """Causal attention FLOPs (QK^T and PV) of one document read in chunks: every token attends to
    all earlier ones (the chunked kernel computes whole key tiles, so this is a lower bound)."""
    pairs = doc_tokens * (doc_tokens + 1) / 2
    return 4 * cfg.num_attention_heads * cfg.head_dim * pairs * len(cfg.attention_layers) / 1e12


def profile_pass(fn, path: str) -> dict:
    """Top GPU kernels of one call of `fn` (the served state pass), written as a table."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1e3
    gemm = sum(e.self_device_time_total for e in events
               if any(s in e.key for s in ("nvjet", "gemm", "cutlass", "xmma"))) / 1e3
    attn = sum(e.self_device_time_total for e in events if "paged_prefix" in e.key) / 1e3
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # runs/ is created on first use
    with open(path, "w") as f:
        f.write(f"one state pass, served path: GPU time {total:.2f} ms, GEMM kernels {gemm:.2f} ms, "
                f"paged attention {attn:.2f} ms\n")
        f.write(events.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
    return {"profile_gpu_ms": total, "profile_gemm_ms": gemm, "profile_attention_ms": attn}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/state_pass.json")
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--long-doc-tokens", type=int, default=61440)
    ap.add_argument("--long-reps", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=8192)
    args = ap.parse_args()
    cfg = kev4b_config()
    model = random_model(cfg).fuse_projections()
    tflops = matmul_tflops()
    long_blocks = -(-args.long_doc_tokens // BLOCK)
    bank = Bank.allocate(cfg, num_slots=args.docs + 1, num_blocks=args.docs * -(-args.doc_tokens // BLOCK) + long_blocks,
                         block_size=BLOCK, dtype=torch.bfloat16, device=DEVICE,
                         max_doc_tokens=max(args.doc_tokens, args.long_doc_tokens))
    runner = Passes(model, bank, TritonOps(), state_chunk_tokens=args.chunk_tokens,
                    tuner=serving_tuner())
    t0 = time.perf_counter()
    warm_up(runner, [ShapeClass.DOCS_FEW, ShapeClass.DOCS_WIDE])  # start-up, as the bank service does it
    info = {**run_info(), "warm_up_s": time.perf_counter() - t0, "matmul_tflops": tflops,
            "chunk_tokens": args.chunk_tokens}
    gen = torch.Generator().manual_seed(0)

    # 16 documents x 2,048 tokens in one pass
    docs = [torch.randint(0, cfg.vocab_size, (args.doc_tokens,), generator=gen).tolist() for _ in range(args.docs)]
    handles = [bank.alloc(args.doc_tokens) for _ in docs]
    run_docs = lambda: runner.state_pass(docs, handles)  # noqa: E731  (rewrites the same slots: no state carried)
    run_docs()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_docs()
    torch.cuda.synchronize()
    docs_peak = torch.cuda.max_memory_allocated() - before
    snapshot = [p[handles[0].slot].clone() for p in bank.pools.recurrent[:2]]
    times = cuda_ms(run_docs, args.reps)
    deterministic = all(torch.equal(s, p[handles[0].slot]) for s, p in zip(snapshot, bank.pools.recurrent[:2]))
    tokens = args.docs * args.doc_tokens
    floor = floor_ms(cfg, tokens, tflops)
    measured = statistics.median(times)
    result = {**info, "docs": args.docs, "doc_tokens": args.doc_tokens, "measured_ms": measured, "floor_ms": floor,
              "efficiency": floor / measured, "times_ms": times, "reps": args.reps,
              "shape_class": classify(tokens, rows=False).value, "tokens_per_s": tokens / measured * 1e3,
              "docs_peak_bytes": docs_peak, "docs_peak_bound_bytes": runner.state_pass_peak_bytes([args.doc_tokens] * args.docs),
              "states_deterministic": deterministic}
    if args.profile_out:
        result.update(profile_pass(run_docs, args.profile_out))
        result["host_gap_ms"] = measured - result["profile_gpu_ms"]
        result["efficiency_gpu_busy"] = floor / result["profile_gpu_ms"]  # without the host gaps
        result["gemm_efficiency"] = floor / result["profile_gemm_ms"]  # the GEMMs alone against the floor
    write_json(args.out, result)  # partial results survive a time-out
    for h in handles:
        bank.free(h)
    torch.cuda.empty_cache()

    # one long document, chunked
    long_doc = torch.randint(0, cfg.vocab_size, (args.long_doc_tokens,), generator=gen).tolist()
    handle = bank.alloc(args.long_doc_tokens)
    run_long = lambda: runner.state_pass([long_doc], [handle])  # noqa: E731  (chunk 0 reads no state: rewrites)
    run_long()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    long_times = cuda_ms(run_long, 1)
    peak = torch.cuda.max_memory_allocated() - before
    long_times += cuda_ms(run_long, args.long_reps - 1)
    bound = runner.state_pass_peak_bytes([args.long_doc_tokens])
    long_ms = statistics.median(long_times)
    long_floor = floor_ms(cfg, args.long_doc_tokens, tflops)
    attn = attention_tflop(cfg, args.long_doc_tokens, args.chunk_tokens)
    result.update({
        "long_doc_tokens": args.long_doc_tokens, "long_doc_ms": long_ms, "long_doc_times_ms": long_times,
        "long_doc_peak_bytes": peak, "long_doc_peak_bound_bytes": bound, "long_doc_within_bound": peak <= bound,
        "long_doc_floor_ms": long_floor, "long_doc_attention_tflop": attn,
        "long_doc_floor_with_attention_ms": long_floor + attn / tflops * 1e3,
        "long_doc_tokens_per_s": args.long_doc_tokens / long_ms * 1e3,
        "allocated_bytes_weights_and_bank": before,
        "bound": f"Passes.state_pass_peak_bytes: {PEAK_SLACK} x the itemised activations of one "
                 f"{args.chunk_tokens}-token chunk (kev.exec.memory.state_pass_peak_bytes), whatever the document length"})
    write_json(args.out, result)


if __name__ == "__main__":
    main()
