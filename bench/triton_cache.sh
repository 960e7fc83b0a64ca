# Triton's compile cache carried between the device calls of one session; sourced by
# bench/gpu_check.sh and bench/load_check.sh. A call packs the cache into $OUT at its end; copied
# to .triton_carry/ here and carried, it spares the next call its kernel compiles (a cold GPU-test
# run took 382 s, one after the configs were compiled 263 s). Autotuning runs at every start either way.
#     rm -rf .triton_carry && mkdir .triton_carry && cp /work/.device/<N>/triton_cache.tgz.part* .triton_carry/
# A load call's carry (wheels, redis, the cache) must stay under the tool's 64 MiB: the gzip parts of
# a GPU-test run's cache (~42 MB) are too much beside them; recompressed with xz they are ~18 MB:
#     cat /work/.device/<N>/triton_cache.tgz.part* | gunzip | xz -T0 -6 > .triton_carry/triton_cache.txz

export TRITON_CACHE_DIR=/tmp/triton_cache KEV_COMPILE_CACHE=empty

triton_cache_restore() {  # fills TRITON_CACHE_DIR from .triton_carry; says which cache the run has
    mkdir -p "$TRITON_CACHE_DIR"
    if [ -n "$(ls -A "$TRITON_CACHE_DIR")" ]; then  # a second run in the same call
        KEV_COMPILE_CACHE="this call's earlier run ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    elif ls .triton_carry/triton_cache.txz >/dev/null 2>&1 \
            && tar xJf .triton_carry/triton_cache.txz -C "$TRITON_CACHE_DIR"; then  # recompressed with xz here
        KEV_COMPILE_CACHE="carried ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    elif ls .triton_carry/triton_cache.tgz* >/dev/null 2>&1 \
            && cat .triton_carry/triton_cache.tgz* | tar xz -C "$TRITON_CACHE_DIR"; then  # one file, or its parts
        KEV_COMPILE_CACHE="carried ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
    fi
    export KEV_COMPILE_CACHE
    echo "triton compile cache: $KEV_COMPILE_CACHE"
}

triton_cache_pack() {  # the cache into $OUT as parts of 15 MB (the device tool returns 8 files of <= 16 MiB)
    tar czf /tmp/triton_cache.tgz -C "$TRITON_CACHE_DIR" . 2>/dev/null
    local size
    size=$(stat -c %s /tmp/triton_cache.tgz 2>/dev/null || echo 0)
    local parts=$(( (size + 14999999) / 15000000 )) files
    files=$(find "$OUT" -type f | wc -l)
    if [ "$size" -eq 0 ] || [ "$parts" -gt 3 ] || [ $(( files + parts )) -gt 8 ]; then
        echo "triton compile cache not packed: $size bytes in $parts parts beside $files files (8 files come back)"
    else
        split -b 15000000 -d -a 2 /tmp/triton_cache.tgz "$OUT/triton_cache.tgz.part"
    fi
    echo "triton compile cache at the end: $(du -sh "$TRITON_CACHE_DIR" | cut -f1), $size bytes compressed"
}
