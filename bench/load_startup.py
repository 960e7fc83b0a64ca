"""What bench/load_compare.py asks its services to prepare at start-up, and where start-up time went.

The services capture CUDA graphs before they serve (kev/exec/passes.py); their defaults cover any load.
A benchmark knows its workloads, so it captures only what they use:

- scorers (`KEV_GRAPH_ROWS`): every row-count bucket up to the scorer's rows per pass, at the row
  length bucket of the workload's longest row (a pass of many rows is padded to its longest);
- the bank (`KEV_GRAPH_DOCS`): every document-count bucket up to the bank's documents per pass,
  at the length bucket of each workload document length (both ends of a length range), where a
  bucket exists (D x L within `Buckets.max_state_tokens`), at most `limit` of them;
- the gathered scorer (`KEV_GATHERED_MAX_PREFIX_TOKENS`): the longest document;
- the autotune classes warmed (`KEV_WARM_CLASSES`, `warm_plan`): those of the workloads' passes and
  of the start-up buckets, per service (six-short's bank skips the document classes);
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
SCORER_MAX_GRAPHS = 32  # scorer_service default (KEV_MAX_GRAPHS)
BANK_MAX_PASS_TOKENS = 16384  # bank_service default (--max-pass-tokens)
STATE_CHUNK_TOKENS = 8192  # the bank's state-pass chunk (kev.exec.passes.PassBuilder's default)


def _bucket(value: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= value), None)


def _doc_lengths(w: Workload) -> list[int]:
    return list(w.doc_tokens) if w.doc_range is None else list(w.doc_range)


def _in_turn(per_length: list[list[str]], limit: int) -> str:
    """At most `limit` buckets, taken in turn from each length's list (its first ones first)."""
    plan: list[str] = []
    while len(plan) < limit and any(per_length):
        for keys in per_length:
            if keys and len(plan) < limit:
                plan.append(keys.pop(0))
    return ",".join(plan) or "none"


def row_plan(workloads: list[Workload], max_rows_per_pass: int = SCORER_MAX_ROWS_PER_PASS,
             limit: int = SCORER_MAX_GRAPHS) -> str:
    """KEV_GRAPH_ROWS for these workloads: 'RxL,...' (room for 5 picks a row, as the default), at
    most `limit` buckets (the scorer refuses a plan over its KEV_MAX_GRAPHS). The longest row
    length's buckets come first, all of them: a pass pads to its longest row, so they serve every
    workload's passes; shorter lengths' follow, fewest rows first, while there is room (mixed and
    longdoc in one run: 20 at 64 tokens, then 12 of longdoc's 32)."""
    from kev.exec.graphs import Buckets

    b = Buckets()
    top = _bucket(max_rows_per_pass, b.rows) or b.rows[-1]
    lengths = sorted({L for w in workloads if (L := _bucket(w.row_tokens[1], b.row_tokens)) is not None}, reverse=True)
    return ",".join([f"{R}x{L}" for L in lengths for R in b.rows if R <= top][:limit]) or "none"


def doc_plan(workloads: list[Workload], max_pass_documents: int = BANK_MAX_PASS_DOCUMENTS, limit: int = 24) -> str:
    """KEV_GRAPH_DOCS for these workloads: 'DxL,...', at most `limit` buckets (taken in turn from
    each length, fewest documents first, when there are more)."""
    from kev.exec.graphs import Buckets

    b = Buckets()
    lengths = sorted({L for w in workloads for n in _doc_lengths(w) if (L := _bucket(n, b.doc_tokens)) is not None})
    return _in_turn([[f"{D}x{L}" for D in b.docs if D <= max_pass_documents and b.state_key(D, L) is not None]
                     for L in lengths], limit)


def warm_plan(workloads: list[Workload], graph_rows: str = "none", graph_docs: str = "none",
              max_rows_per_pass: int = SCORER_MAX_ROWS_PER_PASS,
              max_pass_documents: int = BANK_MAX_PASS_DOCUMENTS) -> tuple[str, str]:
    """KEV_WARM_CLASSES for the scorers and for the bank: the autotune classes (kev.ops.autotune)
    their passes take under these workloads, and those of their start-up buckets (`graph_rows`,
    `graph_docs`: KEV_GRAPH_ROWS / KEV_GRAPH_DOCS values), so that no start-up capture tunes a class
    on its synthetic pass. A bucketed pass is tuned as its bucket's class.
    - both: rows_few, the class of the start-up warm-up passes (the bank's 8-token state pass, the
      scorer's warm-up request);
    - a scorer: its row buckets, `row_plan`'s (every row count up to `max_rows_per_pass` at the
      workloads' row length; rows of more than 128 tokens, which fit no bucket, are not covered);
    - the bank: every state bucket the workloads' documents fit (each length's bucket, for a range
      every bucket between its ends; every document count: the bank keeps a pass that starts in a
      bucket inside one); a document longer than the longest bucket runs unbucketed, a
      `STATE_CHUNK_TOKENS` chunk at a time, k of its length together while they fit
      `BANK_MAX_PASS_TOKENS`: classify(k, k x chunk) (longdoc's 16,384 / 61,440: 1 x 8,192, docs_few).
    A class missed here is tuned at its first pass: slower, never wrong."""
    from kev.exec.graphs import Buckets
    from kev.ops.shapes import ShapeClass, classify
    from kev.exec.plan import parse_doc_buckets, parse_row_buckets

    b = Buckets()
    rows = {ShapeClass.ROWS_FEW}
    for R, L, P in (*parse_row_buckets(row_plan(workloads, max_rows_per_pass)), *parse_row_buckets(graph_rows)):
        if (key := b.row_key(R, L, P)) is not None:
            rows.add(key.shape_class)
    docs = {ShapeClass.ROWS_FEW}
    lengths: set[int] = set()
    for w in workloads:
        if w.doc_range is not None:  # every bucket some length of the range falls in
            lo, hi = w.doc_range
            lengths.update(L for prev, L in zip((0, *b.doc_tokens), b.doc_tokens) if L >= lo and prev < hi)
        else:
            lengths.update(L for n in w.doc_tokens if (L := _bucket(n, b.doc_tokens)) is not None)
        for n in _doc_lengths(w):
            if n > b.doc_tokens[-1]:  # unbucketed: k such documents a pass, a chunk of each at a time
                most = max(1, min(max_pass_documents, BANK_MAX_PASS_TOKENS // n))
                docs.update(classify(k, k * min(n, STATE_CHUNK_TOKENS)) for k in range(1, most + 1))
    buckets = [(D, L) for L in lengths for D in b.docs if D <= max_pass_documents]
    for D, L in (*buckets, *parse_doc_buckets(graph_docs)):
        if (key := b.state_key(D, L)) is not None:
            docs.add(key.shape_class)
    show = lambda classes: ",".join(c.value for c in ShapeClass if c in classes)  # noqa: E731
    return show(rows), show(docs)


def bank_avg_doc_tokens(workloads: list[Workload], floor: int = 2048) -> int:
    """The bank's `--avg-doc-tokens` (its slot / K/V page split) for these workloads: the longest
    workload's mean document (a range: its middle), at least `floor` (the split used so far for
    short documents: hundreds of slots either way). Longdoc's 16,384 / 61,440 make 38,912: a
    48 GiB bank then holds ~37 such documents, not the 14 that a 2,048 split leaves pages for."""
    means = [sum(w.doc_range) // 2 if w.doc_range else sum(w.doc_tokens) // len(w.doc_tokens) for w in workloads]
    return max([floor, *means])


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


def baseline_warm_min_rows(workloads: list[Workload]) -> int:
    """The fewest question rows one baseline forward holds: one request of the fewest questions."""
    return min(w.questions[0] for w in workloads)


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
