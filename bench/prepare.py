"""A request's host-side preparation (`validate_and_build`: questions checked and encoded, the
document rendered and tokenized) per load workload: the requests' first pass from an empty cache,
and the same requests again with and without the scorer's tokenized-document cache
(kev/request/doc_cache.py), and without it with every document tokenized whole instead of in
pieces side by side (kev/request/pieces.py; `pieces_over_whole`). Host only, any machine; one
request thread (the tokenizer's own pool runs a document's pieces on the machine's cores).

    python -m bench.prepare [--out bench/results/prepare.json] [--checkpoint DIR]

Without `--checkpoint`, the tiny random checkpoint (bench/random_checkpoint.py) in a temp dir: the
workloads are defined in tokens of the served tokenizer, so the document lengths are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.common import write_json
from bench.load import environment
from bench.load_workloads import WORKLOADS, RequestStream, TextMaker, load_builder
from bench.random_checkpoint import write_random_checkpoint
from kev.request.doc_cache import DocumentCache
from kev.request.prompts import validate_and_build

WORKLOADS_MEASURED = ("six-short", "five-long", "varied")


def per_request_ms(builder, requests, reps: int) -> float:
    """The median over `reps` rounds of the mean time of one `validate_and_build`."""
    rounds = []
    for _ in range(reps):
        start = time.perf_counter()
        for r in requests:
            validate_and_build(r, builder)
        rounds.append((time.perf_counter() - start) / len(requests) * 1e3)
    return statistics.median(rounds)


def measure(checkpoint: str, n_requests: int, reps: int) -> dict:
    model_id, tokenizer, builder = load_builder(checkpoint)
    maker = TextMaker(tokenizer, builder)
    out = {}
    for name in WORKLOADS_MEASURED:
        stream = RequestStream(maker, model_id, WORKLOADS[name], seed=0)
        requests = [stream.next().request for _ in range(n_requests)]
        builder.documents = None
        uncached = per_request_ms(builder, requests, reps)
        pieces, builder.piece_chars = builder.piece_chars, 0  # side by side: every document tokenized whole
        whole = per_request_ms(builder, requests, reps)
        builder.piece_chars = pieces
        builder.documents = DocumentCache(1 << 24)
        start = time.perf_counter()
        for r in requests:  # the first pass, from an empty cache (a workload's own repeats hit it)
            validate_and_build(r, builder)
        first = (time.perf_counter() - start) / len(requests) * 1e3
        cached = per_request_ms(builder, requests, reps)
        out[name] = {"requests": n_requests, "first_pass_ms": round(first, 4), "repeat_no_cache_ms": round(uncached, 4),
                     "repeat_cached_ms": round(cached, 4), "cached_over_uncached": round(cached / uncached, 3),
                     "repeat_whole_document_ms": round(whole, 4), "pieces_over_whole": round(uncached / whole, 3),
                     "doc_tokens_mean": round(statistics.mean(len(validate_and_build(r, builder).document_ids)
                                                              for r in requests), 1)}
        print(f"{name}: repeat {uncached:.3f} ms (document whole: {whole:.3f} ms) -> {cached:.3f} ms with the cache "
              f"(first pass {first:.3f} ms)")
    builder.documents = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results JSON (e.g. bench/results/prepare.json)")
    p.add_argument("--checkpoint", default=None, help="default: a tiny random checkpoint in a temp dir")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or str(write_random_checkpoint(os.path.join(tmp, "tiny"), "tiny"))
        results = {**environment(), "cpus": len(os.sched_getaffinity(0)), "threads": 1,
                   "workloads": measure(checkpoint, args.requests, args.reps)}
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
