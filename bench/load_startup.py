"""What bench/load_compare.py asks its services to prepare at start-up, and where start-up time went.

The services capture CUDA graphs before they serve (kev/passes.py); their defaults cover any load.
A benchmark knows its workloads, so it captures only what they use:

- scorers (`KEV_GRAPH_ROWS`): every row-count bucket up to the scorer's rows per pass, at the row
  length bucket of the workload's longest row (a pass of many rows is padded to its longest);
- the bank (`KEV_GRAPH_DOCS`): every document-count bucket up to the bank's documents per pass,
  at the length bucket of each workload document length (both ends of a length range), where a
  bucket exists (D x L within `Buckets.max_state_tokens`), at most `limit` of them;
- the gathered scorer (`KEV_GATHERED_MAX_PREFIX_TOKENS`): the longest document;
- the baseline (`--warm-widths`, `--warm-rows`): the sequence lengths (document + row) and the most
  rows a forward of the sweep can hold.

`startup_breakdown` reads a service's log: weights, class warm-up, graph captures, ready.
"""

from __future__ import annotations

import re
from datetime import datetime

from bench.load_workloads import Workload

SCORER_MAX_ROWS_PER_PASS = 96  # scorer_service default (KEV_MAX_ROWS_PER_PASS)
BANK_MAX_PASS_DOCUMENTS = 64  # bank_service default (--max-pass-documents)


def _bucket(value: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= value), None)


def _doc_lengths(w: Workload) -> list[int]:
    return list(w.doc_tokens) if w.doc_range is None else list(w.doc_range)


def row_plan(workloads: list[Workload], max_rows_per_pass: int = SCORER_MAX_ROWS_PER_PASS) -> str:
    """KEV_GRAPH_ROWS for these workloads: 'RxL,...' (room for 5 picks a row, as the default)."""
    from kev.graphs import Buckets

    b = Buckets()
    top = _bucket(max_rows_per_pass, b.rows) or b.rows[-1]
    lengths = sorted({L for w in workloads if (L := _bucket(w.row_tokens[1], b.row_tokens)) is not None})
    return ",".join(f"{R}x{L}" for L in lengths for R in b.rows if R <= top) or "none"


def doc_plan(workloads: list[Workload], max_pass_documents: int = BANK_MAX_PASS_DOCUMENTS, limit: int = 24) -> str:
    """KEV_GRAPH_DOCS for these workloads: 'DxL,...', at most `limit` buckets (taken in turn from
    each length, fewest documents first, when there are more)."""
    from kev.graphs import Buckets

    b = Buckets()
    lengths = sorted({L for w in workloads for n in _doc_lengths(w) if (L := _bucket(n, b.doc_tokens)) is not None})
    per_length = [[f"{D}x{L}" for D in b.docs if D <= max_pass_documents and b.state_key(D, L) is not None]
                  for L in lengths]
    plan: list[str] = []
    while len(plan) < limit and any(per_length):
        for keys in per_length:
            if keys and len(plan) < limit:
                plan.append(keys.pop(0))
    return ",".join(plan) or "none"


def longest_document(workloads: list[Workload]) -> int:
    """KEV_GATHERED_MAX_PREFIX_TOKENS: the longest document (tokens, `<state>` included)."""
    return max(max(_doc_lengths(w)) for w in workloads)


def baseline_warm_widths(workloads: list[Workload]) -> list[int]:
    """Sequence lengths (document + row) a baseline forward of these workloads is padded from: a
    fixed-length workload has one per document length; a range, its two ends."""
    widths = set()
    for w in workloads:
        for n in _doc_lengths(w):
            widths.update({n + w.row_tokens[0], n + w.row_tokens[1]} if w.doc_range else {n + w.row_tokens[1]})
    return sorted(widths)


def baseline_warm_rows(workloads: list[Workload], clients: list[int], max_requests: int = 64) -> int:
    """The most question rows one baseline forward can hold under this sweep."""
    return min(max(clients), max_requests) * max(w.questions[1] for w in workloads)


# ---------------------------------------------------------------------------------------------
# the start-up breakdown from a service log

_PATTERNS = {
    "weights_s": r"(?:weights loaded in|model \S+ loaded in|loaded \S+ on \S+ in) ([\d.]+) s",
    "class_warm_up_s": r"(?:autotune classes .* warmed|warmed \d+ padded shapes \(rows x width\)) in ([\d.]+) s",
    "graph_capture_s": r"captured \d+ CUDA graphs in ([\d.]+) s",
    "graphs": r"captured (\d+) CUDA graphs in",
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_READY = re.compile(r"serving kev\.v1\.Bank|serving \(ready after|serving on ")


def startup_breakdown(log_text: str) -> dict[str, float | int | None]:
    """Seconds a service spent on its weights, the autotune class warm-up and the start-up graph
    captures, and from its first log line to SERVING (`ready_s`); None where the log does not say."""
    out: dict[str, float | int | None] = {}
    for name, pattern in _PATTERNS.items():
        m = re.search(pattern, log_text)
        out[name] = None if m is None else (int(m.group(1)) if name == "graphs" else float(m.group(1)))
    stamps = [(m.group(1), line) for line in log_text.splitlines() if (m := _STAMP.match(line))]
    ready = next((t for t, line in stamps if _READY.search(line)), None)
    if stamps and ready is not None:
        fmt = "%Y-%m-%d %H:%M:%S,%f"
        out["ready_s"] = round((datetime.strptime(ready, fmt) - datetime.strptime(stamps[0][0], fmt)).total_seconds(), 1)
    else:
        out["ready_s"] = None
    return out


def format_breakdown(name: str, b: dict) -> str:
    show = lambda v: "?" if v is None else f"{v:.0f} s" if isinstance(v, float) else str(v)  # noqa: E731
    return (f"{name}: ready {show(b.get('ready_s'))} (weights {show(b.get('weights_s'))}, class warm-up "
            f"{show(b.get('class_warm_up_s'))}, {show(b.get('graphs'))} graphs captured in "
            f"{show(b.get('graph_capture_s'))})")
