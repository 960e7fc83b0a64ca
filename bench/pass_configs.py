"""Is the config a kernel's class picks alone also the fastest inside the pass, under the power limit?

The shape-class autotune (kev/ops/autotune.py) times each config of a kernel on its own, by CUDA-graph
replay, at start-up, on an idle GPU. A loaded server runs its passes at the 700 W limit, where the
SM clock falls (1,373 MHz against 1,980 idle, H100, session 36), and a kernel that waits on latency
slows with the clock where one that waits on DRAM does not. Nsight Compute put our scan at 12%
occupancy (250 registers, 2 programs an SM): 13.0 ms a 16 x 2,048 pass alone, 19.7 ms in the pass
(bench/results/RESULTS.md, session 36). A config with more programs in flight may lose alone and win
in the pass.

So: one pass (Kev-4B shapes, random bf16 weights, the served path and class tune as `warm_up` does
it) is captured once per config of each kernel in `--kernels` (`hot_autotuners` names), that config
pinned for every key the pass class tuned (`ClassTuner.pinned`), all graphs sharing one memory pool.
After `--heat-s` seconds of back-to-back replays (the GPU at its power limit, as under load) the
graphs replay in `--rounds` interleaved rounds of `--reps` each; the SM clock and board power are
sampled over the rounds. Per kernel: every config's median pass time, the class's own pick (what
serving runs) and the best, and pick / best. A kernel's configs that fail to compile or launch are
reported, not fatal. Nothing here changes what the services run.

    python -m bench.pass_configs --out bench/results/pass_configs.json                # state pass, 8 x 2,048
    python -m bench.pass_configs --pass rows --rows 64 --row-tokens 32 --doc-tokens 512 --out ...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import GpuSampler, capture, cuda_ms, floor_ms, kev4b_config, matmul_tflops, random_model, run_info, write_json
from kev.bank.bank import Bank
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.exec.warm_up import warm_up
from kev.ops.autotune import hot_autotuners, serving_tuner
from kev.ops.shapes import classify
from kev.ops.triton_ops import TritonOps

DEVICE = "cuda"
BLOCK = 64
DEFAULT_KERNELS = "indexed_scan,kkt_solve,indexed_conv"  # the latency- and issue-bound ones (RESULTS, session 36)


def state_pass(runner: Passes, cfg, docs: int, doc_tokens: int, gen):
    """(call, class, tokens): `docs` new documents of `doc_tokens` in one pass, rewriting the same
    slots each call (they read no state, so every call is the same pass)."""
    documents = [torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist() for _ in range(docs)]
    slots = [runner.bank.alloc(doc_tokens).slot for _ in documents]
    tokens, meta = runner._chunk_pass(slots, documents, [0] * docs)
    picks = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    return (lambda: runner.model(tokens, meta, runner.bank.pools, runner.ops, picks=picks)), meta.shape_class, \
        docs * doc_tokens


def row_pass(runner: Passes, cfg, docs: int, doc_tokens: int, rows: int, row_tokens: int, gen):
    """(call, class, tokens): `rows` rows of `row_tokens`, spread over `docs` stored documents."""
    documents = [torch.randint(0, cfg.vocab_size, (doc_tokens,), generator=gen).tolist() for _ in range(docs)]
    handles = [runner.bank.alloc(doc_tokens) for _ in documents]
    runner.state_pass(documents, handles)
    row_ids = [torch.randint(0, cfg.vocab_size, (row_tokens,), generator=gen).tolist() for _ in range(rows)]
    batch = RowBatch.build(row_ids, [handles[i % docs] for i in range(rows)], [doc_tokens] * rows,
                           [[row_tokens - 1]] * rows, device=DEVICE)
    meta = runner.row_meta(batch)
    return (lambda: runner.model(batch.tokens, meta, runner.bank.pools, runner.ops, picks=batch.picks)), \
        batch.shape_class, rows * row_tokens


def sweep_kernel(name, autotuner, runner, cls, call, args) -> dict:
    picks = set(runner.tuner.chosen(cls)[name])
    if not picks:
        return {"skipped": f"no key of {name} was tuned in class {cls.value} (the pass does not launch it)"}
    pool = torch.cuda.graph_pool_handle()
    graphs, failed = {}, {}

    def tuned_call():  # under the class's caches, as `Passes` runs a pass
        with runner.tuned(cls):
            call()

    for config in autotuner.configs:
        try:
            with runner.tuner.pinned(cls, name, config):
                graphs[str(config)] = capture(tuned_call, pool)[0]  # compiles the pinned config first
        except Exception as e:  # noqa: BLE001 - a config that cannot compile or launch here is a result
            failed[str(config)] = f"{type(e).__name__}: {str(e)[:300]}"
            torch.cuda.synchronize()
    if not graphs:
        return {"failed": failed}
    first = next(iter(graphs.values()))
    end = time.perf_counter() + args.heat_s
    while time.perf_counter() < end:  # reach the power limit, as under load
        first.replay()
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {c: [] for c in graphs}
    with GpuSampler() as clock:
        for _ in range(args.rounds):
            for c, g in graphs.items():
                times[c] += cuda_ms(g.replay, args.reps)
    med = {c: statistics.median(t) for c, t in times.items()}
    best = min(med, key=med.get)
    pick = next(iter(picks))
    del graphs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"class_pick": sorted(picks), "best": best, "pick_ms": med.get(pick), "best_ms": med[best],
            "pick_over_best": med[pick] / med[best] if pick in med else None, "pass_ms": med,
            "failed": failed, "gpu": clock.medians}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/pass_configs.json")
    ap.add_argument("--pass", dest="kind", choices=["state", "rows"], default="state")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--row-tokens", type=int, default=32)
    ap.add_argument("--kernels", default=DEFAULT_KERNELS, help="comma-separated hot_autotuners names")
    ap.add_argument("--heat-s", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    autotuners = hot_autotuners()
    unknown = [n for n in args.kernels.split(",") if n not in autotuners]
    if unknown:  # before the minutes of warm-up, not after (session 37's call lost 89 s to "conv")
        ap.error(f"unknown --kernels {unknown}; hot_autotuners names: {sorted(autotuners)}")

    cfg = kev4b_config()
    model = random_model(cfg).fuse_projections()
    tflops = matmul_tflops()
    bank = Bank.allocate(cfg, num_slots=args.docs, num_blocks=args.docs * -(-args.doc_tokens // BLOCK),
                         block_size=BLOCK, dtype=torch.bfloat16, device=DEVICE, max_doc_tokens=args.doc_tokens)
    runner = Passes(model, bank, TritonOps(), tuner=serving_tuner())
    gen = torch.Generator().manual_seed(0)
    rows = args.kind == "rows"
    tokens = args.rows * args.row_tokens if rows else args.docs * args.doc_tokens
    cls = classify(tokens, rows=rows)
    # the documents' classes too for a row pass: its documents go in through state passes first
    warm_up(runner, [cls] if not rows else [cls, classify(args.docs * args.doc_tokens, rows=False)])
    with torch.no_grad():
        if rows:
            call, cls, tokens = row_pass(runner, cfg, args.docs, args.doc_tokens, args.rows, args.row_tokens, gen)
        else:
            call, cls, tokens = state_pass(runner, cfg, args.docs, args.doc_tokens, gen)
        result = {**run_info(), "pass": args.kind, "shape_class": cls.value, "tokens": tokens,
                  "docs": args.docs, "doc_tokens": args.doc_tokens, "matmul_tflops": tflops,
                  "floor_ms": floor_ms(cfg, tokens, tflops), "heat_s": args.heat_s, "rounds": args.rounds,
                  "reps": args.reps, "kernels": {}}
        if rows:
            result.update(rows=args.rows, row_tokens=args.row_tokens)
        for name in args.kernels.split(","):
            result["kernels"][name] = sweep_kernel(name, autotuners[name], runner, cls, call, args)
            k = result["kernels"][name]
            print(f"{name}: pick {k.get('pick_ms')} ms, best {k.get('best_ms')} ms ({k.get('best')}), "
                  f"pick/best {k.get('pick_over_best')}", flush=True)
            write_json(args.out, result)  # partial results survive a time-out


if __name__ == "__main__":
    main()
