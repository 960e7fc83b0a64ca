"""PNG plots of load sweeps: requests/s and p99 latency against the client count, one line per system.

matplotlib is optional (`pip install '.[bench]'`): without it the plot is skipped with a message,
so CI and the load generator itself never need it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def plot_sweeps(series: dict[str, list[dict]], path: str | Path, title: str = "") -> Path | None:
    """`series`: system name -> its runs (each with `clients`, `requests_per_s`, `p99_ms`).
    Writes one PNG with two panels; returns its path, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on the benchmark machines
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (pip install '.[bench]')", file=sys.stderr)
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # runs/ is created on first use
    fig, (rps_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in series.items():
        runs = sorted(runs, key=lambda r: r["clients"])
        clients = [r["clients"] for r in runs]
        rps_ax.plot(clients, [r["requests_per_s"] for r in runs], marker="o", label=name)
        p99_ax.plot(clients, [r["p99_ms"] for r in runs], marker="o", label=name)
    counts = sorted({r["clients"] for runs in series.values() for r in runs})
    for ax, ylabel in ((rps_ax, "requests/s"), (p99_ax, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])  # the measured client counts, not powers of two
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    p99_ax.set_yscale("log")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
