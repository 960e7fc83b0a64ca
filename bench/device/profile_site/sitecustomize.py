"""A process-wide profile of a service under load, with no change to the service: Python imports
this module at start-up when its folder is on PYTHONPATH (bench/device/load_profile.sh puts it
there for the bank and the scorer only).

With LOAD_PROFILE_DIR set, a daemon thread waits for the file `go` in that folder (the load
generator writes it when its measurement window opens: bench/load.py), then records the process
with torch.profiler for LOAD_PROFILE_FOR_S seconds (default 2) and writes
`<dir>/profile_<service>_<pid>.json`: GPU time per kernel name (CUPTI sees every kernel of the
process, graph replays included), copies, and the window, so a loaded pass's GPU time can be split
by kernel. CPU ops and CUDA runtime calls are recorded for the profiling thread only (torch's
profiler), which sleeps: the services' threads show on the GPU side alone. Without LOAD_PROFILE_DIR it does nothing.
"""

import os
import sys
import threading
import time


def _summary(trace: dict, window_s: float) -> dict:
    by_cat: dict[str, dict[str, list[float]]] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat = ev.get("cat", "?")
        entry = by_cat.setdefault(cat, {}).setdefault(ev.get("name", "?"), [0, 0.0])
        entry[0] += 1
        entry[1] += float(ev["dur"])

    def top(cat: str, n: int = 40) -> list[dict]:
        rows = sorted(by_cat.get(cat, {}).items(), key=lambda kv: -kv[1][1])[:n]
        return [{"name": name[:160], "count": c, "total_ms": round(us / 1e3, 3)} for name, (c, us) in rows]

    return {"window_s": round(window_s, 3),
            "total_ms_by_category": {cat: round(sum(v[1] for v in names.values()) / 1e3, 3)
                                     for cat, names in by_cat.items()},
            "kernels": top("kernel"), "memcpy": top("gpu_memcpy", 10)}


def _profile(folder: str, seconds: float) -> None:
    import json
    import tempfile

    go = os.path.join(folder, "go")
    while not os.path.exists(go):
        time.sleep(0.1)
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        time.sleep(seconds)
    window = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    main = sys.argv[0] if sys.argv else ""  # `python -m bank_service`: .../bank_service/__main__.py
    service = os.path.basename(os.path.dirname(main)) if main.endswith("__main__.py") else os.path.basename(main) or "python"
    out = os.path.join(folder, f"profile_{service}_{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump({"service": service, "pid": os.getpid(), **_summary(trace, window)}, f, indent=1)


if os.environ.get("LOAD_PROFILE_DIR"):
    threading.Thread(target=_profile, args=(os.environ["LOAD_PROFILE_DIR"], float(os.environ.get("LOAD_PROFILE_FOR_S", "2"))),
                     name="kev-profile", daemon=True).start()
