#!/usr/bin/env bash
# An A/B of service flags under load in one device call: bench/device/load_check.sh run ROUNDS times for
# each of two flag sets, alternating (A B A B ...) so that drift over the call (clocks, heat) falls
# on both; each run in $OUT/<label>_<round>/, one summary table at the end ($OUT/load_ab.md).
# Only the last run keeps its compile cache (the device tool returns 8 files).
#
# On the device machine, carrying .whl .whl_load .redis_carry (and .triton_carry when there is one):
#     KEV_MPS=1 KEV_COMMIT=<sha> bash bench/device/load_ab.sh six-short 2 "" \
#         "--scorer-flag=--switch-interval-ms=0.5 --bank-flag=--switch-interval-ms=0.5" \
#         --systems kev --sweep 64 --duration 15
# Arguments: workload, rounds, flags of A, flags of B (either may be ""), then load_compare flags
# common to both. Each run gets load_check.sh's limit of 200 s (a cold first run of six-short kev x64
# takes ~140 s, a warm one ~70 s: two rounds fit one call).
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the device output folder}"
workload=$1 rounds=$2 flags_a=$3 flags_b=$4
shift 4
root=$OUT
for round in $(seq 1 "$rounds"); do
    for label in a b; do
        [ "$label" = a ] && flags=$flags_a || flags=$flags_b
        dir="$root/${label}_$round"
        mkdir -p "$dir"
        echo "== $label round $round: $flags"
        # shellcheck disable=SC2086 # the flag sets split into words on purpose
        OUT=$dir bash bench/device/load_check.sh "$workload" 200 "$@" $flags | tail -2
        last=$dir
    done
done
find "$root" -name 'triton_cache.txz.part*' -not -path "$last/*" -delete
python3 - "$root" "$workload" "$flags_a" "$flags_b" <<'EOF' | tee "$root/load_ab.md"
import json, pathlib, sys
root, workload, flags = pathlib.Path(sys.argv[1]), sys.argv[2], {"a": sys.argv[3], "b": sys.argv[4]}
print(f"| run | flags | req/s | p50 ms | p99 ms | errors | tokens/s | of matmul ceiling | eager passes | rows / pass | row worker launch / wait | launch cpu | state launch / wait / cpu |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
show = lambda v, fmt: "n/a" if v is None else format(v, fmt)
for d in sorted(root.glob("[ab]_*"), key=lambda p: (int(p.name.split("_")[1]), p.name)):
    f = d / f"load_{workload}.json"
    if not f.exists():
        print(f"| {d.name} | {flags[d.name[0]]} | (no result) |")
        continue
    r = json.loads(f.read_text())
    w, s = r["sweep"][-1].get("row_worker_share", {}), r["sweep"][-1].get("row_launch_share", {})
    b = r["sweep"][-1].get("state_worker_share", {})
    print(f"| {d.name} | {flags[d.name[0]] or '(none)'} | {r['requests_per_s']:.1f} | {r['p50_ms']:.0f} | "
          f"{r['p99_ms']:.0f} | {r['error_count']} | {show(r.get('tokens_per_s'), '.0f')} | "
          f"{show(r.get('ceiling_fraction'), '.1%')} | {show(r.get('eager_passes_after_warmup'), 'd')} | {r['rows_per_pass']:.1f} | "
          f"{w.get('launch', 0):.2f} / {w.get('device_wait', 0):.2f} | {s.get('cpu', float('nan')):.2f} | "
          f"{b.get('launch', float('nan')):.2f} / {b.get('device_wait', float('nan')):.2f} / {b.get('cpu', float('nan')):.2f} |")
EOF
