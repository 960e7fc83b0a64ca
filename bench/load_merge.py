"""One workload's results file from two device calls, when all three systems do not fit in one.

Five-long's baseline needs minutes to start and its padded forwards take seconds each, so kev,
the baseline and the gathered scorer may not fit in one 10-minute call. Then one call measures
kev and the baseline side by side (`--systems kev,baseline`: the ratio the acceptance asks for
comes from one run) and another kev and the gathered scorer (`--systems kev,gathered`: the
identity check compares the gathered scorer with the very states that run's kev stored). This
joins the two files: the first file's kev and baseline, the second file's gathered scorer and its
identity check, the second run's kev headline beside it (`gathered_run_kev`), and both commands.
Both must be of the same workload, commit, GPU and GPU sharing.

    python -m bench.load_merge runs/<call 1>/load_five-long.json runs/<call 2>/load_five-long.json \
        --out bench/results/load_five-long.json \
        --png runs/load_five-long.png   # requests/s and p99 against clients, all three systems

The two calls' files are per-run records (runs/, from bench/device/collect.py); the merged file is
the workload's results file under its plain name.
"""

from __future__ import annotations

import argparse
import copy
import json

from bench.common import write_json
from bench.load_report import HEADLINE

SAME = ("workload", "commit", "gpu", "gpu_sharing", "device", "scale", "default_startup")


def merge(with_baseline: dict, with_gathered: dict) -> dict:
    """The joined results (see the module docstring); ValueError when the two do not go together."""
    for key in SAME:
        if with_baseline.get(key) != with_gathered.get(key):
            raise ValueError(f"{key} differs: {with_baseline.get(key)!r} and {with_gathered.get(key)!r}")
    for name, results, system in (("first", with_baseline, "baseline"), ("second", with_gathered, "gathered")):
        if "sweep" not in results.get(system, {}) or system in results.get("missing", []):
            raise ValueError(f"the {name} file has no complete {system} run")
    out = copy.deepcopy(with_baseline)
    out["gathered"] = copy.deepcopy(with_gathered["gathered"])
    out["gathered_bit_identical"] = copy.deepcopy(with_gathered.get("gathered_bit_identical"))
    for system in ("baseline", "gathered"):  # files written before the objects carried these themselves
        out[system].setdefault("commit", out["commit"])
        out[system].setdefault("gpu", out["gpu"])
    out["gathered_run_kev"] = {**{k: with_gathered.get(k) for k in HEADLINE}, "sweep": with_gathered["sweep"]}
    out["missing"], out["complete"] = [], True
    out["startup"] = {"baseline_run": with_baseline.get("startup"), "gathered_run": with_gathered.get("startup")}
    out["command"] = with_baseline["command"]
    out["gathered_command"] = with_gathered["command"]
    out["merged"] = ("two device calls: kev and the baseline side by side in `command`; the gathered scorer and "
                     "its identity check against that run's kev in `gathered_command` (kev's figures there: "
                     "`gathered_run_kev`)")
    return out


def kev_series(merged: dict) -> list[dict]:
    """kev's runs to plot: the call that swept more client counts (a baseline call often runs kev
    at the compared count alone, its gathered call the whole sweep)."""
    return max(merged["sweep"], merged["gathered_run_kev"]["sweep"], key=len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load_merge", description=__doc__.split("\n\n")[0])
    p.add_argument("with_baseline", help="results of a run with kev and the baseline")
    p.add_argument("with_gathered", help="results of a run with kev and the gathered scorer")
    p.add_argument("--out", required=True, help="the merged results file (bench/results/load_<workload>.json)")
    p.add_argument("--png", help="also plot the merged sweeps here (bench.load_plots; runs/, not bench/results)")
    args = p.parse_args(argv)
    with open(args.with_baseline) as a, open(args.with_gathered) as b:
        merged = merge(json.load(a), json.load(b))
    write_json(args.out, merged)
    if args.png:
        from bench.load_plots import plot_sweeps

        series = {"kev": kev_series(merged), "gathered": merged["gathered"]["sweep"],
                  "baseline": merged["baseline"]["sweep"]}
        plot_sweeps(series, args.png, title=f"{merged['workload']} ({merged['gpu']}, merged from two calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
