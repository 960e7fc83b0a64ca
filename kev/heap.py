"""Python's garbage collector in a serving process: the start-up heap frozen out of its scans.

A served model's process holds millions of long-lived objects once it is up (modules, parameters,
tokenizer and protobuf tables, CUDA graph bookkeeping). Every full collection walks all of them
while holding the GIL, so each is a pause of every thread at once: every request in flight, the
row worker's next launch, the bank's state passes. Under 64 clients a pause lands on the ~64
requests in flight together, which is how a few GC pauses become a whole latency percentile.

`freeze_startup_heap()` (gc.freeze, after a collection) moves everything alive at the end of
start-up into the permanent generation, which collections skip; what requests allocate is
collected as before. Call it once, when start-up is done and before the process reports SERVING.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects, then freezes every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
