"""Model time of one request alone, with CUDA graphs (issue 5's single-request figures).

Kev-4B shapes, random bf16 weights. six-short: a new 48-token document and 6 question rows of
32 tokens; five-long: a 2,200-token document and 5 rows of 32 tokens. `new_ms`: the document is
not in the bank, and it and the rows go through one sweep over the weights
(`sweep`, what the engine runs); `two_pass_new_ms`: the same as a state pass, then a
row pass (side by side); `cached_ms` = row pass only. Wall time from the host call to the GPU
being done (row batch built and copied in, the passes, one sync), medians of alternating reps.
Every class the passes use is warmed and the keys they use captured before timing (`warm_up`,
`GraphCache.capture`; the key ladders are the services' default pass caps, `GraphPlan()`). The same
passes eager (no graphs) are reported beside them.
`new_replay_only_ms`: the new request's sweep graph replayed alone (no batch to build, no buffers
to fill), back to back, so on a GPU kept busier than between alternating reps; `new_issue_ms`: the
host time until a new request's call returns (its GPU work queued, not waited for): the host's part
in front of the GPU's.

    python -m bench.single_request --out bench/results/single_request.json \
        [--profile-out runs/single_request_profile.txt]

`--profile-out` also writes, per workload, the top GPU kernels of one graphed new request and
of the same request eager, with the kernels' summed GPU time beside the wall time (what is left
is launch gaps and host work).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import kev4b_config, random_model, run_info, write_json
from kev.bank.bank import Bank, BankHandle
from kev.exec.graphs import GraphCache, KeyLadder
from kev.exec.plan import GraphPlan
from kev.ops.shapes import ShapeClass
from kev.ops.autotune import serving_tuner
from kev.exec.warm_up import warm_up
from kev.ops.triton_ops import TritonOps
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.exec.static_pass import PassKind, SweepKey

WORKLOADS = {"six-short": (48, 6, 32), "five-long": (2200, 5, 32)}  # doc tokens, rows, row tokens


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def issued(fn) -> float:
    """Host time until `fn` returns, the GPU idle at the start and not waited for at the end: what
    a lone request's host work (batch, buffers, the graph launch) puts in front of its GPU time."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return ms


def request(passes, bank, doc, rows, cached: BankHandle | None = None, one_sweep: bool = True):
    """One request: new (`cached` is None: one sweep, or a state pass then the row pass) or cached
    (the row pass). Returns the picked states."""
    handle = cached if cached is not None else bank.alloc(len(doc))
    batch = RowBatch.build(rows, [handle] * len(rows), [len(doc)] * len(rows), [[len(r) - 1] for r in rows],
                           device="cuda")
    if cached is not None:
        return passes.row_pass(batch)
    if one_sweep:
        out = passes.sweep([doc], [handle], batch)
    else:
        passes.state_pass([doc], [handle])
        out = passes.row_pass(batch)
    bank.free(handle)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/single_request.json")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--pdl", action="store_true",
                    help="launch our kernels with PDL (kev/ops/pdl.py; off by default): the A/B")
    args = ap.parse_args()
    if args.pdl:
        from kev.ops import pdl

        pdl.on = True
    cfg = kev4b_config()
    model = random_model(cfg).fuse_projections()
    bank = Bank.allocate(cfg, num_slots=8, num_blocks=8 * 36, block_size=64, dtype=torch.bfloat16, device="cuda",
                         max_doc_tokens=2304)
    profiles: list[str] = []
    result = {**run_info(), **measure(args, cfg, model, bank, profiles)}
    write_json(args.out, result)


def measure(args, cfg, model, bank, profiles) -> dict:
    """Warm, capture and time both workloads (one seed: the same documents and rows every run)."""
    runner = Passes(model, bank, TritonOps(), tuner=serving_tuner())
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()  # start-up as a server does it: documents' class, one document, rows' class
    warm_up(runner, [ShapeClass.DOCS_FEW])
    prime = bank.alloc(2200)
    runner.state_pass([torch.randint(0, cfg.vocab_size, (2200,), generator=gen).tolist()], [prime])
    warm_up(runner, [ShapeClass.ROWS_FEW], row_slot=prime.slot, row_prefix=2200)
    warm_s = time.perf_counter() - t0
    plan = GraphPlan()  # the services' default pass caps: the scorer's rows, the bank's documents
    graphed = runner.with_graphs(GraphCache(rows=KeyLadder(PassKind.ROWS, plan.row_tokens, plan.row_seqs),
                                            states=KeyLadder(PassKind.STATE, plan.state_tokens, plan.state_seqs)))
    result = {"warm_up_s": warm_s}
    kept = [prime]
    for name, (doc_tokens, n_rows, row_tokens) in WORKLOADS.items():
        doc = torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist()
        rows = [torch.randint(0, cfg.vocab_size, (row_tokens,), generator=gen).tolist() for _ in range(n_rows)]
        state_key, row_key = graphed.graphs.state_key([doc_tokens]), graphed.graphs.rows.key_for([row_tokens] * n_rows)
        keys = [SweepKey(state_key, row_key), state_key, row_key]
        t0 = time.perf_counter()
        graphed.graphs.capture(graphed, keys)
        capture_s = time.perf_counter() - t0
        cached = bank.alloc(doc_tokens)
        kept.append(cached)
        runner.state_pass([doc], [cached])
        cases = {"new": lambda p: request(p, bank, doc, rows), "cached": lambda p: request(p, bank, doc, rows, cached),
                 "two_pass_new": lambda p: request(p, bank, doc, rows, one_sweep=False)}
        for passes in (graphed, runner):  # warm both paths (allocator, first launches)
            for case in cases.values():
                case(passes)
        times = {f"{pre}{k}": [] for pre in ("", "eager_") for k in cases}
        for _ in range(args.reps):  # alternate so drift hits all alike
            for k, case in cases.items():
                times[k].append(timed(lambda: case(graphed)))
                times[f"eager_{k}"].append(timed(lambda: case(runner)))
        # The sweep's graph replayed alone (its static buffers as the last request left them): the
        # GPU's part of `new_ms`; the rest is the host building the batch and filling the buffers.
        sweep_graph = graphed.graphs._entries[keys[0]].graph  # noqa: SLF001 - a benchmark's look inside
        replay_ms = statistics.median(timed(sweep_graph.replay) for _ in range(args.reps))
        issue_ms = statistics.median(issued(lambda: request(graphed, bank, doc, rows)) for _ in range(args.reps))
        g_out, e_out = request(graphed, bank, doc, rows, cached), request(runner, bank, doc, rows, cached)
        g_new, e_new = request(graphed, bank, doc, rows), request(runner, bank, doc, rows)
        two_pass = request(graphed, bank, doc, rows, one_sweep=False)
        med = {k: statistics.median(v) for k, v in times.items()}
        result[name] = {**{f"{k}_ms": v for k, v in med.items()}, "new_replay_only_ms": replay_ms,
                        "new_issue_ms": issue_ms,
                        "doc_tokens": doc_tokens, "rows": n_rows,
                        "row_tokens": row_tokens, "graph_keys": [str(k) for k in keys], "capture_s": capture_s,
                        "graphed_vs_eager_max_abs": (g_out.float() - e_out.float()).abs().max().item(),
                        "graphed_vs_eager_new_max_abs": (g_new.float() - e_new.float()).abs().max().item(),
                        "one_sweep_vs_two_pass_rel": ((g_new.float() - two_pass.float()).norm()
                                                      / two_pass.float().norm()).item(),
                        "graph_stats": vars(graphed.graphs.stats).copy(), "reps": args.reps}
        print(f"{name}: new {med['new']:.2f} ms (two passes {med['two_pass_new']:.2f}, the sweep's replay alone "
              f"{replay_ms:.2f}, the host's issue {issue_ms:.2f}), cached {med['cached']:.2f} ms", flush=True)
        if args.profile_out:
            profiles.append(profile_request(name, graphed, runner, bank, doc, rows))
            os.makedirs(os.path.dirname(args.profile_out) or ".", exist_ok=True)  # runs/ on first use
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
        if label == "graphed":  # where the host's part goes (the graph launch, the buffer fills)
            out.append(f"-- {name} new request, graphed: host side, by self CPU time --")
            out.append(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70))
    return "\n".join(out)


if __name__ == "__main__":
    main()
