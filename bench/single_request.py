"""Model time of one request alone, with CUDA graphs (issue 5's single-request figures).

Kev-4B shapes, random bf16 weights. six-short: a new 48-token document and 6 question rows of
32 tokens; five-long: a 2,200-token document and 5 rows of 32 tokens. `new_ms` = state pass +
row pass (the document is not in the bank), `cached_ms` = row pass only. Wall time from the host
call to the GPU being done (row batch built and copied in, both passes, one sync), medians.
Every class the passes use is warmed and every bucket captured before timing (`warm_up`,
`GraphedPasses.capture`). The same passes eager (no graphs) are reported beside them.

    python -m bench.single_request --out bench/results/single_request.json [--profile-out FILE] \
        [--recurrent-classes none rows_few]   # chunked vs the one-launch recurrent delta rule, one run

`--profile-out` also writes, per workload, the top GPU kernels of one graphed new request and
of the same request eager, with the kernels' summed GPU time beside the wall time (what is left
is launch gaps and host work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import kev4b_config, random_model, run_info, write_json
from kev.bank.bank import Bank, BankHandle
from kev.graphs import CapturePolicy, GraphedPasses
from kev.ops.autotune import ClassTuner, ShapeClass, hot_autotuners
from kev.ops.warm_up import warm_up
from kev.ops.triton_ops import TritonOps
from kev.runner import RowBatch, Runner

WORKLOADS = {"six-short": (48, 6, 32), "five-long": (2200, 5, 32)}  # doc tokens, rows, row tokens


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def request(passes, bank, doc, rows, cached: BankHandle | None = None):
    """One request: a state pass (new: `cached` is None) + the row pass. Returns the picked states."""
    handle = cached if cached is not None else bank.alloc(len(doc))
    batch = RowBatch.build(rows, [handle] * len(rows), [len(doc)] * len(rows), [[len(r) - 1] for r in rows],
                           device="cuda")
    if cached is None:
        passes.state_pass([doc], [handle])
    out = passes.row_pass(batch)
    if cached is None:
        bank.free(handle)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/single_request.json")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--recurrent-classes", nargs="+", default=["none"], metavar="CLASSES",
                    help="one run per value: a comma list of shape classes whose passes run the one-launch "
                         "recurrent delta rule (e.g. rows_few or rows_few,rows_mid; 'none': chunked everywhere). "
                         "The first is the reported one; all are timed on the same model, documents and rows")
    args = ap.parse_args()
    variants = [frozenset(ShapeClass(c) for c in v.split(",") if c and c != "none") for v in args.recurrent_classes]
    cfg = kev4b_config()
    model = random_model(cfg)
    bank = Bank.allocate(cfg, num_slots=8, num_blocks=8 * 36, block_size=64, dtype=torch.bfloat16, device="cuda",
                         max_doc_tokens=2304)
    result = {**run_info(), "variants": {}}
    profiles: list[str] = []
    for i, recurrent in enumerate(variants):
        label = ",".join(sorted(c.value for c in recurrent)) or "none"
        timings = run_variant(args, cfg, model, bank, recurrent, profiles, label)
        result["variants"][label] = timings
        if i == 0:  # the reported figures (the schema of issue 5's single_request.json)
            result.update(timings, recurrent_classes=label)
        write_json(args.out, result)
        torch.cuda.empty_cache()
    write_json(args.out, result)


def run_variant(args, cfg, model, bank, recurrent, profiles, label) -> dict:
    """Warm, capture and time both workloads with `TritonOps(recurrent_classes=recurrent)` on a
    fresh class tuner; the same documents and rows for every variant (one seed)."""
    runner = Runner(model, bank, TritonOps(recurrent_classes=recurrent), tuner=ClassTuner(hot_autotuners()))
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()  # start-up as a server does it: documents' class, one document, rows' class
    warm_up(runner, [ShapeClass.DOCS_FEW])
    prime = bank.alloc(2200)
    runner.state_pass([torch.randint(0, cfg.vocab_size, (2200,), generator=gen).tolist()], [prime])
    warm_up(runner, [ShapeClass.ROWS_FEW], row_slot=prime.slot, row_prefix=2200)
    warm_s = time.perf_counter() - t0
    graphed = GraphedPasses(runner, policy=CapturePolicy.WARMUP_ONLY)
    result = {"warm_up_s": warm_s}
    kept = [prime]
    for name, (doc_tokens, n_rows, row_tokens) in WORKLOADS.items():
        doc = torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist()
        rows = [torch.randint(0, cfg.vocab_size, (row_tokens,), generator=gen).tolist() for _ in range(n_rows)]
        keys = [graphed.buckets.state_key(1, doc_tokens), graphed.buckets.row_key(n_rows, row_tokens, n_rows)]
        t0 = time.perf_counter()
        graphed.capture(keys)
        capture_s = time.perf_counter() - t0
        cached = bank.alloc(doc_tokens)
        kept.append(cached)
        runner.state_pass([doc], [cached])
        for passes in (graphed, runner):  # warm both paths (allocator, first launches)
            request(passes, bank, doc, rows), request(passes, bank, doc, rows, cached)
        times = {k: [] for k in ("new", "cached", "eager_new", "eager_cached")}
        for _ in range(args.reps):  # alternate so drift hits all alike
            times["new"].append(timed(lambda: request(graphed, bank, doc, rows)))
            times["cached"].append(timed(lambda: request(graphed, bank, doc, rows, cached)))
            times["eager_new"].append(timed(lambda: request(runner, bank, doc, rows)))
            times["eager_cached"].append(timed(lambda: request(runner, bank, doc, rows, cached)))
        g_out, e_out = request(graphed, bank, doc, rows, cached), request(runner, bank, doc, rows, cached)
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {"new_ms": med["new"], "cached_ms": med["cached"], "eager_new_ms": med["eager_new"],
                        "eager_cached_ms": med["eager_cached"], "doc_tokens": doc_tokens, "rows": n_rows,
                        "row_tokens": row_tokens, "graph_keys": [str(k) for k in keys], "capture_s": capture_s,
                        "graphed_vs_eager_max_abs": (g_out.float() - e_out.float()).abs().max().item(),
                        "graph_stats": vars(graphed.stats).copy(), "reps": args.reps}
        print(f"recurrent={label} {name}: new {med['new']:.2f} ms, cached {med['cached']:.2f} ms", flush=True)
        if args.profile_out:
            profiles.append(profile_request(f"{name} (recurrent={label})", graphed, runner, bank, doc, rows))
            with open(args.profile_out, "w") as f:
                f.write("\n".join(profiles))
    for h in kept:
        bank.free(h)
    return result


def profile_request(name, graphed, runner, bank, doc, rows) -> str:
    """Kernel tables of one new request, graphed and eager (Kineto traces kernels inside graphs)."""
    out = []
    for label, passes in (("graphed", graphed), ("eager", runner)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            wall = timed(lambda: request(passes, bank, doc, rows))
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events)
        launches = sum(e.count for e in events if e.self_device_time_total > 0)
        out.append(f"== {name} new request, {label}: wall {wall:.2f} ms (under the profiler), kernels' GPU time "
                   f"{gpu_us / 1e3:.2f} ms over {launches} kernel runs ==")
        out.append(events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    return "\n".join(out)


if __name__ == "__main__":
    main()
