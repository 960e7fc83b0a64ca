"""CPython in a serving process: the start-up heap frozen out of GC scans, and the GIL's switch
interval.

A served model's process holds millions of long-lived objects once it is up (modules, parameters,
tokenizer and protobuf tables, CUDA graph bookkeeping). Every full collection walks all of them
while holding the GIL, so each is a pause of every thread at once: every request in flight, the
row worker's next launch, the bank's state passes. Under 64 clients a pause lands on the ~64
requests in flight together, which is how a few GC pauses become a whole latency percentile.
`freeze_startup_heap()` (gc.freeze, after a collection) moves everything alive at the end of
start-up into the permanent generation, which collections skip; what requests allocate is
collected as before. Call it once, when start-up is done and before the process reports SERVING.

One thread feeds the GPU (the scorer's row worker, the bank's state worker) among dozens of
request threads. Every torch op gives the GIL up while it runs; when the feeder wants it back
while a request thread runs Python, it waits until that thread drops it, at the latest after the
switch interval (CPython's default: 5 ms) when it is made to. A launch of tens of ops can so wait
tens of milliseconds with the GPU idle, while some thread wants the GIL all along
(`bench/gil_convoy.py`: Python spread thinly over many threads costs the feeder nothing).
`set_switch_interval(ms)` shortens that wait for every thread of the process (`--switch-interval-ms`
in both services; 0 keeps CPython's default).
"""

from __future__ import annotations

import gc
import sys


def freeze_startup_heap() -> int:
    """Collects, then freezes every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def set_switch_interval(ms: float) -> float:
    """The GIL's switch interval in milliseconds (0: leave CPython's); returns the one in force."""
    if ms < 0:
        raise ValueError(f"switch interval must be >= 0 ms, got {ms}")
    if ms:
        sys.setswitchinterval(ms / 1000)
    return sys.getswitchinterval() * 1000
