#!/usr/bin/env bash
# Where a loaded pass's GPU time goes, kernel by kernel, in one device call: the stack at its
# defaults under one workload at 64 clients (kev only), with the bank and the scorer each profiled
# by torch.profiler for LOAD_PROFILE_FOR_S seconds (default 2) from the moment the load's window
# opens (bench/device/profile_site/sitecustomize.py; no service code changes). $OUT gets
# profile_bank_service_<pid>.json and profile_scorer_service_<pid>.json (GPU ms per kernel, copies),
# load_<workload>.json (a diagnostic run: its settings say the services were
# overridden, by PYTHONPATH) and load_compare.log.
#
# On the device machine, from the repository root, carrying .whl .whl_load .redis_carry (and .triton_carry):
#     [KEV_MPS=1] KEV_COMMIT=<sha> bash bench/device/load_profile.sh six-short [LIMIT_S]
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the device output folder}"
workload=${1:-six-short}
limit=${2:-400}
source bench/device/load_env.sh
load_env  # KEV_MPS=1: as deployed (the kernels of both services then overlap in the profiles)
export LOAD_PROFILE_DIR=/tmp/kev_profile
rm -rf "$LOAD_PROFILE_DIR"
site="PYTHONPATH=$PWD/bench/device/profile_site:$PYTHONPATH"
timeout "$limit" python3 -m bench.load_compare --device cuda --workload "$workload" --systems kev --sweep 64 \
    --duration 5 --warmup-s 2 --out-dir "$OUT" --png-dir /tmp/load_png --bank-env "$site" --scorer-env "$site" \
    > "$OUT/load_compare.log" 2>&1
echo "load_compare: rc $? after ${SECONDS} s"
sleep "${LOAD_PROFILE_FOR_S:-2}"  # a profile still being written when the run ends
cp "$LOAD_PROFILE_DIR"/profile_*.json "$OUT"/ 2>/dev/null || echo "no profile written"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("profile_*.json")):
    d = json.loads(p.read_text())
    print(p.name, "window", d["window_s"], "s; ms by category", d["total_ms_by_category"])
    for k in d["kernels"][:12]:
        print(f"  {k['total_ms']:9.1f} ms {k['count']:6d}x  {k['name'][:100]}")
PY
