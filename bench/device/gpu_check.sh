#!/usr/bin/env bash
# Issue 5's GPU batch in device calls of at most 600 s: the GPU tests (~370 s on the H200 with a warm
# compile cache; cold, ~620 s at 985491f: then `tests-a` and `tests-b` in two calls, see below),
# then the single-request figures with their profile and the
# shape-class config map (~180 s); on request the attention A/B (~100 s, limit 150) and the matmul-floor
# figures, `row_pass.json` and `state_pass.json` (limits 150 s + 200 s). Each step writes its
# log and results under $OUT and has its own time limit; one failing or running out of time does
# not stop the others. Name the steps; the default is `tests perf` (~460 s, one call; limits 540 + 150 + 120).
# Keep the tests first: they leave Triton's compile cache warm, and the single-request figures then
# take ~32 s. Run first, cold, they compiled past an 80 s limit (eee0343's call, "perf tests").
# Back here, `python3 bench/device/collect.py <files_at>` puts the JSONs into bench/results (plain
# names, overwritten) and the logs and profiles into runs/.
#
# On the device machine, from the repository root, carrying .whl (bench/device/device_carry.sh builds it):
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh                  # tests perf
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh perf ab          # figures only
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh floors           # row pass and state pass
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh "tests single"   # tests, then single_request alone
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh "tests-a single" # a cold first call: half the tests, the figures
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh "tests-b perf"   # the next, cache carried (.triton_carry)
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh tests-c          # tests-b without its kernels (tests-b = kernels + tests-c)
#     KEV_TESTS="tests/a.py::test_x tests/b.py" KEV_COMMIT=<sha> bash bench/device/gpu_check.sh named  # those tests only
#         (KEV_TESTS is split on spaces: name tests by node id; a `-k "a or b"` expression collects nothing)
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh kernels-ratios   # test_kernels_gpu.py at head ratios 2 and 3
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh ncu-delta        # Nsight Compute on one layer's non-GEMM kernels
#     KEV_COMMIT=<sha> bash bench/device/gpu_check.sh pass-configs     # each config timed inside the pass (power limit)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the device output folder}"
# .whl_load and .redis_carry, when carried, serve the GPU tests that start services (gRPC, Redis).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .whl_load/*.whl 2>/dev/null) || exit 1
export PYTHONPATH="/tmp/site:$PWD" PATH="$PWD/.redis_carry:$PATH" PYTHONUNBUFFERED=1 KEV_COMMIT="${KEV_COMMIT:-unknown}"
source bench/device/triton_cache.sh
triton_cache_restore

# The GPU tests in two halves: cold (no carried compile cache, a session's first call) all 45 took
# ~620 s at 985491f, past one call; `tests-a` (graphs, served passes) then `tests-b` (kernels, state
# pass, shared bank) in two calls, the cache carried between them. -v: each test's name is logged as
# it ends, so a run cut by its limit still says which passed.
PYTEST_GPU=(-v -rfE --tb=short --durations=15 -p no:cacheprovider)
# KEV_TEST_WORKERS=N (N > 1): the tests in N pytest-xdist processes, one test at a time to each
# (`--dist load`). Cold, a run is mostly Triton compiling, one kernel after another in one process;
# N processes compile side by side on the machine's 16 cores (the tests' models are small: 512 wide,
# a few layers). Not measured yet: try it on a cold `tests` and compare with the figures above.
if [ "${KEV_TEST_WORKERS:-1}" -gt 1 ]; then PYTEST_GPU+=(-n "$KEV_TEST_WORKERS" --dist load); fi
GPU_TESTS_A=(tests/exec/test_graphs_gpu.py tests/exec/test_packed_graphs_gpu.py tests/exec/test_served_passes_gpu.py
             tests/exec/test_family_gpu.py)
# tests-b's kernels alone compile for longer than a call has (cold: 27 of its tests in 420 s at
# 4c6f7bb): `tests-c` runs the rest of it on its own, so a session can start with what was not reached.
GPU_TESTS_B_KERNELS=(tests/ops/test_kernels_gpu.py)
GPU_TESTS_C=(tests/exec/test_state_pass_gpu.py tests/bank/test_shared_bank.py tests/bank/test_shared_weights.py
             tests/services/test_services_gpu.py tests/serving/test_stack_progress.py)
GPU_TESTS_B=("${GPU_TESTS_B_KERNELS[@]}" "${GPU_TESTS_C[@]}")

step() {  # step NAME LIMIT_S COMMAND...: the command's output in $OUT/NAME.log, one summary line here
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $((SECONDS - start)) s; $(grep -E ' passed| failed|new .* ms|worst|efficiency' "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
}

for what in "${@:-tests perf}"; do
    for s in $what; do
        case $s in
            tests)  # the services' tests first: each starts a whole CUDA stack, and at 088b860 (H100, cold, 4
                # workers) the run reached them last and was cut at 520 s with 105 of 109 done; first, they
                # start beside the kernel tests (xdist hands tests out in the order given)
                step gpu_tests "${KEV_LIMIT_TESTS:-540}" python3 -m pytest "${PYTEST_GPU[@]}" tests/services/test_services_gpu.py \
                    tests/serving/test_stack_progress.py "${GPU_TESTS_A[@]}" "${GPU_TESTS_B[@]}" ;;
            tests-a) step gpu_tests_a "${KEV_LIMIT_A:-420}" python3 -m pytest "${PYTEST_GPU[@]}" "${GPU_TESTS_A[@]}" ;;
            tests-b) step gpu_tests_b "${KEV_LIMIT_B:-300}" python3 -m pytest "${PYTEST_GPU[@]}" "${GPU_TESTS_B[@]}" ;;
            tests-c) step gpu_tests_c "${KEV_LIMIT_C:-300}" python3 -m pytest "${PYTEST_GPU[@]}" "${GPU_TESTS_C[@]}" ;;
            named)  # a log of its own per run (gpu_tests_named.log, then _2, _3 ...): a second run in one call keeps the first's
                log=gpu_tests_named; i=1
                while [ -e "$OUT/$log.log" ]; do i=$((i + 1)); log=gpu_tests_named_$i; done
                step "$log" "${KEV_LIMIT_NAMED:-300}" python3 -m pytest "${PYTEST_GPU[@]}" ${KEV_TESTS:?set KEV_TESTS} ;;
            kernels-ratios)  # test_kernels_gpu.py at value/key head ratios 2 and 3 only (ratio 1 ran most
                # often); `-k` cannot hold the '=' of their ids, so they are collected by name here
                ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/ops/test_kernels_gpu.py \
                      | grep -E 'hv_per_h=(2|3)')
                step gpu_tests_kernel_ratios "${KEV_LIMIT_NAMED:-300}" python3 -m pytest "${PYTEST_GPU[@]}" $ids ;;
            perf)
                step single_request 150 python3 -m bench.single_request --out "$OUT/single_request.json" --reps 15 \
                    --profile-out "$OUT/single_request_profile.txt"
                step autotune_map 120 python3 -m bench.autotune_map --out "$OUT/autotune_classes.json" ;;
            single)  # the single-request figures alone (perf without the map)
                step single_request 150 python3 -m bench.single_request --out "$OUT/single_request.json" --reps 15 \
                    --profile-out "$OUT/single_request_profile.txt" ;;
            ab)  # ~100 s before session 36's other tiles (TILES: three more per shape, every config; not run yet)
                step attention_ab "${KEV_LIMIT_AB:-330}" python3 -m bench.attention_ab --out "$OUT/attention_ab.json" ;;
            pdl-ab)  # the single-request figures without PDL (kev/ops/pdl.py; the default), then with it
                step single_request 150 python3 -m bench.single_request --out "$OUT/single_request.json" --reps 15
                step single_request_pdl 150 python3 -m bench.single_request --pdl \
                    --out "$OUT/single_request_pdl.json" --reps 15 ;;
            floors)
                step row_pass 150 python3 -m bench.row_pass --out "$OUT/row_pass.json" \
                    --kernels-out "$OUT/row_pass_kernels.json"
                step state_pass 200 python3 -m bench.state_pass --out "$OUT/state_pass.json" ;;
            load-shapes)  # where a pass's GPU time goes at the pass sizes the load runs (64 clients: six-short's
                # ~63 rows x 32 tokens over 48-token documents and ~11 new documents a state pass;
                # varied's ~60 rows of ~50 tokens over ~900-token documents and ~13 documents of ~870;
                # bench.row_pass spreads its rows over 16 documents, a whole number each: 64 rows).
                # Under load_shapes/, so they do not replace the benchmarks' own files in bench/results.
                # bench.state_pass runs eagerly: at ~500 tokens its measured_ms is host-bound, so read
                # its profile (profile_gpu_ms and the kernel table); bench.row_pass replays a graph.
                mkdir -p "$OUT/load_shapes"
                for shape in "six-short 64 32 48 11 48" "varied 64 48 896 13 864"; do
                    set -- $shape
                    step "row_pass_$1" 150 python3 -m bench.row_pass --rows "$2" --row-tokens "$3" --doc-tokens "$4" \
                        --reps 11 --out "$OUT/load_shapes/row_pass_$1.json" --profile-out "$OUT/load_shapes/row_pass_$1.txt"
                    step "state_pass_$1" 150 python3 -m bench.state_pass --docs "$5" --doc-tokens "$6" \
                        --long-doc-tokens 64 --long-reps 1 --out "$OUT/load_shapes/state_pass_$1.json" \
                        --profile-out "$OUT/load_shapes/state_pass_$1.txt"
                done ;;
            kernel-floors)  # each non-GEMM kernel of a layer against its memory floor and fla's kernel:
                # the state pass benchmark's 16 x 2,048 tokens, then six-short's loaded state and row passes
                step kernel_floors 200 python3 -m bench.kernel_floors --out "$OUT/kernel_floors.json"
                mkdir -p "$OUT/load_shapes"
                step kernel_floors_six-short 120 python3 -m bench.kernel_floors --seqs 11 --seq-tokens 48 \
                    --out "$OUT/load_shapes/kernel_floors_six-short.json"
                step kernel_floors_six-short_rows 120 python3 -m bench.kernel_floors --seqs 63 --seq-tokens 32 --rows \
                    --out "$OUT/load_shapes/kernel_floors_six-short_rows.json" ;;
            ncu-delta)  # Nsight Compute's counters (occupancy, stall reasons, bandwidth) for one layer's non-GEMM
                # kernels, bench.kernel_floors' cases, at 16 x 2,048 tokens (bench/ncu_delta_rule.py); clocks left alone
                ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
                step ncu_delta_rule "${KEV_LIMIT_NCU:-240}" "${ncu_bin:-ncu}" --profile-from-start off --clock-control none \
                    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                    --section SchedulerStats --section MemoryWorkloadAnalysis --csv --page details \
                    --log-file "$OUT/ncu_delta_rule.csv" python3 -m bench.ncu_delta_rule ;;
            pass-configs)  # every config of the scan, fla's KK^T + solve and the conv, each pinned in turn and
                # timed inside the whole 8 x 2,048 state pass after 3 s at the power limit (bench/pass_configs.py;
                # estimated ~3 min warm, not run yet: with pass-configs-rows, one call)
                step pass_configs "${KEV_LIMIT_PASS_CONFIGS:-300}" python3 -m bench.pass_configs \
                    ${KEV_PASS_KERNELS:+--kernels "$KEV_PASS_KERNELS"} --out "$OUT/pass_configs.json" ;;
            pass-configs-rows)  # the same inside a row pass: 64 rows of 32 tokens over 8 documents of 512
                step pass_configs_rows "${KEV_LIMIT_PASS_CONFIGS_ROWS:-240}" python3 -m bench.pass_configs --pass rows \
                    --rows 64 --row-tokens 32 --doc-tokens 512 \
                    ${KEV_PASS_KERNELS:+--kernels "$KEV_PASS_KERNELS"} --out "$OUT/pass_configs_rows.json" ;;
            *) echo "unknown step $s (tests, tests-a, tests-b, tests-c, named, kernels-ratios, perf, single, ab, pdl-ab, floors, load-shapes, kernel-floors, ncu-delta, pass-configs, pass-configs-rows)"
               exit 2 ;;
        esac
    done
done
out_bundle  # before the cache: its parts must fit beside what comes back
triton_cache_pack  # for the next call of the session: carry it as .triton_carry
