"""Sort what a device call brought back: the figures into bench/results, the rest into runs/.

Run here (the CPU machine), on the folder the device tool returned (its `files_at`):

    python3 bench/device/collect.py /work/.device/<N>

- each `*.json` at the folder's top level is copied to `bench/results/<same name>`, overwriting the
  last one: results files keep their plain names (`load_six-short.json`, `single_request.json`), the
  commit is inside (`commit`). A load file that is not `complete` (a run cut short) and a file
  without a real commit (`KEV_COMMIT` unset: `unknown`) do not replace one there (`--force` does);
- Triton's compile cache (`triton_cache.txz.part*`) replaces `.triton_carry/`, for the next call;
- `files.tgz` (what `out_bundle` in triton_cache.sh packs when a call writes more files than the
  tool returns) is unpacked first and sorted as if its files had come back one by one;
- everything, the JSONs included (logs, `gpu_util.csv`, profiles, plots, `load_ab.sh`'s per-run
  folders), is copied to `runs/<time>_<commit>/` (git-ignored): a single run's record stays out of git.

Then update the figure's row in bench/results/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE_PARTS = "triton_cache.txz.part*"
BUNDLE = "files.tgz"


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def commit_of(data) -> str | None:
    first = data[0] if isinstance(data, list) and data else data
    return first.get("commit") if isinstance(first, dict) else None


def why_not_a_result(data) -> str | None:
    """Why a JSON must not replace bench/results' file of the same name, or None."""
    if data is None:
        return "not readable JSON"
    commit = commit_of(data)
    if not commit or commit == "unknown":
        return f"no commit recorded ({commit!r}: set KEV_COMMIT on the device)"
    if isinstance(data, dict) and data.get("complete") is False:
        return f"incomplete (missing {data.get('missing')})"
    return None


def collect(src: Path, root: Path = ROOT, force: bool = False, stamp: str | None = None) -> dict:
    """Copies `src` as the module docstring says; returns what went where."""
    if not (src / BUNDLE).is_file():
        return _collect(src, root, force, stamp)
    with tempfile.TemporaryDirectory() as tmp:
        flat = Path(tmp)
        shutil.copytree(src, flat, ignore=shutil.ignore_patterns(BUNDLE), copy_function=shutil.copyfile,
                        dirs_exist_ok=True)
        with tarfile.open(src / BUNDLE) as tar:
            tar.extractall(flat, filter="data")
        return _collect(flat, root, force, stamp)


def _collect(src: Path, root: Path, force: bool, stamp: str | None) -> dict:
    jsons = sorted(p for p in src.glob("*.json") if p.is_file())
    commits = {commit_of(read_json(p)) for p in jsons} - {None, "unknown"}
    label = "+".join(sorted(c[:7] for c in commits)) or "unknown"
    run_dir = root / "runs" / f"{stamp or time.strftime('%Y%m%d-%H%M%S')}_{label}"
    run_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, list] = {"results": [], "kept_out": [], "cache": [], "runs": str(run_dir)}

    parts = sorted(src.glob(CACHE_PARTS))
    if parts:
        carry = root / ".triton_carry"
        shutil.rmtree(carry, ignore_errors=True)
        carry.mkdir()
        for p in parts:
            shutil.copyfile(p, carry / p.name)  # copyfile: the tool's copies are read-only
            done["cache"].append(p.name)

    for p in sorted(src.iterdir()):
        if p.match(CACHE_PARTS):
            continue
        if p.is_dir():
            shutil.copytree(p, run_dir / p.name, copy_function=shutil.copyfile, dirs_exist_ok=True)
        else:
            shutil.copyfile(p, run_dir / p.name)

    results = root / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    for p in jsons:
        why = why_not_a_result(read_json(p))
        if why and not force:
            done["kept_out"].append((p.name, why))
            continue
        shutil.copyfile(p, results / p.name)
        done["results"].append(p.name)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 bench/device/collect.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the folder a device call's files came back in")
    ap.add_argument("--force", action="store_true", help="replace results files even with incomplete JSONs")
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        ap.error(f"{args.src} is not a folder")
    done = collect(args.src, force=args.force)
    for name in done["results"]:
        print(f"bench/results/{name}")
    for name, why in done["kept_out"]:
        print(f"not in bench/results: {name}: {why}")
    if done["cache"]:
        print(f".triton_carry/: {len(done['cache'])} part(s)")
    print(f"everything: {done['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
