# What both load drivers (load_check.sh, load_profile.sh) set up before the services start, sourced
# from the repository root: `load_env` installs the carried wheels, puts the carried redis-server on
# PATH, restores Triton's compile cache (triton_cache.sh) and starts the GPU sharing.
# KEV_MPS=1 starts an MPS daemon here (pipe and log under /tmp, stopped when the script exits): the
# bank's and the scorer's kernels then share the GPU at once instead of taking turns in time slices,
# as the DRA overlay deploys them (deploy/README.md). The results record which (`gpu_sharing`); a
# daemon that does not come up fails the call rather than measuring the other mode under its name.

source bench/device/triton_cache.sh

load_env() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl .whl_load/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD" PATH="$PWD/.redis_carry:$PATH" PYTHONUNBUFFERED=1 \
        KEV_COMMIT="${KEV_COMMIT:-unknown}"
    triton_cache_restore
    gpu_sharing_start
}

gpu_sharing_start() {
    export KEV_GPU_SHARING=time-sliced
    if [ "${KEV_MPS:-0}" = 1 ]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d || { echo "MPS daemon did not start"; exit 1; }
        trap 'echo quit | nvidia-cuda-mps-control' EXIT
        python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" \
            || { echo "no CUDA context through MPS"; cat "$CUDA_MPS_LOG_DIRECTORY"/*.log; exit 1; }
        KEV_GPU_SHARING=mps
    fi
    echo "GPU sharing between the services: $KEV_GPU_SHARING"
}
