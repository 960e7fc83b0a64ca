#!/usr/bin/env bash
# Builds what the GPU machine lacks for the benchmarks (it has torch and triton, no package index,
# no redis-server), into git-ignored folders that the device tool's `carry` sends along:
#   .whl         fla-core, and pytest-xdist + execnet for gpu_check.sh's KEV_TEST_WORKERS (pure Python)
#   .whl_load    cp312 wheels: grpcio, grpcio-health-checking, grpcio-reflection, protobuf, redis
#   .redis_carry this machine's redis-server + the libraries the GPU machine lacks, behind a wrapper
# Run from the repository root on this (CPU) machine: bash bench/device/device_carry.sh
# Then check on the GPU machine: python3 bench/device/device_check.py
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${PIP:-.venv/bin/pip}"
mkdir -p .whl .whl_load .redis_carry/lib
"$PIP" download -q --no-deps fla-core==0.6.0 pytest-xdist==3.8.0 execnet==2.1.2 -d .whl
"$PIP" download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
    -d .whl_load grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 redis==8.1.0
cp "$(command -v redis-server)" .redis_carry/redis-server.bin
# every library but the C/C++ runtime and the loader, which the GPU machine has in its own versions
ldd "$(command -v redis-server)" | awk '$3 ~ /^\// {print $3}' \
    | grep -Ev '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' | xargs -r -I{} cp -L {} .redis_carry/lib/
cat > .redis_carry/redis-server <<'WRAP'
#!/bin/sh
# Carried redis-server for the GPU machine: its uncommon libraries come from lib/ beside it.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server.bin" "$@"
WRAP
chmod +x .redis_carry/redis-server
du -sh .whl .whl_load .redis_carry
