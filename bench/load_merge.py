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

With `--identity`, the second call only checked the identity (kev's and the gathered scorer's
sample, each at a few clients) after the first call's check could not count: the first file's
figures stay whole, the second's identity check and runs go in `identity_run`. The two may be of
different commits when nothing the services run differs between them (`git diff` over kev/,
bank_service/, scorer_service/ and proto/ is empty: a fix to the harness alone).

    python -m bench.load_merge runs/<load call>/load_27b_varied.json runs/<identity call>/load_27b_varied.json \
        --identity --out bench/results/load_27b_varied.json

The two calls' files are per-run records (runs/, from bench/device/collect.py); the merged file is
the workload's results file under its plain name.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
from pathlib import Path

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


SERVED_CODE = ("kev", "bank_service", "scorer_service", "proto")


def served_code_differs(a: str, b: str) -> str:
    """What the services run that differs between commits `a` and `b` (`git diff --stat`; '' when
    nothing does); raises ValueError when git cannot tell."""
    out = subprocess.run(["git", "diff", "--stat", a, b, "--", *SERVED_CODE], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise ValueError(f"git cannot compare {a} and {b}: {out.stderr.strip()}")
    return out.stdout.strip()


def merge_identity(load_run: dict, identity_run: dict) -> dict:
    """`load_run`'s figures with `identity_run`'s identity check (`--identity`, module docstring);
    ValueError when the two do not go together."""
    for key in (*(k for k in SAME if k != "commit"), "model"):
        if load_run.get(key) != identity_run.get(key):
            raise ValueError(f"{key} differs: {load_run.get(key)!r} and {identity_run.get(key)!r}")
    gathered, check = identity_run.get("gathered", {}), identity_run.get("gathered_bit_identical")
    if "sweep" not in gathered or "gathered" in identity_run.get("missing", []) or not check:
        raise ValueError("the second file has no complete gathered run with its identity check")
    if load_run.get("commit") != identity_run.get("commit") and \
            (diff := served_code_differs(load_run["commit"], identity_run["commit"])):
        raise ValueError(f"the services' code differs between the two commits:\n{diff}")
    out = copy.deepcopy(load_run)
    if "sweep" not in out.get("gathered", {}):  # the load call's gathered scorer did not run (or was cut)
        out["gathered"] = copy.deepcopy(gathered)
    if "gathered_bit_identical" in load_run:
        out["load_call_gathered_bit_identical"] = load_run["gathered_bit_identical"]
    out["gathered_bit_identical"] = copy.deepcopy(check)
    out["identity_run"] = {"commit": identity_run.get("commit"), "command": identity_run.get("command"),
                           "kev": {**{k: identity_run.get(k) for k in HEADLINE}, "sweep": identity_run["sweep"]},
                           "gathered": copy.deepcopy(gathered), "startup": identity_run.get("startup")}
    out["missing"], out["complete"] = [], not [m for m in load_run.get("missing", []) if m != "gathered"]
    out["merged"] = ("two device calls: the figures from `command` (commit `commit`); the identity check "
                     "kev == gathered from `identity_run` (its commit differs from `commit` in nothing the "
                     "services run)")
    return out


def kev_series(merged: dict) -> list[dict]:
    """kev's runs to plot: the call that swept more client counts (a baseline call often runs kev
    at the compared count alone, its gathered call the whole sweep)."""
    return max(merged["sweep"], merged["gathered_run_kev"]["sweep"], key=len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load_merge", description=__doc__.split("\n\n")[0])
    p.add_argument("with_baseline", help="results of a run with kev and the baseline (--identity: the load run)")
    p.add_argument("with_gathered", help="results of a run with kev and the gathered scorer")
    p.add_argument("--out", required=True, help="the merged results file (bench/results/load_<workload>.json)")
    p.add_argument("--png", help="also plot the merged sweeps here (bench.load_plots; runs/, not bench/results)")
    p.add_argument("--identity", action="store_true",
                   help="take only the identity check (and the gathered scorer, if the first has none) from the second")
    args = p.parse_args(argv)
    if args.identity and args.png:
        p.error("--png plots a merge with the baseline; an --identity merge has none to plot")
    with open(args.with_baseline) as a, open(args.with_gathered) as b:
        merged = (merge_identity if args.identity else merge)(json.load(a), json.load(b))
    write_json(args.out, merged)
    if args.png:
        from bench.load_plots import plot_sweeps

        series = {"kev": kev_series(merged), "gathered": merged["gathered"]["sweep"],
                  "baseline": merged["baseline"]["sweep"]}
        plot_sweeps(series, args.png, title=f"{merged['workload']} ({merged['gpu']}, merged from two calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
