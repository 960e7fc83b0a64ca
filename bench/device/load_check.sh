#!/usr/bin/env bash
# Issue 7's load comparison in one device call: the carried wheels installed, redis-server on PATH,
# GPU utilisation sampled once a second beside the run, and bench.load_compare under a time limit
# that leaves the call room to return (it rewrites its JSON after every run, so a run cut short
# keeps what it measured). The services start with their defaults (no start-up plan fitted to the
# workload: bench/load_compare.py). Everything lands in $OUT: load_<workload>.json, load_compare.log, gpu_util.csv, and triton_cache.txz.part*: Triton's compile cache (not
# its autotune results, except the baseline's) at the end (bench/device/triton_cache.sh). Carried into the
# next call, it spares the services their kernel compiles (about a minute of each load call's start-up,
# mostly the bank's) and the baseline its autotuning. The results record which it was
# (`triton_compile_cache`). Back here, `python3 bench/device/collect.py <files_at>` puts the JSON
# into bench/results (plain name, overwritten) and the log, CSV and plot into runs/.
#
# On the device machine, from the repository root, carrying .whl .whl_load .redis_carry
# (bench/device/device_carry.sh builds them), and .triton_carry when there is one:
#     KEV_COMMIT=<sha> bash bench/device/load_check.sh six-short [LIMIT_S] [more load_compare flags...]
# KEV_MPS=1 runs the services as clients of an MPS daemon started here, as deployed
# (bench/device/load_env.sh); the results record which (`gpu_sharing`).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the device output folder}"
workloads=${1:-six-short}
limit=${2:-520}
shift $(( $# < 2 ? $# : 2 ))
# The device tool stops a call at 600 s. After the limit the stack still stops (up to 20 s a
# service) and the cache is packed: 12be09f's five-long run at 575 came back without its cache, and
# cb9932f's longdoc run at 560 (a 176 MB cache, three services to stop) with nothing but its JSON.
if [ "$limit" -gt 520 ]; then echo "limit $limit s capped at 520"; limit=520; fi
source bench/device/load_env.sh
load_env
# The SM clock and temperature beside the power: at 64 clients the GPU sits at its 700 W limit, and
# whether its clock drops there (passes slower than their benchmarks) is the open question of session 31.
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used,power.draw,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv -lms 1000 > "$OUT/gpu_util.csv" 2>&1 &
sampler=$!
# No plots under $OUT: the device tool returns 8 files, and four workloads' JSONs, the log, the CSV and
# the cache's parts are already that many (b4f5757's call lost load_varied.json to two PNGs).
timeout "$limit" python3 -m bench.load_compare --device cuda --workload "$workloads" --sweep 1,8,32,64 \
    --duration 5 --warmup-s 2 --out-dir "$OUT" --png-dir /tmp/load_png "$@" > "$OUT/load_compare.log" 2>&1
rc=$?
kill "$sampler" 2>/dev/null
echo "load_compare: rc $rc after ${SECONDS} s"
grep -E '^(==|   )|x(1|8|32|64)\] +[5-9]\.[0-9] s|req/s p99|errors' "$OUT/load_compare.log" | tail -40
out_bundle  # after the summary (it reads the log), before the cache: its parts must fit beside the rest
triton_cache_pack
