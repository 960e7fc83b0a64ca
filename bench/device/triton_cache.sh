# Triton's compile cache carried between the device calls of one session; sourced by
# bench/device/gpu_check.sh and bench/device/load_env.sh (the load drivers). A call packs the cache into $OUT at its end (xz, in
# parts of 15 MB); copied to .triton_carry/ here and carried, it spares the next call its kernel
# compiles (a cold GPU-test run took 382 s, one after the configs were compiled 263 s). Autotuning
# runs at every start either way.
#     python3 bench/device/collect.py <files_at>   # the parts into .triton_carry/, replacing the last
# xz, not gzip: a load call carries the wheels and redis too (~28 MB with the tracked files) under the
# tool's 64 MiB, and a GPU-test run's cache was 42 MB gzipped, 18 MB with xz (a load run's 72 MB
# gzipped came back not at all: more than 3 parts).

export TRITON_CACHE_DIR=/tmp/triton_cache KEV_COMPILE_CACHE=empty

triton_cache_restore() {  # fills TRITON_CACHE_DIR from .triton_carry; says which cache the run has
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -n "$(ls -A "$TRITON_CACHE_DIR")" ]; then  # a second run in the same call
        KEV_COMPILE_CACHE="this call's earlier run ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    elif ls .triton_carry/triton_cache.txz* >/dev/null 2>&1 \
            && cat .triton_carry/triton_cache.txz* | tar xJ -C "$TRITON_CACHE_DIR"; then  # one file, or its parts
        KEV_COMPILE_CACHE="carried ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    fi
    export KEV_COMPILE_CACHE
    echo "triton compile cache: $KEV_COMPILE_CACHE"
}

out_bundle() {  # more files under $OUT than come back beside the cache's parts: all of them in one files.tgz
    # (the device tool returns 8 files; load-shapes alone writes 12). collect.py unpacks it.
    local n
    n=$(find "$OUT" -type f | wc -l)
    if [ "$n" -gt 5 ]; then
        tar czf /tmp/files.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/files.tgz "$OUT/files.tgz"
        echo "$n files under \$OUT bundled into files.tgz"
    fi
}

triton_cache_pack() {  # the cache into $OUT as parts of 15 MB (the device tool returns 8 files of <= 16 MiB)
    tar cf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | xz -T0 -6 > /tmp/triton_cache.txz
    local size
    size=$(stat -c %s /tmp/triton_cache.txz 2>/dev/null || echo 0)
    local parts=$(( (size + 14999999) / 15000000 )) files
    files=$(find "$OUT" -type f | wc -l)
    if [ "$size" -eq 0 ] || [ "$parts" -gt 3 ] || [ $(( files + parts )) -gt 8 ]; then
        echo "triton compile cache not packed: $size bytes in $parts parts beside $files files (8 files come back)"
    else
        split -b 15000000 -d -a 2 /tmp/triton_cache.txz "$OUT/triton_cache.txz.part"
    fi
    echo "triton compile cache at the end: $(du -sh "$TRITON_CACHE_DIR" | cut -f1), $size bytes compressed"
}
