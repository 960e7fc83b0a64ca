"""How long a thread issuing small torch ops waits for the GIL while other threads run Python, at
CPython's 5 ms switch interval and at shorter ones (the row worker's question: docs/decisions.md,
session 14). Host only, any machine.

Every torch op releases the GIL while it runs; the feeder then has to take it back from whichever
thread took it meanwhile. Two loads of "request" threads: one that always wants the GIL (the worst
case), and 16 that each run 1 ms of Python then wait 64 ms on I/O (~25% of the GIL together, about
a scorer's share at 250 requests/s). Reports the feeder's wall and CPU time for a launch of 50 ops.

    python -m bench.gil_convoy [--out bench/results/gil_convoy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

import torch

OPS = 50


def python_work(stop: threading.Event, busy_s: float, idle_s: float) -> None:
    while not stop.is_set():
        end = time.perf_counter() + busy_s
        while time.perf_counter() < end:  # holds the GIL: parsing, prompts, Redis replies
            pass
        if idle_s:
            time.sleep(idle_s)  # waiting on I/O: the GIL released


def launches(n: int) -> tuple[float, float]:
    """Mean wall and CPU milliseconds of a launch of OPS small torch ops."""
    a = torch.zeros(64, dtype=torch.int64)
    wall = cpu = 0.0
    for _ in range(n):
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(OPS):
            a = a + 1
        wall += time.perf_counter() - t
        cpu += time.thread_time() - c
        time.sleep(0.005)  # the device wait between launches
    return wall / n * 1e3, cpu / n * 1e3


def measure(threads: int, busy_s: float, idle_s: float, interval_ms: float, n: int) -> dict:
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1000)
    stop = threading.Event()
    workers = [threading.Thread(target=python_work, args=(stop, busy_s, idle_s), daemon=True) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        wall, cpu = launches(n)
    finally:
        stop.set()
        for w in workers:
            w.join()
        sys.setswitchinterval(before)
    return {"threads": threads, "switch_interval_ms": interval_ms, "launch_wall_ms": wall, "launch_cpu_ms": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--launches", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    loads = {"one thread always running Python": (1, 1.0, 0.0), "16 threads, 1 ms busy / 64 ms idle": (16, 1e-3, 64e-3),
             "none": (0, 0.0, 0.0)}
    rows = []
    for name, (threads, busy, idle) in loads.items():
        for interval in (5.0, 1.0, 0.5, 0.1):
            r = measure(threads, busy, idle, interval, args.launches)
            rows.append({"load": name, **r})
            print(f"{name:38s} interval {interval:4.1f} ms: launch of {OPS} ops {r['launch_wall_ms']:8.2f} ms wall, "
                  f"{r['launch_cpu_ms']:.2f} ms cpu")
    if args.out:
        with open(args.out, "w") as f:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            json.dump({"commit": commit, "ops_per_launch": OPS, "python": platform.python_version(), "torch": torch.__version__,
                       "host": platform.node(), "cpus": len(os.sched_getaffinity(0)), "runs": rows},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
