#!/usr/bin/env bash
# Issue 5's GPU batch in one device call (~7 minutes on the H200): the GPU tests, the single-request
# figures with their profile, and the shape-class config map, each under its own time limit, each
# writing its log and results under $OUT (eight files: within what the device tool brings back).
# One step failing or running out of time does not stop the others.
#
# On the device machine, from the repository root, carrying .whl (bench/device_carry.sh builds it):
#     KEV_COMMIT=<sha> bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the device output folder}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 KEV_COMMIT="${KEV_COMMIT:-unknown}"

step() {  # step NAME LIMIT_S COMMAND...: the command's output in $OUT/NAME.log, one summary line here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $((SECONDS - start)) s; $(grep -E 'passed|failed|new .* ms|worst' "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
}

step gpu_tests 330 python3 -m pytest -q tests/test_graphs_gpu.py tests/test_served_passes_gpu.py \
    tests/test_kernels_gpu.py tests/test_state_pass_gpu.py tests/test_shared_bank.py
step attention_ab 120 python3 -m bench.attention_ab --out "$OUT/attention_ab.json"
step single_request 200 python3 -m bench.single_request --out "$OUT/single_request.json" --reps 15 \
    --profile-out "$OUT/single_request_profile.txt"
step autotune_map 170 python3 -m bench.autotune_map --out "$OUT/autotune_classes.json"
