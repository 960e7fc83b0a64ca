"""The host work in front of an idle sweep's replay, per load workload's shape: the bank's row batch,
the two graph keys and the two fills of their static buffers (`kev.exec.static_pass`), built in
Python ints before the GPU can start. Host only, any machine (the buffers on the CPU: the device
copy itself is not timed); one thread.

    python -m bench.host_fill [--out bench/results/host_fill.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench.common import write_json
from bench.load import environment
from kev.bank.bank import BankHandle
from kev.exec.batch import RowBatch
from kev.exec.graphs import KeyLadder
from kev.exec.static_pass import PassKind, StaticPass

# (document tokens, rows, row tokens): six-short's and five-long's new requests, one long document
SHAPES = {"six-short": (48, 6, 32), "five-long": (2200, 5, 32), "doc-8k": (8192, 8, 48)}


def per_sweep_us(doc_tokens: int, n_rows: int, row_tokens: int, reps: int) -> float:
    """The median over `reps` rounds of 200 sweeps' host work, per sweep."""
    states, rows = KeyLadder(PassKind.STATE, 16384, 64), KeyLadder(PassKind.ROWS, 2048, 32)
    state_pass = StaticPass(states.key_for([doc_tokens]), 256, 16, "cpu")
    row_pass = StaticPass(rows.key_for([row_tokens] * n_rows), 256, 16, "cpu")
    table = torch.zeros(64, 256, dtype=torch.int32)
    document = [(7 * i) % 30000 for i in range(doc_tokens)]
    row_ids = [[(3 * i + r) % 30000 for i in range(row_tokens)] for r in range(n_rows)]
    handle = BankHandle(3, 1)

    def sweep():
        batch = RowBatch.build(row_ids, [handle] * n_rows, [doc_tokens] * n_rows,
                               [[row_tokens - 1, 0] for _ in row_ids], device="cpu")
        states.key_for([doc_tokens])
        rows.key_for(batch.row_lens)
        state_pass.fill_state([document], [handle.slot], table)
        row_pass.fill_rows(*batch.host_fields(), table)

    rounds = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        for _ in range(200):
            sweep()
        rounds.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(rounds[1:])  # the first round warms up


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_fill", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results JSON (e.g. bench/results/host_fill.json)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = {}
    for name, shape in SHAPES.items():
        shapes[name] = {"doc_tokens": shape[0], "rows": shape[1], "row_tokens": shape[2],
                        "host_us": round(per_sweep_us(*shape, args.reps), 1)}
        print(f"{name}: {shapes[name]['host_us']} us")
    if args.out:
        write_json(args.out, {**environment(), "cpus": len(os.sched_getaffinity(0)), "threads": 1, "shapes": shapes})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
